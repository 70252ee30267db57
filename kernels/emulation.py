"""EMULATION: dequantize the MXFP4 weights and run plain GEMMs, as vLLM's emulation backend does.

Runs wherever torch runs: the harness's torch layer (``instruments.torch_moe``) with bf16 GEMMs
and every stage rounded to bf16, declared as vLLM's EMULATION arithmetic.
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.harness.instruments.torch_moe import TorchMoE
from mxmoe.reference.moe import Precision


class Emulation(TorchMoE):
    """vLLM's EMULATION: bf16 GEMMs on dequantized weights, every GEMM result in bf16."""

    gemm = "bf16"
    declaration = Declaration(
        id="emulation",
        archs=ARCHS,
        production=False,  # the harness's own rendering of vLLM's EMULATION arithmetic
        vllm_backend="EMULATION",
        description="dequantize + bf16 GEMMs (fp32 accumulation), bf16 between every stage",
        w13_layout="interleaved",
        arithmetic=Arithmetic(
            precision=Precision(gemm1_output="bf16", intermediate="bf16", expert_output="bf16", output=torch.bfloat16),
        ),
    )
