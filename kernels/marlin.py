"""MARLIN: vLLM's Marlin MoE kernel with MXFP4 weights (Ampere and later)

Kernel: vLLM's fused Marlin MoE (torch.ops._moe_C / fused_marlin_moe; modular: vLLM routes).
Weights: w13 rows interleaved (the swigluoai epilogue reads pairs), hidden padded to 256 and
intermediate to 128, bf16 biases permuted in runs of 32 (marlin_permute_bias), scales transposed
to [K/32, N], Marlin-permuted and pair-swapped (marlin_permute_scales,
mxfp4_marlin_process_scales). The weights' tile repack is vLLM's CUDA op gptq_marlin_repack, run
on the GPU; the blocks here are as loaded.

Adapter: Marlin's MoE exists only inside vLLM (``torch.ops._moe_C``), so this backend is vLLM's
own layer with ``--moe-backend marlin`` (``kernels.vllm_layer``): vLLM converts the weights (the
layout above is declared for the conversion checks and the padding audit) and runs its modular
Marlin kernel with the engine's top-k. Its compiled ops come from vLLM's install, or from the
project's build of them (``python -m harness build-vllm-ops``). Run on an H200 (docs/vllm.md):
16 of the 18 single-rank nightly gpt-oss cases pass (worst 0.31x the bound); at T=4096 two runs
on the same inputs differ in 109 to 450 elements, both within the bound.
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.kernels import storage
from mxmoe.kernels.vllm_layer import VllmLayer
from mxmoe.reference.moe import Precision


class Marlin(VllmLayer):
    """MARLIN (see the module docstring)."""

    kernel = "vllm fused_marlin_moe (through vLLM's GptOssMxfp4MoEMethod)"
    vllm_backend = "MARLIN"
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
