"""FLASHINFER_CUTLASS_MXFP4_MXFP8: FlashInfer's CUTLASS fused MoE, MXFP4 weights x MXFP8 activations (Blackwell)

Kernel: flashinfer.fused_moe.cutlass_fused_moe with MXFP8 activations (modular: vLLM routes).
Weights: w13 rows chunked [up; gate], hidden and intermediate padded to 128, bf16 biases,
weights as loaded, scales in 128x4 tiles (block_scale_interleave; no padding after the 128
round-ups).
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class FlashInferCutlassMxfp4Mxfp8(VendorKernel):
    """FLASHINFER_CUTLASS_MXFP4_MXFP8 (see the module docstring)."""

    package = "flashinfer"
    pip_name = "flashinfer-python"
    kernel = "flashinfer.fused_moe.cutlass_fused_moe"
    storage = (storage.swizzle_128x4(view_fp8=False),)
    declaration = Declaration(
        id="flashinfer-cutlass-mxfp4-mxfp8",
        archs=("sm100",),
        description="FlashInfer CUTLASS fused MoE, MXFP8 activations",
        quant="w4a8-mxfp8",
        w13_layout="chunked_up_gate",
        hidden_align=128,
        intermediate_align=128,
        vllm_backend="FLASHINFER_CUTLASS_MXFP4_MXFP8",
        arithmetic=Arithmetic(
            precision=Precision(activation_input="mxfp8", intermediate="mxfp8", output=torch.bfloat16),
        ),
    )
