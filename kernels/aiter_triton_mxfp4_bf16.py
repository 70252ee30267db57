"""AITER_TRITON_MXFP4_BF16: AITER's Triton moe_gemm_a16w4 (MI300X, MI355X, gfx1250)

Kernel: aiter.ops.triton.moe_op_gemm_a16w4 (monolithic; routing Renormalize or RenormalizeNaive;
no all2all expert parallelism in vLLM). vLLM prepares it like OpenAI Triton (it is in
TRITON_BACKENDS): w13 rows interleaved, float32 biases, blocks and scales transposed to [E, K,
N] (CDNA4 scale swizzle on gfx950 by the adapter), but padded by the ROCm rule, hidden and
intermediate to 256: a TP8 gpt-oss shard of 360 becomes 512 (the padding-waste finding of vLLM
PR #50622).
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class AiterTritonMxfp4Bf16(VendorKernel):
    """AITER_TRITON_MXFP4_BF16 (see the module docstring)."""

    package = "aiter"
    pip_name = "amd-aiter (ROCm build, not PyPI's)"
    kernel = "aiter.ops.triton moe_gemm_a16w4"
    storage = (storage.transpose(),)
    declaration = Declaration(
        id="aiter-triton-mxfp4-bf16",
        archs=("gfx942", "gfx950", "gfx1250"),
        description="AITER Triton moe_gemm_a16w4",
        quant="w4a16",
        routing_methods=("Renormalize", "RenormalizeNaive"),
        w13_layout="interleaved",
        hidden_align=256,
        intermediate_align=256,
        bias_dtype="fp32",
        expert_parallel=False,
        vllm_backend="AITER_TRITON_MXFP4_BF16",
        arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)),
    )
