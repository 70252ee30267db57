"""The differential engine: one backend, one case, one architecture in; one verdict out.

``run_case`` guards every call the way a kernel author needs to trust the verdict: the output
buffer is poisoned with NaN first (an unwritten element shows), every input is snapshotted
and compared bit for bit afterwards (a kernel that writes into its inputs is caught), the compared call runs twice
and the runs are compared bit for bit (non-determinism is reported apart from wrongness; a second
run that differs is judged against the bound on its own, as a caller may get either), an
exception becomes ERROR with its traceback, and the numbers are judged against the per-element
bound of ``harness.judge.bounds``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import math
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mxmoe.harness.contract.backend import Backend, BackendUnavailable
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs
from mxmoe.harness.contract.platforms import check_arch, device_for, host_arch
from mxmoe.harness.judge.bounds import Bounded, tie_aware_bound
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.routing import route

OUTCOMES = ("PASS", "FAIL", "ERROR", "SKIP", "XFAIL")


STAGES = (
    "load",
    "inputs",
    "oracle and bound",
    "convert",
    "kernel runs",
    "guards",
    "compare",
    "systematic",
    "energy",
    "diagnosis",
)
"""The stages of one check, in the order ``run_case`` passes through them (``StageClock``)."""


class StageClock:
    """Wall seconds spent in each stage of ``run_case`` (``STAGES``), summed over the checks it
    times: what ``bench-check`` reports, so that speed work changes what is measured to cost. On a
    GPU it synchronizes at every stage boundary, or the time of queued kernels would be charged to
    whichever stage next waits on them; a check that is not timed passes no clock and never pays
    for those synchronizations."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.raised: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        """GiB by which each stage raised the device's allocated peak (torch's, on CUDA; 0 elsewhere):
        on a GPU shared by a sweep's workers, memory, not arithmetic, decides how many cases run at
        once, and this names the stage that sets a test's peak (``Result.device_peak_parts``)."""

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Charge the time inside the block to ``name`` (one of ``STAGES``), and what it raised the
        device's allocated peak by."""
        if name not in self.seconds:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}; got {name!r}")
        _synchronize()
        peak = _device_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self.seconds[name] += time.perf_counter() - start
            if peak is not None:
                self.raised[name] += (_device_peak() - peak) / (1 << 30)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _device_peak() -> int | None:
    """torch's allocated peak on the current CUDA device (bytes); None without one in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return None


@contextlib.contextmanager
def timed(clock: StageClock | None, name: str) -> Iterator[None]:
    """``clock.stage(name)``, or nothing where no clock is given."""
    if clock is None:
        yield
    else:
        with clock.stage(name):
            yield


def test_id(backend_id: str, arch: str, case: Case) -> str:
    """``backend-arch-case`` (docs/cases.md): what pytest shows and ``-k`` selects."""
    return f"{backend_id}-{arch}-{case.id}"


@dataclass
class Metrics:
    """How the output compares with the oracle. Ratios are |got - ref| / bound per element."""

    elements: int = 0
    worst_ratio: float = 0.0
    worst_index: tuple[int, int] | None = None
    worst_got: float | None = None
    worst_ref: float | None = None
    worst_bound: float | None = None
    over_bound: int = 0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    """max |got - ref| / max |ref| (the triton_kernels normalisation)."""
    rms_rel_err: float = 0.0
    """sqrt(mean (got - ref)^2) / sqrt(mean ref^2)."""
    cosine: float = 1.0
    nonfinite: int = 0
    """Elements that are NaN or infinite where the oracle is finite (unwritten ones included)."""
    unwritten: int = 0
    """Elements still holding the poison NaN (a payload no arithmetic writes)."""
    nondeterministic: int = 0
    """Elements that differ between the two runs."""
    over_rigorous: int = 0
    """Elements beyond even the rigorous (worst-case) bound: wrong for certain."""
    within_30pct: float = 1.0
    """Share of elements with |got - ref| <= 0.3 |got| (vLLM's test_ocp_mx_moe accepts >= 0.8)."""
    rms_over_max_ref: float = 0.0
    """sqrt(mean (got - ref)^2) / max |ref| (triton_kernels' tests accept <= 0.005, with
    max_rel_err <= 0.025)."""
    systematic_z: float | None = None
    """The systematic-error test's largest z (``harness.judge.systematic``); None where it did not run."""
    systematic_threshold: float | None = None
    """Its threshold for a false-alarm rate of ``harness.judge.systematic.ALPHA`` per case."""
    systematic: str = ""
    """Its finding: where the largest projection is, and whether it fired."""
    energy_ratio: float | None = None
    """The energy test's error energy over the declared arithmetic's prediction
    (``harness.judge.systematic.energy_test``); None where it did not run."""
    energy_threshold: float | None = None
    """The ratio it may reach at the false-alarm rate ``harness.judge.systematic.ALPHA`` per case."""
    effective_bits: float | None = None
    """The precision the measured energy corresponds to (the output's significand bits, less half
    the log2 of the ratio)."""
    energy: str = ""
    """Its finding."""
    unjudged: int = 0
    """Elements where the oracle is finite but the bound or the error/bound ratio is not a finite
    number (a NaN or infinite bound, inf/inf): nothing is known there, so the case is an ERROR of
    the harness, never a pass. Where the two runs differ, the larger count of the two."""
    second_worst_ratio: float | None = None
    """Where the two runs differ, the second run's greatest error/bound: it is judged against the
    same bound on its own (a kernel non-deterministic by design has two outputs, either of which
    a caller may get). None where the runs are identical (the second is then the first, and
    nothing more is computed)."""
    second_over_bound: int = 0
    """The second run's elements over the bound (0 where the runs are identical)."""
    second_over_rigorous: int = 0
    """The second run's elements beyond the rigorous bound."""
    second_nonfinite: int = 0
    """The second run's non-finite elements where the oracle is finite (unwritten ones included)."""
    second_unwritten: int = 0
    """The second run's elements still holding the poison NaN."""
    runs: int = 0
    """The kernel's calls on these inputs: the two guarded runs, and the race hunt's repeats
    (``run_case``'s ``repeat``)."""
    runs_differing: int = 0
    """Of the runs after the first, how many differ from it in any bit."""
    differing_run: int | None = None
    """The run (1-based: the first run is run 1) that the ``second_*`` fields and
    ``nondeterministic`` describe: the first that differs from run 1, or, for a backend declared
    non-deterministic, the worst of those that differ; None where every run is run 1 again."""
    differs_where: str = ""
    """Where that run differs from run 1: its token rows, its 128-column tiles of the output, and
    the experts those rows are routed to (a race in a grouped GEMM corrupts one expert's tile)."""

    @property
    def second_run_wrong(self) -> bool:
        """Whether the second run, judged on its own where it differs from the first, exceeds the
        bound or has non-finite or unwritten elements."""
        return bool(self.second_over_bound or self.second_nonfinite or self.second_unwritten)

    def record_second_run(self, second: Metrics) -> None:
        """Keep what the verdict needs of the second run's metrics (``second``: ``compare`` of
        the second run, with its ``over_rigorous``), beside the first run's."""
        self.second_worst_ratio = second.worst_ratio
        self.second_over_bound, self.second_over_rigorous = second.over_bound, second.over_rigorous
        self.second_nonfinite, self.second_unwritten = second.nonfinite, second.unwritten
        self.unjudged = max(self.unjudged, second.unjudged)

    @property
    def systematic_fired(self) -> bool:
        """Whether the error is systematic beyond the test's threshold."""
        return self.systematic_z is not None and self.systematic_z > (self.systematic_threshold or math.inf)

    @property
    def energy_fired(self) -> bool:
        """Whether the error's energy exceeds what the declared arithmetic allows."""
        return self.energy_ratio is not None and self.energy_ratio > (self.energy_threshold or math.inf)

    @property
    def beyond_bound_fired(self) -> bool:
        """Whether a test of the error's shape (projections or energy) fired."""
        return self.systematic_fired or self.energy_fired

    def to_dict(self) -> dict[str, object]:
        """Plain data for the results file."""
        return dict(self.__dict__)


@dataclass
class Result:
    """The verdict on one (backend, arch, case)."""

    test_id: str
    backend: str
    arch: str
    case: Case
    outcome: str
    reason: str = ""
    metrics: Metrics = field(default_factory=Metrics)
    traceback: str = ""
    seconds: float = 0.0
    findings: list[str] = field(default_factory=list)
    """Observations that are not failures by themselves (declared non-determinism, for one)."""
    contention: str = ""
    """What ran beside the race hunt's calls of this case on its GPU (``guarded_call``'s ``contend``):
    a name of ``harness.run.contention.CONTENTIONS``, "none" for a hunt without company, empty where
    the case was not hunted."""
    build: str = ""
    """Which build of the kernel ran (``Backend.provenance``): the vendor package's version and
    where it was loaded from, or the project's own build of it; empty for the harness's own."""
    diagnosis: str = ""
    """For a FAIL checked with ``diagnose``: the catalogue fault that explains the output, and
    where the error concentrates (``harness.diagnosis``)."""
    inputs_modified: list[str] = field(default_factory=list)
    """The inputs the backend wrote into (by name): a caller that shares one case's inputs among
    backends draws them again after such a check."""
    inputs_checked: bool = False
    """Whether the inputs were compared with what they were before the backend had them, so that
    ``inputs_modified`` is known: after a check that ran, and after a backend that raised or
    declined once it saw the case (unless the comparison itself failed: a device left unusable)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Where the test's time went, in seconds per stage (``STAGES``, plus what no stage covers and
    saving a reproducer), for a test checked with a ``StageClock``: a sweep's records then say
    what its time was spent on, per case and per backend. A case's inputs and oracle, made once
    for every backend checked on it (``sweep.check_pair``), are charged here to the test that made
    them and are not in its ``seconds``."""
    device_peak_gib: float | None = None
    """The most device memory allocated while the test ran (GiB, torch's allocator on CUDA; None
    elsewhere), the worker's kept conversions and its case's shared inputs and oracle included:
    what a sweep's admission of cases onto a GPU (``platforms.case_gpu_gib``) is measured against."""
    device_peak_parts: dict[str, float] = field(default_factory=dict)
    """What ``device_peak_gib`` is made of (GiB), for a test a sweep ran on a GPU: ``held``, what
    was allocated when it began (the worker's kept conversions, its case's shared inputs and
    oracle), each stage that raised the peak, by how much (``StageClock.raised``), and ``other``
    (raised outside every stage). Empty elsewhere."""


HARNESS_RAISED = "the harness raised (not the backend)"


def harness_error(result: Result) -> bool:
    """Whether an ERROR is the harness's own (it raised making inputs or the oracle, or its bound
    is not finite somewhere), not the backend's: such an ERROR says nothing of the kernel, so it is
    never counted as a fault caught."""
    return result.outcome == "ERROR" and (result.reason == HARNESS_RAISED or result.metrics.unjudged > 0)


Diagnose = Callable[[CaseInputs, torch.Tensor, Any], str]
"""How a FAIL gets its diagnosis: ``(inputs, the failing output, the declared arithmetic)`` to a
one-line summary. The front-ends pass ``diagnosis.explain.summarize``; the engine sits below the
diagnosis (which runs the fault catalogue through it), so it receives the diagnosis as a callback
and never imports it."""

DIAGNOSE_MAX_ELEMENTS = 1 << 20
"""Largest output (T x H elements) a failing check diagnoses on its own: the diagnosis reruns some
thirty faults through the float64 oracle. Larger cases say how to ask for it."""


def checksum(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes (on the CPU): a fingerprint that can be compared across
    processes and hosts (the purity of ``make_inputs``)."""
    out = {}
    for name, t in tensors.items():
        data = t.detach().contiguous().cpu()
        out[name] = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b"").hexdigest()
    return out


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


COUNT_SLICE = 1 << 26
"""Elements ``bitwise_differences`` compares at once. On CUDA a count of a mask widens it to int64
first (torch's reductions cast their input to the output's dtype; ``count_nonzero`` too): 9 bytes
per element with the mask, 8.9 GiB for gpt-oss-120b's w13 blocks. The input guards compared those
at every test, and set MARLIN's and FlashInfer's peaks (5 to 7 GiB over the rest, on an H100,
2026-12-07); a slice of this many takes 0.6 GiB."""


def bitwise_differences(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-dtype tensors differ in any bit (NaN payloads included),
    counted ``COUNT_SLICE`` elements at a time along the first dimension."""
    it = _SAME_SIZE_INT[a.element_size()]
    x, y = a.view(it), b.view(it)
    if x.dim() == 0 or x.numel() <= COUNT_SLICE:
        return int(torch.count_nonzero(x != y))
    rows = max(1, COUNT_SLICE // max(1, x[0].numel()))
    return sum(int(torch.count_nonzero(x[lo : lo + rows] != y[lo : lo + rows])) for lo in range(0, x.shape[0], rows))


# Quiet NaNs with a payload no arithmetic produces (kernels write the canonical NaN), so an element
# still holding it was never written, and a NaN the kernel computed is told apart.
_POISON_BITS = {
    torch.float64: 0x7FF8_0000_DEAD_BEEF,
    torch.float32: 0x7FDE_ADBE,
    torch.bfloat16: 0x7FDE,
    torch.float16: 0x7EDE,
}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor filled with the poison NaN of ``dtype``."""
    it = _SAME_SIZE_INT[torch.finfo(dtype).bits // 8]
    bits = _POISON_BITS[dtype]
    if bits >= 1 << (torch.finfo(dtype).bits - 1):  # as a signed integer of that width
        bits -= 1 << torch.finfo(dtype).bits
    return torch.full(shape, bits, dtype=it, device=device).view(dtype)


def still_poisoned(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` still holds the poison (bool, same shape)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]) == poisoned((), t.dtype, t.device).view(
        _SAME_SIZE_INT[t.element_size()]
    )


def compare(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, poison_left: torch.Tensor) -> Metrics:
    """Metrics of ``got`` against ``ref`` under ``bound`` (float64 [T, H] each; ``poison_left``
    marks elements the backend never wrote)."""
    g = got.to(torch.float64)
    m = Metrics(elements=g.numel())
    if g.numel() == 0:
        return m
    finite_ref = torch.isfinite(ref)
    bad = finite_ref & ~torch.isfinite(g)
    m.nonfinite = int(bad.sum())
    m.unwritten = int((poison_left & finite_ref).sum())
    err = torch.where(bad, torch.full_like(g, math.inf), (g - ref).abs())
    err = torch.where(finite_ref, err, torch.zeros_like(err))
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    # A NaN comparison is False: a NaN bound or ratio would pass every element it touches.
    m.unjudged = int((finite_ref & (~torch.isfinite(bound) | torch.isnan(ratio) | (bound < 0))).sum())
    flat = int(torch.argmax(torch.nan_to_num(ratio, nan=math.inf)))
    row, col = divmod(flat, g.shape[1])
    m.worst_ratio = float(ratio.reshape(-1)[flat])
    m.worst_index = (row, col)
    m.worst_got, m.worst_ref, m.worst_bound = float(g[row, col]), float(ref[row, col]), float(bound[row, col])
    m.over_bound = int((ratio > 1).sum())
    finite_err = err[torch.isfinite(err)]
    m.max_abs_err = float(err.max())
    scale = float(ref[finite_ref].abs().max()) if bool(finite_ref.any()) else 0.0
    m.max_rel_err = m.max_abs_err / scale if scale > 0 else (0.0 if m.max_abs_err == 0 else math.inf)
    m.within_30pct = float(((g - ref).abs() <= 0.3 * g.abs()).double().mean())
    if finite_err.numel() == err.numel():
        ref_rms = float(ref.pow(2).mean().sqrt())
        err_rms = float(err.pow(2).mean().sqrt())
        m.rms_rel_err = err_rms / ref_rms if ref_rms > 0 else (0.0 if err_rms == 0 else math.inf)
        m.rms_over_max_ref = err_rms / scale if scale > 0 else (0.0 if err_rms == 0 else math.inf)
        num = float((g * ref).sum())
        den = float(g.norm() * ref.norm())
        m.cosine = num / den if den > 0 else (1.0 if float(g.norm()) == float(ref.norm()) else 0.0)
    else:
        m.rms_rel_err, m.cosine, m.rms_over_max_ref = math.inf, math.nan, math.inf
    return m


def peer_verdicts(m: Metrics) -> dict[str, bool]:
    """Whether the peers' acceptance rules (docs/peers.md) would reject this output: vLLM's
    test_ocp_mx_moe (80% of elements within 30% of the kernel's own output) and triton_kernels'
    tests (max error <= 0.025 and RMS error <= 0.005, both over max |ref|)."""
    return {
        "vllm_80pct_0p3": m.within_30pct < 0.8,
        "triton_kernels": not (m.max_rel_err <= 0.025 and m.rms_over_max_ref <= 0.005),
    }


def failure_message(result: Result, replay: str | None = None) -> str:
    """A torch.testing.assert_close-style report, ending with the one-line replay command."""
    m = result.metrics
    lines = [f"{result.test_id}: {result.reason}"]
    if m.elements:
        pct = 100.0 * m.over_bound / m.elements
        lines.append(f"Mismatched elements: {m.over_bound} / {m.elements} ({pct:.1f}%) exceed the error bound")
        if m.worst_index is not None:
            lines.append(
                f"Greatest error/bound: {m.worst_ratio:.3g} at index {m.worst_index}: got {m.worst_got:.6g}, "
                f"ref {m.worst_ref:.6g}, |diff| {abs((m.worst_got or 0) - (m.worst_ref or 0)):.3g} "
                f"(up to {m.worst_bound:.3g} allowed)"
            )
        lines.append(
            f"Max abs diff {m.max_abs_err:.3g}, max rel diff {m.max_rel_err:.3g}, RMS rel {m.rms_rel_err:.3g}, "
            f"cosine {m.cosine:.8f}, non-finite {m.nonfinite}, unwritten {m.unwritten}"
        )
    if result.diagnosis:
        lines.append(f"Diagnosis: {result.diagnosis}")
    if result.traceback:
        lines.append(result.traceback.rstrip())
    if replay:
        lines.append(f"Replay: {replay}")
    return "\n".join(lines)


def _run_problems(
    unwritten: int, nonfinite: int, over_bound: int, elements: int, worst: float | None, over_rigorous: int
) -> list[str]:
    """What is wrong with one run's output element by element (empty where nothing is): the words of
    a first run's and a second run's problems are the same."""
    problems = []
    if unwritten:
        problems.append(f"{unwritten} output elements never written")
    if nonfinite > unwritten:
        problems.append(f"{nonfinite - unwritten} non-finite output elements where the oracle is finite")
    if over_bound:
        problems.append(
            f"{over_bound} of {elements} elements exceed the error bound (worst {worst:.3g}x; "
            f"{over_rigorous} beyond the rigorous bound, the rest beyond the probabilistic one, which honest "
            "arithmetic exceeds with probability < 3e-14 per element)"
        )
    return problems


def judge(backend: Backend, result: Result) -> None:
    """Set outcome and reason from the metrics (and the declaration's strict xfails): the one
    verdict rule of every check (single case, model layer, distributed)."""
    m = result.metrics
    d = backend.declaration
    problems = _run_problems(m.unwritten, m.nonfinite, m.over_bound, m.elements, m.worst_ratio, m.over_rigorous)
    within = "" if m.over_bound else f" (every element within the bound: worst {m.worst_ratio:.3g}x)"
    if m.systematic_fired:
        problems.append(f"systematic: {m.systematic}{within}")
    if m.energy_fired:
        problems.append(f"energy: {m.energy}{within}")
    if m.nondeterministic:
        text = f"{m.nondeterministic} elements differ between two runs on the same inputs"
        if m.runs > 2:
            text = (f"{m.nondeterministic} elements differ between run 1 and run {m.differing_run} of {m.runs} "
                    f"on the same inputs ({m.runs_differing} of the {m.runs - 1} runs after the first differ "
                    "from it)")  # fmt: skip
        if m.differs_where:
            text += f" at {m.differs_where}"
        both = ""
        if m.second_worst_ratio is not None:
            ratios = f"{m.worst_ratio:.3g}x and {m.second_worst_ratio:.3g}x"
            both = f"; each run judged on its own: worst error/bound {ratios}"
        if d.deterministic:
            problems.append(f"{text} (declared deterministic{both})")
        else:
            result.findings.append(f"{text} (declared non-deterministic{both})")
    second = _run_problems(m.second_unwritten, m.second_nonfinite, m.second_over_bound, m.elements,
                           m.second_worst_ratio, m.second_over_rigorous)  # fmt: skip
    if second:
        which = f"run {m.differing_run} of {m.runs}" if m.runs > 2 else "the second of two runs"
        problems.append(f"{which} on the same inputs: " + ", ".join(second))
    unjudged = []
    if m.unjudged:
        unjudged.append(
            f"{m.unjudged} of {m.elements} elements have no finite error bound or error/bound ratio "
            "(a harness error: they are not judged)"
        )
    if m.systematic_z is not None and not math.isfinite(m.systematic_z) and not (m.nonfinite or m.unwritten):
        unjudged.append(f"the systematic-error test's z is {m.systematic_z} (a harness error)")
    if result.outcome not in ("ERROR",):
        if unjudged and not problems:
            result.outcome, result.reason = "ERROR", "; ".join(unjudged)
        else:
            result.outcome = "FAIL" if problems else "PASS"
            result.reason = "; ".join(problems + unjudged) if problems else f"worst error/bound {m.worst_ratio:.3g}"
    for xf in d.xfails:
        if xf.matches(result.case):
            if result.outcome in ("FAIL", "ERROR"):
                result.outcome, result.reason = "XFAIL", f"{xf.reason} ({xf.link}): {result.reason}"
            else:
                result.outcome, result.reason = "FAIL", f"unexpected pass of a strict xfail: {xf.reason} ({xf.link})"


def _one_run(backend: Backend, ready: object, inputs: CaseInputs, clock: StageClock | None) -> torch.Tensor:
    """One run of ``backend`` into a fresh poisoned output. A function of its own, not a closure
    in ``guarded_call``: a frame kept past the test (a backend's kept exception) keeps the function
    it ran, and a closure's cells, which clearing the frame leaves, would keep the case's inputs
    (``sweep.clear_frames_kept_below``)."""
    with timed(clock, "guards"):
        out = poisoned((inputs.case.tokens, inputs.case.hidden), backend.declaration.arithmetic.precision.output,
                       inputs.x.device)  # fmt: skip
    with timed(clock, "kernel runs"), _the_backends():
        backend.run(ready, inputs, out)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
    return out


def guarded_call(
    backend: Backend,
    inputs: CaseInputs,
    result: Result,
    *,
    bounded: Bounded | Callable[[torch.Tensor], Bounded] | None = None,
    tied: int = 0,
    prepared: Callable[[], Any] | None = None,
    diagnose: Diagnose | None = None,
    clock: StageClock | None = None,
    repeat: int = 0,
    contend: Callable[[], contextlib.AbstractContextManager[str]] | None = None,
) -> torch.Tensor | None:
    """The guarded, judged call of a backend that applies and is loaded: snapshot the inputs,
    convert (or ``prepared()``, for a caller that keeps converted weights, as a model's layer
    does), run twice into poisoned buffers, compare with the oracle under the bound (``bounded``
    if given; a function of the output where the oracle admits alternatives, as an exact routing
    tie does), and the second run too where the two differ, check the inputs are unchanged, and
    set ``result``'s outcome, reason and metrics.
    ``repeat``: the race hunt. The kernel runs that many more times on the same inputs and the same
    converted weights, nothing drawn or computed again, each run compared bit for bit with the
    first. The first run that differs stands where the second run stands above (judged on its own,
    and a FAIL for a backend declared deterministic), named by its number and where it differs
    (``Metrics.differing_run``, ``differs_where``); for a backend declared non-deterministic, the
    worst of the differing runs against the bound does. Every run's difference is counted
    (``runs_differing``), so that a race's rate is measured, not only its existence.
    ``contend``: where the hunt repeats, the company its calls run in (other work on the GPU, which
    the caller makes; ``harness.run.contention``): entered around the calls, not the judging, and
    what it yields is the record's ``contention``.
    Returns the first run's output, or None when the backend raised (``result`` is its ERROR) or
    declined the case once it saw it (BackendUnavailable: a SKIP naming why).
    Raises only for the harness's own failures (making the oracle). ``clock`` times its stages."""
    d = backend.declaration
    result.build = backend.provenance() or ""
    if bounded is None:
        with timed(clock, "oracle and bound"):
            bounded, tied = tie_aware_bound(inputs, d.arithmetic)
    if tied:
        result.findings.append(f"{tied} token(s) routed at an exact top-k tie: judged by the closer resolution")
    with timed(clock, "guards"):
        before = {n: t.clone() for n, t in inputs.tensors().items()}  # on the device: cheap at gpt-oss size
    total = 2 + repeat
    choose = bounded if callable(bounded) else None

    def judged(out: torch.Tensor) -> Metrics:
        # judged on its own against the same oracle and bound (an exact tie resolved by whichever
        # resolution this run is closer to, as the first's is)
        with timed(clock, "compare"):
            return judged_run(out, bounded if choose is None else choose(out))

    number = 2
    try:
        with timed(clock, "convert"), _the_backends():
            ready = prepared() if prepared is not None else backend.convert(inputs)
        company = contend() if contend is not None and repeat else contextlib.nullcontext("none" if repeat else "")
        with company as said:
            result.contention = said
            runs = [_one_run(backend, ready, inputs, clock), _one_run(backend, ready, inputs, clock)]
            with timed(clock, "guards"):
                differ = bitwise_differences(runs[0], runs[1])
            kept = (2, runs[1], differ, None) if differ else None  # run number, output, differences, metrics
            runs[1] = None  # kept above where it differs; else it is run 1 again
            differing = int(bool(differ))
            for number in range(3, total + 1):
                out = _one_run(backend, ready, inputs, clock)
                with timed(clock, "guards"):
                    differ = bitwise_differences(runs[0], out)
                if not differ:
                    continue
                differing += 1
                if kept is None:
                    kept = (number, out, differ, None)
                elif not d.deterministic:  # the worst of the differing runs against the bound stands
                    mine = judged(out)
                    theirs = kept[3] or judged(kept[1])
                    if (_wrong(mine), mine.worst_ratio) > (_wrong(theirs), theirs.worst_ratio):
                        kept = (number, out, differ, mine)
                    else:
                        kept = (*kept[:3], theirs)
    except BackendUnavailable as exc:
        # The backend's own gate, known only once it sees the case (vLLM's oracle refusing or
        # re-routing a deployment): a SKIP that names it, never a verdict on a kernel not run.
        result.outcome = "SKIP"
        result.reason = f"{d.id} cannot run this case: {exc}"
        _compare_inputs(before, inputs, result, clock)
        return None
    except _BackendRaised as exc:
        result.outcome = "ERROR"
        result.reason = "the backend raised" + (f" on run {number} of {total} (the race hunt's)" if number > 2 else "")
        result.traceback = exc.text
        _compare_inputs(before, inputs, result, clock)
        judge(backend, result)
        return None
    got = runs[0]
    del ready  # the backend's converted weights (45 GB as fp32 at DeepSeek-V3) are not needed to judge
    with timed(clock, "compare"):
        if choose is not None:
            bounded = choose(got)
        result.metrics = judged_run(got, bounded)
    m = result.metrics
    m.runs, m.runs_differing = total, differing
    if kept is not None:
        m.differing_run, runs[1], m.nondeterministic, kept_metrics = kept
        with timed(clock, "guards"):
            m.differs_where = where_runs_differ(got, runs[1], inputs)
        m.record_second_run(kept_metrics or judged(runs[1]))
    _systematic(inputs, bounded, got, result, clock)
    _compare_inputs(before, inputs, result, clock)
    mutated = result.inputs_modified
    judge(backend, result)
    if mutated and result.outcome != "XFAIL":
        result.outcome = "FAIL"
        result.reason = f"inputs modified by the backend: {', '.join(mutated)}" + (
            f"; {result.reason}" if result.reason and not result.reason.startswith("worst") else ""
        )
    if diagnose is not None and result.outcome == "FAIL" and not mutated:
        with timed(clock, "diagnosis"):
            result.diagnosis = _diagnose_failing_run(inputs, runs, result, d.arithmetic, diagnose)
    return got


def _compare_inputs(
    before: dict[str, torch.Tensor], inputs: CaseInputs, result: Result, clock: StageClock | None
) -> None:
    """Sets ``result.inputs_modified`` to the inputs that differ from ``before`` (shape or bits) and
    ``inputs_checked``. Also after a backend that raised or declined: a sweep that shares the case's
    inputs and oracle among its backends keeps them where they are unchanged, instead of drawing
    them and computing the oracle, the bound and the energy test's prediction again for every
    backend after it (in an H200 nightly, vLLM's emulation backend declined every case, and the
    backend after it spent 1.2 of its 1.9 s at gpt-oss-120b T=128 drawing the case again). Where
    the comparison itself raises (a device error that outlives the backend's call), they are left
    unchecked, and the sweep draws them again."""
    try:
        with timed(clock, "guards"):
            now = inputs.tensors()
            result.inputs_modified = [
                n for n in before if now[n].shape != before[n].shape or bitwise_differences(now[n], before[n])
            ]
    except Exception:  # the device is unusable: nothing is known of the inputs
        return
    result.inputs_checked = True


class _BackendRaised(Exception):
    """What the backend raised in ``convert`` or ``run`` (``text``: its traceback), told apart from
    the harness's own failures around those calls (judging a run), which propagate as they are."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


@contextlib.contextmanager
def _the_backends() -> Iterator[None]:
    """Inside: the backend's code. Its exceptions become ``_BackendRaised``, its own
    ``BackendUnavailable`` (a SKIP) passes through."""
    try:
        yield
    except BackendUnavailable:
        raise
    except Exception:
        raise _BackendRaised(traceback.format_exc()) from None


def _wrong(m: Metrics) -> bool:
    return bool(m.over_bound or m.nonfinite or m.unwritten)


DIFF_TILE = 128
"""Columns of the output a tile spans in ``where_runs_differ``: the N tile of the grouped GEMMs'
second GEMM (hidden columns), 128 in the SM90 CUTLASS and triton_kernels tiles of gpt-oss's shapes."""


def _ranges(values: list[int], most: int = 6) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``; past ``most`` ranges, the count of the rest."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans[:most])
    return text + (f" and {len(spans) - most} more ranges" if len(spans) > most else "")


def where_runs_differ(a: torch.Tensor, b: torch.Tensor, inputs: CaseInputs) -> str:
    """Where two runs' outputs [T, H] differ in any bit: the token rows, the output's column tiles
    of ``DIFF_TILE``, and the experts those rows are routed to that are shared by most of them
    (a race in a grouped GEMM corrupts a tile of one expert's rows)."""
    it = _SAME_SIZE_INT[a.element_size()]
    diff = a.view(it) != b.view(it)
    rows = diff.any(1).nonzero().flatten().tolist()
    tiles = sorted(set((diff.any(0).nonzero().flatten() // DIFF_TILE).tolist()))
    case = inputs.case
    ids = route(inputs.router_logits, case.top_k, case.routing, **inputs.routing_kwargs).ids
    counts = collections.Counter(ids[rows].flatten().tolist())
    experts = ", ".join(f"{e} ({n})" for e, n in counts.most_common(3))
    return (f"{len(rows)} token row(s) {_ranges(rows)}; {len(tiles)} column tile(s) of {DIFF_TILE} "
            f"{_ranges(tiles)}; experts most routed to by those rows (rows): {experts}")  # fmt: skip


def judged_run(got: torch.Tensor, bounded: Bounded) -> Metrics:
    """``compare`` of one run's output with the oracle under the bound, with its count of elements
    beyond even the rigorous bound."""
    m = compare(got, bounded.ref, bounded.bound, still_poisoned(got))
    m.over_rigorous = int(((got.to(torch.float64) - bounded.ref).abs() > bounded.rigorous).sum())
    return m


def _diagnose_failing_run(
    inputs: CaseInputs,
    runs: list[torch.Tensor],
    result: Result,
    arithmetic: object,
    diagnose: Diagnose,
) -> str:
    """The diagnosis of the run that is numerically wrong: the first where it is; the second where
    only it is (a kernel whose two runs differ, one of them wrong: its metrics are already among
    the first's, ``Metrics.record_second_run``); none where both are within the bound (then every
    catalogue fault would 'explain' an output that needs no explaining)."""
    m = result.metrics
    if m.over_bound or m.nonfinite or m.unwritten or m.beyond_bound_fired:
        return _diagnosis(inputs, runs[0], arithmetic, diagnose)
    if m.second_worst_ratio is not None:
        if m.second_run_wrong:
            second_diagnosis = _diagnosis(inputs, runs[1], arithmetic, diagnose)
            return (f"of the second run (the first is within the bound, worst {m.worst_ratio:.3g}x; the second's "
                    f"worst is {m.second_worst_ratio:.3g}x): " + second_diagnosis)  # fmt: skip
        return (f"none needed: both runs are within the bound (worst {m.worst_ratio:.3g}x and "
                f"{m.second_worst_ratio:.3g}x); they differ in {m.nondeterministic} elements")  # fmt: skip
    return f"none needed: the output is within the bound (worst {m.worst_ratio:.3g}x)"


def _systematic(
    inputs: CaseInputs, bounded: Bounded, got: torch.Tensor, result: Result, clock: StageClock | None = None
) -> None:
    """Run ``harness.judge.systematic`` on the output into the metrics; where it does not apply (a tie,
    a non-finite element), say so among the findings. Only the first run is tested, even where the
    second differs: both runs share the inputs, the weights and the declared arithmetic, so a fault
    of the kernel's arithmetic (a wrong scale, a dropped term) shapes both alike; what differs between
    them (a race, an order of summation) is judged element by element, the second run against the
    bound on its own (``guarded_call``); and these tests cost projections over every expert
    (seconds at gpt-oss-120b), which a backend non-deterministic by design would pay on every case."""
    record_beyond_bound(inputs.weights, bounded, got, result.metrics, clock)
    if result.metrics.elements and bounded.terms is None:
        result.findings.append("systematic-error and energy tests not run: the oracle admits alternatives (a tie)")


def record_beyond_bound(
    weights: MoEWeights, bounded: Bounded, got: torch.Tensor, m: Metrics, clock: StageClock | None = None
) -> None:
    """The tests of the error's shape beyond the per-element bound (``harness.judge.systematic``:
    the projections and the energy test) into ``m``; nothing where they do not apply (no slot
    terms, a non-finite element). Every check that judges a layer's output calls this (one case,
    a model's layer, a sharded layer)."""
    from mxmoe.harness.judge.systematic import energy_test, systematic_test

    with timed(clock, "systematic"):
        found = systematic_test(weights, bounded, got)
    if found is not None:
        m.systematic_z, m.systematic_threshold, m.systematic = found.z, found.threshold, found.finding()
    with timed(clock, "energy"):
        energy = energy_test(weights, bounded, got)
    if energy is not None:
        m.energy_ratio, m.energy_threshold = energy.ratio, energy.threshold
        m.effective_bits, m.energy = energy.effective_bits, energy.finding()


def _diagnosis(inputs: CaseInputs, got: torch.Tensor, arithmetic: object, diagnose: Diagnose) -> str:
    """``diagnose``'s summary, or why there is none (never an exception: a verdict stands without
    its diagnosis)."""
    if got.numel() > DIAGNOSE_MAX_ELEMENTS:
        return (f"not run on its own for {got.numel()} output elements (over {DIAGNOSE_MAX_ELEMENTS}): "
                "python -m harness diagnose REPRO.json")  # fmt: skip
    try:
        return diagnose(inputs, got, arithmetic)
    except Exception as exc:
        return f"could not be made: {type(exc).__name__}: {exc}"


def run_case(
    backend: Backend,
    case: Case,
    arch: str,
    *,
    inputs: CaseInputs | None = None,
    bounded: Bounded | Callable[[torch.Tensor], Bounded] | None = None,
    tied: int = 0,
    prepared: Callable[[CaseInputs], Any] | None = None,
    diagnose: Diagnose | None = None,
    clock: StageClock | None = None,
    repeat: int = 0,
    contend: Callable[[], contextlib.AbstractContextManager[str]] | None = None,
) -> tuple[Result, CaseInputs | None]:
    """Check ``backend`` on ``case`` for ``arch``. Never raises for the backend's sake: whatever
    it does becomes the Result. Returns the inputs used (for a reproducer), or None when skipped
    before they were made. ``bounded`` (the oracle and bound of these inputs under this
    backend's declared arithmetic: ``tie_aware_bound``'s first value, with its tie count as
    ``tied``) may be passed by a caller that checks many backends of one arithmetic on the same
    inputs. ``diagnose``: a FAIL gets its diagnosis (``Result.diagnosis``)
    from it; the user-facing checks pass one, the fault catalogue does not (it plants the cause).
    ``prepared(inputs)``, where given, stands for ``backend.convert(inputs)`` (a sweep's weights
    converted once per layer). ``clock`` is charged each stage's time (``bench-check``).
    ``repeat``: the race hunt's runs beyond the two guarded ones, in the company ``contend`` makes
    (``guarded_call``)."""
    check_arch(arch)
    if not isinstance(repeat, int) or repeat < 0:
        raise ValueError(f"repeat: a whole number of runs >= 0, not {repeat!r}")
    d = backend.declaration
    result = Result(test_id(d.id, arch, case), d.id, arch, case, "SKIP")
    start = time.perf_counter()
    try:
        reason = backend.supports(case, arch)
        if reason:
            result.reason = reason
            return result, None
        if arch != host_arch():
            result.reason = f"needs {arch} hardware; this host is {host_arch()}"
            return result, None
        try:
            with timed(clock, "load"):
                backend.load()
        except (ImportError, BackendUnavailable) as exc:
            result.reason = f"{d.id} cannot run here: {exc}"
            return result, None
        if inputs is None:
            with timed(clock, "inputs"):
                inputs = make_inputs(case, device_for(arch))
        ready = None if prepared is None else functools.partial(prepared, inputs)
        guarded_call(backend, inputs, result, bounded=bounded, tied=tied, prepared=ready, diagnose=diagnose,
                     clock=clock, repeat=repeat, contend=contend)  # fmt: skip
        return result, inputs
    except Exception:
        # A harness failure (making inputs, the oracle): reported, never mistaken for a verdict.
        result.outcome = "ERROR"
        result.reason = HARNESS_RAISED
        result.traceback = traceback.format_exc()
        return result, inputs
    finally:
        result.seconds = time.perf_counter() - start
