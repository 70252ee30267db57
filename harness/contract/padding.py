"""Padding of canonical MXFP4 MoE weights to a backend's alignment, and back.

Backends round the hidden size and each TP partition's intermediate size up to a multiple of
their own (docs/formats.md: 32 for EMULATION, 64 for OAI Triton's intermediate, 128 or 256 for
FlashInfer and AITER). The padded regions must be zero: zero codes, zero scale bytes (value 0 in
any reading of E8M0 byte 0) and zero biases make every padded hidden channel and every padded
intermediate channel contribute exactly nothing (swigluoai(0, 0) = 0 * sigmoid(0) * (0 + 1) = 0;
silu(0) * 0 = 0), so the padded layer equals the canonical one. Padding the intermediate keeps the
gate and up halves apart whatever the row layout. Nothing here modifies its inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mxmoe.reference.activation import convert_layout
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (both positive)."""
    if n < 0 or multiple < 1:
        raise ValueError(f"round_up needs n >= 0 and multiple >= 1, got n={n}, multiple={multiple}")
    return math.ceil(n / multiple) * multiple


def _check_target(name: str, current: int, target: int) -> None:
    if target < current or target % BLOCK:
        raise ValueError(f"{name} must be a multiple of {BLOCK} and at least {current}, got {target}")


def _pad_rows(t: torch.Tensor | None, rows: int, dim: int, layout: str) -> torch.Tensor | None:
    """Pad the 2I gate/up rows of ``t`` along ``dim`` to ``2 * rows``: each half padded at its end."""
    if t is None:
        return None
    chunked = convert_layout(t, layout, "chunked_gate_up", dim)
    gate, up = chunked.chunk(2, dim=dim)
    extra = rows - gate.shape[dim]
    shape = list(gate.shape)
    shape[dim] = extra
    zeros = gate.new_zeros(shape)
    padded = torch.cat([gate, zeros, up, zeros], dim=dim)
    return convert_layout(padded, "chunked_gate_up", layout, dim)


def _unpad_rows(t: torch.Tensor | None, rows: int, dim: int, layout: str) -> torch.Tensor | None:
    if t is None:
        return None
    gate, up = convert_layout(t, layout, "chunked_gate_up", dim).chunk(2, dim=dim)
    kept = torch.cat([gate.narrow(dim, 0, rows), up.narrow(dim, 0, rows)], dim=dim)
    return convert_layout(kept, "chunked_gate_up", layout, dim)


def _pad_last(t: torch.Tensor | None, size: int) -> torch.Tensor | None:
    return None if t is None else F.pad(t, (0, size - t.shape[-1]))


def pad_weights(w: MoEWeights, hidden: int, intermediate: int) -> MoEWeights:
    """``w`` with H padded to ``hidden`` and I to ``intermediate`` (multiples of 32), zero-filled."""
    _check_target("hidden", w.hidden_size, hidden)
    _check_target("intermediate", w.intermediate_size, intermediate)
    lay = w.w13_layout
    w13_blocks = _pad_last(_pad_rows(w.w13_blocks, intermediate, 1, lay), hidden // 2)
    w13_scales = _pad_last(_pad_rows(w.w13_scales, intermediate, 1, lay), hidden // BLOCK)
    extra_h = hidden - w.hidden_size

    def rows_h(t: torch.Tensor | None) -> torch.Tensor | None:  # w2's output rows, then its columns
        return None if t is None else F.pad(t, (0, 0, 0, extra_h))

    return MoEWeights(
        w13_blocks,
        w13_scales,
        _pad_last(rows_h(w.w2_blocks), intermediate // 2),
        _pad_last(rows_h(w.w2_scales), intermediate // BLOCK),
        _pad_rows(w.w13_bias, intermediate, 1, lay),
        _pad_last(w.w2_bias, hidden),
        lay,
    )


def unpad_weights(w: MoEWeights, hidden: int, intermediate: int) -> MoEWeights:
    """The inverse of ``pad_weights``: ``w`` cut back to H = ``hidden``, I = ``intermediate``."""
    lay = w.w13_layout
    if hidden > w.hidden_size or intermediate > w.intermediate_size:
        raise ValueError(
            f"cannot unpad [H={w.hidden_size}, I={w.intermediate_size}] to larger [H={hidden}, I={intermediate}]"
        )

    def cut(t: torch.Tensor | None, size: int) -> torch.Tensor | None:
        return None if t is None else t[..., :size].contiguous()

    return MoEWeights(
        cut(_unpad_rows(w.w13_blocks, intermediate, 1, lay), hidden // 2),
        cut(_unpad_rows(w.w13_scales, intermediate, 1, lay), hidden // BLOCK),
        cut(w.w2_blocks[:, :hidden], intermediate // 2),
        cut(w.w2_scales[:, :hidden], intermediate // BLOCK),
        _unpad_rows(w.w13_bias, intermediate, 1, lay),
        cut(w.w2_bias, hidden),
        lay,
    )


def padded_bytes(w: MoEWeights) -> int:
    """Bytes of the MXFP4 blocks and scales (biases excluded): what padding wastes is measured on
    these, against the same of the unpadded weights."""
    return sum(t.numel() * t.element_size() for t in (w.w13_blocks, w.w13_scales, w.w2_blocks, w.w2_scales))
