"""AITER_MXFP4_BF16: AITER's CK a16w4 MoE (MI355X)

Kernel: ``aiter.fused_moe.fused_moe`` with the CK-tile a16w4 stages, called as vLLM 0.26.0's
``AiterExperts`` calls it (``rocm_aiter_fused_experts`` -> ``_rocm_aiter_fused_moe_impl``). CK runs on
gfx942 but declines the MXFP4 scheme there (its FP4 kernels are gfx950-only), which is why
vLLM picks AITER_TRITON_MXFP4_BF16 on MI300X.

* Weights as vLLM's gpt-oss loader prepares them: w13 rows chunked [gate; up] (de-interleaved
  from the checkpoint), hidden and intermediate padded to 256 (vLLM's ROCm rule), float32
  biases, packed weights in 16-row x 16-byte tiles with gate and up interleaved per 16 rows
  (``shuffle_weight_a16w4(w, 16, gate_up)``), viewed as ``torch.float4_e2m1fn_x2`` and marked
  ``is_shuffled``; scales shuffled (``shuffle_scale_a16w4``) and passed 2-D, [E * N, K/32].
  Where the installed aiter's own shuffles import (a ROCm host), ``convert`` checks that the
  declared storage steps (``kernels/storage.py``) give their bytes exactly.
* Routing by vLLM's router with AITER MoE on: ``aiter.topk_softmax`` on the bfloat16 router
  logits into float32 weights and int32 ids (``need_renorm`` for Renormalize and
  RenormalizeNaive, not for Default). Under expert parallelism vLLM hands aiter its 0/1 expert
  mask of E + 1 entries (the last one 0) with global ids, not the expert map.
* ``fused_moe(x, w13, w2, weights, ids, expert_mask, ActivationType.Swiglu|Silu,
  QuantType.per_1x32, False, s13, s2, None, None, dtype=bf16, hidden_pad, intermediate_pad,
  bias1, bias2, swiglu_limit=0.0, gate_mode="interleave")``, the pads rounded as vLLM rounds them
  (hidden_pad // 128 * 128, intermediate_pad // 64 * 64, doubled at TP 1); enum members looked
  up by name in the installed aiter.

Arithmetic (declared below, and the reason for two classes): aiter chooses the activation dtype
per call. Below ``AITER_BF16_FP8_MOE_BOUND`` tokens (256 unless set; vLLM's gpt-oss path leaves it
unset, its DeepSeek-V4 path sets 0) x and the intermediate stay bfloat16; from 256 tokens on
gfx950 both are quantized to MXFP8 (``fused_dynamic_mxfp8_quant_moe_sort``, scale
ceil_pow2(amax / 448): the ``rceil`` rule). ``AiterMxfp4Bf16`` takes the cases below the bound,
``AiterMxfp4Bf16Prefill`` those at or above it, each with its own precision points. Stage 2
accumulates the top-k rows atomically into the bfloat16 output (``moe_sorting``'s ``moe_buf``), so
runs need not agree bit for bit (declared non-deterministic), and the partial sums round to
bfloat16: a rounding point ``Precision`` cannot express yet (it has no bfloat16 combine), so the
bound is tight there. The CK-tile Swiglu takes no alpha or limit: swigluoai only at GPT-OSS's
(alpha 1.702, beta 1, limit 7).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from mxmoe.harness.contract.backend import Arithmetic, BackendUnavailable, Declaration, VendorKernel
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.convert import partition_sizes
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.kernels import storage
from mxmoe.kernels.aiter_common import PIP_NAME, RENORMALIZING, activation_member, enum_member, require_arch
from mxmoe.reference.activation import GPT_OSS_ALPHA, GPT_OSS_BETA, GPT_OSS_LIMIT
from mxmoe.reference.moe import Precision

FP8_BOUND_ENV = "AITER_BF16_FP8_MOE_BOUND"
FP8_FROM_TOKENS = 256
"""aiter's default for ``AITER_BF16_FP8_MOE_BOUND``: from this many tokens the CK a16w4 path
quantizes activations to MXFP8 on gfx950 (``aiter/fused_moe.py``, ``_fused_moe_impl``)."""


def ck_pads(hidden_padded: int, hidden: int, inter_padded: int, inter: int, tp: int) -> tuple[int, int]:
    """(hidden_pad, intermediate_pad) as vLLM's ``rocm_aiter_fused_experts`` passes them: the
    zero columns the kernel may skip, rounded down to aiter's dispatch granules (128 for the
    hidden size, 64 for the intermediate, doubled at TP 1 where w13's gate and up halves are
    both padded)."""
    for name, padded, real in (("hidden", hidden_padded, hidden), ("intermediate", inter_padded, inter)):
        if padded < real:
            raise ValueError(f"the padded {name} size must be at least the real one, got {padded} < {real}")
    if tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp}")
    hidden_pad = (hidden_padded - hidden) // 128 * 128
    inter_pad = (inter_padded - inter) // 64 * 64 * (2 if tp == 1 else 1)
    return hidden_pad, inter_pad


def aiter_expert_mask(expert_map: torch.Tensor) -> torch.Tensor:
    """vLLM's AITER expert mask (``determine_expert_map(..., return_expert_mask=True)``): int32
    [E + 1], 1 where the global expert is on this rank, and a last entry 0."""
    if expert_map.dim() != 1:
        raise ValueError(f"expert_map must be 1-D [E] (global id -> local id or -1), got {tuple(expert_map.shape)}")
    mask = torch.ones(expert_map.numel() + 1, dtype=torch.int32, device=expert_map.device)
    mask[-1] = 0
    mask[:-1] = (expert_map > -1).to(torch.int32)
    return mask


@dataclass
class CkPrepared:
    """Weights as aiter's CK a16w4 MoE reads them, on the device."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scales: torch.Tensor
    w2_scales: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    hidden: int
    hidden_pad: int
    intermediate_pad: int


def _ck_declaration(ident: str, description: str, vllm_backend: str | None, precision: Precision) -> Declaration:
    return Declaration(
        id=ident,
        archs=("gfx950",),
        device_archs=("gfx942", "gfx950"),
        description=description,
        quant="w4a16",
        activations=("silu", "swigluoai"),
        routing_methods=("Default", "Renormalize", "RenormalizeNaive"),
        w13_layout="chunked_gate_up",
        hidden_align=256,
        intermediate_align=256,
        bias_dtype="fp32",
        router_weight_on_input=False,
        deterministic=False,
        vllm_backend=vllm_backend,
        arithmetic=Arithmetic(precision=precision),
    )


class AiterMxfp4Bf16(VendorKernel):
    """AITER_MXFP4_BF16 below aiter's MXFP8 bound (see the module docstring)."""

    package = "aiter"
    pip_name = PIP_NAME
    kernel = "aiter.fused_moe.fused_moe (CK a16w4)"
    empty_batch = "vLLM never calls the experts with T = 0"
    storage = (storage.aiter_a16w4_weight_shuffle(), storage.aiter_a16w4_scale_shuffle())
    declaration = _ck_declaration(
        "aiter-mxfp4-bf16",
        "AITER CK a16w4 fused MoE, below 256 tokens (bf16 activations)",
        "AITER_MXFP4_BF16",
        Precision(intermediate="bf16", expert_output="bf16", routing_weights="fp32", output=torch.bfloat16),
    )
    prefill = False
    """False: the cases below ``FP8_FROM_TOKENS`` tokens; True: those at or above it."""
    _aiter: Any = None
    _fused_moe: Any = None
    _gate_mode = False

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; swigluoai only with GPT-OSS's constants; the token count on this class's
        side of aiter's MXFP8 bound."""
        reason = super().supports(case, arch)
        if reason is not None:
            return reason
        d = self.declaration
        if case.activation == "swigluoai" and (case.alpha, case.beta, case.limit) != (
            GPT_OSS_ALPHA,
            GPT_OSS_BETA,
            GPT_OSS_LIMIT,
        ):
            return (
                f"{d.id}: the CK-tile Swiglu has GPT-OSS's alpha {GPT_OSS_ALPHA}, beta {GPT_OSS_BETA} and limit "
                f"{GPT_OSS_LIMIT} built in; got alpha {case.alpha}, beta {case.beta}, limit {case.limit}"
            )
        if self.prefill and case.tokens < FP8_FROM_TOKENS:
            return f"{d.id}: below {FP8_FROM_TOKENS} tokens aiter keeps bf16 activations; aiter-mxfp4-bf16 checks those"
        if not self.prefill and case.tokens >= FP8_FROM_TOKENS:
            return (
                f"{d.id}: from {FP8_FROM_TOKENS} tokens aiter quantizes the activations to MXFP8 on gfx950 "
                "(AITER_BF16_FP8_MOE_BOUND); aiter-mxfp4-bf16-prefill checks those"
            )
        return None

    def check_call(self) -> None:
        """gfx950 (ROCm), an aiter with ``fused_moe`` and its C++ enums (a full build, not
        AITER_TRITON_ONLY), and aiter's MXFP8 bound at its default (the declared arithmetic)."""
        d = self.declaration
        require_arch(d.id, d.archs)
        bound = os.environ.get(FP8_BOUND_ENV)
        if bound is not None and bound.strip() != str(FP8_FROM_TOKENS):
            raise BackendUnavailable(
                f"{d.id}: {FP8_BOUND_ENV}={bound} moves aiter's bf16/MXFP8 switch away from {FP8_FROM_TOKENS} tokens, "
                "which the declared arithmetic of aiter-mxfp4-bf16 and -prefill assumes; unset it"
            )
        try:
            aiter = importlib.import_module("aiter")
            fused = importlib.import_module("aiter.fused_moe")
        except ImportError as exc:
            raise BackendUnavailable(f"{d.id}: aiter.fused_moe did not import: {exc}") from exc
        missing = [n for n in ("ActivationType", "QuantType", "topk_softmax") if not hasattr(aiter, n)]
        if missing:
            raise BackendUnavailable(
                f"{d.id}: this aiter lacks {', '.join(missing)} (AITER_TRITON_ONLY=1 or a build without its C++ ops)"
            )
        self._aiter = aiter
        self._fused_moe = fused.fused_moe
        self._gate_mode = "gate_mode" in inspect.signature(fused.fused_moe).parameters

    def _check_against_aiter_shuffles(self, conv: Any) -> None:
        """The declared storage bytes against the installed aiter's own shuffles, where they
        import: a change of aiter's layout shows here, not as wrong numbers."""
        try:
            shuffle = importlib.import_module("aiter.ops.shuffle")
        except ImportError:
            return
        logical = conv.logical()
        e = logical.num_experts
        for role, gate_up in (("w13", True), ("w2", False)):
            blocks = getattr(logical, f"{role}_blocks")
            scales = getattr(logical, f"{role}_scales")
            theirs_w = shuffle.shuffle_weight_a16w4(blocks, 16, gate_up).view(torch.uint8)
            theirs_s = shuffle.shuffle_scale_a16w4(scales.reshape(-1, scales.shape[-1]), e, gate_up)
            ours_w = conv.tensors[f"{role}_blocks"]
            ours_s = conv.tensors[f"{role}_scales"].reshape(-1, scales.shape[-1])
            if not (torch.equal(theirs_w, ours_w) and torch.equal(theirs_s.view(torch.uint8), ours_s)):
                raise RuntimeError(
                    f"{self.declaration.id}: the declared {role} storage (kernels/storage.py aiter_a16w4_*_shuffle) "
                    "differs from the installed aiter's shuffle_weight_a16w4 / shuffle_scale_a16w4"
                )

    def convert(self, inputs: CaseInputs) -> CkPrepared:
        """The declared conversion (chunked rows, padded 256 / 256, float32 biases, CK shuffles),
        then the dtype and shape vLLM hands aiter: blocks as float4_e2m1fn_x2 marked shuffled,
        scales 2-D."""
        conv = self.convert_weights(inputs)
        self._check_against_aiter_shuffles(conv)
        t = conv.tensors
        fp4 = getattr(torch, "float4_e2m1fn_x2", None)
        if fp4 is None:
            raise BackendUnavailable(f"{self.declaration.id}: this torch has no float4_e2m1fn_x2 (aiter keys on it)")

        def blocks(w: torch.Tensor) -> torch.Tensor:
            w = w.contiguous().view(fp4)
            w.is_shuffled = True  # what vLLM sets after its shuffles (and aiter's shuffle_weight sets too)
            return w

        hidden, inter = partition_sizes(inputs.case)
        hidden_pad, inter_pad = ck_pads(conv.target.hidden, hidden, conv.target.intermediate, inter, inputs.case.tp)
        return CkPrepared(
            w13=blocks(t["w13_blocks"]),
            w2=blocks(t["w2_blocks"]),
            w13_scales=t["w13_scales"].reshape(-1, t["w13_scales"].shape[-1]),
            w2_scales=t["w2_scales"].reshape(-1, t["w2_scales"].shape[-1]),
            b13=None if t.get("w13_bias") is None else t["w13_bias"].to(torch.float32).contiguous(),
            b2=None if t.get("w2_bias") is None else t["w2_bias"].to(torch.float32).contiguous(),
            hidden=conv.target.hidden,
            hidden_pad=hidden_pad,
            intermediate_pad=inter_pad,
        )

    def route(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights, int32 global ids) from ``aiter.topk_softmax`` as vLLM's router calls
        it with AITER MoE on."""
        case = inputs.case
        logits = inputs.router_logits.to(torch.bfloat16).contiguous()  # a GPT-OSS router's dtype
        t, dev = logits.shape[0], logits.device
        weights = torch.empty(t, case.top_k, dtype=torch.float32, device=dev)
        ids = torch.empty(t, case.top_k, dtype=torch.int32, device=dev)
        token_expert = torch.empty(t, case.top_k, dtype=torch.int32, device=dev)
        self._aiter.topk_softmax(weights, ids, token_expert, logits, case.routing in RENORMALIZING, 0, "")
        return weights, ids

    def run(self, prepared: CkPrepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """aiter's fused_moe as vLLM calls it, into ``out``."""
        aiter = self._aiter
        weights, ids = self.route(inputs)
        mask = None if inputs.expert_map is None else aiter_expert_mask(inputs.expert_map)
        extra = {"gate_mode": "interleave"} if self._gate_mode else {}
        y = self._fused_moe(
            inputs.padded_x(prepared.hidden), prepared.w13, prepared.w2, weights, ids, mask,
            activation_member(aiter.ActivationType, inputs.case.activation),
            enum_member(aiter.QuantType, "per_1x32", "quant_type"),
            False, prepared.w13_scales, prepared.w2_scales, None, None,
            num_local_tokens=None, dtype=torch.bfloat16, hidden_pad=prepared.hidden_pad,
            intermediate_pad=prepared.intermediate_pad, bias1=prepared.b13, bias2=prepared.b2,
            moe_sorting_dispatch_policy=0, swiglu_limit=0.0, **extra,
        )  # fmt: skip
        out.copy_(y[:, : out.shape[1]])


class AiterMxfp4Bf16Prefill(AiterMxfp4Bf16):
    """AITER_MXFP4_BF16 from 256 tokens, where aiter quantizes x and the intermediate to MXFP8
    (rceil scales) on gfx950 (see the module docstring)."""

    prefill = True
    declaration = replace(
        AiterMxfp4Bf16.declaration,
        id="aiter-mxfp4-bf16-prefill",
        description="AITER CK a16w4 fused MoE from 256 tokens (MXFP8 activations inside aiter)",
        vllm_backend=None,
        arithmetic=Arithmetic(
            precision=Precision(
                activation_input="mxfp8",
                intermediate="mxfp8",
                expert_output="bf16",
                routing_weights="fp32",
                output=torch.bfloat16,
                mx_rule="rceil",
            )
        ),
    )
