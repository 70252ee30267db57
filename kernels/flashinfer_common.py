"""What the four FlashInfer adapters share: the installed version and the SM90 layouts it takes,
enum members by name, and whether a kernel can be called here without an hour of compiling.

FlashInfer's SM90 mixed-input CUTLASS MoE (MXFP4 weights x bf16 activations) changed its weight
and scale layouts twice: up to 0.6.9 it read plain packed weights and scales interleaved to
[E, K/128, 4R]; 0.6.10 to 0.6.15 interleave the nibbles of row pairs (r, r + 8) as well; 0.6.16
repacks the weights bit by bit and folds the scales to [E, R/64, K/128, 16, 16]. A converter
that gets the version wrong returns garbage without an error (FlashInfer issue #3334 and vLLM
PR #46915: GPQA 0.0 on H100/H200), so the adapter picks the layout from the installed version.
Layouts agree for K = 128 and differ beyond, which is why the project's tests use K > 128.

Enums are passed as members looked up by name (``RoutingMethodType[...]``): their integer values
moved between releases (0.6.9 had ``Unspecified = 8``; 0.6.14 has ``Sigmoid = 8``), and a
hard-coded integer was a shipped bug (docs/shipped-bugs.md).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from types import ModuleType
from typing import ClassVar

import torch

from mxmoe.harness.contract.backend import BackendUnavailable, VendorKernel
from mxmoe.harness.contract.convert import Converted, Storage
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.upstream.flashinfer_releases import INDEX_RELEASES
from mxmoe.kernels import storage
from mxmoe.reference.moe import round_to

VLLM_PINNED_FLASHINFER = "0.7.2"
"""The FlashInfer release of the newest vLLM checked (vLLM 0.33.0 pins 0.7.2.post1, whose layout
helpers and SM90 weight interleave kernel are 0.7.2's unchanged)."""
NEWEST_FLASHINFER = INDEX_RELEASES[-1]
"""The newest FlashInfer release (the last the set-up's list of PyPI's releases has)."""
CACHED_FLASHINFERS = (VLLM_PINNED_FLASHINFER, NEWEST_FLASHINFER)
"""The FlashInfer releases whose layout helpers are cross-checked beside the installed one
(``suites/kernels/test_flashinfer_layouts.py``, each in a subprocess): ``python -m harness fetch
flashinfer`` (which ``./dev`` runs) puts each, without its dependencies, in
``.cache/vendor/flashinfer-<version>``, never in the environment."""

SM90_LAYOUTS: dict[str, tuple[Storage, ...]] = {
    "0.6.9": (storage.sm90_scale_interleave(),),
    "0.6.10": (storage.sm90_weight_interleave(), storage.sm90_scale_interleave()),
    "0.6.16": (storage.sm90_weight_repack(), storage.sm90_scale_fold()),
}
"""The storage steps of the SM90 mixed-input MoE's weights and scales, by the first release of
each layout generation."""
DEFAULT_SM90_GENERATION = "0.6.10"
"""Where FlashInfer is not installed: the layout of 0.6.14, the release vLLM 0.26 pins."""
FULL_SM90_MODULE = "fused_moe_90"
"""FlashInfer's SM90 CUTLASS MoE module, whose bf16 x MXFP4 part the project can build alone."""
JIT_OPT_IN = "MXMOE_FLASHINFER_JIT"
"""Set to 1 to let a check compile FlashInfer's JIT modules on first use (the SM90 MoE module
is ~182 CUTLASS translation units: 35-90 minutes at 16 cores)."""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != p:  # 0.6.15rc1, 0.6.15.post1: the release is what counts
            break
    return tuple(parts)


def installed_version() -> str | None:
    """The installed flashinfer-python version, or None."""
    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return None


def sm90_generation(version: str | None) -> str:
    """The SM90 layout generation (a key of SM90_LAYOUTS) that FlashInfer ``version`` reads."""
    if version is None:
        return DEFAULT_SM90_GENERATION
    v = _version_tuple(version)
    if v < (0, 6, 10):
        return "0.6.9"
    if v < (0, 6, 16):
        return "0.6.10"
    return "0.6.16"


def enum_member(enum: type, name: str, what: str) -> object:
    """``enum[name]``; a FlashInfer without that member is a clear BackendUnavailable."""
    try:
        return enum[name]
    except KeyError:
        names = ", ".join(m.name for m in enum)
        raise BackendUnavailable(
            f"this flashinfer ({installed_version()}) has no {what}.{name}; it has {names}"
        ) from None


def enums(fi: ModuleType) -> tuple[type, type]:
    """(RoutingMethodType, ActivationType) of the installed FlashInfer, wherever it keeps them."""
    for holder in ("flashinfer.tllm_enums", "flashinfer.fused_moe", "flashinfer.fused_moe.core", "flashinfer"):
        try:
            mod = __import__(holder, fromlist=["RoutingMethodType"])
        except ImportError:
            continue
        if hasattr(mod, "RoutingMethodType") and hasattr(mod, "ActivationType"):
            return mod.RoutingMethodType, mod.ActivationType
    raise BackendUnavailable(f"flashinfer {installed_version()} exposes no RoutingMethodType/ActivationType")


def compiled_by_flashinfer(module_name: str) -> bool:
    """Whether FlashInfer's own JIT module ``module_name`` is prebuilt (the flashinfer-jit-cache
    package or the AOT folder) or already compiled in FlashInfer's JIT cache."""
    from flashinfer.jit import env as jit_env

    for base in (getattr(jit_env, "FLASHINFER_AOT_DIR", None), getattr(jit_env, "FLASHINFER_JIT_DIR", None)):
        if base is not None and (base / module_name / f"{module_name}.so").exists():
            return True
    return False


def require_compiled(module_name: str, backend_id: str) -> dict[str, object] | None:
    """Make sure a call will not silently spend an hour in nvcc. In order: FlashInfer's own
    module ``module_name`` prebuilt or compiled (None); for ``fused_moe_90``, the project's
    bf16 x MXFP4 subset built for this FlashInfer (``harness.upstream.flashinfer_sm90``), which is
    then installed in FlashInfer's place (its ``build.json`` record); the user's opt-in to
    FlashInfer compiling the whole module (``MXMOE_FLASHINFER_JIT=1``, None). Otherwise
    BackendUnavailable saying how to get one."""
    try:
        if compiled_by_flashinfer(module_name):
            return None
    except ImportError as exc:
        raise BackendUnavailable(f"{backend_id}: flashinfer.jit did not import: {exc}") from exc
    subset = module_name == FULL_SM90_MODULE
    imported = getattr(sys.modules.get("flashinfer"), "__version__", None)
    if imported is not None and imported != installed_version():
        # The layouts follow the installed distribution and the subset the imported package: they
        # must be one release, or a build of one would run with the other's layout.
        raise BackendUnavailable(f"{backend_id}: the imported flashinfer is {imported} but flashinfer-python "
                                 f"{installed_version()} is installed; one release must be both")  # fmt: skip
    if subset:
        from mxmoe.harness.upstream import flashinfer_sm90

        record = flashinfer_sm90.install()
        if record is not None:
            return record
    if os.environ.get(JIT_OPT_IN) == "1":
        return None
    if subset and (failed := flashinfer_sm90.failed_record()) is not None:
        reason = str(failed["reason"]).splitlines()[0]
        raise BackendUnavailable(
            f"{backend_id}: the project's bf16 x MXFP4 subset of FlashInfer {failed['flashinfer']}'s {module_name} "
            f"could not be built: {reason} (in {flashinfer_sm90.build_root() / flashinfer_sm90.FAILED}); set "
            f"{JIT_OPT_IN}=1 to let the first call compile FlashInfer's whole module instead"
        )
    build = (
        "; or build the project's bf16 x MXFP4 subset of it on this GPU machine with "
        "`python -m harness build-flashinfer` (about a tenth of the module)"
        if subset
        else ""
    )
    raise BackendUnavailable(
        f"{backend_id}: FlashInfer's JIT module {module_name} is neither prebuilt nor compiled here; install "
        f"flashinfer-jit-cache {installed_version()}, or set {JIT_OPT_IN}=1 to let the first call compile it "
        f"(the SM90 MoE module takes 35-90 minutes at 16 cores){build}"
    )


def subset_build(record: dict[str, object]) -> str:
    """The build string of a result whose kernel ran from the project's SM90 subset (its
    ``build.json`` record), naming the FlashInfer release first."""
    return (f"flashinfer-python {record['flashinfer']}, SM90 subset built by the project ({record['module']}: the "
            f"bf16 x MXFP4 part of fused_moe_90, recipe {record['recipe']}, CUDA {record['cuda']})")  # fmt: skip


class FlashInferKernel(VendorKernel):
    """Base of the FlashInfer adapters: imports ``flashinfer.fused_moe`` lazily and refuses, with
    the reason, a host of another architecture or one where the kernel's JIT module would first
    have to be compiled (``require_compiled``)."""

    package = "flashinfer"
    pip_name = "flashinfer-python"
    jit_modules: ClassVar[dict[str, str]]
    """FlashInfer's JIT module holding the kernel, by declared architecture."""
    _fi: ClassVar[ModuleType | None] = None
    _built: ClassVar[dict[str, object] | None] = None
    """The ``build.json`` of the project-built module in use, if one is (``require_compiled``)."""
    converts_per_layer = True
    """The declared conversion alone (``Backend.convert``); ``run`` does the rest: one per layer."""

    def check_call(self) -> None:
        """The declared architecture, the fused_moe module, a compiled kernel."""
        d = self.declaration
        super().check_call()
        try:
            import flashinfer.fused_moe as fused_moe
        except ImportError as exc:
            raise BackendUnavailable(f"{d.id}: flashinfer.fused_moe did not import: {exc}") from exc
        self._built = require_compiled(self.jit_modules[host_arch()], d.id)
        FlashInferKernel._fi = fused_moe

    def provenance(self) -> str | None:
        """The FlashInfer release first, then which build of its kernel ran: the project-built
        subset where it runs in place of FlashInfer's module (``subset_build``), else FlashInfer's
        own, from the installed package's folder."""
        b = self._built
        if b is not None:
            return subset_build(b)
        own = super().provenance()
        return own and f"flashinfer-python {installed_version()}, FlashInfer's own build: {own}"

    def cutlass_common(self, conv: Converted, inputs: CaseInputs, output: torch.Tensor) -> dict[str, object]:
        """The ``cutlass_fused_moe`` arguments both CUTLASS variants pass alike (vLLM's
        ``FlashInferExperts``): the engine's routing (global ids, float32 weights; the kernel
        keeps its EP rank's experts), biases, per-expert swiglu constants, TP/EP, the output."""
        case = inputs.case
        t = conv.tensors
        experts = t["w13_blocks"].shape[0]
        dev = output.device
        routing = inputs.routing()
        swiglu = case.activation == "swigluoai"
        _, activation_type = enums(self._fi)
        return {
            "token_selected_experts": routing.ids.to(torch.int32),
            "token_final_scales": round_to(routing.weights, "fp32").to(torch.float32),
            "output_dtype": torch.bfloat16,
            "fc1_expert_biases": t.get("w13_bias"),
            "fc2_expert_biases": t.get("w2_bias"),
            "swiglu_alpha": self.per_expert(case.alpha if swiglu else None, experts, dev),
            "swiglu_beta": self.per_expert(case.beta if swiglu else None, experts, dev),
            "swiglu_limit": self.per_expert(case.limit if swiglu and case.limit else None, experts, dev),
            "tp_size": case.tp,
            "tp_rank": case.tp_rank,
            "ep_size": case.ep,
            "ep_rank": case.ep_rank,
            "output": output,
            "activation_type": enum_member(activation_type, "Swiglu", "ActivationType"),
        }

    @staticmethod
    def per_expert(value: float | None, experts: int, device: torch.device) -> torch.Tensor | None:
        """A swiglu constant as the float32 [E_local] tensor FlashInfer takes (None stays None)."""
        if value is None:
            return None
        return torch.full((experts,), float(value), dtype=torch.float32, device=device)
