"""MARLIN: vLLM's Marlin MoE kernel with MXFP4 weights (Ampere and later)

Kernel: vLLM's fused Marlin MoE (torch.ops._moe_C / fused_marlin_moe; modular: vLLM routes).
Weights: w13 rows interleaved (the swigluoai epilogue reads pairs), hidden padded to 256 and
intermediate to 128, bf16 biases permuted in runs of 32 (marlin_permute_bias), scales transposed
to [K/32, N], Marlin-permuted and pair-swapped (marlin_permute_scales,
mxfp4_marlin_process_scales). The weights' tile repack is vLLM's CUDA op gptq_marlin_repack, run
by the adapter on the GPU; the blocks here are as loaded.
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class Marlin(VendorKernel):
    """MARLIN (see the module docstring)."""

    package = "vllm"
    pip_name = "vllm"
    kernel = "vllm fused_marlin_moe"
    storage = (storage.marlin_scales(), storage.marlin_bias())
    declaration = Declaration(
        id="marlin",
        archs=("sm80", "sm90", "sm100", "sm120"),
        description="vLLM Marlin MoE, MXFP4 weights, bf16 activations",
        quant="w4a16",
        w13_layout="interleaved",
        hidden_align=256,
        intermediate_align=128,
        vllm_backend="MARLIN",
        arithmetic=Arithmetic(
            precision=Precision(gemm1_output="bf16", intermediate="bf16", expert_output="bf16", output=torch.bfloat16),
        ),
    )
