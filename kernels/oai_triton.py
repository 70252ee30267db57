"""TRITON: OpenAI triton_kernels' matmul_ogs with the swiglu fused into GEMM1

Kernel: triton_kernels.matmul_ogs with routing (monolithic) and FusedActivation(swiglu, (alpha,
limit)). Weights as vLLM's oracle prepares them: w13 rows interleaved (gate in even columns),
the hidden size unchanged and the intermediate padded to 64, float32 biases, blocks and scales
transposed to [E, K, N]. The architecture's value and scale swizzles (HopperMXValueLayout /
HopperMXScaleLayout with mx_axis=1, CDNA4 scales on gfx950) and the Hopper pad of scale groups
to a multiple of 4 (H/32 = 90 read out of bounds before it) are triton_kernels' own layout
conversion, run by the adapter.
"""

from __future__ import annotations

import torch

from mxmoe.harness.backend import Arithmetic, Declaration, VendorKernel
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision


class OaiTriton(VendorKernel):
    """TRITON (see the module docstring)."""

    package = "triton_kernels"
    pip_name = "none: vLLM vendors it as vllm.third_party.triton_kernels"
    kernel = "triton_kernels.matmul_ogs (fused swiglu)"
    storage = (storage.transpose(),)
    declaration = Declaration(
        id="triton",
        archs=("sm90", "sm100", "gfx942", "gfx950"),
        description="OpenAI triton_kernels matmul_ogs, fused swiglu",
        quant="w4a16",
        activations=("swigluoai",),
        routing_methods=("Renormalize", "RenormalizeNaive"),
        w13_layout="interleaved",
        intermediate_align=64,
        bias_dtype="fp32",
        vllm_backend="TRITON",
        arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)),
    )
