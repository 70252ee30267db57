"""The backend protocol: what a kernel under test declares, and the three calls the engine makes.

A backend is one class (one module in ``kernels/`` for the project's own). Everything the engine
needs to decide whether it applies, and how precise it must be, is DATA in its ``Declaration``;
``supports`` is pure (no GPU, no environment, no vendor import), so that the set of collected
tests is the same on every host. Vendor packages are imported in ``load`` only; an ImportError
there becomes a SKIP that names the package. ``convert`` (weights into the backend's layout,
once per case) is separate from ``run`` (the call that is compared, made twice).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.convert import BIAS_DTYPES, Converted, Storage, Target, convert_weights, padded_sizes
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.reference.activation import ACTIVATIONS, LAYOUTS
from mxmoe.reference.moe import Precision
from mxmoe.reference.routing import ROUTING_METHODS

QUANT_SCHEMES = ("w4a16", "w4a8-mxfp8", "w4a8-fp8")
"""MXFP4 weights with bf16 activations; with MXFP8 activations; with per-tensor FP8 activations."""
ACCUMULATORS = {"fp32": 2.0**-24, "fp64": 2.0**-53}
"""GEMM accumulator formats and their unit roundoff."""
KINDS = ("backend", "instrument")
"""``backend``: a kernel people ship (checked by default); ``instrument``: a variant that exists to
test the harness itself (honest variants, faulty mutants), run only when asked for."""


@dataclass(frozen=True)
class Arithmetic:
    """How a backend computes, as the error bound needs it (see ``harness.judge.bounds``).

    ``precision`` names the points where it rounds (reference.moe.Precision); the activation input
    is emulated exactly by the oracle (a deterministic function of the same input), every other
    point is an error source of the bound.
    """

    precision: Precision = Precision(intermediate="bf16", output=torch.bfloat16)
    accumulate: str = "fp32"
    """Format of GEMM and combine accumulators."""
    activation_ulps: float = 64.0
    """Error of evaluating the activation (exp, sigmoid), in accumulator ulps of its magnitude."""
    routing_ulps: float = 64.0
    """Error of computing routing weights (softmax, sigmoid, sums), in accumulator ulps."""

    def __post_init__(self) -> None:
        if self.accumulate not in ACCUMULATORS:
            raise ValueError(f"Arithmetic.accumulate must be one of {', '.join(ACCUMULATORS)}; got {self.accumulate!r}")
        if not isinstance(self.precision, Precision):
            raise ValueError(f"Arithmetic.precision must be a Precision, got {type(self.precision).__name__}")


TACTIC_SELECTIONS = ("default", "all")
"""``--tactics`` values besides a list of tactic names: the kernel's own pick only, or that and
every declared tactic."""


@dataclass(frozen=True)
class Tactic:
    """One configuration a kernel may pick for a call (its autotuner's or heuristic's choice):
    a name (an id token), the settings the adapter forces (for triton_kernels, opt-flag
    constraints), the architectures where the kernel can pick it, and why it is declared. The
    engine runs a case under each declared tactic as a backend of its own (``with_tactic``), so a
    tactic that corrupts the output is named by its test id."""

    name: str
    settings: tuple[tuple[str, object], ...]
    archs: tuple[str, ...]
    why: str

    def __post_init__(self) -> None:
        import re

        if not re.fullmatch(r"[a-z0-9]+", self.name):
            raise ValueError(f"Tactic.name must be one lower-case token [a-z0-9]+, got {self.name!r}")
        bad = [a for a in self.archs if a not in ARCHS]
        if bad or not self.archs:
            raise ValueError(f"Tactic.archs must be a non-empty subset of {', '.join(ARCHS)}; got {self.archs}")

    def as_dict(self) -> dict[str, object]:
        """The settings as keyword values."""
        return dict(self.settings)


@dataclass(frozen=True)
class XFail:
    """A known upstream failure: cases matching ``when`` (Case field -> required value) are
    expected to FAIL or ERROR; a PASS there is reported as an unexpected pass (strict)."""

    when: dict[str, object]
    reason: str
    link: str

    def matches(self, case: Case) -> bool:
        """Whether ``case`` has every field value in ``when``."""
        return all(getattr(case, k) == v for k, v in self.when.items())


@dataclass(frozen=True)
class Declaration:
    """What a backend is and promises, as data."""

    id: str
    """Lower-case tokens joined by '-' (the first token of its test ids)."""
    archs: tuple[str, ...]
    description: str
    quant: str = "w4a16"
    activations: tuple[str, ...] = ACTIVATIONS
    routing_methods: tuple[str, ...] = ROUTING_METHODS
    w13_layout: str = "interleaved"
    """Row layout of w13 after ``convert``."""
    hidden_align: int = 32
    """The hidden size is padded up to a multiple of this."""
    intermediate_align: int = 32
    """Each TP partition's intermediate size is padded up to a multiple of this."""
    bias: bool = True
    bias_dtype: str = "bf16"
    """The dtype biases are stored in after conversion (``harness.contract.convert.BIAS_DTYPES``)."""
    expert_parallel: bool = True
    router_weight_on_input: bool = True
    arithmetic: Arithmetic = Arithmetic()
    deterministic: bool = True
    """Whether two runs on the same inputs must agree bit for bit (False for atomics)."""
    kind: str = "backend"
    production: bool = True
    """A production kernel (what an inference engine ships). False for the harness's own backends of
    kind ``backend`` (emulation, portable Triton): judged like any other, but a sign-off that judged
    only those has judged no production kernel and never says SHIP."""
    xfails: tuple[XFail, ...] = field(default_factory=tuple)
    vllm_backend: str | None = None
    """Its member of vLLM's ``Mxfp4MoeBackend`` (e.g. ``TRITON``), if it is one of vLLM's."""
    vllm_needs_biases: bool = False
    """vLLM's GPT-OSS weight conversion for this backend asserts that both biases are there
    (``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``): vLLM never sends it a layer without
    them, so vLLM's own layer of it (``vllm-<id>``) declares no case without biases. The kernel
    itself may take one: the direct adapter is not bound by this. ``vllm-drift`` checks it against
    each release's conversion."""
    device_archs: tuple[str, ...] = ()
    """Where the vendor kernel family loads at all, if wider than ``archs`` (where it takes MXFP4):
    AITER's CK MoE runs on gfx942 but declines the MXFP4 scheme there."""
    tactics: tuple[Tactic, ...] = ()
    """The configurations the kernel may pick besides what it picks by itself for a case
    (``check --tactics all`` runs each); empty where the adapter cannot force one."""

    def __post_init__(self) -> None:
        import re

        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", self.id):
            raise ValueError(f"Declaration.id must be lower-case tokens joined by '-', got {self.id!r}")
        if self.bias_dtype not in BIAS_DTYPES:
            raise ValueError(f"Declaration.bias_dtype must be one of {', '.join(BIAS_DTYPES)}; got {self.bias_dtype!r}")
        bad_dev = [a for a in self.device_archs if a not in ARCHS]
        if bad_dev:
            raise ValueError(
                f"Declaration.device_archs must be a subset of {', '.join(ARCHS)}; got {self.device_archs}"
            )
        for name, values, accepted in (
            ("archs", self.archs, ARCHS),
            ("activations", self.activations, ACTIVATIONS),
            ("routing_methods", self.routing_methods, ROUTING_METHODS),
        ):
            bad = [v for v in values if v not in accepted]
            if bad or not values:
                raise ValueError(
                    f"Declaration.{name} must be a non-empty subset of {', '.join(accepted)}; got {values}"
                )
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"Declaration.quant must be one of {', '.join(QUANT_SCHEMES)}; got {self.quant!r}")
        if self.w13_layout not in LAYOUTS:
            raise ValueError(f"Declaration.w13_layout must be one of {', '.join(LAYOUTS)}; got {self.w13_layout!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Declaration.kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        names = [t.name for t in self.tactics]
        if len(set(names)) != len(names) or "default" in names or "all" in names:
            raise ValueError(f"Declaration.tactics must have distinct names, none 'default' or 'all'; got {names}")


class BackendUnavailable(Exception):
    """Raised by ``load`` when the backend cannot run on this host (missing package, unsupported
    device); the engine turns it into a SKIP with this message."""


class Backend:
    """Base class of every backend. Subclasses set ``declaration`` and implement ``convert`` and
    ``run``; they may narrow ``supports`` and override ``load``."""

    declaration: ClassVar[Declaration]
    storage: ClassVar[tuple[Storage, ...]] = ()
    """The backend's storage steps after row layout and padding (``harness.contract.convert``)."""
    tactic: Tactic | None = None
    """The tactic this instance forces (``with_tactic``); None: the kernel's own pick."""
    converts_per_layer: ClassVar[bool] = False
    """True where ``convert`` reads nothing that a case's tokens decide: only ``inputs.weights``,
    ``inputs.expert_map``, the device and ``inputs.case`` but its ``tokens`` and ``skew``
    (``Case.conversion_key``). A sweep then converts once per layer and reuses the result for the
    layer's other cases, which is most of a vLLM layer's time per test. False (the default) for any
    conversion that reads the activations (static FP8 scales calibrated on ``x``, for instance)."""

    def with_tactic(self, name: str) -> None:
        """Force the declared tactic ``name`` on this instance: its declaration becomes
        ``<id>-tactic-<name>`` of the tactic's architectures, so every verdict names the tactic.
        A ValueError names the declared ones otherwise."""
        d = type(self).declaration
        found = {t.name: t for t in d.tactics}
        if name not in found:
            raise ValueError(f"tactic must be one of {', '.join(found) or '(none declared)'} for {d.id}; got {name!r}")
        t = found[name]
        self.tactic = t
        archs = tuple(a for a in d.archs if a in t.archs) or t.archs
        self.declaration = replace(  # type: ignore[misc]  # an instance's own declaration
            d, id=f"{d.id}-tactic-{name}", archs=archs, description=f"{d.description}; tactic {name}: {t.why}"
        )

    def supports(self, case: Case, arch: str) -> str | None:
        """None if this backend applies to ``case`` on ``arch``, else the reason it does not.
        Pure: decided from the declaration and the case alone."""
        d = self.declaration
        if arch not in d.archs:
            return f"{d.id} does not run on {arch} (declared: {', '.join(d.archs)})"
        if case.activation not in d.activations:
            return f"{d.id} does not implement activation {case.activation}"
        if case.routing not in d.routing_methods:
            return f"{d.id} does not implement routing method {case.routing}"
        if case.bias and not d.bias:
            return f"{d.id} takes no biases"
        if case.ep > 1 and not d.expert_parallel:
            return f"{d.id} does not support expert parallelism"
        if case.routing == "Llama4" and not d.router_weight_on_input:
            return f"{d.id} cannot apply the router weight to the input (Llama4)"
        return None

    def load(self) -> None:
        """Import vendor packages; raise BackendUnavailable (or let ImportError out) if absent."""

    def built_to_fail(self) -> str | None:
        """None for a backend that must PASS wherever it loads. An instrument that exists to be
        caught where it loads (a vendor kernel fed a layout it no longer reads) returns what it must
        show there instead, so that a suite demands that, and never a PASS, of it."""
        return None

    def provenance(self) -> str | None:
        """Which build of the kernel runs: the vendor package's version and where it was loaded
        from, or the project-built subset of a JIT module that runs in its place; None for the
        harness's own backends. Every result records it (``Result.build``) and the sign-off report
        names it per backend, so a verdict is never read as another build's."""
        return None

    def target(self, case: Case) -> Target:
        """What ``case``'s weights convert to for this backend: declared layout, padded sizes,
        bias dtype, storage steps."""
        d = self.declaration
        hidden, intermediate = padded_sizes(case, d.hidden_align, d.intermediate_align)
        return Target(d.w13_layout, hidden, intermediate, d.bias_dtype, self.storage)

    def convert_weights(self, inputs: CaseInputs) -> Converted:
        """``inputs.weights`` in this backend's layout, padding and storage (pure torch, any host)."""
        return convert_weights(inputs.weights, self.target(inputs.case))

    def convert(self, inputs: CaseInputs) -> Any:
        """What ``run`` reads, made once per case: by default ``convert_weights``; backends that
        prepare more (dequantized copies, vendor objects) build it from that. Must not modify
        ``inputs``."""
        return self.convert_weights(inputs)

    def run(self, prepared: Any, inputs: CaseInputs, out: torch.Tensor) -> None:
        """The layer: write [T, H] into ``out`` (allocated by the engine, poisoned with NaN, of the
        declared output dtype). ``inputs.weights`` are the canonical weights; kernels use
        ``prepared``."""
        raise NotImplementedError


class VendorKernel(Backend):
    """A backend whose kernel lives in a vendor package (``package``, installed as ``pip_name``).
    ``load`` imports it (absent: a SKIP naming it) and then ``check_call``, which says whether the
    adapter can call the kernel here."""

    package: ClassVar[str]
    pip_name: ClassVar[str]
    kernel: ClassVar[str]
    """The vendor entry point, as its users know it (for reasons and reports)."""
    empty_batch: ClassVar[str | None] = None
    """Why the adapter does not call its kernel on an empty batch (T = 0), where it does not: such a
    case is then a SKIP saying so, never a PASS of a kernel that did not run."""

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; and no empty batch where the kernel is not called on one (``empty_batch``)."""
        reason = super().supports(case, arch)
        if reason is None and case.tokens == 0 and self.empty_batch:
            return f"{self.declaration.id} does not call {self.kernel} on an empty batch: {self.empty_batch}"
        return reason

    def load(self) -> None:
        """Import the vendor package, then ``check_call``."""
        import importlib

        try:
            importlib.import_module(self.package)
        except ImportError as exc:
            raise BackendUnavailable(
                f"{self.declaration.id} needs the package {self.package!r} (pip: {self.pip_name}): {exc}"
            ) from exc
        self.check_call()

    def provenance(self) -> str | None:
        """The vendor package as imported: its distribution's version and its folder."""
        return package_build(self.package)

    def check_call(self) -> None:
        """Raise BackendUnavailable unless ``run`` can call the kernel on this host: by default,
        unless this host's architecture is declared (adapters add their own checks after it)."""
        require_host_arch(self.declaration.id, self.declaration.archs)

    def run(self, prepared: Any, inputs: CaseInputs, out: torch.Tensor) -> None:
        """Call the vendor kernel (only reached where ``check_call`` passed)."""
        raise NotImplementedError(f"{self.declaration.id}: no kernel adapter")


@functools.cache
def _distribution(top: str) -> str | None:
    """``dist version`` of the installed distribution providing the top-level module ``top``."""
    from importlib import metadata

    try:
        dists = metadata.packages_distributions().get(top, [])
        return f"{dists[0]} {metadata.version(dists[0])}" if dists else None
    except Exception:  # metadata of an odd install: the module's own version stands
        return None


def package_build(package: str) -> str | None:
    """``package`` as this process imported it: ``name version (folder)``, the version from its
    distribution's metadata (or ``__version__``); None if it is not imported."""
    import sys

    mod = sys.modules.get(package)
    if mod is None:
        return None
    version = _distribution(package.split(".")[0]) or getattr(mod, "__version__", None)
    where = os.path.dirname(getattr(mod, "__file__", "") or "") or "?"
    return f"{package} {version or '(no version)'} ({where})"


def require_host_arch(backend_id: str, archs: tuple[str, ...], platform: str = "") -> str:
    """This host's architecture, if it is one of ``archs``; else BackendUnavailable saying which
    it is. ``platform`` (e.g. " (ROCm)") is added after the declared list."""
    from mxmoe.harness.contract.platforms import host_arch

    arch = host_arch()
    if arch not in archs:
        raise BackendUnavailable(f"{backend_id} runs on {', '.join(archs)}{platform}; this host is {arch}")
    return arch
