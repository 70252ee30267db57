"""FLASHINFER_CUTLASS_MXFP4_MXFP8: FlashInfer's CUTLASS fused MoE, MXFP4 weights x MXFP8 activations (Blackwell)

vLLM 0.26 takes this scheme wherever ``has_device_capability(100)``: the SM10x and SM12x
(RTX PRO 6000, DGX Spark) families; FlashInfer builds the SM12x kernel as its own JIT module.

Kernel: ``flashinfer.fused_moe.cutlass_fused_moe`` with ``use_mxfp8_act_scaling`` (modular: the
engine routes), called as vLLM 0.26's ``FlashInferExperts`` calls it: x quantized to MXFP8 by
FlashInfer's ``mxfp8_quantize`` with 128x4-swizzled scales; weights as int64 views of the
packed bytes, scales as int32 views, and float32 ones for the two global scales
(``quant_scales = [w13 scales, 1, w2 scales, 1]``). Weights: w13 rows chunked [up; gate], hidden
and intermediate padded to 128, bf16 biases, weights as loaded, scales in 128x4 tiles
(block_scale_interleave; no padding after the 128 round-ups). Not run on hardware here (no
Blackwell).
"""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.harness.contract.convert import Converted
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.judge.engine import poisoned
from mxmoe.kernels import storage
from mxmoe.kernels.flashinfer_common import FlashInferKernel
from mxmoe.reference.moe import Precision


class FlashInferCutlassMxfp4Mxfp8(FlashInferKernel):
    """FLASHINFER_CUTLASS_MXFP4_MXFP8 (see the module docstring)."""

    kernel = "flashinfer.fused_moe.cutlass_fused_moe"
    jit_modules = {"sm100": "fused_moe_100", "sm120": "fused_moe_120"}

    storage = (storage.swizzle_128x4(view_fp8=False),)
    declaration = Declaration(
        id="flashinfer-cutlass-mxfp4-mxfp8",
        # vLLM 0.33.0 FlashInferExperts: _supports_current_device (SM90, SM10x, SM12x) and
        # _supports_quant_scheme (MXFP4 x MXFP8 from has_device_capability(100)): SM10x and SM12x
        archs=("sm100", "sm120"),
        description="FlashInfer CUTLASS fused MoE, MXFP8 activations",
        quant="w4a8-mxfp8",
        w13_layout="chunked_up_gate",
        hidden_align=128,
        intermediate_align=128,
        vllm_backend="FLASHINFER_CUTLASS_MXFP4_MXFP8",
        vllm_needs_biases=True,
        arithmetic=Arithmetic(
            precision=Precision(activation_input="mxfp8", intermediate="mxfp8", output=torch.bfloat16),
        ),
    )

    def run(self, prepared: Converted, inputs: CaseInputs, out: torch.Tensor) -> None:
        """MXFP8-quantize x (FlashInfer's own quantizer), then one ``cutlass_fused_moe`` call."""
        import flashinfer

        t = prepared.tensors
        x = inputs.padded_x(prepared.target.hidden)
        xq, xs = flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=32)
        ones = torch.ones(t["w13_blocks"].shape[0], dtype=torch.float32, device=x.device)
        output = poisoned(tuple(x.shape), torch.bfloat16, x.device)  # unwritten shows as such
        self._fi.cutlass_fused_moe(
            input=xq,
            input_sf=xs,
            fc1_expert_weights=t["w13_blocks"].contiguous().view(torch.long),
            fc2_expert_weights=t["w2_blocks"].contiguous().view(torch.long),
            quant_scales=[t["w13_scales"].view(torch.int32), ones, t["w2_scales"].view(torch.int32), ones],
            use_mxfp8_act_scaling=True,
            **self.cutlass_common(prepared, inputs, output),
        )
        out.copy_(output[:, : out.shape[1]])
