"""FLASHINFER_TRTLLM_MXFP4_MXFP8: FlashInfer's TRT-LLM-gen MXFP4 MoE with MXFP8 activations (Blackwell)

The same kernel, call and weight layout as FLASHINFER_TRTLLM_MXFP4_BF16 (w13 pair-swapped,
padding 256 / 128, epilogue row shuffle, 128x4 scale tiles, float32 biases); x is quantized to
MXFP8 (E4M3 with one E8M0 scale per 32) by FlashInfer's ``mxfp8_quantize`` with linear scales
(vLLM: ``is_sf_swizzled_layout=False``, alignment 256), the scales passed viewed as
float8_e4m3fn, and the kernel quantizes the intermediate before GEMM2. Not run on hardware here
(no Blackwell).
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.kernels.flashinfer_trtllm_mxfp4_bf16 import FlashInferTrtllmMxfp4Bf16
from mxmoe.reference.moe import Precision


class FlashInferTrtllmMxfp4Mxfp8(FlashInferTrtllmMxfp4Bf16):
    """FLASHINFER_TRTLLM_MXFP4_MXFP8 (see the module docstring)."""

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
        vllm_needs_biases=True,
        arithmetic=Arithmetic(
            precision=Precision(
                activation_input="mxfp8", intermediate="mxfp8", routing_weights="bf16", output=torch.bfloat16
            ),
        ),
    )

    def activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x as MXFP8 with linear E8M0 scales [T, H/32], viewed as float8_e4m3fn (vLLM's call)."""
        import flashinfer

        xq, xs = flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=False, alignment=256)
        return xq, xs.view(torch.float8_e4m3fn).reshape(x.shape[0], -1)
