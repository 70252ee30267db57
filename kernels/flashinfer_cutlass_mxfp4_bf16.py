"""FLASHINFER_CUTLASS_MXFP4_BF16: FlashInfer's CUTLASS fused MoE, MXFP4 weights x bf16 activations (Hopper)

Kernel: ``flashinfer.fused_moe.cutlass_fused_moe`` with ``use_w4_group_scaling`` (modular: the
engine routes and hands over global top-k ids, float32 weights and its EP rank; the kernel
keeps its own experts), called as vLLM 0.26's ``FlashInferExperts`` calls it. Weights as vLLM's
GPT-OSS converter prepares them: w13 rows chunked [up; gate], hidden and intermediate padded to
128, bf16 biases (the binding requires the output dtype), then the SM90 mixed-input GEMM's
layout of the INSTALLED FlashInfer (``kernels.flashinfer_common``): plain weights and [E, K/128,
4R] scales up to 0.6.9; the nibble interleave of row pairs (r, r + 8) plus those scales from
0.6.10 to 0.6.15 (the default, vLLM 0.26's pin 0.6.14); the bit-level repack and folded scales
from 0.6.16. SwiGLU-OAI is ActivationType.Swiglu with per-expert float32 alpha, beta and limit;
SiLU is the same member without them.

Known upstream: FlashInfer issue #5438 reports that this kernel in 0.6.10-0.6.15 sporadically
writes wrong tiles (a race on the TMA descriptor between experts), fixed by the 0.6.16 rewrite;
the harness's determinism and bound checks are what would show it. Its JIT module (fused_moe_90)
takes 35-90 minutes to compile: ``check_call`` refuses to start that unless asked
(``MXMOE_FLASHINFER_JIT=1``) or prebuilt (flashinfer-jit-cache).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mxmoe.harness.backend import Arithmetic, Declaration
from mxmoe.harness.cases import Case
from mxmoe.harness.convert import Converted, Target
from mxmoe.harness.inputs import CaseInputs
from mxmoe.kernels.flashinfer_common import (
    DEFAULT_SM90_GENERATION,
    SM90_LAYOUTS,
    FlashInferKernel,
    installed_version,
    sm90_generation,
)
from mxmoe.reference.moe import Precision


class FlashInferCutlassMxfp4Bf16(FlashInferKernel):
    """FLASHINFER_CUTLASS_MXFP4_BF16 (see the module docstring)."""

    kernel = "flashinfer.fused_moe.cutlass_fused_moe"
    jit_modules = {"sm90": "fused_moe_90"}
    storage = SM90_LAYOUTS[DEFAULT_SM90_GENERATION]
    declaration = Declaration(
        id="flashinfer-cutlass-mxfp4-bf16",
        archs=("sm90",),
        description="FlashInfer CUTLASS fused MoE (SM90 mixed-input GEMM), bf16 activations",
        quant="w4a16",
        w13_layout="chunked_up_gate",
        hidden_align=128,
        intermediate_align=128,
        vllm_backend="FLASHINFER_CUTLASS_MXFP4_BF16",
        arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)),
    )

    def target(self, case: Case) -> Target:
        """The declared target with the SM90 layout of the installed FlashInfer."""
        return replace(super().target(case), storage=SM90_LAYOUTS[sm90_generation(installed_version())])

    def run(self, prepared: Converted, inputs: CaseInputs, out: torch.Tensor) -> None:
        """One ``cutlass_fused_moe`` call with the engine's routing."""
        t = prepared.tensors
        x = inputs.padded_x(prepared.target.hidden)
        output = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        self._fi.cutlass_fused_moe(
            input=x,
            fc1_expert_weights=t["w13_blocks"],
            fc2_expert_weights=t["w2_blocks"],
            quant_scales=[t["w13_scales"], t["w2_scales"]],
            use_w4_group_scaling=True,
            **self.cutlass_common(prepared, inputs, output),
        )
        out.copy_(output[:, : out.shape[1]])
