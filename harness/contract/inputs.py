"""Deterministic inputs: every tensor a case uses derives from the case's id, never from the order
in which cases are collected or from the clock, so any case can be rerun alone and get the same
bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch

from mxmoe.harness.contract.cases import Case
from mxmoe.reference.activation import gate_up_rows
from mxmoe.reference.moe import EXACT, MoEWeights, Precision, moe
from mxmoe.reference.mxfp4 import BLOCK
from mxmoe.reference.routing import Routing, route, topk_margin


def seed_for(case_id: str) -> int:
    """A 63-bit seed derived from a case id (stable across processes, hosts and Python versions)."""
    return int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "little") >> 1


def generator_for(case_id: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded from ``case_id``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_for(case_id))
    return gen


TRAINED_SCALE_BYTES = (118, 124)
"""The scale bytes ``random_mxfp4_weights`` draws by default (weights of about a trained layer's
magnitude), from which ``_trained_biases`` sizes the biases."""


def random_mxfp4_weights(
    gen: torch.Generator,
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    bias: bool = True,
    scale_bytes: tuple[int, int] = TRAINED_SCALE_BYTES,
    w13_layout: str = "interleaved",
    device: str | torch.device = "cpu",
) -> MoEWeights:
    """Uniformly random MXFP4 expert weights: every code equally likely, scale bytes uniform in
    ``scale_bytes`` (inclusive), biases bf16 like a checkpoint's. With the default scale range the
    weights have roughly the magnitude of trained ones (|w| up to about 6 * 2**-3)."""
    e, h, i = num_experts, hidden, intermediate
    if h % BLOCK or i % BLOCK:
        raise ValueError(f"hidden ({h}) and intermediate ({i}) must be multiples of {BLOCK}")
    lo, hi = scale_bytes

    def u8(*shape: int, low: int = 0, high: int = 256) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen, device=device, dtype=torch.int32).to(torch.uint8)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    return MoEWeights(
        w13_blocks=u8(e, 2 * i, h // 2),
        w13_scales=u8(e, 2 * i, h // BLOCK, low=lo, high=hi + 1),
        w2_blocks=u8(e, h, i // 2),
        w2_scales=u8(e, h, i // BLOCK, low=lo, high=hi + 1),
        w13_bias=bf16(e, 2 * i) if bias else None,
        w2_bias=bf16(e, h) if bias else None,
        w13_layout=w13_layout,
    )


def logit_step(experts: int) -> float:
    """Spacing of ``tie_free_logits``: a power of two near 6 / (E - 1), so E levels span about
    [-3, 3] and every level is exactly a bfloat16 value (kernels that read bf16 logits see the
    same ones)."""
    return 2.0 ** min(0, math.ceil(math.log2(6.0 / max(experts - 1, 1))))


def tie_free_logits(
    gen: torch.Generator, tokens: int, experts: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Router logits [T, E] in float32: per token a random permutation of E levels spaced by
    ``logit_step(E)``, so distinct experts never tie and every value is exact in bfloat16."""
    order = torch.argsort(torch.rand(tokens, experts, generator=gen, device=device), dim=1)
    return ((order.to(torch.float32) - (experts - 1) / 2) * logit_step(experts)).to(torch.float32)


MIN_ROUTING_MARGIN = 1e-3
"""Smallest gap allowed between the k-th and the (k+1)-th selection score of a case (and between
kept and dropped groups): a kernel computing routing in float32 cannot flip such a choice."""


@dataclass(frozen=True)
class CaseInputs:
    """Everything one case feeds a backend, on one device. ``weights`` are this rank's shard of
    the canonical MXFP4 weights, in the checkpoint's row layout (``case.layout``)."""

    case: Case
    x: torch.Tensor
    """[T, H] bfloat16."""
    router_logits: torch.Tensor
    """[T, E] float32, every value exactly representable in bfloat16, tie-free per token."""
    weights: MoEWeights
    expert_map: torch.Tensor | None
    """int32 [E] (global expert -> local index or -1) on EP ranks, else None."""
    correction_bias: torch.Tensor | None
    """float32 [E] for DeepSeekV3 / MiniMax2 with a correction bias, else None."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (for checksums and reproducers)."""
        out = {"x": self.x, "router_logits": self.router_logits}
        names = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias")
        out.update({n: getattr(self.weights, n) for n in names if getattr(self.weights, n) is not None})
        if self.expert_map is not None:
            out["expert_map"] = self.expert_map
        if self.correction_bias is not None:
            out["correction_bias"] = self.correction_bias
        return out

    @property
    def selection_kwargs(self) -> dict[str, object]:
        """The keyword arguments of ``reference.routing.topk_margin``: what decides the selection."""
        return _selection_kwargs(self.case, self.correction_bias)

    @property
    def routing_kwargs(self) -> dict[str, object]:
        """The keyword arguments of ``reference.routing.route`` (and ``moe``) for this case."""
        kw = self.selection_kwargs
        if self.case.routing in ("DeepSeekV3", "MiniMax2"):
            kw["routed_scaling_factor"] = self.case.routed_scaling_factor
        return kw

    def routing(self) -> Routing:
        """The case's routing (float64 weights, global expert ids), as the oracle routes."""
        c = self.case
        return route(self.router_logits, c.top_k, c.routing, **self.routing_kwargs)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids as this EP rank's local indices (-1: another rank's expert)."""
        if self.expert_map is None:
            return ids
        return self.expert_map.to(ids.device, torch.int64)[ids]

    def padded_x(self, hidden: int) -> torch.Tensor:
        """x zero-padded to a converted hidden size (as vLLM's runner pads it), contiguous."""
        return torch.nn.functional.pad(self.x, (0, hidden - self.x.shape[1])).contiguous()

    def reference(self, precision: Precision = EXACT, weights: MoEWeights | None = None) -> torch.Tensor:
        """The oracle's output for these inputs (float64 unless ``precision.output`` says else).
        ``weights`` replaces the canonical weights (a backend's converted ones, in its declared row
        layout); where they are padded wider, x is zero-padded to match and the output is as wide."""
        c = self.case
        w = self.weights if weights is None else weights
        return moe(
            self.padded_x(w.hidden_size),
            self.router_logits,
            w,
            top_k=c.top_k,
            routing_method=c.routing,
            activation=c.activation,
            alpha=c.alpha,
            beta=c.beta,
            limit=c.limit,
            router_weight_on_input=c.routing == "Llama4",
            expert_map=self.expert_map,
            precision=precision,
            **self.routing_kwargs,
        )


def _layer_weights(case: Case, device: str | torch.device) -> MoEWeights:
    """The full layer's canonical weights (all experts, the whole intermediate dimension)."""
    gen = generator_for(case.layer_key, device)
    e, h, i = case.experts, case.hidden, case.intermediate
    if case.inputs == "normal":
        return random_mxfp4_weights(gen, e, h, i, bias=case.bias, w13_layout=case.layout, device=device)
    if case.inputs == "trained":
        return _trained_biases(random_mxfp4_weights(gen, e, h, i, bias=case.bias, w13_layout=case.layout,
                                                    device=device))  # fmt: skip
    w = random_mxfp4_weights(gen, e, h, i, bias=case.bias, w13_layout=case.layout, device=device)

    def wide(scales: torch.Tensor) -> torch.Tensor:
        # A base exponent per row over 2^-12..2^4 and a jitter of +-3 per block: every useful
        # scale exponent appears, and blocks of one row differ in magnitude.
        rows = scales.shape[:-1]
        base = torch.randint(-12, 5, (*rows, 1), generator=gen, device=device, dtype=torch.int32)
        jitter = torch.randint(-3, 4, scales.shape, generator=gen, device=device, dtype=torch.int32)
        return (127 + base + jitter).to(torch.uint8)

    return MoEWeights(
        w.w13_blocks,
        wide(w.w13_scales),
        w.w2_blocks,
        wide(w.w2_scales),
        w.w13_bias,
        w.w2_bias,
        w.w13_layout,
    )


_FP4_MEAN_SQUARE = sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8
"""E[v^2] of an E2M1 value whose 16 codes are equally likely (the sign does not matter)."""


def _trained_biases(w: MoEWeights) -> MoEWeights:
    """The biases rescaled to the size of what they are added to, as in a trained layer: b13 to
    the standard deviation of x W13 for unit-variance x (sqrt(H) times the weights' RMS), b2 to
    that of a W2 for an activation of that size (sqrt(I) times the RMS, times b13's scale). The
    RMS follows from the codes and scale bytes' uniform draw. A rule, not a checkpoint's measured
    statistics: no checkpoint is read."""
    if w.w13_bias is None:
        return w
    lo, hi = TRAINED_SCALE_BYTES
    rms = math.sqrt(_FP4_MEAN_SQUARE * sum(4.0 ** (b - 127) for b in range(lo, hi + 1)) / (hi - lo + 1))
    s13 = math.sqrt(w.hidden_size) * rms
    s2 = math.sqrt(w.intermediate_size) * rms * s13
    return dataclasses.replace(w, w13_bias=(w.w13_bias.float() * s13).to(torch.bfloat16),
                               w2_bias=(w.w2_bias.float() * s2).to(torch.bfloat16))  # fmt: skip


def _shard(case: Case, w: MoEWeights) -> MoEWeights:
    """This rank's experts and intermediate slice; the w2 bias only on TP rank 0 (zeros elsewhere),
    as a TP layer applies it once before the all-reduce."""
    e0, e1 = case.local_experts
    i0, i1 = case.intermediate_shard
    rows = torch.cat([r[i0:i1] for r in gate_up_rows(2 * case.intermediate, case.layout)])
    # gate rows then up rows of the slice, put back into the checkpoint's layout
    keep = torch.sort(rows).values.to(w.w13_blocks.device)

    def w13(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[e0:e1].index_select(1, keep)

    b2 = None if w.w2_bias is None else w.w2_bias[e0:e1].clone()
    if b2 is not None and case.tp_rank != 0:
        b2.zero_()
    return MoEWeights(
        w13(w.w13_blocks),
        w13(w.w13_scales),
        w.w2_blocks[e0:e1, :, i0 // 2 : i1 // 2],
        w.w2_scales[e0:e1, :, i0 // BLOCK : i1 // BLOCK],
        w13(w.w13_bias),
        b2,
        w.w13_layout,
    )


def _selection_kwargs(case: Case, bias: torch.Tensor | None) -> dict[str, object]:
    """What decides the selection (``topk_margin``'s arguments): groups and the correction bias."""
    kw: dict[str, object] = {}
    if case.n_group is not None:
        kw.update(n_group=case.n_group, topk_group=case.topk_group)
    if bias is not None and case.routing in ("DeepSeekV3", "MiniMax2"):
        kw["correction_bias"] = bias
    return kw


def _logits(case: Case, gen: torch.Generator, rows: int, device: str | torch.device) -> torch.Tensor:
    """Router logits [rows, E]: tie-free levels, then the case's skew, exact in bf16."""
    e = case.experts
    logits = tie_free_logits(gen, rows, e, device)
    if case.skew == "hot":
        # one expert is every token's clear first choice, one level above the rest; which one
        # derives from the case, not from the row
        hot = seed_for(case.tokens_key + "-hot") % e
        logits[:, hot] = logits.amax(dim=1) + logit_step(e)
    elif case.skew == "sparse":
        # the odd experts sink below every even one; ties among them cannot reach the top k
        logits[:, 1::2] -= 8.0
    elif case.skew == "negative":
        # the same tie-free levels, shifted below zero: the largest is -step
        logits = logits - (logits.amax(dim=1, keepdim=True) + logit_step(e))
    elif case.skew == "neartie":
        # the levels in [1, 2), one bf16 ulp (2^-7) apart: exact in bf16, distinct, nearly tied
        order = torch.argsort(torch.rand(rows, e, generator=gen, device=device), dim=1)
        logits = 1.0 + order.to(torch.float32) * 2.0**-7
    elif case.skew == "balanced":
        # token t's top k are experts (t k + j) mod E, above every other level, in a random order:
        # with T k a multiple of E every expert gets exactly T k / E tokens
        k = case.top_k
        start = seed_for(case.tokens_key + "-balanced") % e
        chosen = (start + torch.arange(rows, device=device).unsqueeze(1) * k + torch.arange(k, device=device)) % e
        lift = torch.zeros_like(logits).scatter_(1, chosen, 1.0)
        logits = logits + lift * (e * logit_step(e))
    return logits.to(torch.bfloat16).to(torch.float32)


def make_inputs(case: Case, device: str | torch.device = "cpu", draw_on: str | None = None) -> CaseInputs:
    """The inputs of ``case`` on ``device``: a pure function of the case's id and of the device the
    draw is made on (the layer's weights of its layer key, so every shard slices one layer). A CUDA
    generator draws other numbers from the same seed than the CPU's; ``draw_on="cpu"`` draws on the
    CPU and moves the tensors, giving the same bytes on every host (for a check of one particular
    draw), at the CPU's speed (about 17 s for gpt-oss-120b's layer on 2 cores, against well under
    a second on a GPU, which is why it is not the default)."""
    inputs = _draw(case, draw_on or device)
    if draw_on is None or torch.device(device) == torch.device(draw_on):
        return inputs
    w = inputs.weights
    moved = dataclasses.replace(w, **{f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)
                                      if isinstance(getattr(w, f.name), torch.Tensor)})  # fmt: skip

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return CaseInputs(case, to(inputs.x), to(inputs.router_logits), moved, to(inputs.expert_map),
                      to(inputs.correction_bias))  # fmt: skip


def _draw(case: Case, device: str | torch.device) -> CaseInputs:
    """``make_inputs``'s draw, on ``device``."""
    weights = _shard(case, _layer_weights(case, device))
    gen = generator_for(case.tokens_key, device)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device=device)
    if case.inputs == "wide":
        x = x * torch.exp2(torch.randint(-8, 9, (case.tokens, 1), generator=gen, device=device).float())
    x = x.to(torch.bfloat16)
    logits = _logits(case, gen, case.tokens, device)
    bias = None
    if case.correction_bias:
        bias = (0.05 * torch.randn(case.experts, generator=gen, device=device)).to(torch.bfloat16).to(torch.float32)
    # Selection on sigmoid + bias can land arbitrarily close to a tie; such a token redraws its
    # logits from a seed derived from the case id, the token and the attempt: still a function of
    # the id, and independent of the other tokens.
    for attempt in range(1, 65):
        margin = topk_margin(logits, case.top_k, case.routing, **_selection_kwargs(case, bias))
        bad = torch.nonzero(margin < MIN_ROUTING_MARGIN).flatten().tolist()
        if not bad:
            break
        if case.skew == "balanced":  # a redrawn token would leave the balance
            raise AssertionError(f"{case.id}: 'balanced' routing leaves tokens {bad[:8]} within "
                                 f"{MIN_ROUTING_MARGIN} of a tie under {case.routing}: give it a logit-ordered "
                                 "routing")  # fmt: skip
        for t in bad:
            logits[t] = _logits(case, generator_for(f"{case.tokens_key}-token{t}-redraw{attempt}", device), 1, device)[
                0
            ]
    else:
        raise AssertionError(f"no tie-free routing for {case.id} in 64 draws")
    emap = None
    if case.ep > 1:
        e0, e1 = case.local_experts
        emap = torch.full((case.experts,), -1, dtype=torch.int32, device=device)
        emap[e0:e1] = torch.arange(e1 - e0, dtype=torch.int32, device=device)
    return CaseInputs(case, x, logits, weights, emap, bias)
