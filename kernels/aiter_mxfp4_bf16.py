"""AITER_MXFP4_BF16: AITER's CK a16w4 MoE (MI355X)

Kernel: aiter.fused_moe with the CK a16w4 kernels. CK runs on gfx942 but declines the MXFP4
scheme there (its FP4 kernels are gfx950-only), which is why vLLM picks AITER_TRITON_MXFP4_BF16
on MI300X. Weights: w13 rows chunked [gate; up], hidden and intermediate padded to 256 (vLLM's
ROCm rule; 128 for SiLU only with an activation-aware caller), float32 biases, packed weights in
16-row x 16-byte tiles with gate and up interleaved per 16 rows (shuffle_weight_a16w4), scales
shuffled (shuffle_scale_a16w4).
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class AiterMxfp4Bf16(VendorKernel):
    """AITER_MXFP4_BF16 (see the module docstring)."""

    package = "aiter"
    pip_name = "amd-aiter (ROCm build, not PyPI's)"
    kernel = "aiter CK fused_moe a16w4"
    storage = (storage.aiter_a16w4_weight_shuffle(), storage.aiter_a16w4_scale_shuffle())
    declaration = Declaration(
        id="aiter-mxfp4-bf16",
        archs=("gfx950",),
        device_archs=("gfx942", "gfx950"),
        description="AITER CK a16w4 fused MoE",
        quant="w4a16",
        w13_layout="chunked_gate_up",
        hidden_align=256,
        intermediate_align=256,
        bias_dtype="fp32",
        vllm_backend="AITER_MXFP4_BF16",
        arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)),
    )
