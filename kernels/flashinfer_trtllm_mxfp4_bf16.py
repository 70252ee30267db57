"""FLASHINFER_TRTLLM_MXFP4_BF16: FlashInfer's TRT-LLM-gen MXFP4 MoE with bf16 activations (Blackwell)

Kernel: flashinfer.fused_moe.trtllm_fp4_block_scale_moe (monolithic: routing inside). Weights as
vLLM's oracle prepares them: w13 rows pair-swapped [u0, g0, u1, g1, ...] (the kernel computes X2
* sigmoid(alpha * X2) * (X1 + beta) with X1 = up), hidden and intermediate padded to 256 and
128, every row of w13, w2, their scales and biases shuffled for the transposed-MMA epilogue
(tile 128), scales then in 128x4 tiles viewed as float8_e4m3fn, biases float32. FlashInfer's
routing kernels emit bf16 routing weights.
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class FlashInferTrtllmMxfp4Bf16(VendorKernel):
    """FLASHINFER_TRTLLM_MXFP4_BF16 (see the module docstring)."""

    package = "flashinfer"
    pip_name = "flashinfer-python"
    kernel = "flashinfer.fused_moe.trtllm_fp4_block_scale_moe"
    storage = (storage.row_shuffle(), storage.swizzle_128x4())
    declaration = Declaration(
        id="flashinfer-trtllm-mxfp4-bf16",
        archs=("sm100",),
        description="FlashInfer TRT-LLM-gen fp4 block-scale MoE, bf16 activations",
        quant="w4a16",
        routing_methods=("Default", "Renormalize", "RenormalizeNaive", "DeepSeekV3", "Llama4", "TopK"),
        w13_layout="pair_swapped",
        hidden_align=256,
        intermediate_align=128,
        bias_dtype="fp32",
        vllm_backend="FLASHINFER_TRTLLM_MXFP4_BF16",
        arithmetic=Arithmetic(
            precision=Precision(intermediate="bf16", routing_weights="bf16", output=torch.bfloat16),
        ),
    )
