"""Shrinking a failing case: the smallest slice of its exact inputs that still fails the same way.

A failure found at gpt-oss size (thousands of tokens, 128 experts, 2880 x 2880 weights) is hard to
read and its reproducer weighs hundreds of megabytes. The shrinker keeps the failing inputs' own
bytes and cuts them, so a data-dependent bug (one scale byte, one token's routing) survives:

1. **tokens**: the single worst token (by error/bound), then halves, then single tokens in turn;
2. **experts**: only the experts the kept tokens route to (at least top-k), their router logits
   and weights (not for grouped routings or EP shards, whose groups the cut would change);
3. **intermediate**, then **hidden**: halved, on block boundaries (the gate and up rows and the
   w2 columns of the kept intermediate slice; the first input columns and output rows of hidden);

each cut kept only if the backend still FAILs (or ERRORs, if the original did) under the engine's
usual check, repeated until no cut applies. A backend that does not support a smaller shape skips
it, and that cut is not taken. The smaller case is checked from scratch: its verdict and bound
are the engine's for the cut inputs, never carried over.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mxmoe.harness.contract.backend import Backend
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.distributed.shard import slice_intermediate
from mxmoe.harness.judge.engine import Result, run_case
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK

GROUPED = ("DeepSeekV3", "MiniMax2")


@dataclasses.dataclass
class Shrunk:
    """The smallest failing case found, its inputs and verdict, and the cuts that got there."""

    case: Case
    inputs: CaseInputs
    result: Result
    steps: list[str]


def _case(inputs: CaseInputs, **changes: object) -> Case:
    return dataclasses.replace(inputs.case, **changes)


def _tokens(inputs: CaseInputs, keep: list[int]) -> CaseInputs:
    index = torch.tensor(keep, dtype=torch.int64, device=inputs.x.device)
    return dataclasses.replace(inputs, case=_case(inputs, tokens=len(keep)), x=inputs.x.index_select(0, index),
                               router_logits=inputs.router_logits.index_select(0, index))  # fmt: skip


def _experts(inputs: CaseInputs) -> CaseInputs | None:
    c = inputs.case
    if c.routing in GROUPED or inputs.expert_map is not None or c.tokens == 0:
        return None
    used = sorted(set(inputs.routing().ids.reshape(-1).tolist()))
    if len(used) < c.top_k:  # keep the case valid: at least top-k experts
        used = sorted(used + [e for e in range(c.experts) if e not in used][: c.top_k - len(used)])
    if len(used) >= c.experts:
        return None
    index = torch.tensor(used, dtype=torch.int64, device=inputs.x.device)
    w = inputs.weights

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device))

    weights = MoEWeights(pick(w.w13_blocks), pick(w.w13_scales), pick(w.w2_blocks), pick(w.w2_scales),
                         pick(w.w13_bias), pick(w.w2_bias), w.w13_layout)  # fmt: skip
    cb = None if inputs.correction_bias is None else inputs.correction_bias.index_select(0, index)
    case = _case(inputs, experts=len(used), skew="uniform" if c.skew == "sparse" else c.skew)
    return dataclasses.replace(inputs, case=case, router_logits=inputs.router_logits.index_select(1, index),
                               weights=weights, correction_bias=cb)  # fmt: skip


def _intermediate(inputs: CaseInputs) -> CaseInputs | None:
    c = inputs.case
    if c.tp != 1 or c.intermediate <= BLOCK:
        return None
    i = max(BLOCK, (c.intermediate // 2) // BLOCK * BLOCK)
    weights = slice_intermediate(inputs.weights, c.intermediate, 0, i, i)
    return dataclasses.replace(inputs, case=_case(inputs, intermediate=i), weights=weights)


def _hidden(inputs: CaseInputs) -> CaseInputs | None:
    c = inputs.case
    if c.hidden <= BLOCK:
        return None
    h = max(BLOCK, (c.hidden // 2) // BLOCK * BLOCK)
    w = inputs.weights
    weights = MoEWeights(w.w13_blocks[:, :, : h // 2].contiguous(), w.w13_scales[:, :, : h // BLOCK].contiguous(),
                         w.w2_blocks[:, :h].contiguous(), w.w2_scales[:, :h].contiguous(), w.w13_bias,
                         None if w.w2_bias is None else w.w2_bias[:, :h].contiguous(), w.w13_layout)  # fmt: skip
    return dataclasses.replace(inputs, case=_case(inputs, hidden=h), x=inputs.x[:, :h].contiguous(), weights=weights)


def _worst_token(backend: Backend, inputs: CaseInputs, arch: str) -> int | None:
    from mxmoe.harness.judge.bounds import reference_and_bound
    from mxmoe.harness.judge.engine import poisoned

    d = backend.declaration
    out = poisoned((inputs.case.tokens, inputs.case.hidden), d.arithmetic.precision.output, inputs.x.device)
    try:
        backend.run(backend.convert(inputs), inputs, out)
    except Exception:
        return None
    b = reference_and_bound(inputs, d.arithmetic)
    ratio = torch.nan_to_num((out.to(torch.float64) - b.ref).abs() / b.bound, nan=math.inf).amax(dim=1)
    return int(ratio.argmax()) if ratio.numel() else None


def shrink(backend: Backend, inputs: CaseInputs, arch: str, max_checks: int = 200) -> Shrunk:
    """The smallest failing slice of ``inputs`` (module docstring); raises ValueError if the case
    does not fail to begin with."""
    first, _ = run_case(backend, inputs.case, arch, inputs=inputs)
    if first.outcome not in ("FAIL", "ERROR"):
        raise ValueError(f"{first.test_id} does not fail here ({first.outcome}: {first.reason}); nothing to shrink")
    want = first.outcome
    best, result, steps = inputs, first, []
    checks = 0

    def fails(cand: CaseInputs | None) -> Result | None:
        nonlocal checks
        if cand is None or checks >= max_checks:
            return None
        checks += 1
        try:
            got, _ = run_case(backend, cand.case, arch, inputs=cand)
        except ValueError:  # a cut the case cannot take
            return None
        return got if got.outcome == want else None

    progress = True
    while progress and checks < max_checks:
        progress = False
        t = best.case.tokens
        if t > 1:
            worst = _worst_token(backend, best, arch) if want == "FAIL" else None
            tries = ([[worst]] if worst is not None else []) + [list(range(t // 2)), list(range(t // 2, t))]
            tries += [[i] for i in range(min(t, 8))]
            for keep in tries:
                got = fails(_tokens(best, keep))
                if got is not None:
                    best, result, progress = _tokens(best, keep), got, True
                    steps.append(f"tokens {t} -> {len(keep)}")
                    break
            if progress:
                continue
        for name, cut in (("experts", _experts), ("intermediate", _intermediate), ("hidden", _hidden)):
            cand = cut(best)
            got = fails(cand)
            if got is not None:
                before = {"experts": best.case.experts, "intermediate": best.case.intermediate,
                          "hidden": best.case.hidden}[name]  # fmt: skip
                best, result, progress = cand, got, True
                steps.append(f"{name} {before} -> {getattr(cand.case, name)}")
                break
    return Shrunk(best.case, best, result, steps)
