"""The MXFP4 MoE layer in float64: the oracle every backend is compared with.

For each token ``t`` and each of its ``k`` chosen experts ``e`` with routing weight ``w``
(docs/formats.md; canonical GPT-OSS weights)::

    h   = x[t] @ W13[e].T + b13[e]                    # [2I], W13 dequantized exactly
    a   = activation(h, layout of w13's rows)         # [I]
    y   = a @ W2[e].T + b2[e]                         # [H]
    out[t] += w * y

Everything is computed in float64 from exactly dequantized weights. ``Precision`` names the points
where a backend legitimately rounds (its activation input, GEMM1's output, the intermediate, each
expert's output, the routing weights, the final output); by default none is rounded, and with the
points a backend declares the oracle reproduces that backend's arithmetic up to its accumulation
order. With ``router_weight_on_input`` (Llama4) ``w`` scales ``x[t]`` before GEMM1 instead.

Experts run in groups, one batched GEMM pair per group, each expert's tokens padded to the group's
largest count (the padding rows are computed and dropped); the same code runs on CPU and CUDA;
inputs are never modified.
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
from mxmoe.reference.mxfp4 import BLOCK, SCALE_RULES, dequantize_mxfp4, fake_quantize, round_to_dtype
from mxmoe.reference.routing import Routing, route

ROUNDINGS = ("fp64", "fp32", "bf16", "mxfp8")
"""What a precision point can round to; ``mxfp8`` quantizes blocks of 32 along the last axis."""

_POINT_CHOICES = {
    "activation_input": ("fp64", "bf16", "mxfp8"),
    "gemm1_output": ("fp64", "fp32", "bf16"),
    "intermediate": ("fp64", "fp32", "bf16", "mxfp8"),
    "expert_output": ("fp64", "fp32", "bf16"),
    "routing_weights": ("fp64", "fp32", "bf16"),
    "combine": ("fp32", "bf16", "bf16-terms"),
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
    combine: str = "fp32"
    """What the top-k sum accumulates in: ``fp32`` (the sum rounded once, to the output), or
    ``bf16`` (each slot's weighted output rounded to bfloat16, then every partial sum: a combine
    kernel that adds bfloat16 rows in bfloat16), or ``bf16-terms`` (each slot's weighted output
    rounded to bfloat16, the sum in float32 rounded once: Marlin's GEMM2 stores its weighted rows in
    bf16 and vLLM's ``moe_sum`` adds them in float32). The oracle never rounds here; the bound counts
    the k + (k - 1) roundings of a ``bf16`` combine and the k of a ``bf16-terms`` one."""
    bias_after_rounding: bool = False
    """Whether ``gemm1_output`` and ``expert_output`` round the GEMM's product alone, the bias
    being added after, in float32 (FlashInfer's CUTLASS MoE adds the biases in its activation and
    finalize kernels). A bias that cancels the product makes the rounded value larger than the
    result, so the bound must know which one is rounded."""
    bias_add_rounds: bool = False
    """With ``bias_after_rounding``: whether the bias is added to the rounded product in that
    point's format, which rounds the sum again (Marlin's epilogue rounds its float32 accumulator to
    bf16, then adds its bf16 bias with a bf16 add). Two roundings, not one: the bound counts both."""

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = _POINT_CHOICES.get(f.name)
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"Precision.{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}"
                )
        if self.output not in OUTPUT_DTYPES:
            raise ValueError(f"Precision.output must be one of {OUTPUT_DTYPES}; got {self.output!r}")
        if self.bias_add_rounds and not self.bias_after_rounding:
            raise ValueError(
                "Precision.bias_add_rounds needs bias_after_rounding=True (the bias is added after the rounding)"
            )
        if self.mx_rule not in SCALE_RULES:
            raise ValueError(f"Precision.mx_rule must be one of {', '.join(SCALE_RULES)}; got {self.mx_rule!r}")


EXACT = Precision()


def round_to(x: torch.Tensor, point: str, mx_rule: str = "floor") -> torch.Tensor:
    """``x`` (float64) rounded as a precision point ``point`` rounds it, returned as float64."""
    if point == "fp64":
        return x
    if point == "fp32":
        return round_to_dtype(x, torch.float32)
    if point == "bf16":
        return round_to_dtype(x, torch.bfloat16)
    if point == "mxfp8":
        return fake_quantize(x, "mxfp8", mx_rule)
    raise ValueError(f"point must be one of {', '.join(ROUNDINGS)}; got {point!r}")


@dataclass(frozen=True)
class MoEWeights:
    """Canonical MXFP4 expert weights (docs/formats.md), for E (local) experts.

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


@dataclass(frozen=True)
class DequantizedWeights:
    """MoE weights already dequantized to float64 (``dequantize_weights``): ``w13`` [E, 2I, H],
    ``w2`` [E, H, I], biases float64 or None.

    Dequantizing is exact, so the layer computed from these equals the layer computed from the
    packed weights bit for bit; it only saves the dequantization when many cases (token counts,
    routings, precision points) are checked against one layer's weights. At gpt-oss-120b shapes
    dequantization costs about as much as the GEMMs of T=4096 tokens.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    w13_layout: str

    @property
    def num_experts(self) -> int:
        """E."""
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        """H."""
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        """I."""
        return self.w13.shape[1] // 2


def dequantize_weights(weights: MoEWeights) -> DequantizedWeights:
    """All experts' weights in float64 (3 * E * H * I * 8 bytes: 25 GB for gpt-oss-120b)."""
    if not isinstance(weights, MoEWeights):
        raise ValueError(f"weights must be a MoEWeights, got {type(weights).__name__}")
    return DequantizedWeights(
        w13=dequantize_mxfp4(weights.w13_blocks, weights.w13_scales),
        w2=dequantize_mxfp4(weights.w2_blocks, weights.w2_scales),
        w13_bias=None if weights.w13_bias is None else weights.w13_bias.to(torch.float64),
        w2_bias=None if weights.w2_bias is None else weights.w2_bias.to(torch.float64),
        w13_layout=weights.w13_layout,
    )


AnyWeights = MoEWeights | DequantizedWeights


def _expert_range(
    weights: AnyWeights, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """float64 (w13, b13, w2, b2) of experts lo..hi-1 (views where already dequantized)."""
    if isinstance(weights, DequantizedWeights):
        w13, w2 = weights.w13[lo:hi], weights.w2[lo:hi]
    else:
        w13 = dequantize_mxfp4(weights.w13_blocks[lo:hi], weights.w13_scales[lo:hi])
        w2 = dequantize_mxfp4(weights.w2_blocks[lo:hi], weights.w2_scales[lo:hi])
    b13 = None if weights.w13_bias is None else weights.w13_bias[lo:hi].to(torch.float64)
    b2 = None if weights.w2_bias is None else weights.w2_bias[lo:hi].to(torch.float64)
    return w13, b13, w2, b2


def _check_inputs(x: torch.Tensor, weights: AnyWeights) -> None:
    if not isinstance(weights, (MoEWeights, DequantizedWeights)):
        raise ValueError(f"weights must be a MoEWeights or DequantizedWeights, got {type(weights).__name__}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError("x must be a floating-point tensor [T, H]")
    if x.shape[1] != weights.hidden_size:
        raise ValueError(f"x must be [T, H={weights.hidden_size}] to match the weights, got {tuple(x.shape)}")
    wdev = weights.w13.device if isinstance(weights, DequantizedWeights) else weights.w13_blocks.device
    if x.device != wdev:
        raise ValueError(f"x and the weights must be on one device, got {x.device} and {wdev}")


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


BUDGET_BYTES = 4 << 30
"""Most bytes of float64 weights and activations one group of experts may hold at once."""
MAX_PADDING = 0.15
"""Most extra cost a group of experts may add by padding, as a fraction of its experts' own."""


FREE_ROWS = 64
"""Below this many token rows an expert's GEMMs are bound by reading its weights, not by
arithmetic (float64 on an H200: about 58 TFLOP/s over 4.3 TB/s is 13.5 FLOP a byte, 2 FLOP per
8-byte weight per row), so padding an expert up to it costs next to nothing."""


def _expert_groups(counts: list[int], weights: AnyWeights) -> list[tuple[int, int, int]]:
    """Runs of consecutive experts ``(lo, hi, rows)`` that each run as one batched GEMM pair, every
    expert's tokens padded to ``rows``, the run's largest count.

    Per-expert host overhead, not arithmetic, bounds a per-expert loop at gpt-oss-120b shapes (128
    experts), hence the batches. Runs are consecutive so that their weights are slices (views,
    once dequantized). An expert's cost is taken as ``max(rows, FREE_ROWS)``; a run grows while its
    cost stays within MAX_PADDING of what its experts would cost alone (an expert without tokens
    inside a run costs FREE_ROWS for nothing) and its weights and activations fit BUDGET_BYTES.
    A run never starts or ends with an expert that has no tokens.
    """
    h, i = weights.hidden_size, weights.intermediate_size
    weight_bytes = 3 * h * i * (8 + 2)  # float64 values plus the int32 gather index (one per 2 values)
    row_bytes = (h + 3 * i + h) * 8  # a token's input, GEMM1 output, intermediate and output rows
    groups: list[tuple[int, int, int]] = []
    run: list[int] | None = None  # [lo, last expert with tokens, rows, cost alone]
    for e, c in enumerate(counts):
        alone = max(c, FREE_ROWS) if c else 0
        if run is not None:
            lo, last, rows, cost = run
            size, new_rows = e + 1 - lo, max(rows, c)
            pad_ok = size * max(new_rows, FREE_ROWS) <= (1 + MAX_PADDING) * (cost + alone)
            if pad_ok and size * (weight_bytes + new_rows * row_bytes) <= BUDGET_BYTES:
                run = [lo, e if c else last, new_rows, cost + alone]
                continue
            groups.append((lo, last + 1, rows))
            run = None
        if c:
            run = [e, e, c, alone]
    if run is not None:
        groups.append((run[0], run[1] + 1, run[2]))
    return groups


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    weights: AnyWeights,
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
    _check_inputs(x, weights)
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
    weights: AnyWeights,
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

    # Slots (token, j-th choice) sorted by local expert: each expert's slots are one run.
    flat = local.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts_dev = torch.bincount(flat[flat >= 0], minlength=n_local)
    counts = counts_dev.tolist()  # the one host sync: group sizes are decided on the host
    starts_dev = torch.cumsum(counts_dev, 0) - counts_dev + (flat < 0).sum()  # non-local slots sort first
    k = ids.shape[1]
    w_flat = w64.reshape(-1)
    # Each slot's expert output, weighted; summed over a token's k slots at the end, in selection
    # order, so that the result does not depend on how experts are grouped or on atomics.
    # Row t*k is a sink for padding rows, so that no step inside the loop waits for the device.
    per_slot = torch.zeros(t * k + 1, weights.hidden_size, dtype=torch.float64, device=x.device)
    for lo, hi, rows in _expert_groups(counts, weights):
        arange = torch.arange(rows, device=x.device)
        valid = arange[None, :] < counts_dev[lo:hi, None]  # [G, rows]: False on padding rows
        pos = starts_dev[lo:hi, None] + arange
        slots = order[torch.where(valid, pos, 0)]  # padding rows borrow slot order[0]; dropped below
        tok = slots // k
        we = w_flat[slots].unsqueeze(-1)
        if router_weight_on_input:
            xe = round_to(x64[tok] * we, precision.activation_input, precision.mx_rule)
        else:
            xe = x_in[tok]
        w13, b13, w2, b2 = _expert_range(weights, lo, hi)
        late = precision.bias_after_rounding
        h = torch.bmm(xe, w13.transpose(1, 2))
        if b13 is not None and not late:
            h = h + b13.unsqueeze(1)
        h = round_to(h, precision.gemm1_output)
        if b13 is not None and late:
            h = h + b13.unsqueeze(1)
            if precision.bias_add_rounds:
                h = round_to(h, precision.gemm1_output)
        a = gated_activation(h, activation, weights.w13_layout, alpha, beta, limit)
        a = round_to(a, precision.intermediate, precision.mx_rule)
        y = torch.bmm(a, w2.transpose(1, 2))
        if b2 is not None and not late:
            y = y + b2.unsqueeze(1)
        y = round_to(y, precision.expert_output)
        if b2 is not None and late:
            y = y + b2.unsqueeze(1)
            if precision.bias_add_rounds:
                y = round_to(y, precision.expert_output)
        if not router_weight_on_input:
            y = y * we
        per_slot[torch.where(valid, slots, t * k).flatten()] = y.flatten(0, 1)
        del w13, w2, h, a, y
    out = per_slot[: t * k].reshape(t, k, weights.hidden_size).sum(dim=1)
    if precision.output == torch.float64:
        return out
    return round_to_dtype(out, precision.output).to(precision.output)  # one rounding, not two
