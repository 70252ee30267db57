"""The oracle's self-check: the batched float64 reference against its plain per-token definitions
(reference.brute) on built-in cases. Run before any backend is judged by the oracle, on the same
machine and device, so that a broken torch build or device cannot make the oracle itself wrong
unnoticed."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mxmoe.harness.contract.inputs import generator_for, random_mxfp4_weights, tie_free_logits
from mxmoe.reference import brute
from mxmoe.reference.activation import LAYOUTS, convert_layout, gated_activation
from mxmoe.reference.moe import MoEWeights, moe
from mxmoe.reference.mxfp4 import (
    SCALE_RULES,
    decode_e2m1,
    decode_e8m0,
    dequantize_mxfp4,
    quantize_mxfp4,
    unpack_fp4,
)
from mxmoe.reference.routing import ROUTING_METHODS, route

REL_TOL = 1e-12
"""Largest relative difference accepted between the batched oracle and the plain loops: both are
float64, they differ only in summation order (fsum is correctly rounded)."""


@dataclass(frozen=True)
class CheckResult:
    """One row of the self-check table."""

    name: str
    cases: int
    worst: float
    """Worst relative difference seen (0 for exact checks)."""
    tolerance: float
    seconds: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        """Whether the worst difference is within tolerance (NaN never passes)."""
        return not math.isnan(self.worst) and self.worst <= self.tolerance


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including the sign of zero and NaN in the same places."""
    a, b = a.double().cpu(), b.double().cpu()
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b))) and bool(
        torch.equal(torch.where(nan, 0.0, a), torch.where(nan, 0.0, b))
        and torch.equal(torch.signbit(a), torch.signbit(b))
    )


def _check_e2m1(device: str) -> tuple[int, float]:
    byte = torch.arange(256, dtype=torch.uint8, device=device)
    got = decode_e2m1(unpack_fp4(byte.unsqueeze(1)))
    ref = torch.tensor([[brute.e2m1_value(b & 0xF), brute.e2m1_value(b >> 4)] for b in range(256)], dtype=torch.float64)
    return 256, 0.0 if _same_bits(got, ref) else math.inf


def _check_e8m0(device: str) -> tuple[int, float]:
    got = decode_e8m0(torch.arange(256, dtype=torch.uint8, device=device))
    ref = torch.tensor([brute.e8m0_value(b) for b in range(256)], dtype=torch.float64)
    return 256, 0.0 if _same_bits(got, ref) else math.inf


def _check_dequant(device: str) -> tuple[int, float]:
    """Every packed byte under every scale byte: 65,536 blocks' worth of products."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1).reshape(256 * 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(16).reshape(256 * 16, 1)
    got = dequantize_mxfp4(blocks.to(device), scales.to(device))
    ref = torch.tensor(
        [brute.dequantize_row(b, s) for b, s in zip(blocks.tolist(), scales.tolist())], dtype=torch.float64
    )
    return blocks.numel(), 0.0 if _same_bits(got, ref) else math.inf


def _check_roundtrip(device: str) -> tuple[int, float]:
    """Quantize then dequantize returns representable inputs unchanged, under every rule."""
    gen = generator_for("selfcheck-roundtrip", device)
    codes = torch.randint(0, 16, (64, 8, 32), generator=gen, device=device)
    codes[..., 0] = 7  # each block holds a +-6, so every rule picks the block's own exponent
    exps = torch.randint(-20, 21, (64, 8, 1), generator=gen, device=device).double()
    x = (decode_e2m1(codes.to(torch.uint8)) * torch.exp2(exps)).reshape(64, 256)
    ok = all(_same_bits(dequantize_mxfp4(*quantize_mxfp4(x, rule)), x) for rule in SCALE_RULES)
    return x.numel() * len(SCALE_RULES), 0.0 if ok else math.inf


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (NaN anywhere gives NaN)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    if got.shape != ref.shape or bool(torch.isnan(got).any() or torch.isnan(ref).any()):
        return math.nan
    if ref.numel() == 0:
        return 0.0
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


_ROUTING_EXTRA = {
    "DeepSeekV3": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    "MiniMax2": {"routed_scaling_factor": 1.5},
}


def _check_routing(device: str) -> tuple[int, float]:
    worst, cases = 0.0, 0
    for method in ROUTING_METHODS:
        gen = generator_for(f"selfcheck-routing-{method}", device)
        logits = tie_free_logits(gen, 16, 16, device)
        extra = dict(_ROUTING_EXTRA.get(method, {}))
        if method in ("DeepSeekV3", "MiniMax2"):
            extra["correction_bias"] = 0.1 * torch.randn(16, generator=gen, device=device)
        top_k = 1 if method == "Llama4" else 4
        got = route(logits, top_k, method, **extra)
        bias = extra.pop("correction_bias", None)
        plain = [
            brute.route_token(row, top_k, method, None if bias is None else bias.tolist(), **extra)
            for row in logits.double().tolist()
        ]
        if got.ids.tolist() != [[e for e, _ in p] for p in plain]:
            return cases, math.inf
        worst = max(worst, _rel(got.weights, torch.tensor([[w for _, w in p] for p in plain], dtype=torch.float64)))
        cases += logits.shape[0]
    return cases, worst


def _check_activation(device: str) -> tuple[int, float]:
    gen = generator_for("selfcheck-activation", device)
    h = 4 * torch.randn(8, 64, generator=gen, device=device, dtype=torch.float64)
    worst, cases = 0.0, 0
    for layout in LAYOUTS:
        x = convert_layout(h, "interleaved", layout, dim=-1)
        for act in ("silu", "swigluoai"):
            got = gated_activation(x, act, layout)
            ref = torch.tensor(
                [brute.activate(r, act, layout, 1.702, 1.0, 7.0) for r in x.tolist()], dtype=torch.float64
            )
            worst = max(worst, _rel(got, ref))
            cases += x.shape[0]
    return cases, worst


# (id, E, H, I, top_k, routing, activation, layout, on_input, ep_ranks)
_MOE_CASES = (
    ("gptoss-interleaved", 8, 64, 64, 4, "Renormalize", "swigluoai", "interleaved", False, 1),
    ("gptoss-default-routing", 8, 64, 96, 2, "Default", "swigluoai", "interleaved", False, 1),
    ("deepseek-chunked", 16, 96, 64, 4, "DeepSeekV3", "silu", "chunked_gate_up", False, 1),
    ("cutlass-up-gate", 8, 64, 64, 2, "Renormalize", "swigluoai", "chunked_up_gate", False, 1),
    ("trtllm-pair-swapped", 8, 64, 64, 2, "RenormalizeNaive", "swigluoai", "pair_swapped", False, 1),
    ("llama4-input-weight", 8, 64, 64, 1, "Llama4", "silu", "chunked_gate_up", True, 1),
    ("gptoss-ep2-rank0", 8, 64, 64, 4, "Renormalize", "swigluoai", "interleaved", False, 2),
)


def _check_moe(device: str) -> tuple[int, float]:
    worst, cases = 0.0, 0
    for name, e, h, i, k, method, act, layout, on_input, ranks in _MOE_CASES:
        gen = generator_for(f"selfcheck-moe-{name}", device)
        full = random_mxfp4_weights(gen, e, h, i, w13_layout=layout, device=device)
        x = torch.randn(9, h, generator=gen, device=device).to(torch.bfloat16)
        logits = tie_free_logits(gen, 9, e, device)
        extra = {"n_group": 4, "topk_group": 2} if method == "DeepSeekV3" else {}
        kwargs = dict(top_k=k, routing_method=method, activation=act, router_weight_on_input=on_input, **extra)
        ref = brute.moe_token_loop(x.cpu(), logits.cpu(), _on_cpu(full), **kwargs)
        if ranks == 1:
            got = moe(x, logits, full, **kwargs)
        else:  # expert parallelism: each rank holds a contiguous slice; ranks' outputs sum to the layer
            per = e // ranks
            got = torch.zeros_like(ref)
            for r in range(ranks):
                emap = torch.full((e,), -1, dtype=torch.int64, device=device)
                emap[r * per : (r + 1) * per] = torch.arange(per, device=device)
                local = _slice_experts(full, r * per, (r + 1) * per)
                got += moe(x, logits, local, expert_map=emap, **kwargs).cpu()
        worst = max(worst, _rel(got, ref))
        cases += x.shape[0]
    return cases, worst


def _on_cpu(w: MoEWeights) -> MoEWeights:
    return _map(w, lambda t: t.cpu())


def _slice_experts(w: MoEWeights, lo: int, hi: int) -> MoEWeights:
    return _map(w, lambda t: t[lo:hi])


def _map(w: MoEWeights, fn: Callable[[torch.Tensor], torch.Tensor]) -> MoEWeights:
    def opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else fn(t)

    return MoEWeights(
        fn(w.w13_blocks),
        fn(w.w13_scales),
        fn(w.w2_blocks),
        fn(w.w2_scales),
        opt(w.w13_bias),
        opt(w.w2_bias),
        w.w13_layout,
    )


CHECKS: tuple[tuple[str, str, Callable[[str], tuple[int, float]], float], ...] = (
    ("e2m1-decode", "all 256 bytes as two E2M1 codes vs bit fields", _check_e2m1, 0.0),
    ("e8m0-decode", "all 256 scale bytes vs 2**(b-127), 255 NaN", _check_e8m0, 0.0),
    ("mxfp4-dequant", "every byte under every scale byte", _check_dequant, 0.0),
    ("quantize-roundtrip", "representable inputs, rules floor/rceil/even", _check_roundtrip, 0.0),
    ("routing", "every method vs per-token definition", _check_routing, REL_TOL),
    ("activation", "silu/swigluoai in every w13 layout", _check_activation, REL_TOL),
    ("moe-layer", "layouts, routings, Llama4 input weight, EP=2", _check_moe, REL_TOL),
)


def run_selfcheck(device: str = "cpu") -> list[CheckResult]:
    """Run every check on ``device``; an exception in one check is recorded as its failure."""
    results = []
    for name, detail, fn, tol in CHECKS:
        start = time.perf_counter()
        try:
            cases, worst = fn(device)
            note = detail
        except Exception as exc:  # a crash is a failed check, reported, not a lost run
            cases, worst, note = 0, math.nan, f"raised {type(exc).__name__}: {exc}"
        results.append(CheckResult(name, cases, worst, tol, time.perf_counter() - start, note))
    return results
