"""The MXFP4 MoE layer in float64: the oracle every backend is compared with.

For each token ``t`` and each of its ``k`` chosen experts ``e`` with routing weight ``w``
(SPEC section 3; canonical GPT-OSS weights)::

    h   = x[t] @ W13[e].T + b13[e]                    # [2I], W13 dequantized exactly
    a   = activation(h, layout of w13's rows)         # [I]
    y   = a @ W2[e].T + b2[e]                         # [H]
    out[t] += w * y

Everything is computed in float64 from exactly dequantized weights. ``Precision`` names the points
where a backend legitimately rounds (its activation input, GEMM1's output, the intermediate, each
expert's output, the routing weights, the final output); by default none is rounded, and with the
points a backend declares the oracle reproduces that backend's arithmetic up to its accumulation
order. With ``router_weight_on_input`` (Llama4) ``w`` scales ``x[t]`` before GEMM1 instead.

Experts are processed in a batch each (one GEMM pair per expert with tokens), the same code on CPU
and CUDA; inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from mxmoe.reference.activation import (
    GPT_OSS_ALPHA,
    GPT_OSS_BETA,
    GPT_OSS_LIMIT,
    check_activation,
    check_layout,
    gated_activation,
)
from mxmoe.reference.mxfp4 import BLOCK, SCALE_RULES, dequantize_mxfp4, fake_quantize
from mxmoe.reference.routing import Routing, route

ROUNDINGS = ("fp64", "fp32", "bf16", "mxfp8")
"""What a precision point can round to; ``mxfp8`` quantizes blocks of 32 along the last axis."""

_POINT_CHOICES = {
    "activation_input": ("fp64", "bf16", "mxfp8"),
    "gemm1_output": ("fp64", "fp32", "bf16"),
    "intermediate": ("fp64", "fp32", "bf16", "mxfp8"),
    "expert_output": ("fp64", "fp32", "bf16"),
    "routing_weights": ("fp64", "fp32", "bf16"),
}
OUTPUT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Precision:
    """Where a backend rounds, and to what. The default rounds nowhere (the exact layer)."""

    activation_input: str = "fp64"
    """x (after the router weight, if applied on the input) as GEMM1 reads it."""
    gemm1_output: str = "fp64"
    """GEMM1's output plus bias, as the activation reads it (unfused kernels store it)."""
    intermediate: str = "fp64"
    """The activation's output as GEMM2 reads it."""
    expert_output: str = "fp64"
    """Each expert's GEMM2 output plus bias, before the weighted combine."""
    routing_weights: str = "fp64"
    """The routing weights as the combine (or the input scaling) uses them."""
    output: torch.dtype = torch.float64
    """The layer's output dtype: the exact sum is rounded once, to this."""
    mx_rule: str = "floor"
    """The scale rule of every MXFP8 point (see reference.mxfp4)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = _POINT_CHOICES.get(f.name)
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"Precision.{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}"
                )
        if self.output not in OUTPUT_DTYPES:
            raise ValueError(f"Precision.output must be one of {OUTPUT_DTYPES}; got {self.output!r}")
        if self.mx_rule not in SCALE_RULES:
            raise ValueError(f"Precision.mx_rule must be one of {', '.join(SCALE_RULES)}; got {self.mx_rule!r}")


EXACT = Precision()


def round_to(x: torch.Tensor, point: str, mx_rule: str = "floor") -> torch.Tensor:
    """``x`` (float64) rounded as a precision point ``point`` rounds it, returned as float64."""
    if point == "fp64":
        return x
    if point == "fp32":
        return x.to(torch.float32).to(torch.float64)
    if point == "bf16":
        return x.to(torch.bfloat16).to(torch.float64)
    if point == "mxfp8":
        return fake_quantize(x, "mxfp8", mx_rule)
    raise ValueError(f"point must be one of {', '.join(ROUNDINGS)}; got {point!r}")


@dataclass(frozen=True)
class MoEWeights:
    """Canonical MXFP4 expert weights (SPEC section 3), for E (local) experts.

    ``w13_blocks`` uint8 [E, 2I, H/2], ``w13_scales`` uint8 [E, 2I, H/32], ``w13_bias`` [E, 2I];
    ``w2_blocks`` uint8 [E, H, I/2], ``w2_scales`` uint8 [E, H, I/32], ``w2_bias`` [E, H]. Biases
    may be None. ``w13_layout`` says how the 2I rows hold gate and up (see reference.activation).
    """

    w13_blocks: torch.Tensor
    w13_scales: torch.Tensor
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w13_layout: str = "interleaved"

    def __post_init__(self) -> None:
        check_layout(self.w13_layout, "w13_layout")
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 3:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a torch.uint8 tensor [E, rows, cols], got {got}")
        e, two_i, h_half = self.w13_blocks.shape
        if two_i % 2:
            raise ValueError(f"w13_blocks' rows must be 2I (even), got {two_i}")
        h, i = 2 * h_half, two_i // 2
        expect = {
            "w13_scales": (e, two_i, h // BLOCK),
            "w2_blocks": (e, h, i // 2),
            "w2_scales": (e, h, i // BLOCK),
        }
        if h % BLOCK or i % BLOCK:
            raise ValueError(
                f"hidden size H={h} and intermediate size I={i} must be multiples of {BLOCK} "
                f"(from w13_blocks {tuple(self.w13_blocks.shape)})"
            )
        for name, shape in expect.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(
                    f"{name} must have shape {shape} to match w13_blocks {tuple(self.w13_blocks.shape)}, "
                    f"got {tuple(getattr(self, name).shape)}"
                )
        for name, shape in (("w13_bias", (e, two_i)), ("w2_bias", (e, h))):
            b = getattr(self, name)
            if b is not None and (
                not isinstance(b, torch.Tensor) or not b.is_floating_point() or tuple(b.shape) != shape
            ):
                raise ValueError(f"{name} must be None or a floating-point tensor of shape {shape}")
        devices = {t.device for t in self.tensors()}
        if len(devices) > 1:
            raise ValueError(f"all weight tensors must be on one device, got {sorted(map(str, devices))}")

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that are present, in field order."""
        names = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias")
        return [t for t in (getattr(self, n) for n in names) if t is not None]

    @property
    def num_experts(self) -> int:
        """E, the number of experts these weights hold."""
        return self.w13_blocks.shape[0]

    @property
    def hidden_size(self) -> int:
        """H."""
        return self.w2_blocks.shape[1]

    @property
    def intermediate_size(self) -> int:
        """I."""
        return self.w13_blocks.shape[1] // 2


def _check_inputs(x: torch.Tensor, weights: MoEWeights) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError("x must be a floating-point tensor [T, H]")
    if x.shape[1] != weights.hidden_size:
        raise ValueError(f"x must be [T, H={weights.hidden_size}] to match the weights, got {tuple(x.shape)}")
    if x.device != weights.w13_blocks.device:
        raise ValueError(f"x and the weights must be on one device, got {x.device} and {weights.w13_blocks.device}")


def _local_ids(ids: torch.Tensor, expert_map: torch.Tensor | None, n_global: int, n_local: int) -> torch.Tensor:
    """Map global expert ids to local ones (-1 for experts another rank holds)."""
    if expert_map is None:
        if n_global != n_local:
            raise ValueError(
                f"the router has E={n_global} experts but the weights hold {n_local}; "
                "pass expert_map for expert parallelism"
            )
        return ids
    if expert_map.dtype not in (torch.int32, torch.int64) or tuple(expert_map.shape) != (n_global,):
        raise ValueError(f"expert_map must be an int32/int64 tensor [E={n_global}] (global id -> local id or -1)")
    em = expert_map.to(ids.device, torch.int64)
    local = em[em >= 0]
    if (
        bool((em < -1).any())
        or (local.numel() and int(local.max()) >= n_local)
        or local.unique().numel() != local.numel()
    ):
        raise ValueError(f"expert_map values must be -1 or distinct local ids in 0..{n_local - 1}")
    return em[ids]


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    weights: MoEWeights,
    *,
    top_k: int,
    routing_method: str = "Renormalize",
    activation: str = "swigluoai",
    alpha: float = GPT_OSS_ALPHA,
    beta: float = GPT_OSS_BETA,
    limit: float | None = GPT_OSS_LIMIT,
    router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    precision: Precision = EXACT,
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    """The MoE layer: route ``router_logits`` [T, E] with ``routing_method``, then
    ``moe_routed``. Returns [T, H] in ``precision.output``."""
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2 or router_logits.shape[0] != x.shape[0]:
        raise ValueError(f"router_logits must be a tensor [T={x.shape[0]}, E]")
    routing = route(
        router_logits,
        top_k,
        routing_method,
        correction_bias=correction_bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
    )
    return moe_routed(
        x,
        routing,
        weights,
        n_experts=router_logits.shape[1],
        activation=activation,
        alpha=alpha,
        beta=beta,
        limit=limit,
        router_weight_on_input=router_weight_on_input,
        expert_map=expert_map,
        precision=precision,
    )


def moe_routed(
    x: torch.Tensor,
    routing: Routing,
    weights: MoEWeights,
    *,
    n_experts: int | None = None,
    activation: str = "swigluoai",
    alpha: float = GPT_OSS_ALPHA,
    beta: float = GPT_OSS_BETA,
    limit: float | None = GPT_OSS_LIMIT,
    router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    precision: Precision = EXACT,
) -> torch.Tensor:
    """The MoE layer for a given routing (``routing.ids`` are global expert ids; ``n_experts`` is
    the global E, by default the weights' E). Returns [T, H] in ``precision.output``."""
    _check_inputs(x, weights)
    check_activation(activation)
    if not isinstance(precision, Precision):
        raise ValueError(f"precision must be a Precision, got {type(precision).__name__}")
    ids, w = routing.ids, routing.weights
    t = x.shape[0]
    if ids.dim() != 2 or ids.shape[0] != t or w.shape != ids.shape:
        raise ValueError(
            f"routing ids and weights must both be [T={t}, k], got {tuple(ids.shape)} and {tuple(w.shape)}"
        )
    n_local = weights.num_experts
    n_global = n_local if n_experts is None else n_experts
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_global):
        raise ValueError(f"routing ids must be expert ids in 0..{n_global - 1}")
    if router_weight_on_input and ids.shape[1] != 1:
        raise ValueError(f"router_weight_on_input needs top_k == 1 (as Llama4), got top_k={ids.shape[1]}")
    local = _local_ids(ids.to(x.device), expert_map, n_global, n_local)

    x64 = x.to(torch.float64)
    w64 = round_to(w.to(x.device, torch.float64), precision.routing_weights)
    x_in = None if router_weight_on_input else round_to(x64, precision.activation_input, precision.mx_rule)
    out = torch.zeros(t, weights.hidden_size, dtype=torch.float64, device=x.device)

    flat = local.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=n_local).tolist()
    start = int((flat < 0).sum())  # non-local slots sort first (id -1)
    k = ids.shape[1]
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tok = slots // k
        we = w64.reshape(-1)[slots].unsqueeze(1)
        if router_weight_on_input:
            xe = round_to(x64[tok] * we, precision.activation_input, precision.mx_rule)
        else:
            xe = x_in[tok]
        w13 = dequantize_mxfp4(weights.w13_blocks[e], weights.w13_scales[e])
        h = xe @ w13.T
        if weights.w13_bias is not None:
            h = h + weights.w13_bias[e].to(torch.float64)
        h = round_to(h, precision.gemm1_output)
        a = gated_activation(h, activation, weights.w13_layout, alpha, beta, limit)
        a = round_to(a, precision.intermediate, precision.mx_rule)
        w2 = dequantize_mxfp4(weights.w2_blocks[e], weights.w2_scales[e])
        y = a @ w2.T
        if weights.w2_bias is not None:
            y = y + weights.w2_bias[e].to(torch.float64)
        y = round_to(y, precision.expert_output)
        if not router_weight_on_input:
            y = y * we
        out.index_add_(0, tok, y)
    return out.to(precision.output)
