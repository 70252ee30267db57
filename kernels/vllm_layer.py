"""vLLM's own MXFP4 MoE layer, driven through its oracle, where vLLM is installed.

The project's adapters call each vendor kernel the way vLLM does; this one calls vLLM itself, so
that a vLLM installation is validated layer by layer with whatever it would really run: for one
``--moe-backend`` value (and activation quantization), vLLM's ``GptOssMxfp4MoEMethod`` selects
the backend (``select_mxfp4_moe_backend``; a different choice than the one this backend stands
for is a SKIP that names vLLM's choice), rounds the sizes up
(``mxfp4_round_up_hidden_size_and_intermediate_size``), creates the zero-filled padded weights,
copies the GPT-OSS checkpoint tensors into their leading slice as vLLM's weight loader does,
converts them (``process_weights_after_loading``: the kernel format, the quant config, the
modular kernel), and applies it: ``apply_monolithic`` with the bf16 router logits, or ``apply``
with the engine's top-k (float32 weights, int32 ids). x is zero-padded to the rounded hidden size
as vLLM's runner pads it, and the output cut back.

One backend per vLLM backend this project declares, ``vllm-<its id>``, with that backend's
declaration (archs, precision): a vLLM kernel that rounds differently from the declaration is
then a FAIL of the check. MARLIN exists only inside vLLM, so ``kernels.marlin`` is this driver
with ``--moe-backend marlin``.

Where vLLM is not installed (a GPU machine with no network, say), the driver boots the project's
carryable vLLM runtime (``harness.upstream.vllm_runtime``: ``python -m harness fetch
vllm-runtime``) and loads the project's build of the few compiled ops vLLM's layer calls
(``harness.upstream.vllm_ops``: ``python -m harness build-vllm-ops``); every result's build names
the vLLM release, where it came from and the ops build. vLLM 0.34.0 (NEWEST_VLLM) is the release
driven by default; ``MXMOE_VLLM_VERSION`` picks another fetched runtime (``driven_release``: 0.33.0,
PREVIOUS_VLLM, or 0.26.0, whose layer object is the same).

Scope: one rank without expert parallelism (the engine's EP all-to-all is not run here); a TP
rank's shard is a layer of its own (its partial sum), as the checks define it. A routing method
the installed vLLM's ``RoutingMethodType`` lacks (0.33.0 and 0.34.0: ``TopKSigmoid``) is declined in
``convert``, a SKIP naming the release and its members: vLLM cannot configure such a layer, and
the declarations say what the kernels do, not what one vLLM release can name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from mxmoe.harness.contract.backend import BackendUnavailable, Declaration, VendorKernel
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.convert import to_layout
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.reference.moe import round_to
from mxmoe.reference.routing import ROUTING_METHODS

GPT_OSS_SWIGLU = ("swigluoai", 1.702, 1.0, 7.0)
"""(activation, alpha, beta, limit) that vLLM's GPT-OSS MXFP4 method passes to every kernel."""
ACTIVATION_KEYS = {"w4a16": None, "w4a8-mxfp8": "kMxfp8Dynamic", "w4a8-fp8": "kFp8StaticTensorSym"}
"""A declaration's quant scheme, to the name of vLLM's activation ``QuantKey`` it asks for."""
MOE_BACKEND_STRINGS = {
    "TRITON": "triton",
    "TRITON_UNFUSED": "triton_unfused",
    "MARLIN": "marlin",
    "EMULATION": "emulation",
    "FLASHINFER_TRTLLM_MXFP4_BF16": "flashinfer_trtllm",
    "FLASHINFER_TRTLLM_MXFP4_MXFP8": "flashinfer_trtllm",
    "FLASHINFER_CUTLASS_MXFP4_BF16": "flashinfer_cutlass",
    "FLASHINFER_CUTLASS_MXFP4_MXFP8": "flashinfer_cutlass",
    "AITER_MXFP4_BF16": "aiter",
    "AITER_TRITON_MXFP4_BF16": "aiter",
    "AITER_MXFP4_FP8": "aiter",
}
"""vLLM backend -> the ``--moe-backend`` string that reaches it (with the activation key)."""


def vllm_routing_method(routing: str, routing_type: Any, version: str) -> Any:
    """vLLM's ``RoutingMethodType`` member (``routing_type``: the installed vLLM's enum) for the
    harness's routing method ``routing``. Raises BackendUnavailable (the case is a SKIP naming
    why) where vLLM ``version`` has no such member: its layer cannot be configured with that
    routing, so vLLM never runs such a layer, and a crash there says nothing of the kernel. vLLM
    names its members as the harness names its methods (0.33.0 and 0.34.0 lack ``TopKSigmoid``)."""
    if routing not in ROUTING_METHODS:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_METHODS)}; got {routing!r}")
    members = routing_type.__members__  # by name: the enum's integers drift between releases
    if routing not in members:
        raise BackendUnavailable(
            f"vLLM {version}'s RoutingMethodType has no {routing} member (it has {', '.join(members)}), so vLLM's "
            f"layer cannot express routing method {routing}"
        )
    return members[routing]


@dataclass
class Prepared:
    """vLLM's quant method and the layer holding its converted weights."""

    method: Any
    layer: Any
    hidden: int
    padded_hidden: int


class _Layer(torch.nn.Module):
    """The attributes ``GptOssMxfp4MoEMethod`` reads from its ``RoutedExperts`` layer (0.26.0 to
    0.34.0: since 0.33.0 ``apply_monolithic`` also passes the grouped-top-k, score-bias, scaling,
    sink and hash-routing attributes on, which a GPT-OSS layer leaves unset; 0.34.0 keeps the Triton
    backends' swizzled tensors on it as ``w13_weight_triton``/``w2_weight_triton`` and its kernel
    constants as buffers, which any ``torch.nn.Module`` takes)."""

    def __init__(self, experts: int, activation: Any, moe_config: Any) -> None:
        super().__init__()
        self.activation = activation
        self.global_num_experts = experts
        self.expert_map = None
        self.apply_router_weight_on_input = False
        self.moe_config = moe_config
        self.num_expert_group = None
        self.topk_group = None
        self.e_score_correction_bias = None
        self.routed_scaling_factor = 1.0
        self.routing_sink = None
        self.hash_indices_table = None

    def _expert_routing_tables(self) -> None:
        return None


class VllmLayer(VendorKernel):
    """Base of the vLLM-driven backends: ``vllm_backend`` names the one it stands for."""

    package = "vllm"
    pip_name = "vllm"
    kernel = "vllm GptOssMxfp4MoEMethod (oracle/mxfp4.py)"
    vllm_backend: ClassVar[str]
    jit_modules: ClassVar[dict[str, str] | None] = None
    """FlashInfer's JIT module of the kernel vLLM calls, by architecture (the FlashInfer backends):
    vLLM's call would otherwise start an hour of nvcc where it is not built."""
    flashinfer_build: dict[str, object] | None = None
    converts_per_layer = True
    """vLLM's layer is made from the weights and the case's model config, not its tokens, as the
    engine makes one per layer for every batch: one per layer (``Backend``)."""

    base_backend: ClassVar[type | None] = None
    """The project's direct adapter of the same kernel: its shape limits are the kernel's, and hold
    for vLLM's call of it too (TRITON on Hopper: N >= 128 in both GEMMs, or matmul_ogs fails a
    compile-time assertion with vLLM's Hopper scale layout)."""

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; one rank without expert parallelism; GPT-OSS's swiglu (vLLM's
        ``GptOssMxfp4MoEMethod.get_fused_moe_quant_config`` passes alpha 1.702, beta 1 and limit 7 to
        every kernel, whatever the model: another activation or constant cannot be expressed through
        it); both biases where vLLM's conversion asserts them (``Declaration.vllm_needs_biases``);
        the direct adapter's limits of the same kernel.

        A limit of vLLM's that only its run would show is a SKIP of a case declared here, and a
        sign-off that requires the backend counts it as not run: the FlashInfer backends' bias
        assertion, found so on a GPU, blocked every policy that required ``vllm-flashinfer-*``."""
        d = self.declaration
        reason = super().supports(case, arch)
        if reason is None and case.ep > 1:
            return f"{d.id}: the vLLM driver runs one rank without expert parallelism"
        if reason is None and d.vllm_needs_biases and not case.bias:
            return (
                f"{d.id}: vLLM's {self.vllm_backend} weight conversion asserts both biases "
                "(convert_gpt_oss_weight_to_mxfp4_moe_kernel_format); GPT-OSS checkpoints always have them, "
                "so vLLM never sends a layer without"
            )
        if reason is None and (case.activation, case.alpha, case.beta, case.limit) != GPT_OSS_SWIGLU:
            return (
                f"{d.id}: vLLM's GptOssMxfp4MoEMethod runs GPT-OSS's swigluoai (alpha 1.702, beta 1, limit 7) only; "
                f"this case is {case.activation} (alpha {case.alpha}, beta {case.beta}, limit {case.limit})"
            )
        if reason is None and self.base_backend is not None:
            base = self.base_backend().supports(case, arch)
            if base:
                return f"{d.id}: the same kernel's limit: {base}"
        return reason

    def load(self) -> None:
        """Boot vLLM (installed, or the project's runtime with its ops build), then import it."""
        from mxmoe.harness.contract.backend import require_host_arch
        from mxmoe.harness.upstream.fetch import VendorMissing
        from mxmoe.harness.upstream.vllm_ops import BuildError
        from mxmoe.harness.upstream.vllm_runtime import boot, driven_release

        d = self.declaration
        arch = require_host_arch(d.id, d.archs)
        try:
            self.booted = boot(driven_release(), arch)
        except (VendorMissing, BuildError) as exc:
            raise BackendUnavailable(f"{d.id}: vLLM is not installed and its runtime cannot boot: {exc}") from exc
        super().load()

    def provenance(self) -> str | None:
        """vLLM's release and origin (installed, or the project's runtime) and the ops build."""
        b = getattr(self, "booted", None)
        if b is None:
            return super().provenance()
        ops = b["ops"]
        built = (f"compiled ops from the project's build {ops['hash']} of vLLM {ops['recipe']['vllm']}'s sources "
                 f"({', '.join(ops['recipe']['ops'])}; torch {ops['recipe']['torch']}, CUDA {ops['recipe']['nvcc']})"
                 if ops else "no compiled vLLM op loaded")  # fmt: skip
        fi = self.flashinfer_build
        if fi is not None:
            from mxmoe.kernels.flashinfer_common import subset_build

            built += f"; FlashInfer's kernel: {subset_build(fi)}"
        elif self.jit_modules:
            from mxmoe.kernels.flashinfer_common import installed_version

            built += f"; FlashInfer's kernel: flashinfer-python {installed_version()}, FlashInfer's own build"
        return f"vllm {b['vllm']} ({b['source']}); {built}"

    def check_call(self) -> None:
        """vLLM's oracle imports, on a host of a declared architecture."""
        d = self.declaration
        super().check_call()
        for name in (
            "vllm.model_executor.layers.fused_moe.oracle.mxfp4",
            "vllm.model_executor.layers.quantization.mxfp4",
        ):
            try:
                importlib.import_module(name)
            except Exception as exc:  # vLLM's imports fail in many ways (compiled ops, versions)
                raise BackendUnavailable(f"{d.id}: {name} did not import: {type(exc).__name__}: {exc}") from exc
        booted = getattr(self, "booted", None) or {}
        from_runtime = bool(booted) and not booted["source"].startswith("installed")
        if self.vllm_backend in OPS_BACKENDS and from_runtime and not booted["ops"]:
            raise BackendUnavailable(
                f"{d.id}: vLLM's {self.vllm_backend} calls vLLM's compiled ops, and vLLM runs here from the "
                "project's runtime without them: build them on this GPU machine with `python -m harness "
                "build-vllm-ops` (about a minute; docs/vllm.md)"
            )
        if self.jit_modules:
            from mxmoe.harness.contract.platforms import host_arch
            from mxmoe.kernels.flashinfer_common import require_compiled

            self.flashinfer_build = require_compiled(self.jit_modules[host_arch()], d.id)

    def convert(self, inputs: CaseInputs) -> Prepared:
        """vLLM's own selection, round-up, weight loading and conversion for this case. A routing
        method the installed vLLM cannot express is declined first (``vllm_routing_method``)."""
        from vllm.model_executor.layers.fused_moe import config as fcfg

        routing_method = vllm_routing_method(inputs.case.routing, fcfg.RoutingMethodType, self._vllm_version())
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle
        from vllm.model_executor.layers.quantization import mxfp4 as qmx
        from vllm.model_executor.layers.quantization.utils import quant_utils

        case = inputs.case
        d = self.declaration
        w = to_layout(inputs.weights, "interleaved")  # the GPT-OSS checkpoint's rows, as vLLM loads them
        experts, two_i, half_h = w.w13_blocks.shape
        hidden, inter = 2 * half_h, two_i // 2
        key_name = ACTIVATION_KEYS[d.quant]
        key = None if key_name is None else getattr(quant_utils, key_name)
        oracle._user_moe_activation_override = lambda: key  # no engine config: say what the user asked for
        activation = MoEActivation[{"swigluoai": "SWIGLUOAI", "silu": "SILU"}[case.activation]]
        cfg = fcfg.FusedMoEConfig(
            num_experts=case.experts,
            experts_per_token=case.top_k,
            hidden_dim=hidden,
            intermediate_size=inter,
            num_local_experts=experts,
            num_logical_experts=case.experts,
            activation=activation,
            device=inputs.x.device.type,
            routing_method=routing_method,
            moe_parallel_config=fcfg.FusedMoEParallelConfig.make_no_parallel(),
            in_dtype=torch.bfloat16,
            has_bias=case.bias,
            moe_backend=MOE_BACKEND_STRINGS[self.vllm_backend],
        )
        try:
            method = qmx.GptOssMxfp4MoEMethod(cfg)
        except ValueError as exc:  # vLLM's oracle refusing the deployment ("does not support ...")
            raise BackendUnavailable(f"vLLM's oracle refuses --moe-backend {cfg.moe_backend} here: {exc}") from exc
        chosen = method.mxfp4_backend.name
        if chosen != self.vllm_backend:
            raise BackendUnavailable(
                f"{d.id}: vLLM's oracle chose {chosen} for --moe-backend {cfg.moe_backend} here, "
                f"not {self.vllm_backend}"
            )
        hp, ip = method.maybe_roundup_sizes(hidden, inter, torch.bfloat16, cfg.moe_parallel_config)
        cfg.hidden_dim, cfg.intermediate_size_per_partition = hp, ip
        layer = _Layer(case.experts, activation, cfg)
        method.create_weights(layer, experts, hp, ip, torch.bfloat16)
        layer.to(inputs.x.device)
        ckpt = {
            "w13_weight": w.w13_blocks,
            "w13_weight_scale": w.w13_scales,
            "w2_weight": w.w2_blocks,
            "w2_weight_scale": w.w2_scales,
            "w13_bias": w.w13_bias,
            "w2_bias": w.w2_bias,
        }
        for name, t in ckpt.items():  # vLLM's gpt-oss loader: into the leading slice of the zeroed tensor
            if t is not None and hasattr(layer, name):
                getattr(layer, name).data[tuple(slice(0, s) for s in t.shape)].copy_(t)
        try:
            method.process_weights_after_loading(layer)
        except AssertionError as exc:
            if case.bias:
                raise
            raise BackendUnavailable(_refused_without_bias(self.vllm_backend, exc)) from exc
        return Prepared(method, layer, hidden, hp)

    def _vllm_version(self) -> str:
        """The vLLM release driven: as booted (``load``), else the imported package's own."""
        booted = getattr(self, "booted", None) or {}
        if booted.get("vllm"):
            return str(booted["vllm"])
        return str(getattr(importlib.import_module("vllm"), "__version__", "(version unknown)"))

    def run(self, prepared: Prepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """vLLM's apply, monolithic (it routes) or modular (the engine's top-k)."""
        method, layer = prepared.method, prepared.layer
        x = inputs.padded_x(prepared.padded_hidden)
        if method.is_monolithic:
            y = method.apply_monolithic(layer, x, inputs.router_logits.to(torch.bfloat16))
        else:
            from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

            if not is_workspace_manager_initialized():
                init_workspace_manager(x.device)
            routing = inputs.routing()
            weights = round_to(routing.weights, "fp32").to(torch.float32)
            y = method.apply(layer, x, weights, routing.ids.to(torch.int32), None, None)
        out.copy_(y[..., : prepared.hidden])


OPS_BACKENDS = ("TRITON_UNFUSED", "MARLIN")
"""vLLM's MXFP4 backends whose layer calls vLLM's compiled ops on CUDA (docs/vllm.md's table:
TRITON_UNFUSED's activation, MARLIN's GEMMs): where vLLM is booted from the runtime without the
project's ops build, such a backend cannot run, and its SKIP says which command builds them."""


def _refused_without_bias(vllm_backend: str, exc: AssertionError) -> str:
    """Why the driver declines a case without biases that vLLM's conversion refused: GPT-OSS's
    checkpoints always carry both biases, so ``GptOssMxfp4MoEMethod`` never sees such a layer in
    vLLM, and an assertion of its conversion there is no finding about the kernel. The reason names
    vLLM's own check (file, line and statement)."""
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1]
    where = f"{Path(frame.filename).name}:{frame.lineno} `{frame.line}`" if frame.line else Path(frame.filename).name
    return (f"vLLM's {vllm_backend} weight conversion refuses a layer without biases ({where}); "
            "GPT-OSS checkpoints always have them, so vLLM never sends this case")


def _driven(base: type, vllm_backend: str) -> Declaration:
    """The direct adapter's declaration as vLLM's layer runs it: its own id, and no tactics. vLLM's
    layer runs its kernel's own pick for each case, as vLLM serves it; nothing here forces a tactic
    on vLLM's call, so a ``vllm-<id>-tactic-<name>`` would be named for a configuration it did not
    run. Each tactic is forced on the direct adapter, which calls the same kernel source."""
    d = base.declaration
    return replace(
        d,
        id=f"vllm-{d.id}",
        description=f"vLLM's own layer for {vllm_backend} (--moe-backend {MOE_BACKEND_STRINGS[vllm_backend]})",
        vllm_backend=None,
        tactics=(),
    )


def _make(name: str, base_path: str) -> type:
    """A VllmLayer subclass standing for the vLLM backend declared by ``base_path``'s class."""
    module, cls = base_path.split(":")
    base = getattr(importlib.import_module(module), cls)
    vb = base.declaration.vllm_backend
    return type(
        name,
        (VllmLayer,),
        {
            "__doc__": f"{vb} as vLLM itself runs it (see the module docstring).",
            "__module__": __name__,
            "vllm_backend": vb,
            "storage": base.storage,
            "declaration": _driven(base, vb),
            "jit_modules": getattr(base, "jit_modules", None),
            "base_backend": base,
        },
    )


VllmTriton = _make("VllmTriton", "mxmoe.kernels.oai_triton:OaiTriton")
VllmTritonUnfused = _make("VllmTritonUnfused", "mxmoe.kernels.oai_triton_unfused:OaiTritonUnfused")
VllmEmulation = _make("VllmEmulation", "mxmoe.kernels.emulation:Emulation")
VllmFlashInferTrtllmMxfp4Bf16 = _make(
    "VllmFlashInferTrtllmMxfp4Bf16", "mxmoe.kernels.flashinfer_trtllm_mxfp4_bf16:FlashInferTrtllmMxfp4Bf16"
)
VllmFlashInferTrtllmMxfp4Mxfp8 = _make(
    "VllmFlashInferTrtllmMxfp4Mxfp8", "mxmoe.kernels.flashinfer_trtllm_mxfp4_mxfp8:FlashInferTrtllmMxfp4Mxfp8"
)
VllmFlashInferCutlassMxfp4Bf16 = _make(
    "VllmFlashInferCutlassMxfp4Bf16", "mxmoe.kernels.flashinfer_cutlass_mxfp4_bf16:FlashInferCutlassMxfp4Bf16"
)
VllmFlashInferCutlassMxfp4Mxfp8 = _make(
    "VllmFlashInferCutlassMxfp4Mxfp8", "mxmoe.kernels.flashinfer_cutlass_mxfp4_mxfp8:FlashInferCutlassMxfp4Mxfp8"
)
VllmAiterMxfp4Bf16 = _make("VllmAiterMxfp4Bf16", "mxmoe.kernels.aiter_mxfp4_bf16:AiterMxfp4Bf16")
VllmAiterTritonMxfp4Bf16 = _make(
    "VllmAiterTritonMxfp4Bf16", "mxmoe.kernels.aiter_triton_mxfp4_bf16:AiterTritonMxfp4Bf16"
)
VllmAiterMxfp4Fp8 = _make("VllmAiterMxfp4Fp8", "mxmoe.kernels.aiter_mxfp4_fp8:AiterMxfp4Fp8")
DRIVEN = (
    VllmTriton,
    VllmTritonUnfused,
    VllmEmulation,
    VllmFlashInferTrtllmMxfp4Bf16,
    VllmFlashInferTrtllmMxfp4Mxfp8,
    VllmFlashInferCutlassMxfp4Bf16,
    VllmFlashInferCutlassMxfp4Mxfp8,
    VllmAiterMxfp4Bf16,
    VllmAiterTritonMxfp4Bf16,
    VllmAiterMxfp4Fp8,
)
"""Every vLLM backend but MARLIN (``kernels.marlin`` is the driver itself)."""
