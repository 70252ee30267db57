"""AITER_MXFP4_FP8: AITER's Triton a8w4 MoE, per-tensor FP8 activations (MI355X, gfx1250)

Kernel: aiter.ops.triton moe_gemm_a8w4 (static per-tensor FP8 E4M3 activation scales, the max
over the loaded input scales). Weights as OpenAI Triton's: w13 rows interleaved, float32 biases,
blocks and scales transposed to [E, K, N] (CDNA4 scale swizzle by the adapter), padded by the
ROCm rule to 256 / 256.
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class AiterMxfp4Fp8(VendorKernel):
    """AITER_MXFP4_FP8 (see the module docstring)."""

    package = "aiter"
    pip_name = "amd-aiter (ROCm build, not PyPI's)"
    kernel = "aiter.ops.triton moe_gemm_a8w4"
    storage = (storage.transpose(),)
    declaration = Declaration(
        id="aiter-mxfp4-fp8",
        archs=("gfx950", "gfx1250"),
        description="AITER Triton moe_gemm_a8w4, per-tensor FP8 activations",
        quant="w4a8-fp8",
        routing_methods=("Renormalize", "RenormalizeNaive"),
        w13_layout="interleaved",
        hidden_align=256,
        intermediate_align=256,
        bias_dtype="fp32",
        expert_parallel=False,
        vllm_backend="AITER_MXFP4_FP8",
        arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)),
    )
