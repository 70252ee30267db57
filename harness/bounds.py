"""The per-element error bound: how far an honest backend's output may be from the exact layer.

Derivation. The oracle computes the layer exactly (float64; its own error, ~2^-53 of the sum of
magnitudes, is folded into every accumulation below). A backend rounds at the points its
``Arithmetic`` declares and accumulates in its declared format with unit roundoff ``u``. Every
quantity is carried with a bound ``E`` on |kernel value - exact value|, propagated to first order
through the same computation on absolute values (|X| |W|, not |X W|), with the second-order
terms of the activation kept:

* Accumulating n products (a GEMM row, or the k-way combine) plus a bias in any order errs by at
  most ``gamma(n + 2) * sum |terms|`` (one rounding per product, n - 1 per sum, one for the
  bias), ``gamma(n) = n u' / (1 - n u')`` with ``u' = u + 2^-53`` (Higham, Accuracy and Stability
  of Numerical Algorithms, 2nd ed., eq. 3.5); erroneous inputs add ``|W| E_in`` (the GEMM is
  linear).
* Rounding a value ``v`` (known to within ``E``) to a format errs by at most half an ulp of
  ``|v| + E`` in that format (``rounding_bound``); for MXFP8, half an E4M3 ulp at the largest
  scale the block's amax allows, or the saturation excess under FLOOR.
* The activation f(g, u) at the clamped point: ``|df/dg| E_g + |df/du| E_u + E_g E_u |d2f/dgdu|
  + 0.5 E_g^2 max|d2f/dg2|`` (the clamps are 1-Lipschitz, so they do not enlarge E), plus its
  evaluation error ``activation_ulps * u * |g sigma(alpha g)| (|u| + beta)``.
* Routing weights: ``routing_ulps * u * |w|`` plus their declared rounding.
* The activation input is not an error source: a correct kernel quantizes the same x with the
  same rule, so the oracle applies that rounding too (``Arithmetic.precision.activation_input``).
  With the router weight on the input (Llama4), the product w x may round differently on the two
  sides, so there it counts both roundings.

The result is a bound for honest arithmetic at ANY summation order (split-K, tiles, atomics),
never a statistical estimate: an honest kernel cannot exceed it, so a FAIL is never flaky.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxmoe.harness.backend import ACCUMULATORS, Arithmetic
from mxmoe.harness.inputs import CaseInputs
from mxmoe.reference.activation import split_gate_up
from mxmoe.reference.moe import Precision, moe, round_to
from mxmoe.reference.mxfp4 import BLOCK, dequantize_mxfp4, shared_exponent
from mxmoe.reference.routing import route

_IEEE = {"fp32": (23, -126), "bf16": (7, -126), "fp16": (10, -14), "fp64": (52, -1022)}
_DTYPE_POINT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_U64 = 2.0**-53


def _half_ulp(m: torch.Tensor, mbits: int, emin: int) -> torch.Tensor:
    """Half an ulp of magnitude ``m`` in a format with ``mbits`` mantissa bits and smallest normal
    exponent ``emin`` (the largest rounding error of any value of magnitude up to ``m``)."""
    _, exp = torch.frexp(m)
    e = torch.clamp(exp.to(torch.float64) - 1, min=emin)
    return torch.exp2(e - mbits - 1)


def _mx_bound(hi: torch.Tensor, lo: torch.Tensor, rule: str) -> torch.Tensor:
    """Largest MXFP8 quantization error of elements whose magnitudes lie in [lo, hi], blocks of 32
    along the last axis, under scale ``rule``."""
    shape = hi.shape
    hb = hi.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    lb = lo.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    e_hi = shared_exponent(hb.amax(-1), rule, "e4m3").unsqueeze(-1)
    e_lo = shared_exponent(lb.amax(-1), rule, "e4m3").unsqueeze(-1)
    step = torch.exp2(e_hi)
    rounding = _half_ulp(hb / step, 3, -6) * step
    saturation = torch.clamp(hb - 448.0 * torch.exp2(e_lo), min=0.0)
    return torch.maximum(rounding, saturation).reshape(shape)


def rounding_bound(point: str, magnitude: torch.Tensor, err: torch.Tensor, mx_rule: str = "floor") -> torch.Tensor:
    """Largest error of rounding, at ``point``, a value of magnitude ``magnitude`` known to within
    ``err`` (float64 tensors of one shape)."""
    if point == "mxfp8":
        return _mx_bound(magnitude + err, torch.clamp(magnitude - err, min=0.0), mx_rule)
    if point not in _IEEE:
        raise ValueError(f"point must be one of {', '.join((*_IEEE, 'mxfp8'))}; got {point!r}")
    if point == "fp64":
        return (magnitude + err) * _U64
    return _half_ulp(magnitude + err, *_IEEE[point])


def _gamma(n: int, u: float) -> float:
    nu = n * (u + _U64)
    return nu / (1.0 - nu)


@dataclass(frozen=True)
class Bounded:
    """The exact layer and the bound on an honest backend's deviation from it, float64 [T, H]."""

    ref: torch.Tensor
    bound: torch.Tensor


def oracle_precision(arithmetic: Arithmetic) -> Precision:
    """The oracle's precision for a backend: exact everywhere but the activation input, which a
    correct kernel rounds exactly as the oracle does."""
    p = arithmetic.precision
    return Precision(activation_input=p.activation_input, mx_rule=p.mx_rule)


def reference_and_bound(inputs: CaseInputs, arithmetic: Arithmetic) -> Bounded:
    """The oracle's output for ``inputs`` and the per-element bound for ``arithmetic``."""
    case = inputs.case
    p = arithmetic.precision
    u = ACCUMULATORS[arithmetic.accumulate]
    w = inputs.weights
    on_input = case.routing == "Llama4"
    kw = inputs.routing_kwargs
    ref = moe(
        inputs.x,
        inputs.router_logits,
        w,
        top_k=case.top_k,
        routing_method=case.routing,
        activation=case.activation,
        alpha=case.alpha,
        beta=case.beta,
        limit=case.limit,
        router_weight_on_input=on_input,
        expert_map=inputs.expert_map,
        precision=oracle_precision(arithmetic),
        **kw,
    )
    routing = route(inputs.router_logits, case.top_k, case.routing, **kw)
    t, k, hidden = case.tokens, case.top_k, w.hidden_size
    dev = inputs.x.device
    ids = routing.ids
    if inputs.expert_map is not None:
        ids = inputs.expert_map.to(dev, torch.int64)[ids]
    wts = routing.weights
    e_w = arithmetic.routing_ulps * u * wts.abs()
    if not on_input and p.routing_weights != "fp64":
        e_w = e_w + rounding_bound(p.routing_weights, wts.abs(), e_w)

    x64 = inputs.x.to(torch.float64)
    val = torch.zeros(t, k, hidden, dtype=torch.float64, device=dev)  # each slot's weighted output
    err = torch.zeros_like(val)
    mag = torch.zeros_like(val)
    alpha = case.alpha if case.activation == "swigluoai" else 1.0
    beta = case.beta if case.activation == "swigluoai" else 0.0
    limit = case.limit if case.activation == "swigluoai" else None
    x_in = round_to(x64, p.activation_input, p.mx_rule)
    for e in range(w.num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        we, ew = wts[tok, slot].unsqueeze(1), e_w[tok, slot].unsqueeze(1)
        w1 = dequantize_mxfp4(w.w13_blocks[e], w.w13_scales[e])
        w2 = dequantize_mxfp4(w.w2_blocks[e], w.w2_scales[e])
        b1 = torch.zeros(w1.shape[0], dtype=torch.float64, device=dev) if w.w13_bias is None else w.w13_bias[e].double()
        b2 = torch.zeros(w2.shape[0], dtype=torch.float64, device=dev) if w.w2_bias is None else w.w2_bias[e].double()
        if on_input:
            prod = x64[tok] * we
            xe = round_to(prod, p.activation_input, p.mx_rule)
            e_x = x64[tok].abs() * ew + u * prod.abs()
            if p.activation_input != "fp64":  # both sides round w x, possibly to neighbours
                e_x = e_x + 2 * rounding_bound(p.activation_input, prod.abs(), e_x, p.mx_rule)
        else:
            xe = x_in[tok]
            e_x = torch.zeros_like(xe)
        a1 = w1.abs()
        h = xe @ w1.T + b1
        e_h = e_x @ a1.T + _gamma(w1.shape[1] + 2, u) * ((xe.abs() + e_x) @ a1.T + b1.abs())
        if p.gemm1_output != "fp64":
            e_h = e_h + rounding_bound(p.gemm1_output, h.abs(), e_h)
        g, up = split_gate_up(h, w.w13_layout)
        e_g, e_u = split_gate_up(e_h, w.w13_layout)
        if limit:
            g, up = torch.clamp(g, max=limit), torch.clamp(up, min=-limit, max=limit)
        s = torch.sigmoid(alpha * g)
        gated = g * s
        d_gated = s * (1 + alpha * g * (1 - s))  # d/dg of g sigmoid(alpha g)
        shift = up + beta
        a = gated * shift
        e_a = (
            d_gated.abs() * shift.abs() * e_g
            + gated.abs() * e_u
            + d_gated.abs() * e_g * e_u
            + 0.5 * alpha * e_g**2 * (shift.abs() + e_u)  # |d2/dg2 g sigmoid(alpha g)| <= alpha / 2
            + arithmetic.activation_ulps * u * gated.abs() * (up.abs() + abs(beta))
        )
        if p.intermediate != "fp64":
            e_a = e_a + rounding_bound(p.intermediate, a.abs(), e_a, p.mx_rule)
        a2 = w2.abs()
        y = a @ w2.T + b2
        e_y = e_a @ a2.T + _gamma(w2.shape[1] + 2, u) * ((a.abs() + e_a) @ a2.T + b2.abs())
        if p.expert_output != "fp64":
            e_y = e_y + rounding_bound(p.expert_output, y.abs(), e_y)
        if on_input:
            val[tok, slot], err[tok, slot], mag[tok, slot] = y, e_y, y.abs() + e_y
        else:
            val[tok, slot] = we * y
            err[tok, slot] = we.abs() * e_y + ew * (y.abs() + e_y)
            mag[tok, slot] = (we.abs() + ew) * (y.abs() + e_y)
    out = val.sum(1)
    bound = err.sum(1) + _gamma(k + 1, u) * mag.sum(1)
    point = _DTYPE_POINT[p.output]
    bound = bound + rounding_bound(point, out.abs(), bound)
    # The bound's own pass recomputes the layer: it must agree with the oracle, or the two code
    # paths disagree about the math and neither the bound nor the verdict can be trusted.
    scale = mag.sum(1)
    if not torch.all((out - ref).abs() <= 1e-10 * (scale + ref.abs()) + 1e-300):
        raise AssertionError("harness.bounds disagrees with reference.moe on this case: a harness bug")
    return Bounded(ref=ref, bound=bound)
