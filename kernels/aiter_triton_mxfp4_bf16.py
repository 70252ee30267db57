"""AITER_TRITON_MXFP4_BF16: AITER's Triton moe_gemm_a16w4 (MI300X, MI355X, gfx1250)

Kernel: ``aiter.ops.triton.moe.moe_op_gemm_a16w4.moe_gemm_a16w4`` twice (GEMM1 with the
activation fused, GEMM2 scattered and summed over the top-k), called as vLLM's monolithic
``AiterW4A16ExpertsMonolithic`` calls it (vLLM PR #50622, after 0.26.0; ``kernels/aiter_common.py``):

* weights prepared like OpenAI Triton's (vLLM's ``TRITON_BACKENDS`` branch): w13 rows
  interleaved (gate in even columns, which the kernel's ``_swiglu`` reads in pairs), float32
  biases, blocks and scales as [E, K, N] views of the [E, N, K] memory, K contiguous; the scales
  CDNA4-swizzled on gfx950 at TP <= 2 (``swizzle_mx_scale="CDNA4_SCALE"``), strided elsewhere;
  hidden and intermediate padded to 256 (vLLM's ROCm rule: a TP8 gpt-oss shard of 360 becomes
  512, the padding-waste finding of PR #50622);
* routing by aiter's own ``routing(logits, k, sm_first=False)`` on bfloat16 router logits (top-k
  on the logits, softmax over the k; the weights come back in the logits' dtype);
* GEMM1: ``apply_swiglu=True`` with alpha and limit (no clamp for SiLU), ``swiglu_add_residual``
  False only for SiLU (``silu(g) * u``), so swigluoai's beta is fixed at 1; GEMM2 with the routing
  weights as ``gammas``, each (token, slot) row stored in bfloat16, the k rows summed in float32
  by ``reduce_grouped``; ``unpadded_N/K`` None and ``backend`` left to aiter (Gluon on gfx1250),
  as the newest vLLM passes them.

Not taken: SiLU on gfx1250 (vLLM reroutes it through the a8w4 kernel with dynamic MXFP8
activations: another arithmetic), expert parallelism (vLLM ignores ``expert_map`` here), the
DeepseekV4 routing (not a harness routing method).

Precision points (declared below): bf16 x times MXFP4 in float32, bias and activation in
float32, the intermediate stored in bf16; GEMM2 rows times their bf16 routing weight stored in
bf16 before the float32 top-k sum.
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.kernels import storage
from mxmoe.kernels.aiter_common import A16W4_MODULES, AiterTritonBase, TritonPrepared
from mxmoe.reference.moe import Precision


class AiterTritonMxfp4Bf16(AiterTritonBase):
    """AITER_TRITON_MXFP4_BF16 (see the module docstring)."""

    kernel = "aiter.ops.triton moe_gemm_a16w4"
    gemm_modules = A16W4_MODULES
    gemm_name = "moe_gemm_a16w4"
    storage = (storage.transpose(),)
    declaration = Declaration(
        id="aiter-triton-mxfp4-bf16",
        archs=("gfx942", "gfx950", "gfx1250"),
        description="AITER Triton moe_gemm_a16w4",
        quant="w4a16",
        activations=("silu", "swigluoai"),
        # vLLM 0.33.0 and 0.34.0 also take DeepSeekV3 here (AiterW4A16ExpertsMonolithic._supports_routing_method:
        # sigmoid scores with the correction bias); the adapter's routing is aiter's softmax routing only.
        routing_methods=("Renormalize", "RenormalizeNaive"),
        w13_layout="interleaved",
        hidden_align=256,
        intermediate_align=256,
        bias_dtype="fp32",
        expert_parallel=False,
        router_weight_on_input=False,
        vllm_backend="AITER_TRITON_MXFP4_BF16",
        arithmetic=Arithmetic(
            precision=Precision(
                intermediate="bf16", expert_output="bf16", routing_weights="bf16", output=torch.bfloat16
            )
        ),
    )

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; SiLU not on gfx1250, where vLLM runs it through the a8w4 kernel."""
        reason = super().supports(case, arch)
        if reason is None and case.activation == "silu" and arch == "gfx1250":
            return (
                f"{self.declaration.id}: on gfx1250 vLLM computes SiLU with the a8w4 kernel and dynamic MXFP8 "
                "activations (_aiter_w4a16_silu_via_a8w4), not with moe_gemm_a16w4"
            )
        return reason

    def run(self, prepared: TritonPrepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """GEMM1 with the fused activation, GEMM2 scattered and reduced, into ``out``."""
        case = inputs.case
        gemm = self._mods.gemm.moe_gemm_a16w4
        rd, gather, scatter, x = self.route(prepared, inputs, inputs.padded_x(prepared.hidden))
        silu = case.activation == "silu"
        inter = gemm(
            x, prepared.w13, None, prepared.w13_scales, None, None, prepared.b13, rd,
            gather_indx=gather, gammas=None, swizzle_mx_scale=prepared.swizzle, apply_swiglu=True,
            alpha=1.0 if silu else float(case.alpha), limit=None if silu else (case.limit or None),
            swiglu_add_residual=not silu, unpadded_N=None, unpadded_K=None,
        )  # fmt: skip
        y = gemm(
            inter, prepared.w2, None, prepared.w2_scales, None, None, prepared.b2, rd,
            scatter_indx=scatter, gammas=rd.gate_scal, swizzle_mx_scale=prepared.swizzle,
            unpadded_N=None, unpadded_K=None,
        )  # fmt: skip
        out.copy_(y[:, : out.shape[1]])
