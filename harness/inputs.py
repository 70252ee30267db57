"""Deterministic inputs: every tensor a case uses derives from the case's id, never from the order
in which cases are collected or from the clock, so any case can be rerun alone and get the same
bytes."""

from __future__ import annotations

import hashlib

import torch

from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK


def seed_for(case_id: str) -> int:
    """A 63-bit seed derived from a case id (stable across processes, hosts and Python versions)."""
    return int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "little") >> 1


def generator_for(case_id: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded from ``case_id``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_for(case_id))
    return gen


def random_mxfp4_weights(
    gen: torch.Generator,
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    bias: bool = True,
    scale_bytes: tuple[int, int] = (118, 124),
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


def tie_free_logits(
    gen: torch.Generator, tokens: int, experts: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Router logits [T, E] in float32 whose values within each token are distinct: a random
    permutation of evenly spaced levels plus a small jitter, so no selection is decided by a tie."""
    levels = torch.linspace(-3.0, 3.0, experts, dtype=torch.float64, device=device)
    order = torch.argsort(torch.rand(tokens, experts, generator=gen, device=device), dim=1)
    jitter = torch.rand(tokens, experts, generator=gen, device=device, dtype=torch.float64)
    spacing = 6.0 / max(experts - 1, 1)
    return (levels[order] + 0.25 * spacing * jitter).to(torch.float32)
