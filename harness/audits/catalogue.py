"""The fault catalogue's run: is every planted fault caught, and every honest variant clean?

``run_catalogue`` checks every fault of ``instruments.faults`` and every honest variant on a
profile's cases, case by case, sharing each case's inputs and oracle between backends of one
arithmetic. A fault stops at its first catch (that is "how many cases it took") unless it is marked
``full``: the control (which must never fire) and the bf16 routing-weights fault (whose catch rate
is the number to report). Honest variants run every case: any FAIL or ERROR there is a false alarm.
The sub-bound faults run again on the other arithmetic family (bf16 GEMMs with GEMM1's output in
bf16, ``faults.ON_BF16_GEMM1``), required as the others are: the judge predicts the mean that
rounding GEMM1's output adds through the activation (``harness.judge.bounds``), so that arithmetic
leaves the tests the power they have on float32's. ``full`` runs every fault on every case, for the
catch rates of both families.
A module that fails at import (``IMPORT_FAILURE``) is run as the registry's stand-in for it.
A fault runs only on the cases it can reach (``Mutant.reaches``: a token bucket's fault, only its
bucket at production shapes); where none of the cases is one, its row says 'not reached': the
list could not have caught it, which is what it shows, and no verdict of catching or missing.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mxmoe.harness.contract.backend import Backend
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.contract.platforms import device_for
from mxmoe.harness.instruments.faults import MUTANTS, ON_BF16_GEMM1, Mutant
from mxmoe.harness.instruments.honest import HONEST
from mxmoe.harness.judge.bounds import reference_and_bound
from mxmoe.harness.judge.engine import harness_error, peer_verdicts, run_case
from mxmoe.harness.run.registry import load_spec

UNPATCHED_FAILS = "FAILS UNPATCHED"
"""A vendor matrix's control verdict where the vendor's unpatched kernel FAILs or ERRORs on a case
(``harness.audits.mutation.patched.VRow``): a finding about the vendor or a false alarm, not told apart."""
BAD_VERDICTS = ("MISSED", "FALSE ALARM", UNPATCHED_FAILS, "NOT RUN", "HARNESS ERROR")
"""Row verdicts that mean the catalogue did not show what it is for (``Row.verdict``)."""
PEER_RULES = ("vllm_80pct_0p3", "triton_kernels")
"""The peers' acceptance rules the matrix compares with (``engine.peer_verdicts``)."""


_BROKEN_MODULE = '''"""A backend module that fails at import (vLLM PR #50622's NameError), made by the catalogue."""
from mxmoe.harness.instruments.torch_moe import TorchMoE


class ImportNameError(TorchMoE):
    declaration = MXFP4_DECLARATION  # noqa: F821
'''
IMPORT_FAILURE = ("import-nameerror", "the backend's module fails at import with NameError", "vLLM PR #50622")


def import_failure_backend(folder: Path) -> Backend:
    """The registry's stand-in (a BrokenBackend) for a module that fails at import."""
    path = folder / "mutant_import_nameerror.py"
    path.write_text(_BROKEN_MODULE)
    return load_spec(f"{path}:ImportNameError").backend


@dataclass
class Row:
    """One line of the matrix."""

    id: str
    fault: str
    reference: str | None
    kind: str
    """``mutant``, ``control`` or ``honest``."""
    runs: int = 0
    fails: int = 0
    errors: int = 0
    harness_errors: int = 0
    """ERRORs of the harness itself (``engine.harness_error``): neither a catch nor a clean run."""
    skips: int = 0
    unreached: int = 0
    """Cases the fault cannot change (``Mutant.reaches``), not run."""
    first_catch: int | None = None
    """1-based count of cases run until the first FAIL or ERROR."""
    worst_ratio: float = 0.0
    worst_z: float = 0.0
    """Largest z of the systematic-error test (``harness.judge.systematic``) over the cases run."""
    worst_energy: float = 0.0
    """Largest error energy over its prediction (the energy test, ``harness.judge.systematic``)."""
    z_only: int = 0
    """FAILs with every element within the bound: caught by the systematic-error or the energy test alone."""
    peer_catches: dict[str, int] = field(default_factory=dict)
    """Peer rule -> cases run that it rejects (``engine.peer_verdicts``; an ERROR counts)."""
    failure: str = ""
    """The first FAIL or ERROR: case id, reason and the traceback's last line."""
    seconds: float = 0.0
    outcomes: dict[str, str] = field(default_factory=dict)
    """Case id -> outcome, for every case run."""

    @property
    def caught(self) -> bool:
        """Whether any case FAILed or ERRORed."""
        return self.fails + self.errors > 0

    @property
    def verdict(self) -> str:
        """What the row means: caught / MISSED for faults, clean / FALSE ALARM for the rest; NOT RUN
        where no case ran (nothing was shown), HARNESS ERROR where the harness itself failed on a
        case (that case says nothing of the fault)."""
        if self.harness_errors:
            return "HARNESS ERROR"
        if self.runs == 0:
            return "not reached" if self.unreached and not self.skips else "NOT RUN"
        if self.kind == "mutant":
            return "caught" if self.caught else "MISSED"
        return "FALSE ALARM" if self.caught else "clean"

    def to_dict(self) -> dict[str, object]:
        """Plain data (JSON-ready, ratios as strings when not finite)."""
        d = dataclasses.asdict(self)
        d.update(caught=self.caught, verdict=self.verdict)
        if not math.isfinite(self.worst_ratio):
            d["worst_ratio"] = str(self.worst_ratio)
        return d


def run_catalogue(cases: list[Case], arch: str = "cpu", log: object = None, full: bool = False) -> list[Row]:
    """Run the honest variants, the mutants and the import failure over ``cases`` (see the module
    docstring); rows in that order. ``full``: every fault on every case (catch rates, not only the
    first catch)."""
    with tempfile.TemporaryDirectory() as tmp:
        entries: list[tuple[Backend, Row, bool]] = []
        for cls in HONEST:
            b = cls()
            entries.append((b, Row(b.declaration.id, b.declaration.description, None, "honest"), True))
        for cls in MUTANTS:
            kind = "control" if cls.control else "mutant"
            row = Row(cls.declaration.id, cls.fault, cls.reference, kind)
            entries.append((cls(), row, cls.full or cls.control or full))
        for cls in ON_BF16_GEMM1:
            entries.append((cls(), Row(cls.declaration.id, cls.fault, cls.reference, "mutant"), cls.full or full))
        slug, fault, ref = IMPORT_FAILURE
        entries.append((import_failure_backend(Path(tmp)), Row(f"mutant-{slug}", fault, ref, "mutant"), False))
        device = device_for(arch)
        for case in cases:
            inputs = pristine = None
            bounds: dict[object, object] = {}
            for backend, row, full in entries:
                if row.caught and not full:
                    continue
                if isinstance(backend, Mutant) and not backend.reaches(case):
                    row.unreached += 1
                    continue
                if backend.supports(case, arch):
                    row.skips += 1
                    continue
                if inputs is None:
                    inputs = make_inputs(case, device)
                    pristine = {n: t.clone() for n, t in inputs.tensors().items()}
                for name, t in inputs.tensors().items():  # undo a mutant that wrote into its inputs
                    if not torch.equal(t, pristine[name]):
                        t.copy_(pristine[name])
                arith = backend.declaration.arithmetic
                if arith not in bounds:
                    bounds[arith] = reference_and_bound(inputs, arith)
                start = time.perf_counter()
                result, _ = run_case(backend, case, arch, inputs=inputs, bounded=bounds[arith])
                row.seconds += time.perf_counter() - start
                row.runs += 1
                row.outcomes[case.id] = result.outcome
                if result.outcome == "FAIL":
                    row.fails += 1
                    row.z_only += int(result.metrics.beyond_bound_fired and not result.metrics.over_bound)
                elif harness_error(result):
                    row.harness_errors += 1
                elif result.outcome == "ERROR":
                    row.errors += 1
                    row.worst_ratio = math.inf
                row.worst_z = max(row.worst_z, result.metrics.systematic_z or 0.0)
                row.worst_energy = max(row.worst_energy, result.metrics.energy_ratio or 0.0)
                if result.metrics is not None and result.outcome != "ERROR":
                    row.worst_ratio = max(row.worst_ratio, result.metrics.worst_ratio)
                    rejected = peer_verdicts(result.metrics)
                else:  # a peer's test sees the same exception
                    rejected = dict.fromkeys(PEER_RULES, result.outcome == "ERROR")
                for rule, bad in rejected.items():
                    row.peer_catches[rule] = row.peer_catches.get(rule, 0) + int(bad)
                if harness_error(result):
                    row.failure = row.failure or f"{case.id}: harness error: {result.reason}"
                elif result.outcome in ("FAIL", "ERROR") and not row.failure:
                    last = result.traceback.strip().splitlines()[-1:] if result.traceback else []
                    row.failure = f"{case.id}: {result.reason}" + (f" ({last[0]})" if last else "")
                if result.outcome in ("FAIL", "ERROR") and not harness_error(result) and row.first_catch is None:
                    row.first_catch = row.runs
                if log is not None:
                    log(f"{row.id} {case.id} {result.outcome}")
        return [row for _, row, _ in entries]
