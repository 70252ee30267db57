"""What the three AITER adapters share: finding aiter's entry points across its module moves,
the host check, enum members by name, and the Triton kernels' weight form and routing.

Why a shared module: the two Triton backends (``aiter-triton-mxfp4-bf16``, ``aiter-mxfp4-fp8``)
take their weights and routing the same way (vLLM prepares both in its ``TRITON_BACKENDS``
branch and routes both with aiter's own ``routing``), and all three must refuse a host the
same way. The facts come from vLLM 0.26.0 and the later ``aiter_mxfp4_w4a16_moe.py`` (vLLM PR
#50622), read against aiter HEAD e4048607.

Where the installed aiter is imported: only in ``load`` (``VendorKernel``) and in
``AiterTritonBase.check_call``; nothing here needs aiter to import, so the helpers are tested
on any host (``suites/kernels/test_aiter_adapters.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from mxmoe.harness.contract import platforms
from mxmoe.harness.contract.backend import BackendUnavailable, VendorKernel, require_host_arch
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs

PIP_NAME = "amd-aiter (a ROCm build of ROCm/aiter; PyPI's amd-aiter predates these kernels)"

# aiter moved its Triton MoE modules under ``aiter.ops.triton.moe`` and keeps the old names
# importable through an import hook; vLLM tries the new path first, then the old one.
A16W4_MODULES = ("aiter.ops.triton.moe.moe_op_gemm_a16w4", "aiter.ops.triton.moe_op_gemm_a16w4")
A8W4_MODULES = ("aiter.ops.triton.moe.moe_op_gemm_a8w4", "aiter.ops.triton.moe_op_gemm_a8w4")
QUANT_MOE_MODULES = ("aiter.ops.triton.moe.quant_moe", "aiter.ops.triton.quant_moe")
ROUTING_MODULES = ("aiter.ops.triton.moe.moe_routing.routing", "aiter.ops.triton.moe_routing.routing")

AITER_ACTIVATIONS = {"silu": "Silu", "swigluoai": "Swiglu"}
"""The harness's activation -> the member of aiter's ``ActivationType`` vLLM passes for it
(``rocm_aiter_moe.py``: SILU -> Silu, SWIGLUOAI -> ``get_aiter_activation_type("swiglu")``)."""
RENORMALIZING = ("Renormalize", "RenormalizeNaive")
"""Routing methods vLLM hands aiter as ``renormalize=True`` (softmax over the chosen k)."""


def import_first(names: tuple[str, ...], backend_id: str) -> ModuleType:
    """The first of ``names`` that imports (aiter's current module path, then the older one).
    None importing is a BackendUnavailable naming every path tried and why."""
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise BackendUnavailable(
        f"{backend_id}: the installed aiter has none of the modules it needs (" + "; ".join(errors) + ")"
    )


def require_arch(backend_id: str, archs: tuple[str, ...]) -> str:
    """This host's architecture, if it is one of ``archs``; else BackendUnavailable saying which
    it is (a CPU host, an NVIDIA GPU, or an AMD GPU the kernel does not run on)."""
    return require_host_arch(backend_id, archs, " (ROCm)")


def enum_member(enum_type: Any, name: str, what: str) -> Any:
    """``enum_type``'s member called ``name`` (aiter's enums are pybind types whose integer
    values are not ours to assume); a clear ValueError naming the members it has otherwise."""
    members = getattr(enum_type, "__members__", None)
    if members is not None:
        if name in members:
            return members[name]
        accepted = ", ".join(members)
    else:
        if hasattr(enum_type, name):
            return getattr(enum_type, name)
        accepted = ", ".join(n for n in dir(enum_type) if not n.startswith("_"))
    raise ValueError(f"{what} must be a member of aiter's {getattr(enum_type, '__name__', enum_type)}: "
                     f"{accepted}; got {name!r}")  # fmt: skip


def activation_member(activation_type: Any, activation: str) -> Any:
    """aiter's ``ActivationType`` member for the harness activation ``activation``."""
    if activation not in AITER_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(AITER_ACTIVATIONS)}; got {activation!r}")
    return enum_member(activation_type, AITER_ACTIVATIONS[activation], "activation")


def cdna4_scale_swizzle(arch: str, tp: int) -> bool:
    """vLLM's ``should_use_cdna4_mx_scale_swizzle``: gfx950 and a tensor-parallel size of at
    most 2 (the scales of larger TP shards stay strided)."""
    return arch == "gfx950" and tp <= 2


def k_major(t: torch.Tensor) -> torch.Tensor:
    """[E, K, N] with K the contiguous dimension (stride 1 along -2), as aiter's MoE GEMMs assert
    for MXFP4 weights (``w.stride(-2) == 1``): ``t`` itself when it already is (a transposed view of
    the checkpoint's [E, N, K] memory), else the same values re-laid out."""
    if t.stride(-2) == 1:
        return t
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


@dataclass
class TritonPrepared:
    """Weights as aiter's Triton MoE GEMMs read them, on the device.

    ``w13``/``w2``: uint8 [E, K/2, N], K contiguous; ``w13_scales``/``w2_scales``: uint8
    [E, K/32, N] (strided) or aiter's CDNA4 swizzle of it; biases float32 [E, N] or None."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    hidden: int
    swizzle: str | None
    arch: str
    extra: dict[str, Any]


class AiterTritonBase(VendorKernel):
    """The AITER Triton MoE adapters' common part: loading, weights, routing."""

    package = "aiter"
    pip_name = PIP_NAME
    gemm_modules: tuple[str, ...] = A16W4_MODULES
    gemm_name = "moe_gemm_a16w4"
    empty_batch = "vLLM never calls the experts with T = 0"
    _mods: SimpleNamespace | None = None

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; the swigluoai the kernel fuses computes ``s * (up + 1)`` (beta 1)."""
        reason = super().supports(case, arch)
        if reason is None and case.activation == "swigluoai" and case.beta != 1.0:
            return f"{self.declaration.id}: aiter's fused swiglu computes s * (up + 1); beta {case.beta} is not 1"
        return reason

    def provenance(self) -> str | None:
        """aiter as imported (its folder names the commit of a cached checkout,
        ``aiter-<commit>``), and whether its Triton kernels were interpreted or compiled."""
        import os

        from mxmoe.harness.contract.backend import package_build

        built = package_build("aiter")
        if built is None:
            return None
        how = "interpreted (TRITON_INTERPRET=1)" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
        return f"{built}; Triton kernels {how}"

    def check_call(self) -> None:
        """A declared ROCm GPU, and an aiter that has the Triton GEMM and routing modules."""
        require_arch(self.declaration.id, self.declaration.archs)
        gemm = import_first(self.gemm_modules, self.declaration.id)
        routing = import_first(ROUTING_MODULES, self.declaration.id)
        # The CDNA4 scale swizzle lives beside the a16w4 GEMM; the a8w4 kernel reads the same layout.
        a16w4 = gemm if self.gemm_modules == A16W4_MODULES else import_first(A16W4_MODULES, self.declaration.id)
        for mod, name in ((gemm, self.gemm_name), (routing, "routing"), (a16w4, "swizzle_scales_gfx950")):
            if not hasattr(mod, name):
                raise BackendUnavailable(f"{self.declaration.id}: {mod.__name__} has no {name} (aiter too old?)")
        self._mods = SimpleNamespace(gemm=gemm, routing=routing, swizzle=a16w4.swizzle_scales_gfx950)

    def convert(self, inputs: CaseInputs) -> TritonPrepared:
        """The declared conversion (interleaved rows, padded 256 / 256, float32 biases, blocks and
        scales as [E, K, N] views), then the CDNA4 scale swizzle where vLLM applies it. vLLM 0.26
        swizzles with triton_kernels' ``CDNA4MXScaleLayout``; aiter's ``swizzle_scales_gfx950``
        (what aiter's own tests use) is the same byte order and needs no triton_kernels."""
        arch = platforms.host_arch()
        conv = self.convert_weights(inputs)
        t = conv.tensors
        swizzle = "CDNA4_SCALE" if cdna4_scale_swizzle(arch, inputs.case.tp) else None

        def scales(s: torch.Tensor) -> torch.Tensor:
            return self._mods.swizzle(s) if swizzle else s

        return TritonPrepared(
            w13=k_major(t["w13_blocks"]),
            w13_scales=scales(t["w13_scales"]),
            w2=k_major(t["w2_blocks"]),
            w2_scales=scales(t["w2_scales"]),
            b13=None if t.get("w13_bias") is None else t["w13_bias"].to(torch.float32).contiguous(),
            b2=None if t.get("w2_bias") is None else t["w2_bias"].to(torch.float32).contiguous(),
            hidden=conv.target.hidden,
            swizzle=swizzle,
            arch=arch,
            extra={},
        )

    def route(
        self, prepared: TritonPrepared, inputs: CaseInputs, x: torch.Tensor
    ) -> tuple[Any, Any, Any, torch.Tensor]:
        """(routing data, gather index, scatter index, x as GEMM1 reads it), as vLLM's monolithic
        AITER experts route: aiter's ``routing`` on the router logits in a GPT-OSS router's dtype
        (bfloat16; the case's values are exact there), ``sm_first = not renormalize``. On
        gfx1250 vLLM gathers x in torch (aiter's in-kernel gather is broken there) and turns
        aiter's TDM path off for routing."""
        case = inputs.case
        mod = self._mods.routing
        if prepared.arch == "gfx1250":
            mod.is_tdm_avail = lambda: False
        logits = inputs.router_logits.to(torch.bfloat16)
        rd, gather, scatter = mod.routing(logits, case.top_k, sm_first=case.routing not in RENORMALIZING)
        if prepared.arch == "gfx1250":
            x = x[gather.to(torch.long) // case.top_k]
            gather = None
        return rd, gather, scatter, x
