"""FLASHINFER_CUTLASS_MXFP4_BF16: FlashInfer's CUTLASS fused MoE, MXFP4 weights x bf16 activations (Hopper)

Kernel: flashinfer.fused_moe.cutlass_fused_moe with use_w4_group_scaling (modular: vLLM routes).
Weights: w13 rows chunked [up; gate], hidden and intermediate padded to 128, bf16 biases; the
SM90 mixed-input GEMM's layouts of FlashInfer 0.6.10 to 0.6.15: packed weights with the nibbles
of row pairs (r, r + 8) interleaved per 64 elements, scales [E, K/128, 4R]. FlashInfer 0.6.16
changed both (folded scales, a bit-level weight repack) and releases before 0.6.10 took plain
weights: the adapter picks by the installed version.
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class FlashInferCutlassMxfp4Bf16(VendorKernel):
    """FLASHINFER_CUTLASS_MXFP4_BF16 (see the module docstring)."""

    package = "flashinfer"
    pip_name = "flashinfer-python"
    kernel = "flashinfer.fused_moe.cutlass_fused_moe"
    storage = (storage.sm90_weight_interleave(), storage.sm90_scale_interleave())
    declaration = Declaration(
        id="flashinfer-cutlass-mxfp4-bf16",
        archs=("sm90",),
        description="FlashInfer CUTLASS fused MoE (SM90 mixed-input GEMM), bf16 activations",
        quant="w4a16",
        w13_layout="chunked_up_gate",
        hidden_align=128,
        intermediate_align=128,
        vllm_backend="FLASHINFER_CUTLASS_MXFP4_BF16",
        arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)),
    )
