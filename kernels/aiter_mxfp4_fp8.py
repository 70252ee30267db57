"""AITER_MXFP4_FP8: AITER's Triton a8w4 MoE, static per-tensor FP8 activations (MI355X, gfx1250)

Kernel: ``aiter.ops.triton.moe.moe_op_gemm_a8w4.moe_gemm_a8w4`` twice, called as vLLM 0.26.0's
``AiterW4A8ExpertsMonolithic`` calls it (``triton_kernel_fused_mxfp4_w4a8_experts``), reached from quark
w4a8 checkpoints or ``--moe-backend aiter_mxfp4_fp8``:

* weights as OpenAI Triton's (``_swizzle_mxfp4``): w13 rows interleaved, float32 biases, blocks and
  scales as [E, K, N] views, K contiguous, the scales CDNA4-swizzled on gfx950 at TP <= 2; hidden
  and intermediate padded to 256 (vLLM's ROCm rule);
* static FP8 E4M3 input scales: vLLM takes the max of the checkpoint's per-expert scales (one
  scalar each for x and the intermediate). Canonical weights carry none, so the adapter
  calibrates them on the case, as a quantizer calibrates on its data: amax / 448 of x and of the
  exact intermediate over the routed (token, expert) pairs (``static_fp8_scales``);
* routing by aiter's ``routing(logits, k, sm_first=False)`` on bfloat16 logits; on gfx1250 x
  gathered in torch (as the newer vLLM does: aiter's in-kernel gather is broken there);
* x to FP8 by ``downcast_to_static_fp8(x, a1)``; GEMM1 with ``x_static_scale=a1``,
  ``quant_static_scale=a2``, ``out_dtype=float8_e4m3fn`` and the fused swiglu at vLLM's fixed
  alpha 1.702 and limit 7 (function defaults there, not read from the quant config); GEMM2 with
  ``x_static_scale=a2`` and the routing weights as ``gammas``; ``unpadded_N/K`` the unpadded
  sizes, as vLLM 0.26 passes them (used by aiter at block_m 16 only).

Arithmetic: x and the intermediate are rounded to FP8 E4M3 with one static scale each (in-kernel:
acc * a1, + bias, swiglu, fp8(out / a2), no clamp). ``reference.moe.Precision`` has no static
per-tensor FP8 point yet (only MXFP8), so no bound derived from the declaration below would hold
for an honest a8w4 kernel: ``supports`` declines every case with that reason until the point
exists. The declared points are the ones it does have (bf16 routing weights, bf16 GEMM2 rows).
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, BackendUnavailable, Declaration
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.convert import partition_sizes
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.kernels import storage
from mxmoe.kernels.aiter_common import (
    A8W4_MODULES,
    QUANT_MOE_MODULES,
    AiterTritonBase,
    TritonPrepared,
    import_first,
)
from mxmoe.reference.activation import GPT_OSS_BETA, gated_activation
from mxmoe.reference.moe import Precision
from mxmoe.reference.mxfp4 import dequantize_mxfp4

E4M3_MAX = 448.0
A8W4_ALPHA, A8W4_LIMIT = 1.702, 7.0
"""vLLM 0.26's ``triton_kernel_fused_mxfp4_w4a8_experts`` defaults, passed to the kernel as is."""


def static_fp8_scales(inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(a1, a2): float32 scalars with amax / 448 of x and of the exact (float64) intermediate
    over the routed (token, local expert) pairs, so that neither FP8 cast saturates. A tensor
    whose amax is 0 gets scale 1."""
    case, w = inputs.case, inputs.weights
    x = inputs.x.to(torch.float64)
    routing = inputs.routing()
    ids = inputs.local_ids(routing.ids.to(x.device))
    amax_inter = torch.zeros((), dtype=torch.float64, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tokens = torch.nonzero((ids == e).any(dim=1)).flatten()
        w13 = dequantize_mxfp4(w.w13_blocks[e], w.w13_scales[e])
        h = x[tokens] @ w13.T
        if w.w13_bias is not None:
            h = h + w.w13_bias[e].to(torch.float64)
        act = gated_activation(h, case.activation, w.w13_layout, case.alpha, case.beta, case.limit)
        amax_inter = torch.maximum(amax_inter, act.abs().max())

    def scale(amax: torch.Tensor) -> torch.Tensor:
        return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.float32)

    return scale(x.abs().max() if x.numel() else torch.zeros((), dtype=torch.float64)), scale(amax_inter)


class AiterMxfp4Fp8(AiterTritonBase):
    """AITER_MXFP4_FP8 (see the module docstring)."""

    kernel = "aiter.ops.triton moe_gemm_a8w4"
    gemm_modules = A8W4_MODULES
    gemm_name = "moe_gemm_a8w4"
    storage = (storage.transpose(),)
    declaration = Declaration(
        id="aiter-mxfp4-fp8",
        archs=("gfx950", "gfx1250"),
        description="AITER Triton moe_gemm_a8w4, static per-tensor FP8 activations",
        quant="w4a8-fp8",
        activations=("swigluoai",),
        routing_methods=("Renormalize", "RenormalizeNaive"),
        w13_layout="interleaved",
        hidden_align=256,
        intermediate_align=256,
        bias_dtype="fp32",
        expert_parallel=False,
        router_weight_on_input=False,
        vllm_backend="AITER_MXFP4_FP8",
        arithmetic=Arithmetic(
            precision=Precision(
                intermediate="bf16", expert_output="bf16", routing_weights="bf16", output=torch.bfloat16
            )
        ),
    )
    judged = False
    """Whether cases run: False until ``Precision`` has a static per-tensor FP8 point (see the
    module docstring); a subclass may set True to record the numbers anyway."""

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; swigluoai at vLLM's fixed alpha 1.702 and limit 7; and not judged until the
        harness can bound static FP8 activations."""
        reason = super().supports(case, arch)
        if reason is not None:
            return reason
        d = self.declaration
        if (case.alpha, case.beta, case.limit) != (A8W4_ALPHA, GPT_OSS_BETA, A8W4_LIMIT):
            return (
                f"{d.id}: vLLM calls the a8w4 kernel with alpha {A8W4_ALPHA} and limit {A8W4_LIMIT} (beta 1) whatever "
                f"the model says; got alpha {case.alpha}, beta {case.beta}, limit {case.limit}"
            )
        if not self.judged:
            return (
                f"{d.id}: x and the intermediate are rounded to FP8 E4M3 with static per-tensor scales, a precision "
                "point reference.moe.Precision cannot express yet (only MXFP8); an honest kernel would FAIL the bound"
            )
        return None

    def check_call(self) -> None:
        """As the Triton base, plus aiter's static FP8 downcast."""
        super().check_call()
        quant = import_first(QUANT_MOE_MODULES, self.declaration.id)
        if not hasattr(quant, "downcast_to_static_fp8"):
            raise BackendUnavailable(f"{self.declaration.id}: {quant.__name__} has no downcast_to_static_fp8")
        self._mods.quant = quant

    def convert(self, inputs: CaseInputs) -> TritonPrepared:
        """The Triton weight form (``AiterTritonBase.convert``) and the calibrated static scales."""
        prepared = super().convert(inputs)
        a1, a2 = static_fp8_scales(inputs)
        hidden, inter = partition_sizes(inputs.case)
        prepared.extra.update(a1=a1.to(inputs.x.device), a2=a2.to(inputs.x.device), hidden=hidden, inter=inter)
        return prepared

    def run(self, prepared: TritonPrepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """x to FP8, GEMM1 (FP8 out), GEMM2 scattered and reduced, into ``out``."""
        gemm = self._mods.gemm.moe_gemm_a8w4
        ex = prepared.extra
        rd, gather, scatter, x = self.route(prepared, inputs, inputs.padded_x(prepared.hidden))
        xq = self._mods.quant.downcast_to_static_fp8(x, ex["a1"])
        inter = gemm(
            xq, prepared.w13, None, prepared.w13_scales, ex["a1"], ex["a2"], prepared.b13, rd,
            gather_indx=gather, gammas=None, swizzle_mx_scale=prepared.swizzle, out_dtype=torch.float8_e4m3fn,
            apply_swiglu=True, alpha=A8W4_ALPHA, limit=A8W4_LIMIT, unpadded_N=2 * ex["inter"], unpadded_K=ex["hidden"],
        )  # fmt: skip
        y = gemm(
            inter, prepared.w2, None, prepared.w2_scales, ex["a2"], None, prepared.b2, rd,
            scatter_indx=scatter, gammas=rd.gate_scal, swizzle_mx_scale=prepared.swizzle,
            unpadded_N=ex["hidden"], unpadded_K=ex["inter"],
        )  # fmt: skip
        out.copy_(y[:, : out.shape[1]])
