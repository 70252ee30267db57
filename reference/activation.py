"""Gated activations of the MoE's first GEMM, and the row layouts of the fused gate/up weight.

The first GEMM produces ``2I`` columns per token holding the gate ``g`` and the up projection
``u``; backends disagree on how those columns (the rows of w13) are ordered (docs/formats.md):

* ``interleaved``       [g0, u0, g1, u1, ...]  GPT-OSS checkpoint, OAI Triton, Marlin, AITER Triton
* ``pair_swapped``      [u0, g0, u1, g1, ...]  FlashInfer TRTLLM-gen
* ``chunked_gate_up``   [g0..g(I-1), u0..u(I-1)]  standard checkpoints, AITER CK, vLLM unfused Triton
* ``chunked_up_gate``   [u0..u(I-1), g0..g(I-1)]  FlashInfer CUTLASS

Activations (exact math, float64 in, float64 out):

* ``silu``:      ``silu(g) * u``
* ``swigluoai``: ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``,
  ``g * sigmoid(alpha * g) * (u + beta)``; GPT-OSS uses alpha 1.702, beta 1, limit 7. The clamp
  comes BEFORE the sigmoid. ``limit=None`` (or 0) means no clamp.
"""

from __future__ import annotations

import torch

LAYOUTS = ("interleaved", "pair_swapped", "chunked_gate_up", "chunked_up_gate")
ACTIVATIONS = ("silu", "swigluoai")

GPT_OSS_ALPHA = 1.702
GPT_OSS_BETA = 1.0
GPT_OSS_LIMIT = 7.0


def check_layout(layout: str, name: str = "layout") -> None:
    """Raise ValueError unless ``layout`` is one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {', '.join(LAYOUTS)}; got {layout!r}")


def gate_up_rows(n_rows: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (int64) of the gate and of the up projection in a w13 of ``n_rows`` = 2I rows."""
    check_layout(layout)
    if n_rows % 2:
        raise ValueError(f"a fused gate/up dimension must be even (2I), got {n_rows}")
    half = n_rows // 2
    even = torch.arange(0, n_rows, 2)
    first = torch.arange(half)
    if layout == "interleaved":
        return even, even + 1
    if layout == "pair_swapped":
        return even + 1, even
    if layout == "chunked_gate_up":
        return first, first + half
    return first + half, first


def split_gate_up(x: torch.Tensor, layout: str, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of ``x`` along ``dim``, under ``layout``, as views of ``x`` (no
    copy and no index tensor: the oracle calls this once per expert, on the device)."""
    check_layout(layout)
    n = x.shape[dim]
    if n % 2:
        raise ValueError(f"a fused gate/up dimension must be even (2I), got {n}")
    if layout in ("interleaved", "pair_swapped"):
        pair_axis = dim if dim < 0 else dim + 1
        pairs = x.unflatten(dim, (n // 2, 2))
        first, second = pairs.select(pair_axis, 0), pairs.select(pair_axis, 1)
    else:
        first, second = x.narrow(dim, 0, n // 2), x.narrow(dim, n // 2, n // 2)
    return (first, second) if layout in ("interleaved", "chunked_gate_up") else (second, first)


def convert_layout(t: torch.Tensor, src: str, dst: str, dim: int) -> torch.Tensor:
    """Reorder the gate/up rows of ``t`` along ``dim`` from layout ``src`` to layout ``dst``.

    Works on anything that has one entry per w13 row along ``dim``: packed weights [E, 2I, H/2]
    and their scales [E, 2I, H/32] (``dim=-2``), biases [E, 2I] and GEMM1 outputs (``dim=-1``).
    Returns a new tensor; ``t`` is never modified.
    """
    check_layout(src, "src")
    check_layout(dst, "dst")
    n = t.shape[dim]
    src_g, src_u = gate_up_rows(n, src)
    dst_g, dst_u = gate_up_rows(n, dst)
    perm = torch.empty(n, dtype=torch.int64)
    perm[dst_g] = src_g
    perm[dst_u] = src_u
    return t.index_select(dim, perm.to(t.device))


def check_activation(activation: str) -> None:
    """Raise ValueError unless ``activation`` is one of ACTIVATIONS."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return gate * torch.sigmoid(gate) * up


def swigluoai(
    gate: torch.Tensor,
    up: torch.Tensor,
    alpha: float = GPT_OSS_ALPHA,
    beta: float = GPT_OSS_BETA,
    limit: float | None = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU: clamp first, then ``g * sigmoid(alpha * g) * (u + beta)``."""
    if limit:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def gated_activation(
    x: torch.Tensor,
    activation: str,
    layout: str,
    alpha: float = GPT_OSS_ALPHA,
    beta: float = GPT_OSS_BETA,
    limit: float | None = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """Apply ``activation`` to the GEMM1 output ``x`` [..., 2I] laid out as ``layout``: [..., I].

    ``alpha``, ``beta`` and ``limit`` are used by ``swigluoai`` only.
    """
    check_activation(activation)
    # Contiguous copies: strided and contiguous inputs take different vectorized paths through
    # torch's elementwise kernels, which differ in the last bit; copies keep the result the same
    # bits whatever the layout.
    gate, up = (t.contiguous() for t in split_gate_up(x, layout))
    if activation == "silu":
        return silu_and_mul(gate, up)
    return swigluoai(gate, up, alpha, beta, limit)
