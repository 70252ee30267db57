"""The selection oracle: which MXFP4 MoE backend a serving engine picks for a deployment.

It reproduces the decision of vLLM's MXFP4 oracle (``select_mxfp4_moe_backend`` in
``fused_moe/oracle/mxfp4.py``) of the release ``harness.upstream.fetch.NEWEST_VLLM`` (0.34.0),
which the backends' declarations follow too, from the declarations alone, so that the choice for
any architecture can be asked and tested on any host. (``DEFAULT_VLLM``, 0.26.0, is another thing:
the release whose vendored triton_kernels the Triton backends run.)

* ``--moe-backend auto``: walk the GPT-OSS priority list (``gpt_oss_priority``: on SM12x TRITON
  comes after MARLIN) and take the first backend whose capability checks (device, quantization
  scheme, activation, routing method, parallel config) pass;
* an explicit ``--moe-backend`` string: its candidates (a vendor family may name several, tried
  in order) and nothing else;
* activation quantization (vLLM's ``_filter_by_activation``): with none asked for, only the bf16
  variants are candidates (or, where a string names none, all of its variants: the ``_afp8``
  strings); with one asked for, first the variants of that scheme and EMULATION, then the bf16
  variants as a fallback (vLLM warns that it runs with bf16 activations then); variants of any
  other scheme are never tried;
* when nothing fits, an error that lists every candidate with the reason it was rejected;
  an unknown string is rejected with the list of accepted ones.

vLLM 0.26.0 differed (``python -m harness vllm-drift --vllm-version 0.26.0`` lists where): no
AITER_TRITON_MXFP4_BF16, no bf16 fallback, one priority order on every architecture.
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
"""vLLM's ``_get_priority_backends_for_gpt_oss`` restricted to the backends this project declares,
on every architecture but SM12x (``gpt_oss_priority``). TRITON_UNFUSED is commented out there ("has
bug with MTP support"); the undeclared members (AITER_MXFP4_MXFP4, CUTLASS_MXFP4_MXFP4,
BATCHED_MARLIN, HUMMING, XPU, CPU) are left out."""

SM12X = ("sm120",)
"""The architectures of vLLM's ``is_device_capability_family(120)`` (consumer Blackwell)."""


def gpt_oss_priority(arch: str) -> tuple[str, ...]:
    """The ``auto`` order on ``arch``: GPT_OSS_PRIORITY, except on SM12x, where vLLM 0.34.0's
    ``_get_priority_backends_for_gpt_oss`` moves TRITON after MARLIN (after BATCHED_MARLIN, which is
    not declared): there the OAI Triton kernels fit only small tiles in 99 KB of shared memory, and
    MARLIN prefills faster. 0.34.0 does the same on SM110 (Jetson Thor, not benchmarked there), an
    architecture no declaration names."""
    check_arch(arch)
    if arch not in SM12X:
        return GPT_OSS_PRIORITY
    order = [name for name in GPT_OSS_PRIORITY if name != "TRITON"]
    order.insert(order.index("MARLIN") + 1, "TRITON")
    return tuple(order)


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
"""``--moe-backend`` values as vLLM spells them (``map_mxfp4_backend``), to the declared backends
they name, in the order they are tried ("auto": the order on most architectures, see
``candidates``). vLLM's 'aiter' also names AITER_MXFP4_MXFP4 and AITER_TRITON_MXFP4_MXFP4 (MXFP4
activations), which are not declared."""


def candidates(moe_backend: str, arch: str) -> tuple[str, ...]:
    """The backends ``--moe-backend`` names on ``arch``, in vLLM's order (before the activation filter)."""
    return gpt_oss_priority(arch) if moe_backend == "auto" else MOE_BACKENDS[moe_backend]


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
"""Backends vLLM's ``_filter_by_activation`` counts as matching whatever activation quantization is
asked for (emulation fake-quantizes any scheme; vLLM hands it the asked-for key)."""


def activation_order(
    names: tuple[str, ...], by_name: dict[str, Declaration], asked: str | None
) -> tuple[list[str], list[str]]:
    """vLLM 0.34.0's ``_filter_by_activation`` on a candidate list: (the declared candidates it keeps,
    in the order tried; those of them that are bf16 fallbacks). With a quantization asked for: the
    candidates of that scheme and EMULATION, then the bf16 (w4a16) candidates, the fallback; with
    none asked: the bf16 candidates if the list has any, else all of them (an ``_afp8`` string
    alone still reaches its MXFP8 kernel). Undeclared names are not kept (their scheme is unknown)."""
    declared = [n for n in names if n in by_name]
    bf16 = [n for n in declared if by_name[n].quant == "w4a16"]
    if asked is None:
        return (bf16 or declared), []
    wanted = ACTIVATION_QUANTS[asked]
    matching = [n for n in declared if by_name[n].quant == wanted or n in ANY_ACTIVATION_QUANT]
    fallback = [n for n in bf16 if n not in matching]
    return matching + fallback, fallback


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
    """The chosen backend and, for every candidate in the order tried, None (chosen) or its rejection."""

    chosen: Declaration
    candidates: tuple[tuple[str, str | None], ...]
    bf16_fallback: bool = False
    """The chosen backend runs with bf16 activations although a quantization was asked for and no
    backend of that scheme fits (vLLM logs a warning: ``_warn_on_bf16_fallback``)."""


class NoBackend(ValueError):
    """No candidate fits; the message lists each with its reason."""


def select_backend(dep: Deployment, declarations: list[Declaration]) -> Selection:
    """Walk ``dep.moe_backend``'s candidates in the order vLLM tries them and take the first that fits.
    The candidates its activation filter drops follow, each with that reason (they are never
    chosen); names no loaded module declares come last."""
    by_name = {d.vllm_backend: d for d in declarations if d.vllm_backend}
    names = candidates(dep.moe_backend, dep.arch)
    kept, fallback = activation_order(names, by_name, dep.activation_quant)
    dropped = [n for n in names if n in by_name and n not in kept]
    missing = [n for n in names if n not in by_name]
    tried: list[tuple[str, str | None]] = []
    for name in kept + dropped + missing:
        d = by_name.get(name)
        reason = "not declared by any loaded backend module" if d is None else rejection(d, dep, name in kept)
        tried.append((name, reason))
        if reason is None:
            return Selection(d, tuple(tried), bf16_fallback=name in fallback)
    lines = "\n".join(f"  {name}: {reason}" for name, reason in tried)
    raise NoBackend(f"no MXFP4 MoE backend supports {describe(dep)}; candidates:\n{lines}")


def describe(dep: Deployment) -> str:
    """One line naming the deployment."""
    quant = dep.activation_quant or "bf16 (not asked)"
    return (
        f"arch {dep.arch}, activation {dep.activation}, activations {quant}, routing {dep.routing}, "
        f"TP{dep.tp} EP{dep.ep}, --moe-backend {dep.moe_backend}"
    )
