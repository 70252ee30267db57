"""TRITON_UNFUSED: OpenAI triton_kernels' matmul_ogs with a separate activation

Kernel: two ``triton_kernels.matmul_ogs`` calls (v3.5.1; ``harness.upstream.fetch``) with the activation
between them, as vLLM's ``UnfusedOAITritonExperts`` (modular: the engine routes) runs them:
GEMM1 stores its output (plus the float32 bias) in bf16 in expert order; the rows are gathered
back to token order for the activation, then re-sorted for GEMM2; GEMM2 runs with one expert per
row (``n_expts_act`` = 1, no fused sum) and the routing weight as ``gammas``, each (token, slot)
row stored in bf16; the top-k rows of each token are summed in float32, skipping slots of other
EP ranks. The activation and the sum are vLLM's own CUDA/Triton ops (``swigluoai_and_mul``,
``silu_and_mul_with_clamp``, ``masked_moe_sum``), which need vLLM: they are done here in torch
with the same arithmetic (float32 from bf16, rounded to bf16), and only the GEMMs are the vendor's.

Weights: w13 rows chunked [gate; up] (vLLM keeps a standard checkpoint's rows; for GPT-OSS's
interleaved checkpoint vLLM 0.26 keeps them interleaved and uses the interleaved activation: the
GEMMs are the same, only which columns the activation pairs differs), the hidden size unchanged
and the intermediate padded to 64, float32 biases, blocks and scales as [E, K, N] views, then
triton_kernels' layout conversion (``kernels.oai_triton``).

Architectures and their settings are TRITON's (``kernels.oai_triton``), vLLM 0.34.0's, SM12x's
block_m pin included (``UnfusedOAITritonExperts.apply`` calls ``_constrain_sm12x_block_m`` before
GEMM1). **sm120 has not been run on hardware**: it follows vLLM's code only.
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.judge.engine import poisoned
from mxmoe.kernels.oai_triton import OAI_TRITON_ARCHS, TRITON_TACTICS, OaiTritonBase, Prepared
from mxmoe.reference.activation import gated_activation, split_gate_up
from mxmoe.reference.moe import Precision


def unfused_activation(gemm1: torch.Tensor, case: Case, layout: str) -> torch.Tensor:
    """vLLM's separate activation kernel (``swigluoai_and_mul`` / ``silu_and_mul_with_clamp`` /
    ``silu_and_mul``, vLLM CUDA ops, not callable without vLLM) in torch: float32 from the bf16
    GEMM1 output, rounded to bfloat16.

    swigluoai in vLLM 0.34.0's operation order (``csrc/activation_kernels.cu``: ``(u + 1) * g / (1 +
    expf(-g * alpha))``, one product and one division), not the oracle's ``g * sigmoid(alpha g) *
    (u + 1)``: the two differ in the last bit of about a third of the float32 activations, and
    vLLM's layer over the same GEMMs differed from this adapter in 6 to 20 of 11.8 M outputs at
    T=4096 (``harness vllm-cross``), every one honest. In vLLM's order the two sides can agree bit
    for bit, so a difference there is a finding again."""
    x = gemm1.float()
    if case.activation != "swigluoai":
        return gated_activation(x, case.activation, layout, case.alpha, case.beta, case.limit).to(torch.bfloat16)
    g, u = split_gate_up(x, layout)
    if case.limit:
        g, u = torch.clamp(g, max=case.limit), torch.clamp(u, min=-case.limit, max=case.limit)
    return ((u + case.beta) * g / (1.0 + torch.exp(-g * case.alpha))).to(torch.bfloat16)


class OaiTritonUnfused(OaiTritonBase):
    """TRITON_UNFUSED (see the module docstring)."""

    kernel = "triton_kernels.matmul_ogs + separate activation"
    routes_in_kernel = False
    declaration = Declaration(
        id="triton-unfused",
        archs=OAI_TRITON_ARCHS,  # as TRITON (kernels/oai_triton.py); sm120 not run on hardware
        description="OpenAI triton_kernels matmul_ogs, activation in a separate kernel",
        quant="w4a16",
        w13_layout="chunked_gate_up",
        intermediate_align=64,
        bias_dtype="fp32",
        router_weight_on_input=False,
        vllm_backend="TRITON_UNFUSED",
        tactics=TRITON_TACTICS,
        arithmetic=Arithmetic(
            precision=Precision(
                gemm1_output="bf16",
                intermediate="bf16",
                expert_output="bf16",
                routing_weights="bf16",
                output=torch.bfloat16,
            ),
        ),
    )

    def run(self, prepared: Prepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """GEMM1, activation, GEMM2 per (token, slot), masked float32 sum into ``out``."""
        tk = prepared.tk
        case = inputs.case
        mo = tk.matmul_ogs
        rd, gather, scatter, ids, x = self.begin(prepared, inputs)
        t, n = x.shape[0], prepared.w13.shape[-1]
        k = prepared.hidden
        gemm1 = poisoned((1, t * case.top_k, n), torch.bfloat16, x.device)
        rows = poisoned((1, t * case.top_k, k), torch.bfloat16, x.device)
        with self.constrained(prepared, t, case.top_k):
            mo.matmul_ogs(x, prepared.w13, prepared.b13, rd, gather_indx=gather, precision_config=prepared.pc13,
                          y=gemm1)  # fmt: skip
            act_in = gemm1.view(-1, n)[gather.dst_indx.to(torch.int64)]
            act = unfused_activation(act_in, case, self.declaration.w13_layout)
            rd.n_expts_act = 1  # one row per (token, slot): the sum over the top-k is done below
            mo.matmul_ogs(
                act[gather.src_indx.to(torch.int64)], prepared.w2, prepared.b2, rd, scatter_indx=scatter,
                precision_config=prepared.pc2, gammas=rd.gate_scal, y=rows,
            )  # fmt: skip
        rows = rows.view(t, case.top_k, k).float()
        valid = (ids >= 0).view(t, case.top_k, 1)
        summed = torch.where(valid, rows, torch.zeros_like(rows)).sum(dim=1)
        out.copy_(summed[:, : out.shape[1]].to(out.dtype))
