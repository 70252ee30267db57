"""FLASHINFER_TRTLLM_MXFP4_BF16: FlashInfer's TRT-LLM-gen MXFP4 MoE with bf16 activations (Blackwell)

Kernel: ``flashinfer.fused_moe.trtllm_fp4_block_scale_moe`` (monolithic: FlashInfer routes from
the bf16 router logits), called as vLLM 0.26's ``TrtLlmMxfp4ExpertsMonolithic`` calls it, every
argument by keyword and the routing method as a ``RoutingMethodType`` member looked up by name
(``kernels.flashinfer_common``). Weights as vLLM's oracle prepares them: w13 rows pair-swapped
[u0, g0, u1, g1, ...] (the kernel computes X2 * sigmoid(alpha * X2) * (X1 + beta) with X1 =
up), hidden and intermediate padded to 256 and 128, every row of w13, w2, their scales and
biases shuffled for the transposed-MMA epilogue (tile 128), scales then in 128x4 tiles viewed
as float8_e4m3fn, biases float32; alpha, beta and limit as float32 [E_local] tensors. The output
is written unpadded. FlashInfer's routing kernels emit bf16 routing weights. Not run on
hardware here (no Blackwell).
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.harness.contract.convert import Converted
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.judge.engine import poisoned
from mxmoe.kernels import storage
from mxmoe.kernels.flashinfer_common import FlashInferKernel, enum_member, enums
from mxmoe.reference.moe import Precision


class FlashInferTrtllmMxfp4Bf16(FlashInferKernel):
    """FLASHINFER_TRTLLM_MXFP4_BF16 (see the module docstring)."""

    kernel = "flashinfer.fused_moe.trtllm_fp4_block_scale_moe"
    jit_modules = {"sm100": "fused_moe_trtllm_sm100"}
    storage = (storage.row_shuffle(), storage.swizzle_128x4())
    declaration = Declaration(
        id="flashinfer-trtllm-mxfp4-bf16",
        archs=("sm100",),
        description="FlashInfer TRT-LLM-gen fp4 block-scale MoE, bf16 activations",
        quant="w4a16",
        routing_methods=("Default", "Renormalize", "RenormalizeNaive", "DeepSeekV3", "Llama4", "TopK"),
        w13_layout="pair_swapped",
        hidden_align=256,
        intermediate_align=128,
        bias_dtype="fp32",
        vllm_backend="FLASHINFER_TRTLLM_MXFP4_BF16",
        vllm_needs_biases=True,
        arithmetic=Arithmetic(
            precision=Precision(intermediate="bf16", routing_weights="bf16", output=torch.bfloat16),
        ),
    )

    def activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_states, hidden_states_scale) as the kernel takes them: bf16 x, no scale."""
        return x, None

    def run(self, prepared: Converted, inputs: CaseInputs, out: torch.Tensor) -> None:
        """One ``trtllm_fp4_block_scale_moe`` call: routing, both GEMMs, finalize."""
        fi = self._fi
        case = inputs.case
        t = prepared.tensors
        experts = t["w13_blocks"].shape[0]
        routing_method, _ = enums(fi)
        x, x_scale = self.activations(inputs.padded_x(prepared.target.hidden))
        dev = x.device
        swiglu = case.activation == "swigluoai"
        bias = inputs.correction_bias
        output = poisoned((inputs.x.shape[0], out.shape[1]), torch.bfloat16, dev)  # unwritten shows as such
        fi.trtllm_fp4_block_scale_moe(
            routing_logits=inputs.router_logits.to(torch.bfloat16),  # exact: the logits are bf16 values
            routing_bias=None if bias is None else bias.to(torch.bfloat16),
            hidden_states=x,
            hidden_states_scale=x_scale,
            gemm1_weights=t["w13_blocks"],
            gemm1_weights_scale=t["w13_scales"],
            gemm1_bias=t.get("w13_bias"),
            gemm1_alpha=self.per_expert(case.alpha if swiglu else None, experts, dev),
            gemm1_beta=self.per_expert(case.beta if swiglu else None, experts, dev),
            gemm1_clamp_limit=self.per_expert(case.limit if swiglu and case.limit else None, experts, dev),
            gemm2_weights=t["w2_blocks"],
            gemm2_weights_scale=t["w2_scales"],
            gemm2_bias=t.get("w2_bias"),
            output1_scale_scalar=None,
            output1_scale_gate_scalar=None,
            output2_scale_scalar=None,
            num_experts=case.experts,
            top_k=case.top_k,
            n_group=case.n_group,
            topk_group=case.topk_group,
            intermediate_size=prepared.target.intermediate,
            local_expert_offset=case.ep_rank * experts,
            local_num_experts=experts,
            routed_scaling_factor=case.routed_scaling_factor if case.routing == "DeepSeekV3" else None,
            routing_method_type=enum_member(routing_method, case.routing, "RoutingMethodType"),
            do_finalize=True,
            output=output,
        )
        out.copy_(output)
