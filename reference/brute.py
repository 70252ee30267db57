"""Plain per-token, per-expert definitions in Python floats: the oracle's own check.

These restate docs/formats.md as literally as possible (bit fields, one token at a time,
``math.fsum`` for every sum) and share no code with ``mxfp4``, ``routing``, ``activation`` or
``moe``. They are slow on purpose and used only on small cases: the tests and ``signoff`` compare
the batched float64 oracle with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def e2m1_value(code: int) -> float:
    """E2M1 from its bit fields: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp = (code >> 1) & 0b11
    man = code & 1
    mag = man * 0.5 if exp == 0 else (1.0 + man / 2) * 2.0 ** (exp - 1)
    return math.copysign(mag, sign)


def e8m0_value(byte: int) -> float:
    """E8M0 per the spec: 2**(byte - 127); 255 is NaN."""
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127)


def dequantize_row(packed: Sequence[int], scales: Sequence[int]) -> list[float]:
    """One row of MXFP4: element 2i is the low nibble of byte i; 32 elements per scale byte."""
    out = []
    for i, byte in enumerate(packed):
        scale = e8m0_value(scales[(2 * i) // 32])
        out.append(e2m1_value(byte & 0xF) * scale)
        out.append(e2m1_value(byte >> 4) * scale)
    return out


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def _softmax(v: Sequence[float]) -> list[float]:
    m = max(v)
    ex = [math.exp(a - m) for a in v]
    s = math.fsum(ex)
    return [a / s for a in ex]


def _top(scores: Sequence[float], k: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The k best experts; on equal scores the lower index first."""
    idx = range(len(scores)) if allowed is None else allowed
    return sorted(idx, key=lambda e: (-scores[e], e))[:k]


def route_token(
    logits: Sequence[float],
    top_k: int,
    method: str,
    correction_bias: Sequence[float] | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> list[tuple[int, float]]:
    """(expert, weight) pairs for one token, in selection order, literally as docs/formats.md says."""
    n = len(logits)
    if method == "Default":
        p = _softmax(logits)
        return [(e, p[e]) for e in _top(p, top_k)]
    if method == "Renormalize":
        chosen = _top(logits, top_k)
        return list(zip(chosen, _softmax([logits[e] for e in chosen])))
    if method == "RenormalizeNaive":
        p = _softmax(logits)
        chosen = _top(p, top_k)
        total = math.fsum(p[e] for e in chosen)
        return [(e, p[e] / total) for e in chosen]
    if method == "TopK":
        return [(e, logits[e]) for e in _top(logits, top_k)]
    if method in ("Llama4", "TopKSigmoid"):
        return [(e, _sigmoid(logits[e])) for e in _top(logits, top_k)]
    if method in ("Sigmoid", "SigmoidRenorm"):
        s = [_sigmoid(v) for v in logits]
        chosen = _top(s, top_k)
        if method == "Sigmoid":
            return [(e, s[e]) for e in chosen]
        total = math.fsum(s[e] for e in chosen)
        return [(e, s[e] / total) for e in chosen]
    if method in ("DeepSeekV3", "MiniMax2"):
        s = [_sigmoid(v) for v in logits]
        bias = correction_bias if correction_bias is not None else [0.0] * n
        sb = [a + b for a, b in zip(s, bias)]
        allowed = list(range(n))
        if n_group is not None:
            size = n // n_group
            gscore = [math.fsum(sorted(sb[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
            groups = _top(gscore, topk_group)
            allowed = [e for e in range(n) if e // size in groups]
        chosen = _top(sb, top_k, allowed)
        total = math.fsum(s[e] for e in chosen) + 1e-20
        return [(e, s[e] / total * routed_scaling_factor) for e in chosen]
    raise ValueError(f"unknown routing method {method!r}")


def activate(
    h: Sequence[float], activation: str, layout: str, alpha: float, beta: float, limit: float | None
) -> list[float]:
    """The gated activation of one token's GEMM1 output, literally as docs/formats.md says."""
    half = len(h) // 2
    if layout == "interleaved":
        pairs = [(h[2 * j], h[2 * j + 1]) for j in range(half)]
    elif layout == "pair_swapped":
        pairs = [(h[2 * j + 1], h[2 * j]) for j in range(half)]
    elif layout == "chunked_gate_up":
        pairs = [(h[j], h[half + j]) for j in range(half)]
    elif layout == "chunked_up_gate":
        pairs = [(h[half + j], h[j]) for j in range(half)]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    out = []
    for g, u in pairs:
        if activation == "silu":
            out.append(g * _sigmoid(g) * u)
            continue
        if limit:
            g = min(g, limit)
            u = max(-limit, min(u, limit))
        out.append(g * _sigmoid(alpha * g) * (u + beta))
    return out


def moe_token_loop(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    weights: object,
    *,
    top_k: int,
    routing_method: str = "Renormalize",
    activation: str = "swigluoai",
    alpha: float = 1.702,
    beta: float = 1.0,
    limit: float | None = 7.0,
    router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    """The exact MoE layer, one token and one expert at a time (``weights`` is a
    reference.moe.MoEWeights). Returns float64 [T, H]."""
    w13b = weights.w13_blocks.tolist()
    w13s = weights.w13_scales.tolist()
    w2b = weights.w2_blocks.tolist()
    w2s = weights.w2_scales.tolist()
    b13 = None if weights.w13_bias is None else weights.w13_bias.double().tolist()
    b2 = None if weights.w2_bias is None else weights.w2_bias.double().tolist()
    emap = None if expert_map is None else expert_map.tolist()
    bias = None if correction_bias is None else correction_bias.double().tolist()
    cache: dict[tuple[str, int], list[list[float]]] = {}

    def rows(kind: str, e: int) -> list[list[float]]:
        if (kind, e) not in cache:
            blocks, scales = (w13b, w13s) if kind == "w13" else (w2b, w2s)
            cache[kind, e] = [dequantize_row(b, s) for b, s in zip(blocks[e], scales[e])]
        return cache[kind, e]

    hidden = len(w2b[0]) if w2b else 0
    out = []
    for xt, lt in zip(x.double().tolist(), router_logits.double().tolist()):
        acc: list[list[float]] = [[] for _ in range(hidden)]
        for ge, wt in route_token(lt, top_k, routing_method, bias, n_group, topk_group, routed_scaling_factor):
            e = ge if emap is None else emap[ge]
            if e < 0:
                continue
            xin = [wt * v for v in xt] if router_weight_on_input else xt
            h = [math.fsum(a * b for a, b in zip(xin, r)) for r in rows("w13", e)]
            if b13 is not None:
                h = [v + b for v, b in zip(h, b13[e])]
            a = activate(h, activation, weights.w13_layout, alpha, beta, limit)
            y = [math.fsum(p * q for p, q in zip(a, r)) for r in rows("w2", e)]
            if b2 is not None:
                y = [v + b for v, b in zip(y, b2[e])]
            scale = 1.0 if router_weight_on_input else wt
            for j in range(hidden):
                acc[j].append(scale * y[j])
        out.append([math.fsum(terms) for terms in acc])
    return torch.tensor(out, dtype=torch.float64).reshape(len(out), hidden)
