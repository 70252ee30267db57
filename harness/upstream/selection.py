"""The selection oracle: which MXFP4 MoE backend a serving engine picks for a deployment.

It reproduces the decision of vLLM's MXFP4 oracle (``fused_moe/oracle/mxfp4.py``, after PR
#50622 split AITER's CK and Triton W4A16 paths), from the backends' declarations alone, so that
the choice for any architecture can be asked and tested on any host:

* ``--moe-backend auto``: walk the GPT-OSS priority list and take the first backend whose
  capability checks (device, quantization scheme, activation, routing method, parallel config)
  pass; with no activation quantization asked for, only bf16-activation variants are candidates,
  with one asked for, that scheme's variants and EMULATION (vLLM's ``_filter_by_activation``);
* an explicit ``--moe-backend`` string: its candidates (a vendor family may name several, tried
  in order) and nothing else;
* when nothing fits, an error that lists every candidate with the reason it was rejected;
  an unknown string is rejected with the list of accepted ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from mxmoe.harness.contract.backend import Declaration
from mxmoe.harness.contract.platforms import check_arch
from mxmoe.reference.activation import check_activation
from mxmoe.reference.routing import ROUTING_METHODS

GPT_OSS_PRIORITY = (
    "FLASHINFER_TRTLLM_MXFP4_BF16",
    "FLASHINFER_TRTLLM_MXFP4_MXFP8",
    "AITER_MXFP4_BF16",
    "AITER_TRITON_MXFP4_BF16",
    "AITER_MXFP4_FP8",
    "TRITON",
    "FLASHINFER_CUTLASS_MXFP4_BF16",
    "FLASHINFER_CUTLASS_MXFP4_MXFP8",
    "MARLIN",
    "EMULATION",
)
"""vLLM's ``_get_priority_backends_for_gpt_oss`` restricted to the backends this project
declares (TRITON_UNFUSED is commented out there: "has bug with MTP support")."""

MOE_BACKENDS = {
    "auto": GPT_OSS_PRIORITY,
    "flashinfer_trtllm": ("FLASHINFER_TRTLLM_MXFP4_BF16", "FLASHINFER_TRTLLM_MXFP4_MXFP8"),
    "flashinfer_trtllm_afp8": ("FLASHINFER_TRTLLM_MXFP4_MXFP8",),
    "flashinfer_cutlass": ("FLASHINFER_CUTLASS_MXFP4_BF16", "FLASHINFER_CUTLASS_MXFP4_MXFP8"),
    "flashinfer_cutlass_afp8": ("FLASHINFER_CUTLASS_MXFP4_MXFP8",),
    "triton": ("TRITON",),
    "triton_unfused": ("TRITON_UNFUSED",),
    "marlin": ("MARLIN",),
    "aiter": ("AITER_MXFP4_BF16", "AITER_TRITON_MXFP4_BF16", "AITER_MXFP4_FP8"),
    "aiter_triton_mxfp4_bf16": ("AITER_TRITON_MXFP4_BF16",),
    "aiter_mxfp4_fp8": ("AITER_MXFP4_FP8",),
    "emulation": ("EMULATION",),
}
"""``--moe-backend`` values as vLLM spells them (``map_mxfp4_backend``), to the backends they
name, in the order they are tried."""

ACTIVATION_QUANTS = {"bf16": "w4a16", "mxfp8": "w4a8-mxfp8", "fp8": "w4a8-fp8"}
"""Activation quantization as a deployment asks for it, to the declared quant scheme."""


@dataclass(frozen=True)
class Deployment:
    """What the choice depends on."""

    arch: str
    activation: str = "swigluoai"
    activation_quant: str | None = None
    """None: not asked for (bf16 variants only, as vLLM); else one of ACTIVATION_QUANTS."""
    routing: str = "Renormalize"
    tp: int = 1
    ep: int = 1
    moe_backend: str = "auto"

    def __post_init__(self) -> None:
        check_arch(self.arch)
        check_activation(self.activation)
        if self.activation_quant is not None and self.activation_quant not in ACTIVATION_QUANTS:
            raise ValueError(
                f"activation_quant must be one of {', '.join(ACTIVATION_QUANTS)} (or None); "
                f"got {self.activation_quant!r}"
            )
        if self.routing not in ROUTING_METHODS:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_METHODS)}; got {self.routing!r}")
        for name in ("tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(
                f"moe_backend {self.moe_backend!r} is not an MXFP4 MoE backend; accepted: {', '.join(MOE_BACKENDS)}"
            )


ANY_ACTIVATION_QUANT = ("EMULATION",)
"""Backends vLLM's ``_filter_by_activation`` keeps whatever activation quantization is asked for
(emulation fake-quantizes any scheme)."""


def _activation_filter(names: tuple[str, ...], by_name: dict[str, Declaration], asked: str | None) -> set[str]:
    """vLLM's ``_filter_by_activation`` on a candidate list: with a quantization asked for, the
    candidates of that scheme plus EMULATION; with none asked, the bf16 (w4a16) candidates if the
    list has any, else all of them (an ``_afp8`` string alone still reaches its MXFP8 kernel)."""
    declared = [n for n in names if n in by_name]
    if asked is not None:
        wanted = ACTIVATION_QUANTS[asked]
        return {n for n in declared if by_name[n].quant == wanted or n in ANY_ACTIVATION_QUANT}
    bf16 = {n for n in declared if by_name[n].quant == "w4a16"}
    return bf16 or set(declared)


def rejection(d: Declaration, dep: Deployment, quant_ok: bool | None = None) -> str | None:
    """Why backend ``d`` cannot serve ``dep`` (the first failing capability check), or None.
    ``quant_ok``: whether vLLM's activation filter kept it (default: its scheme is the one asked
    for, bf16 when none is)."""
    if dep.arch not in d.archs:
        if dep.arch in d.device_archs:
            return f"declines the quantization scheme MXFP4 {d.quant} on {dep.arch} (takes it on {', '.join(d.archs)})"
        return f"device {dep.arch} not supported (runs on {', '.join(d.archs)})"
    wanted = ACTIVATION_QUANTS[dep.activation_quant or "bf16"]
    if not (d.quant == wanted if quant_ok is None else quant_ok):
        return f"activation quantization {d.quant} was not asked for (asked: {wanted})"
    if dep.activation not in d.activations:
        return f"activation {dep.activation} not supported ({', '.join(d.activations)})"
    if dep.routing not in d.routing_methods:
        return f"routing method {dep.routing} not supported ({', '.join(d.routing_methods)})"
    if dep.ep > 1 and not d.expert_parallel:
        return "expert parallelism not supported"
    return None


@dataclass(frozen=True)
class Selection:
    """The chosen backend and, for every candidate in order, None (chosen) or its rejection."""

    chosen: Declaration
    candidates: tuple[tuple[str, str | None], ...]


class NoBackend(ValueError):
    """No candidate fits; the message lists each with its reason."""


def select_backend(dep: Deployment, declarations: list[Declaration]) -> Selection:
    """Walk ``dep.moe_backend``'s candidates in order and take the first that fits."""
    by_name = {d.vllm_backend: d for d in declarations if d.vllm_backend}
    kept = _activation_filter(MOE_BACKENDS[dep.moe_backend], by_name, dep.activation_quant)
    tried: list[tuple[str, str | None]] = []
    for name in MOE_BACKENDS[dep.moe_backend]:
        d = by_name.get(name)
        reason = "not declared by any loaded backend module" if d is None else rejection(d, dep, name in kept)
        tried.append((name, reason))
        if reason is None:
            return Selection(d, tuple(tried))
    lines = "\n".join(f"  {name}: {reason}" for name, reason in tried)
    raise NoBackend(f"no MXFP4 MoE backend supports {describe(dep)}; candidates:\n{lines}")


def describe(dep: Deployment) -> str:
    """One line naming the deployment."""
    quant = dep.activation_quant or "bf16 (not asked)"
    return (
        f"arch {dep.arch}, activation {dep.activation}, activations {quant}, routing {dep.routing}, "
        f"TP{dep.tp} EP{dep.ep}, --moe-backend {dep.moe_backend}"
    )
