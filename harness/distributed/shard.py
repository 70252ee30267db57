"""How a layer is cut across ranks, what the combined output may deviate by, and the planted faults.

**Tensor parallel** (``tp``), as GPT-OSS's weight loader shards MXFP4 experts: rank r holds the
intermediate slice ``cases.tp_shard(I, N, r)``: ceil((I/32)/N) blocks of 32 on every rank but the
last, which holds the rest (gpt-oss-120b TP8: 384 x 7 + 192 of 2880). Every rank allocates the
same partition width (the first ranks' width) and the last rank's tail is padding, which must be
zero: a zero gate/up row gives a zero activation and a zero w2 column adds nothing. The w2 bias is
on rank 0 only (zeros elsewhere), since the output is summed across ranks by an all-reduce. Each
rank is thus a plain layer of the partition width, which is how its kernel sees it.

**Expert parallel** (``ep``), as vLLM's naive prepare/finalize (all-gather / reduce-scatter) does:
rank r owns a contiguous slice of the experts (``Case.local_experts``, an expert map of -1 for
the others) and a contiguous slice of the tokens. The tokens (and their router logits) are
all-gathered, every rank runs its experts over all of them, and the partial outputs are summed
and scattered back so that each rank keeps its own tokens' rows.

**The bound.** Shard r's output deviates from its exact partial output ``ref_r`` by at most the
engine's per-element bound ``b_r`` (``bounds.reference_and_bound`` of the shard as the kernel sees
it). The shards' exact partials sum to the unsharded layer, so the combined output deviates from
the unsharded oracle by at most ``sum_r b_r`` plus the rounding of the reduction itself: summing N
values in the output precision (unit roundoff u; NCCL and gloo add in the tensor's dtype) in any
order errs by at most gamma_{N-1}(u) * sum_r |got_r| (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., eq. 4.4). The probabilistic half of each ``b_r`` holds except with
probability 2.5e-14 per element; a union over N ranks multiplies that by N.

**Planted faults** (``FAULTS``), each a bug of a sharded deployment rather than of a kernel, applied
to what the ranks are given, never to the oracle: the check must catch every one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from mxmoe.harness.contract.cases import Case, tp_shard
from mxmoe.harness.contract.inputs import CaseInputs, generator_for, make_inputs
from mxmoe.reference.activation import gate_up_rows
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK

MODES = ("tp", "ep")
FAULTS = {
    "bias-every-rank": ("tp", "the w2 bias added on every rank, so the all-reduce applies it N times"),
    "padding-unzeroed": ("tp", "the last rank's padded partition tail left uninitialised instead of zero"),
    "token-twice": ("ep", "one token dispatched to two ranks, so its output is combined twice"),
    "skip-allreduce": ("tp ep", "one rank (the last with tokens) skips the combine and keeps its own partial output"),
}
"""Fault -> (the modes it applies to, what it does)."""
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One distributed check: the unsharded case, the mode, the number of ranks and a fault."""

    case: Case
    mode: str
    world: int
    fault: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.world < 2:
            raise ValueError(f"world (ranks) must be at least 2; got {self.world}")
        if self.case.tp != 1 or self.case.ep != 1:
            raise ValueError(f"case {self.case.id} is already a shard; give the unsharded case")
        if self.mode == "tp":
            blocks = self.case.intermediate // BLOCK
            if self.world > blocks or (self.world - 1) * math.ceil(blocks / self.world) >= blocks:
                raise ValueError(f"TP {self.world} leaves a rank without intermediate blocks of "
                                 f"I={self.case.intermediate} ({blocks} blocks of {BLOCK})")  # fmt: skip
        elif self.case.experts % self.world:
            raise ValueError(f"EP {self.world} must divide the {self.case.experts} experts of {self.case.id}")
        if self.fault is not None:
            if self.fault not in FAULTS:
                raise ValueError(f"fault must be one of {', '.join(FAULTS)} (or none); got {self.fault!r}")
            if self.mode not in FAULTS[self.fault][0].split():
                raise ValueError(f"fault {self.fault} applies to {FAULTS[self.fault][0]}, not {self.mode}")

    @property
    def suffix(self) -> str:
        """The test id's tail: ``tp4``, ``ep2-fault-token-twice``."""
        return f"{self.mode}{self.world}" + (f"-fault-{self.fault}" if self.fault else "")

    @property
    def fault_rank(self) -> int:
        """The rank a one-rank fault strikes: the last one (under EP, the last that owns tokens,
        since a rank with no tokens keeps no rows for the fault to change)."""
        if self.mode == "ep":
            return max(r for r in range(self.world) if self.token_slice(r)[1] > self.token_slice(r)[0])
        return self.world - 1

    @property
    def partition(self) -> int:
        """TP: the intermediate width every rank allocates (the first ranks' slice)."""
        lo, hi = tp_shard(self.case.intermediate, self.world, 0)
        return hi - lo

    def token_slice(self, rank: int) -> tuple[int, int]:
        """EP: the [start, stop) of the tokens rank ``rank`` owns (contiguous, near-equal)."""
        per = math.ceil(self.case.tokens / self.world)
        return min(rank * per, self.case.tokens), min((rank + 1) * per, self.case.tokens)

    def dispatched(self, rank: int) -> list[int]:
        """EP: the token indices rank ``rank`` sends into the all-gather (with the fault, rank 0
        also sends the first token of the next rank that owns one)."""
        t0, t1 = self.token_slice(rank)
        mine = list(range(t0, t1))
        if self.fault == "token-twice" and rank == 0:
            other = next((self.token_slice(r)[0] for r in range(1, self.world) if self.token_slice(r)[1] >
                          self.token_slice(r)[0]), 0)  # fmt: skip
            mine.append(other)
        return mine


Fill = Callable[[tuple[int, ...], torch.Tensor, bool], torch.Tensor]
"""Makes the padding of a slice: (shape, a tensor of the dtype and device, whether it holds scales)."""


def zeros(shape: tuple[int, ...], like: torch.Tensor, scales: bool = False) -> torch.Tensor:
    """Correct padding: a zero code gives a zero weight whatever its scale, a zero bias adds nothing."""
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def slice_intermediate(w: MoEWeights, intermediate: int, lo: int, hi: int, width: int,
                       fill: Fill = zeros) -> MoEWeights:  # fmt: skip
    """The layer restricted to intermediate columns [lo, hi) (multiples of 32), padded by ``fill``
    to ``width``: the gate and up rows of w13 (in its row layout) and the w2 columns and scales.
    The w2 bias is the caller's: it does not depend on the intermediate dimension."""
    src_g, src_u = gate_up_rows(2 * intermediate, w.w13_layout)
    dst_g, dst_u = gate_up_rows(2 * width, w.w13_layout)

    def w13(t: torch.Tensor | None, scales: bool = False) -> torch.Tensor | None:
        if t is None:
            return None
        tail = (t.shape[0], width - (hi - lo), *t.shape[2:])
        out = torch.empty((t.shape[0], 2 * width, *t.shape[2:]), dtype=t.dtype, device=t.device)
        for src, dst in ((src_g, dst_g), (src_u, dst_u)):
            part = t.index_select(1, src[lo:hi].to(t.device))
            out[:, dst.to(t.device)] = torch.cat([part, fill(tail, t, scales)], dim=1)
        return out

    def cols(t: torch.Tensor, per_col: int, scales: bool = False) -> torch.Tensor:
        a, b = lo // per_col, hi // per_col
        tail = (*t.shape[:2], width // per_col - (b - a))
        return torch.cat([t[:, :, a:b], fill(tail, t, scales)], dim=2).contiguous()

    return MoEWeights(w13(w.w13_blocks), w13(w.w13_scales, scales=True), cols(w.w2_blocks, 2),
                      cols(w.w2_scales, BLOCK, scales=True), w13(w.w13_bias), w.w2_bias, w.w13_layout)  # fmt: skip


def tp_rank_inputs(full: CaseInputs, plan: Plan, rank: int, *, planted: bool) -> CaseInputs:
    """Rank ``rank``'s layer under tensor parallelism (module docstring): its slice, padded to the
    partition width, as a plain layer of that width. ``planted`` applies the plan's fault (the
    oracle's own shard is always built with ``planted=False``)."""
    c = full.case
    w = full.weights
    lo, hi = tp_shard(c.intermediate, plan.world, rank)
    per = plan.partition
    fill: Fill = zeros
    if planted and plan.fault == "padding-unzeroed" and rank == plan.world - 1 and hi - lo < per:
        gen = generator_for(f"{c.id}-{plan.suffix}-garbage", w.w13_blocks.device)

        def fill(shape: tuple[int, ...], like: torch.Tensor, scales: bool = False) -> torch.Tensor:
            if like.dtype == torch.uint8:  # uninitialised codes; scales kept in the weights' range
                low, high = (118, 125) if scales else (0, 256)
                return torch.randint(low, high, shape, generator=gen, device=like.device,
                                     dtype=torch.int32).to(like.dtype)  # fmt: skip
            return torch.randn(shape, generator=gen, device=like.device, dtype=torch.float32).to(like.dtype)

    weights = slice_intermediate(w, c.intermediate, lo, hi, per, fill)
    if w.w2_bias is not None and rank != 0 and not (planted and plan.fault == "bias-every-rank"):
        weights = dataclasses.replace(weights, w2_bias=torch.zeros_like(w.w2_bias))
    return CaseInputs(dataclasses.replace(c, intermediate=per), full.x, full.router_logits, weights, None,
                      full.correction_bias)  # fmt: skip


def ep_rank_inputs(plan: Plan, rank: int, x: torch.Tensor, logits: torch.Tensor, device: str) -> CaseInputs:
    """Rank ``rank``'s layer under expert parallelism: its experts (``make_inputs`` of the EP shard
    case) over the all-gathered tokens ``x`` and ``logits`` (in dispatch order)."""
    shard = make_inputs(dataclasses.replace(plan.case, ep=plan.world, ep_rank=rank), device)
    case = dataclasses.replace(shard.case, tokens=x.shape[0])
    return CaseInputs(case, x, logits, shard.weights, shard.expert_map, shard.correction_bias)


def reduction_bound(partials: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """gamma_{N-1}(u) * sum_r |partial_r| (float64): the rounding of summing N partials in ``dtype``."""
    n = len(partials)
    u = UNIT_ROUNDOFF.get(dtype)
    if u is None:
        raise ValueError(f"no unit roundoff for output dtype {dtype}; accepted: {', '.join(map(str, UNIT_ROUNDOFF))}")
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    return gamma * sum(p.to(torch.float64).abs() for p in partials)
