"""FLASHINFER_TRTLLM_MXFP4_MXFP8: FlashInfer's TRT-LLM-gen MXFP4 MoE with MXFP8 activations (Blackwell)

The same kernel and weight layout as FLASHINFER_TRTLLM_MXFP4_BF16 (w13 pair-swapped, padding 256
/ 128, epilogue row shuffle, 128x4 scale tiles, float32 biases); the activations are quantized
to MXFP8 (E4M3 with one E8M0 scale per 32) before GEMM1 and the intermediate before GEMM2.
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class FlashInferTrtllmMxfp4Mxfp8(VendorKernel):
    """FLASHINFER_TRTLLM_MXFP4_MXFP8 (see the module docstring)."""

    package = "flashinfer"
    pip_name = "flashinfer-python"
    kernel = "flashinfer.fused_moe.trtllm_fp4_block_scale_moe"
    storage = (storage.row_shuffle(), storage.swizzle_128x4())
    declaration = Declaration(
        id="flashinfer-trtllm-mxfp4-mxfp8",
        archs=("sm100",),
        description="FlashInfer TRT-LLM-gen fp4 block-scale MoE, MXFP8 activations",
        quant="w4a8-mxfp8",
        routing_methods=("Default", "Renormalize", "RenormalizeNaive", "DeepSeekV3", "Llama4", "TopK"),
        w13_layout="pair_swapped",
        hidden_align=256,
        intermediate_align=128,
        bias_dtype="fp32",
        vllm_backend="FLASHINFER_TRTLLM_MXFP4_MXFP8",
        arithmetic=Arithmetic(
            precision=Precision(
                activation_input="mxfp8", intermediate="mxfp8", routing_weights="bf16", output=torch.bfloat16
            ),
        ),
    )
