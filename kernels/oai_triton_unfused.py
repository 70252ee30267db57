"""TRITON_UNFUSED: OpenAI triton_kernels' matmul_ogs with a separate activation

Kernel: two triton_kernels.matmul_ogs calls with vLLM's activation between them (modular: vLLM
routes), so the GEMM1 output is stored in bf16. Weights: w13 rows chunked [gate; up], the hidden
size unchanged and the intermediate padded to 64, float32 biases, blocks and scales transposed
to [E, K, N]; the architecture's swizzles are triton_kernels' own layout conversion, run by the
adapter.
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class OaiTritonUnfused(VendorKernel):
    """TRITON_UNFUSED (see the module docstring)."""

    package = "triton_kernels"
    pip_name = "none: vLLM vendors it as vllm.third_party.triton_kernels"
    kernel = "triton_kernels.matmul_ogs + separate activation"
    storage = (storage.transpose(),)
    declaration = Declaration(
        id="triton-unfused",
        archs=("sm90", "sm100", "gfx942", "gfx950"),
        description="OpenAI triton_kernels matmul_ogs, activation in a separate kernel",
        quant="w4a16",
        w13_layout="chunked_gate_up",
        intermediate_align=64,
        bias_dtype="fp32",
        vllm_backend="TRITON_UNFUSED",
        arithmetic=Arithmetic(
            precision=Precision(gemm1_output="bf16", intermediate="bf16", expert_output="bf16", output=torch.bfloat16),
        ),
    )
