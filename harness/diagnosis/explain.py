"""Explain a FAIL by the catalogue of faults (``harness.instruments.faults``).

Each catalogue fault is the honest float64-exact layer with one bug (a layout read wrong, the
nibbles swapped, a scale off by one, a clamp missing, the routing renormalised or not, a bias
dropped, an expert map ignored, ...). Run on the failing case's exact inputs, each gives the output
that bug would produce. A fault **explains** the kernel's output where the kernel is within the
bound of it: |got - fault_out| <= b_kernel + b_fault element-wise, the first bound the engine's
for the kernel's declared arithmetic, the second the same for the fault's own (fp32) arithmetic,
so that an honest kernel with that one bug would pass against it. The candidates are ranked by
their worst error/bound; those under 1 are named.

Where the error concentrates is reported beside it: the tokens with the most elements over the
bound, the experts those tokens route to (weighted by routing weight, against how often each is
chosen overall), and the blocks of 32 output columns.

Faults that do not change the output of a run (a mutated input, a raise, unwritten rows, garbage
padding, which the engine's other guards catch and name) are not candidates; nor is a fault that
has no effect on this case (its output within ``NO_EFFECT`` of its own bound of the honest
layer's: a hard-coded Renormalize on a Renormalize case, an ignored expert map where there is none),
since it would "explain" any output the honest layer explains and name a cause that is not one.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mxmoe.harness.contract.backend import Arithmetic
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.instruments.faults import MUTANTS
from mxmoe.harness.instruments.honest import HonestFp32
from mxmoe.harness.judge.bounds import reference_and_bound
from mxmoe.harness.judge.engine import poisoned
from mxmoe.reference.mxfp4 import BLOCK

NOT_CANDIDATES = ("input-mutated", "nameerror-at-call", "rows-unwritten", "garbage-padding")
"""Faults the engine's guards name by themselves (inputs compared, raise caught, poison, padding)."""
NO_EFFECT = 0.01
"""A fault whose output differs from the honest layer's by less than this fraction of its own bound
everywhere has no effect on the case: it is not a candidate."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One catalogue fault and how close the kernel's output is to it."""

    slug: str
    fault: str
    worst_ratio: float
    """max |got - fault output| / (b_kernel + b_fault); under 1: the fault explains the output."""


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Why a check failed, as far as the catalogue can tell, and where."""

    candidates: tuple[Candidate, ...]  # every fault, closest first
    tokens: tuple[tuple[int, int], ...]  # (token, elements over the bound), most first
    experts: tuple[tuple[int, float], ...]  # (expert, weight share among failing tokens / overall share)
    blocks: tuple[tuple[int, int], ...]  # (block of 32 output columns, elements over the bound)

    @property
    def explained_by(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.worst_ratio < 1)

    def summary(self) -> str:
        """A few lines for a failure message, a reproducer or a report."""
        lines = []
        if self.explained_by:
            names = ", ".join(f"{c.slug} ({c.worst_ratio:.2g}x)" for c in self.explained_by[:3])
            lines.append(f"explained by: {names}; the first: {self.explained_by[0].fault}")
        else:
            near = ", ".join(f"{c.slug} ({c.worst_ratio:.3g}x)" for c in self.candidates[:3])
            lines.append(f"no catalogue fault explains it; the nearest: {near}")
        if self.tokens:
            lines.append("error concentrates on tokens " + ", ".join(f"{t} ({n})" for t, n in self.tokens[:5])
                         + "; experts " + ", ".join(f"{e} ({r:.1f}x)" for e, r in self.experts[:3])
                         + "; column blocks " + ", ".join(f"{b} ({n})" for b, n in self.blocks[:3]))  # fmt: skip
        return "\n".join(lines)


def _clone(inputs: CaseInputs) -> CaseInputs:
    """Inputs a candidate may not spoil for the next (one fault writes into its input)."""
    w = inputs.weights
    weights = dataclasses.replace(w, **{f.name: getattr(w, f.name).clone() for f in dataclasses.fields(w)
                                        if isinstance(getattr(w, f.name), torch.Tensor)})  # fmt: skip
    return dataclasses.replace(inputs, x=inputs.x.clone(), router_logits=inputs.router_logits.clone(), weights=weights)


def _ratio(got: torch.Tensor, other: torch.Tensor, tolerance: torch.Tensor) -> float:
    diff = (got.to(torch.float64) - other.to(torch.float64)).abs()
    ratio = torch.nan_to_num(diff / tolerance, nan=math.inf)
    return float(ratio.max()) if ratio.numel() else 0.0


def explain(inputs: CaseInputs, got: torch.Tensor, arithmetic: Arithmetic) -> Diagnosis:
    """The diagnosis of a kernel output ``got`` on ``inputs`` (module docstring); ``arithmetic``
    is the kernel's declared one."""
    mine = reference_and_bound(inputs, arithmetic)
    candidates = []
    own_bounds: dict[Arithmetic, torch.Tensor] = {}
    honest = HonestFp32()
    given = _clone(inputs)
    honest_out = poisoned((inputs.case.tokens, inputs.case.hidden), honest.declaration.arithmetic.precision.output,
                          inputs.x.device)  # fmt: skip
    honest.run(honest.convert(given), given, honest_out)
    for cls in MUTANTS:
        if cls.slug in NOT_CANDIDATES:
            continue
        fault = cls()
        if not fault.reaches(inputs.case):
            continue  # it cannot change this case's output
        ar = fault.declaration.arithmetic
        if ar not in own_bounds:
            own_bounds[ar] = reference_and_bound(inputs, ar).bound
        given = _clone(inputs)
        out = poisoned((inputs.case.tokens, inputs.case.hidden), ar.precision.output, inputs.x.device)
        try:
            fault.run(fault.convert(given), given, out)
        except Exception:  # a fault that cannot apply to this case explains nothing
            continue
        if _ratio(out, honest_out, own_bounds[ar]) < NO_EFFECT:
            continue  # no effect here: it would name a cause that is not one
        candidates.append(Candidate(cls.slug, cls.fault, _ratio(got, out, mine.bound + own_bounds[ar])))
    candidates.sort(key=lambda c: c.worst_ratio)
    return Diagnosis(tuple(candidates), *_where(inputs, got, mine.ref, mine.bound))


def summarize(inputs: CaseInputs, got: torch.Tensor, arithmetic: Arithmetic) -> str:
    """``explain``'s summary on one line: the callback the front-ends hand the engine
    (``engine.Diagnose``), so that a FAIL of ``check``, of the suites and of a replay names its
    likely cause."""
    return explain(inputs, got, arithmetic).summary().replace("\n", "; ")


def _where(inputs: CaseInputs, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple:
    over = torch.nan_to_num((got.to(torch.float64) - ref).abs() / bound, nan=math.inf) > 1
    per_token = over.sum(dim=1)
    tokens = [(int(t), int(per_token[t])) for t in torch.argsort(per_token, descending=True) if per_token[t] > 0]
    per_block = over.reshape(over.shape[0], -1, BLOCK).sum(dim=(0, 2)) if over.shape[1] % BLOCK == 0 else None
    blocks = [] if per_block is None else [(int(b), int(per_block[b])) for b in torch.argsort(per_block,
                                                                                             descending=True)
                                           if per_block[b] > 0]  # fmt: skip
    r = inputs.routing()
    ids, weights = r.ids.cpu(), r.weights.abs().cpu()
    e = inputs.weights.num_experts if inputs.expert_map is None else int(inputs.expert_map.numel())
    failing = per_token.cpu() > 0

    def mass(rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(e, dtype=torch.float64).index_add_(0, ids[rows].reshape(-1), weights[rows].reshape(-1))

    overall, bad = mass(torch.ones_like(failing)), mass(failing)
    experts = []
    if bad.sum() > 0:
        share = (bad / bad.sum()) / (overall / overall.sum()).clamp_min(1e-12)
        experts = [(int(i), float(share[i])) for i in torch.argsort(share, descending=True) if bad[i] > 0]
    return tuple(tokens), tuple(experts), tuple(blocks)
