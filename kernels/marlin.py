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
project's build of them (``python -m harness build-vllm-ops``).

Arithmetic, from vLLM 0.33.0's Marlin epilogue (``csrc/moe/marlin_moe_wna16/marlin_template.h``,
its ``write``) and ``fused_marlin_moe``: each GEMM's float32 accumulator is rounded to bf16 and
its bf16 bias added with a bf16 add (a second rounding); GEMM2's row is then multiplied by the
routing weight, itself rounded to bf16, in bf16 (a third); the top-k rows are summed in float32
(``moe_sum``, or torch's sum over bf16) and rounded once. Declared so since the energy test's
sharper tail saw the difference: declared with float32 weights and one rounding per GEMM, an H200
nightly judged 225 of 1779 tests FAIL (139 on the energy test, 1.6 to 2.2x its prediction; 71 with
elements over the bound, at most 1.51x; 207 with bf16 routing weights or a bf16 combine among the
diagnosis's explanations, 9 on run-to-run differences alone).

Not deterministic, by design: vLLM's ``moe_align_block_size`` places each expert's rows with an
``atomicAdd`` (past its small-batch path: 1024 or more routed slots, or more than 64 experts), so
their order changes from call to call, and Marlin's split of K over thread blocks depends on the
M block a row lands in. On an H200 (``tools/marlin_nondeterminism.py``, E=32, T=4096): one sorted
order run again gives identical output; each call's own order, 625 and 754 differing elements;
every expert's rows put in ascending order, identical again. Each run is judged on its own and
the difference reported.
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
            precision=Precision(
                gemm1_output="bf16",
                intermediate="bf16",
                expert_output="bf16",
                routing_weights="bf16",
                combine="bf16-terms",
                output=torch.bfloat16,
                bias_after_rounding=True,
                bias_add_rounds=True,
            ),
        ),
        deterministic=False,
    )
