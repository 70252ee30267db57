"""Fixtures shared by the reference suite: the device a test runs on, and a builder of random
canonical MXFP4 expert weights. Both are session-scoped so that Hypothesis tests can use them
(function-scoped fixtures are not reset between a Hypothesis test's examples)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mxmoe.reference.moe import MoEWeights

SCALE_BYTES = (119, 130)
"""E8M0 scale bytes drawn in [119, 130): 2**-8 .. 2**2, so every weight, GEMM output and expert
output stays finite and of moderate size while still spanning several binades."""


@pytest.fixture(
    scope="session",
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
        ),
    ],
)
def device(request: pytest.FixtureRequest) -> str:
    """Where the oracle under test runs; the set of collected tests does not depend on the host."""
    return request.param


def build_weights(
    n_experts: int,
    hidden: int,
    inter: int,
    seed: int,
    *,
    bias: bool = True,
    device: str = "cpu",
) -> MoEWeights:
    """Random canonical (interleaved) MXFP4 weights: random code bytes, scale bytes in SCALE_BYTES,
    and bf16 biases, all derived from ``seed`` through a private generator."""
    g = torch.Generator().manual_seed(seed)

    def blocks(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def scales(*shape: int) -> torch.Tensor:
        return torch.randint(*SCALE_BYTES, shape, generator=g, dtype=torch.uint8)

    w13_blocks = blocks(n_experts, 2 * inter, hidden // 2)
    w13_scales = scales(n_experts, 2 * inter, hidden // 32)
    w2_blocks = blocks(n_experts, hidden, inter // 2)
    w2_scales = scales(n_experts, hidden, inter // 32)
    b13 = torch.randn(n_experts, 2 * inter, generator=g).to(torch.bfloat16) if bias else None
    b2 = torch.randn(n_experts, hidden, generator=g).to(torch.bfloat16) if bias else None
    tensors = [w13_blocks, w13_scales, w2_blocks, w2_scales, b13, b2]
    tensors = [None if t is None else t.to(device) for t in tensors]
    return MoEWeights(*tensors)


@pytest.fixture(scope="session")
def make_weights() -> Callable[..., MoEWeights]:
    """``build_weights(n_experts, hidden, inter, seed, *, bias=True, device="cpu")``."""
    return build_weights
