"""Ask vLLM's own MXFP4 MoE oracle (0.26.0, 0.33.0, 0.34.0) what it would do on an architecture this host does not have.

Our declarations (backend lists, ``--moe-backend`` strings, padding, gate/up layouts, auto-selection)
are copied from reading vLLM; this probe lets the harness check them against vLLM's code instead of
against memory. It runs vLLM's Python on a CPU-only host by swapping in a fake platform object, so
what it reports is what vLLM's *Python* decides: gates, priority lists, round-up rules, the row
order the conversion hands to a vendor packer and whether that conversion takes a layer without
biases. It never runs a kernel.

It is meant to run as a subprocess, one architecture per process (vLLM binds ``current_platform``
and ROCm's GCN arch once per process, and the probe patches module globals)::

    PYTHONPATH=<vllm-<version> sources>:<pure-python deps> python -m mxmoe.harness.upstream.vllm_probe --arch sm100

Packages vLLM imports on the oracle's way but never calls there (IMPORT_ONLY_STUBS: 0.33.0's and
0.34.0's structured-output grammar libraries) get a placeholder where they are not installed; the JSON's
``stubbed_imports`` names them.

It prints one JSON object, on one line (callers read the last line), on stdout; everything else
(vLLM's logs, warnings) goes to stderr. Every section is computed on its own: a failure becomes an
``"error: ..."`` string in that section, never a missing JSON. It imports nothing from mxmoe, so a
broken vendor import cannot take the harness down.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import time
import traceback
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

PROBE_ARCHS = ("sm80", "sm90", "sm100", "sm120", "gfx942", "gfx950", "cpu")
"""Architectures the probe can pretend to be."""

CUDA_CAPS = {"sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}
FLASHINFER_ARCHS = ("sm90", "sm100", "sm120")
"""Where a vLLM install can have FlashInfer's MoE kernels, so the probe pretends it does."""
AITER_ARCHS = ("gfx942", "gfx950")
"""Where a vLLM install can have AITER, so the probe pretends it is installed and enabled."""

ROUND_UP_SHAPES = (
    (2880, 2880),
    (2880, 1440),
    (2880, 720),
    (2880, 360),
    (2880, 180),
    (64, 64),
    (96, 160),
    (128, 96),
    (7168, 2048),
    (7168, 256),
)
"""(hidden, intermediate per partition): gpt-oss at TP 1..16, tiny shapes that straddle every
alignment vLLM uses (32, 64, 128, 256), and DeepSeek-like shapes."""

ACTIVATION_KEYS = {"none": None, "mxfp8": "kMxfp8Dynamic", "fp8": "kFp8StaticTensorSym"}
"""Selection columns: the activation key handed to select_mxfp4_moe_backend, by quant_utils name."""

ORACLE = "vllm.model_executor.layers.fused_moe.oracle.mxfp4"
EXPERTS = "vllm.model_executor.layers.fused_moe.experts"
QUANT = "vllm.model_executor.layers.quantization"

# Modules the w13 layout probe touches lazily inside vLLM's conversion. They are imported while
# the real (Unspecified) platform is current, because some of them run CUDA-only probes at import
# under a CUDA platform (w8a8_utils queries torch.ops._C, quantization.mxfp4 loads vllm_flash_attn).
EXTRA_IMPORTS: tuple[str | tuple[str, ...], ...] = (
    f"{QUANT}.mxfp4",
    f"{QUANT}.utils.mxfp4_utils",
    f"{QUANT}.utils.marlin_utils_fp4",
    (f"{QUANT}.utils.humming_utils", f"{QUANT}.utils.humming"),  # 0.26.0, 0.33.0 and 0.34.0
    f"{EXPERTS}.cpu_moe",
    "vllm._aiter_ops",
    "vllm.utils.flashinfer",
    "vllm.utils.import_utils",
    "vllm.utils.deep_gemm",
    "vllm.config.kernel",
)
"""(A tuple is one module under the names it had in different releases: the first that exists is taken.)"""

LAYOUT_E, LAYOUT_I, LAYOUT_H = 2, 32, 64
"""Probe checkpoint for the w13 layout: 2I = 64 rows (each row's bytes hold its own index, so
they fit a uint8), H/2 = 32 bytes and H/32 = 2 scale groups, so that every axis size differs and
the row axis can be found again after any transpose."""


def _error(exc: BaseException, limit: int = 300) -> str:
    """One line for the JSON: the type tells a gate's ValueError from a missing module."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return "error: " + text[:limit]


def _log(msg: str) -> None:
    print(f"[vllm_probe] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM logs to stdout by default and C extensions may print too; the JSON must be alone there.

    Diverts both ``sys.stdout`` and file descriptor 1 to stderr for the duration, then restores them.
    """
    sys.stdout.flush()
    saved_stdout = sys.stdout
    saved_fd = None
    with contextlib.suppress(OSError, ValueError):
        saved_fd = os.dup(1)
        os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stdout = saved_stdout
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def _set_environment(arch: str) -> None:
    """Environment vLLM reads at import time, set before the first ``import vllm``.

    AITER's switches are class attributes read once at import, so VLLM_ROCM_USE_AITER must be set
    before; the probe also sets the attributes afterwards (``_pretend_vendors``) in case vLLM was
    imported already.
    """
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_ROCM_USE_AITER"] = "1" if arch in AITER_ARCHS else "0"
    os.environ["VLLM_ROCM_USE_AITER_MOE"] = "1"
    os.environ.setdefault("VLLM_BATCH_INVARIANT", "0")


IMPORT_ONLY_STUBS = {
    "xgrammar": (
        "structured outputs' grammar library (native): vLLM 0.33.0 and 0.34.0 import it at module level on the "
        "oracle's import path (fused_moe -> _aiter_ops -> ... -> v1.request -> v1.structured_output -> "
        "parser.abstract_parser); the oracle never calls it"
    ),
    "llguidance": (
        "structured outputs' other grammar library (native): 0.33.0's and 0.34.0's "
        "v1/structured_output/backend_guidance.py reads llguidance.LLMatcher in a dataclass annotation at import, "
        "on the same path"
    ),
}
"""Packages vLLM imports on the oracle's way but never calls there: where one is not installed, its
import gets a placeholder package (every attribute a placeholder class) instead of failing."""


def placeholder_module(name: str) -> types.ModuleType:
    """A package whose every public attribute is a placeholder class (usable in annotations, ``X | None``,
    base classes and calls), and whose submodules are placeholders too."""
    mod = _stub_module(name)
    mod.__path__ = []
    made: dict[str, type] = {}

    def __getattr__(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in made:
            made[attr] = type(attr, (), {"__module__": name, "__init__": lambda self, *a, **k: None})
        return made[attr]

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return mod


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: imports of ROOTS (and their submodules) that no real finder found."""

    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return placeholder_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _stub_missing_imports() -> list[str]:
    """Install placeholders for the IMPORT_ONLY_STUBS this host lacks; the names stubbed."""
    missing = sorted(name for name in IMPORT_ONLY_STUBS if importlib.util.find_spec(name) is None)
    if missing:
        sys.meta_path.append(_PlaceholderFinder(frozenset(missing)))
        _log(f"placeholders for {', '.join(missing)} (imported on the oracle's path, never called)")
    return missing


def _module_exists(name: str) -> bool:
    """Whether NAME can be found (its parent packages are imported to look; a broken parent counts as no)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _import_oracle() -> types.ModuleType:
    """Import the oracle and every module it may reach, under the platform vLLM detected itself.

    The kernel classes are imported here for the same reason as EXTRA_IMPORTS: importing them
    later, under a fake CUDA or ROCm platform, runs device-only code at import.
    """
    ox = importlib.import_module(ORACLE)
    for entry in EXTRA_IMPORTS:
        names = (entry,) if isinstance(entry, str) else entry
        present = [n for n in names if _module_exists(n)]
        if not present:
            _log(f"pre-import: none of {', '.join(names)} exists in this vLLM")
            continue
        try:
            importlib.import_module(present[0])
        except Exception as exc:  # the section that needs it reports it
            _log(f"pre-import {present[0]}: {_error(exc)}")
    for backend in ox.Mxfp4MoeBackend:
        if backend is ox.Mxfp4MoeBackend.NONE:
            continue
        try:
            ox.backend_to_kernel_cls(backend)
        except Exception as exc:
            _log(f"pre-import kernel classes of {backend.name}: {_error(exc)}")
    return ox


def _make_platform(arch: str) -> Any:
    """A vLLM platform object that answers as ARCH would, without touching a device."""
    if arch in CUDA_CAPS:
        # vllm/platforms/cuda.py imports the compiled extension unconditionally.
        sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
        from vllm.platforms.cuda import CudaPlatformBase
        from vllm.platforms.interface import DeviceCapability

        cap = CUDA_CAPS[arch]

        class FakeCudaPlatform(CudaPlatformBase):
            @classmethod
            def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
                return DeviceCapability(*cap)

            @classmethod
            def get_device_name(cls, device_id: int = 0) -> str:
                return f"fake-{arch}"

        return FakeCudaPlatform()
    if arch.startswith("gfx"):
        import torch

        # rocm.py fixes _GCN_ARCH at import: amdsmi (absent) first, then torch.cuda's properties.
        torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(gcnArchName=arch, name=arch)
        rocm = importlib.import_module("vllm.platforms.rocm")
        if arch not in getattr(rocm, "_GCN_ARCH", ""):
            raise RuntimeError(f"vllm.platforms.rocm was imported before the fake arch was set: {rocm._GCN_ARCH!r}")

        class FakeRocmPlatform(rocm.RocmPlatform):
            @classmethod
            def get_device_name(cls, device_id: int = 0) -> str:  # the real one asks amdsmi
                return f"fake-{arch}"

        return FakeRocmPlatform()
    if arch == "cpu":
        from vllm.platforms.cpu import CpuPlatform

        return CpuPlatform()
    raise ValueError(f"unknown arch {arch!r}")


def _install_platform(arch: str) -> int:
    """Make ARCH's platform current everywhere; returns how many module bindings were re-pointed.

    Assigning ``vllm.platforms.current_platform`` would not reach its module ``__getattr__`` hook,
    so the private slot is set, and every module that did ``from vllm.platforms import
    current_platform`` gets the new object too.
    """
    import vllm.platforms as platforms

    old = platforms.current_platform
    new = _make_platform(arch)
    platforms._current_platform = new
    count = 0
    for mod in list(sys.modules.values()):
        with contextlib.suppress(Exception):
            if getattr(mod, "current_platform", None) is old:
                mod.current_platform = new
                count += 1
    return count


def _rebind(match: Callable[[str], bool], value: bool) -> int:
    """Replace vLLM's availability checks wherever a module bound them by name.

    vLLM's gates call ``has_flashinfer()`` and friends through names imported into each module,
    so patching the defining module alone would not reach them.
    """
    answer = (lambda *a, **k: True) if value else (lambda *a, **k: False)
    count = 0
    for name, mod in list(sys.modules.items()):
        if not (name == "vllm" or name.startswith("vllm.")) or mod is None:
            continue
        for attr in [a for a in vars(mod) if match(a)]:
            if callable(getattr(mod, attr)):
                setattr(mod, attr, answer)
                count += 1
    return count


def _pretend_vendors(arch: str) -> dict[str, int]:
    """Vendor libraries as a real install for ARCH could have them, not as this host has them.

    FlashInfer on sm90/sm100/sm120, AITER installed and enabled (VLLM_ROCM_USE_AITER=1) on
    gfx942/gfx950, DeepGEMM nowhere, triton_kernels wherever vLLM can run it (triton is a
    dependency of every CUDA/ROCm vLLM install, but may be missing on this host), and AMD's Quark
    (``amd-quark``, optional, not a vLLM dependency) everywhere: since 0.33.0 the EMULATION
    backend refuses to run without it (``has_quark()`` in its ``is_supported_config``), and the
    project's emulation backend stands for an install that can emulate.
    """
    counts = {
        "has_flashinfer": _rebind(lambda a: a.startswith("has_flashinfer"), arch in FLASHINFER_ARCHS),
        "deep_gemm": _rebind(lambda a: a in ("has_deep_gemm", "is_deep_gemm_supported"), False),
        "has_quark": _rebind(lambda a: a == "has_quark", True),
    }
    if arch != "cpu":
        counts["has_triton_kernels"] = _rebind(lambda a: a == "has_triton_kernels", True)
    aiter_ops = importlib.import_module("vllm._aiter_ops")
    on = arch in AITER_ARCHS
    aiter_ops.IS_AITER_FOUND = on
    aiter_ops.rocm_aiter_ops._AITER_ENABLED = on
    aiter_ops.rocm_aiter_ops._FMOE_ENABLED = True
    return counts


# ----------------------------------------------------------------------------------------------
# Sections. Each takes the oracle module and returns plain JSON data; probe() isolates failures.


def _backends(ox: types.ModuleType) -> list[str]:
    return [b.name for b in ox.Mxfp4MoeBackend]


def _probe_members(ox: types.ModuleType) -> list[Any]:
    """Members that name a kernel; NONE is the oracle's "nothing chosen" sentinel."""
    return [b for b in ox.Mxfp4MoeBackend if b is not ox.Mxfp4MoeBackend.NONE]


def _string_constants(code: types.CodeType) -> Iterator[str]:
    for const in code.co_consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, tuple):
            yield from (c for c in const if isinstance(c, str))
        elif isinstance(const, types.CodeType):
            yield from _string_constants(const)


def _candidate_strings(ox: types.ModuleType) -> list[str]:
    """Every string map_mxfp4_backend might accept, taken from vLLM: the MoEBackend Literal it is
    typed with, the list its own error message offers, and the string constants of its code."""
    seen: dict[str, None] = {}
    try:
        ox.map_mxfp4_backend("\x00not-a-backend")
    except ValueError as exc:
        found = re.search(r"Expected one of (\[.*?\])", str(exc))
        if found:
            for s in ast.literal_eval(found.group(1)):
                seen.setdefault(str(s), None)
    kernel = importlib.import_module("vllm.config.kernel")
    for s in typing.get_args(kernel.MoEBackend):
        seen.setdefault(s, None)
    for s in _string_constants(ox.map_mxfp4_backend.__code__):
        if re.fullmatch(r"[a-z0-9_]+", s):
            seen.setdefault(s, None)
    return list(seen)


def _moe_backend_strings(ox: types.ModuleType) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in _candidate_strings(ox):
        try:
            out[s] = [b.name for b in ox.map_mxfp4_backend(s)]
        except ValueError:
            continue
    return out


def _rejected_strings(strings: list[str]) -> list[str] | None:
    """Strings the oracle maps but KernelConfig's validation (hence the CLI) refuses.

    None when the answer cannot be told apart from an unrelated failure.
    """
    kernel = importlib.import_module("vllm.config.kernel")
    rejected = []
    for s in strings:
        try:
            kernel.KernelConfig(moe_backend=s)
        except Exception as exc:
            if type(exc).__name__ != "ValidationError":
                _log(f"KernelConfig(moe_backend={s!r}) failed for another reason: {_error(exc)}")
                return None
            rejected.append(s)
    return rejected


def _gpt_oss_priority(ox: types.ModuleType) -> list[str]:
    return [b.name for b in ox._get_priority_backends_for_gpt_oss()]


def _round_up(ox: types.ModuleType) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for backend in _probe_members(ox):
        row: dict[str, Any] = {}
        for h, i in ROUND_UP_SHAPES:
            try:
                row[f"{h}x{i}"] = list(ox.mxfp4_round_up_hidden_size_and_intermediate_size(backend, h, i))
            except Exception as exc:
                row[f"{h}x{i}"] = _error(exc)
        out[backend.name] = row
    return out


def _gpt_oss_config(moe_backend: str) -> Any:
    """A gpt-oss-120b-like layer: what the selection is asked about in production."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=128,
        experts_per_token=4,
        hidden_dim=2880,
        intermediate_size=2880,
        num_local_experts=128,
        num_logical_experts=128,
        activation=MoEActivation.SWIGLUOAI,
        device="cpu",
        routing_method=RoutingMethodType.RenormalizeNaive,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        has_bias=True,
        moe_backend=moe_backend,
    )


def _selection(ox: types.ModuleType, strings: list[str]) -> dict[str, dict[str, str]]:
    quant_utils = importlib.import_module(f"{QUANT}.utils.quant_utils")
    out: dict[str, dict[str, str]] = {}
    for s in ["auto", *[s for s in strings if s != "auto"]]:
        row: dict[str, str] = {}
        for column, key_name in ACTIVATION_KEYS.items():
            try:
                key = None if key_name is None else getattr(quant_utils, key_name)
                backend, _cls = ox.select_mxfp4_moe_backend(_gpt_oss_config(s), key)
                row[column] = backend.name
            except Exception as exc:
                row[column] = _error(exc)
        out[s] = row
    return out


def _kernel_classes(ox: types.ModuleType) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend in _probe_members(ox):
        try:
            out[backend.name] = [cls.__name__ for cls in ox.backend_to_kernel_cls(backend)]
        except Exception as exc:
            out[backend.name] = _error(exc)
    return out


def _supports(ox: types.ModuleType) -> dict[str, Any]:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType

    weight_key = importlib.import_module(f"{QUANT}.utils.quant_utils").kMxfp4Static
    out: dict[str, Any] = {}
    for backend in _probe_members(ox):
        entry: dict[str, Any] = {}
        try:
            classes = ox.backend_to_kernel_cls(backend)
        except Exception as exc:
            out[backend.name] = _error(exc)
            continue
        try:
            entry["activations"] = [
                act.name for act in MoEActivation if any(cls._supports_activation(act) for cls in classes)
            ]
        except Exception as exc:
            entry["activations"] = _error(exc)
        try:  # the backend serves a routing method if any of its kernel classes takes it (vLLM tries each)
            entry["routing_methods"] = [
                rm.name
                for rm in RoutingMethodType
                if any(cls._supports_routing_method(rm, weight_key, None) for cls in classes)
            ]
            entry["routing_methods_preferred_class"] = [
                rm.name for rm in RoutingMethodType if classes[0]._supports_routing_method(rm, weight_key, None)
            ]
        except Exception as exc:
            entry["routing_methods"] = _error(exc)
        out[backend.name] = entry
    return out


def _routing_method_names(ox: types.ModuleType) -> list[str]:
    """Every member name of vLLM's RoutingMethodType (what a declaration's methods are compared on)."""
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType

    return [rm.name for rm in RoutingMethodType]


# ----------------------------------------------------------------------------------------------
# w13 layout: run vLLM's gpt-oss conversion on a checkpoint whose rows carry their own index, with
# every vendor packer replaced by the identity, and read back which row went where.

LAYOUT_PATTERNS: dict[str, Callable[[int], list[int]]] = {
    "interleaved": lambda n: list(range(n)),
    "chunked_gate_up": lambda n: list(range(0, n, 2)) + list(range(1, n, 2)),
    "chunked_up_gate": lambda n: list(range(1, n, 2)) + list(range(0, n, 2)),
    "pair_swapped": lambda n: [r ^ 1 for r in range(n)],
}
"""Source rows are gpt-oss interleaved: row 2j is gate j, row 2j+1 is up j."""

LAYOUT_NEEDS_VENDOR = {
    "HUMMING": "its conversion is done by the humming library (CUDA), which vLLM calls as a whole",
}


def _identity(x: Any, *args: Any, **kwargs: Any) -> Any:
    return x


def _triton_tensor(t: Any) -> Any:
    """What triton_kernels' swizzle returns, as far as vLLM's conversion reads it: the data at
    ``.storage.data`` (0.34.0's ``store_params_in_triton`` moves it into the layer's parameter and
    back; earlier releases only hand the object on)."""
    return types.SimpleNamespace(storage=types.SimpleNamespace(data=t))


def _stub_module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    # importlib.util.find_spec() on a module in sys.modules reads its __spec__.
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]], modules: dict[str, types.ModuleType]) -> Iterator[None]:
    """Apply attribute patches and sys.modules stubs, and undo both, so later code sees vLLM as it was."""
    missing = object()
    saved_attrs = [(obj, name, obj.__dict__.get(name, missing)) for obj, name, _ in patches]
    saved_mods = {name: sys.modules.get(name, missing) for name in modules}
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        sys.modules.update(modules)
        yield
    finally:
        for obj, name, value in reversed(saved_attrs):
            if value is missing:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, value)
        for name, mod in saved_mods.items():
            if mod is missing:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def _layout_stubs(ox: types.ModuleType) -> tuple[list[tuple[Any, str, Any]], dict[str, types.ModuleType]]:
    """Identity stand-ins for every vendor shuffle, swizzle and packer the gpt-oss conversion calls.

    They keep each tensor's row order, so what is left is exactly vLLM's own reordering of w13.
    """
    import torch

    modules = {
        "flashinfer": _stub_module("flashinfer", block_scale_interleave=_identity),
        "flashinfer.fp4_quantization": _stub_module(
            "flashinfer.fp4_quantization", nvfp4_block_scale_interleave=_identity
        ),
        "flashinfer.fused_moe": _stub_module(
            "flashinfer.fused_moe",
            interleave_moe_weights_for_sm90_mixed_gemm=_identity,
            interleave_moe_scales_for_sm90_mixed_gemm=_identity,
        ),
        "flashinfer.fused_moe.core": _stub_module(
            "flashinfer.fused_moe.core",
            get_w2_permute_indices_with_cache=lambda cache, x, *a, **k: torch.arange(x.shape[0]),
        ),
        "aiter": _stub_module("aiter"),
        "aiter.utility": _stub_module("aiter.utility"),
        "aiter.utility.fp4_utils": _stub_module("aiter.utility.fp4_utils", e8m0_shuffle=_identity),
        # 0.33.0: AITER_TRITON_MXFP4_MXFP4's scale pre-shuffle for moe_gemm_a4w4.
        "aiter.ops": _stub_module("aiter.ops"),
        "aiter.ops.triton": _stub_module("aiter.ops.triton"),
        "aiter.ops.triton.utils": _stub_module("aiter.ops.triton.utils"),
        "aiter.ops.triton.utils.shuffle": _stub_module("aiter.ops.triton.utils.shuffle", shuffle_scale_moe=_identity),
    }
    try:
        importlib.import_module("triton_kernels.matmul_ogs")
        in_flex = importlib.import_module("triton_kernels.numerics").InFlexData
    except Exception:  # no triton on this host: the containers are all the conversion needs
        in_flex = types.SimpleNamespace
        ns = types.SimpleNamespace
        modules["triton_kernels"] = _stub_module("triton_kernels")
        modules["triton_kernels.matmul_ogs"] = _stub_module("triton_kernels.matmul_ogs", FlexCtx=ns, PrecisionConfig=ns)
        modules["triton_kernels.numerics"] = _stub_module("triton_kernels.numerics", InFlexData=ns)

    aiter_ops = importlib.import_module("vllm._aiter_ops").rocm_aiter_ops
    marlin = importlib.import_module(f"{QUANT}.utils.marlin_utils_fp4")
    cpu_moe = importlib.import_module(f"{EXPERTS}.cpu_moe")
    patches: list[tuple[Any, str, Any]] = [
        (ox, "_swizzle_mxfp4", lambda w, s, *a, **k: (_triton_tensor(w), in_flex(), _triton_tensor(s))),
        (ox, "_pack_deepgemm_mxfp4_scales", lambda w13, w2, s13, s2: (s13, s2)),
        (aiter_ops, "shuffle_weight_a16w4", staticmethod(_identity)),
        (aiter_ops, "shuffle_scale_a16w4", staticmethod(_identity)),
        (aiter_ops, "shuffle_weights", staticmethod(lambda *ws, **k: tuple(ws))),
        (marlin, "_repack_marlin_experts", _identity),
        (marlin, "marlin_permute_scales", lambda s, *a, **k: s),
        (marlin, "mxfp4_marlin_process_scales", _identity),
        (marlin, "marlin_permute_bias", _identity),
        (cpu_moe, "prepare_mxfp4_moe_layer_for_cpu", lambda w13, w2, s13, s2: (w13, w2, s13, s2)),
    ]
    for obj, name, _ in patches:  # a renamed packer would run for real: its backend's layout then says why
        if not hasattr(obj, name):
            _log(f"w13 layout: {getattr(obj, '__name__', type(obj).__name__)}.{name} is not in this vLLM")
    return patches, modules


def _layout_layer() -> Any:
    """A minimal layer holding a gpt-oss checkpoint whose w13 rows, scales and biases encode their row."""
    import torch

    e, i, h = LAYOUT_E, LAYOUT_I, LAYOUT_H
    rows = torch.arange(2 * i, dtype=torch.uint8)

    def param(t: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(t.contiguous(), requires_grad=False)

    layer = torch.nn.Module()
    layer.w13_weight = param(rows.view(1, -1, 1).expand(e, 2 * i, h // 2))
    layer.w13_weight_scale = param((rows + 100).view(1, -1, 1).expand(e, 2 * i, h // 32))  # E8M0 2^-27..2^36
    layer.w2_weight = param(torch.zeros(e, h, i // 2, dtype=torch.uint8))
    layer.w2_weight_scale = param(torch.full((e, h, i // 32), 127, dtype=torch.uint8))
    layer.w13_bias = param(torch.arange(2 * i, dtype=torch.bfloat16).view(1, -1).expand(e, -1))
    layer.w2_bias = param(torch.zeros(e, h, dtype=torch.bfloat16))
    layer.w13_input_scale = param(torch.ones(e, dtype=torch.float32))
    layer.w2_input_scale = param(torch.ones(e, dtype=torch.float32))
    layer.params_dtype = torch.bfloat16
    # What vLLM's RoutedExperts carries for gpt-oss; 0.33.0's conversion reads it (AITER_TRITON_MXFP4_MXFP4).
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    layer.activation = MoEActivation.SWIGLUOAI
    return layer


def _row_sequence(t: Any, kind: str) -> list[int] | str:
    """The source row index found at each output row, or why it cannot be read."""
    import torch

    if kind == "scale" and hasattr(t, "weight_scale"):  # a triton_kernels PrecisionConfig
        t = t.weight_scale
    if isinstance(getattr(t, "storage", None), types.SimpleNamespace):  # _triton_tensor's
        t = t.storage.data
    if not isinstance(t, torch.Tensor):
        return f"{kind} is a {type(t).__name__}"
    n = 2 * LAYOUT_I
    axes = [d for d, size in enumerate(t.shape) if size == n]
    flat = [d for d, size in enumerate(t.shape) if size == LAYOUT_E * n]
    if not axes and len(flat) == 1:  # a packer that takes the experts flattened into rows ([E*2I, K])
        t = t.unflatten(flat[0], (LAYOUT_E, n))
        axes = [flat[0] + 1]
    if len(axes) != 1:
        return f"{kind} shape {tuple(t.shape)} has no single axis of {n} rows"
    t = t.detach()
    if t.element_size() == 1:
        values = t.view(torch.uint8).to(torch.int64)
        if kind == "scale":
            values = values - 100
    elif kind == "scale":  # converted from E8M0 to a float dtype
        values = torch.log2(t.float()).round().to(torch.int64) + 127 - 100
    else:
        values = t.float().round().to(torch.int64)
    per_row = values.movedim(axes[0], -1).reshape(-1, n)
    if not bool((per_row == per_row[:1]).all()):
        return f"{kind} rows are not constant across experts and columns"
    return [int(v) for v in per_row[0].tolist()]


def _classify(seq: list[int] | str) -> str:
    if isinstance(seq, str):
        return "unknown: " + seq
    for name, pattern in LAYOUT_PATTERNS.items():
        if seq == pattern(len(seq)):
            return name
    return f"unknown: row order starts {seq[:8]}"


def _convert(ox: types.ModuleType, backend: Any, layer: Any) -> tuple[Any, ...]:
    """vLLM's GPT-OSS weight conversion of ``layer`` for ``backend`` (the vendor packers stubbed)."""
    return ox.convert_gpt_oss_weight_to_mxfp4_moe_kernel_format(
        backend,
        layer,
        layer.w13_weight,
        layer.w2_weight,
        layer.w13_weight_scale,
        layer.w2_weight_scale,
        layer.w13_bias,
        layer.w2_bias,
        _cache_permute_indices={},
    )


def _w13_layout_one(ox: types.ModuleType, backend: Any) -> str:
    layer = _layout_layer()
    try:
        w13, _w2, s13, _s2, b13, _b2 = _convert(ox, backend, layer)
    except Exception as exc:
        return "unknown: conversion raised " + _error(exc)[len("error: ") :]
    weights = _classify(_row_sequence(w13, "weight"))
    if weights.startswith("unknown"):
        return weights
    # Scales and biases must follow their rows; a disagreement is a finding, not a detail.
    others = {kind: _classify(_row_sequence(t, kind)) for kind, t in (("scale", s13), ("bias", b13)) if t is not None}
    disagree = {k: v for k, v in others.items() if v != weights and not v.startswith("unknown: scale is a")}
    if disagree:
        return f"unknown: weight rows are {weights} but " + ", ".join(f"{k} rows are {v}" for k, v in disagree.items())
    return weights


def _each_converted(ox: types.ModuleType, one: Callable[[types.ModuleType, Any], str]) -> dict[str, str]:
    """``one(ox, backend)`` for every backend, with the vendor packers stubbed (``_layout_stubs``);
    a backend whose conversion needs its vendor (``LAYOUT_NEEDS_VENDOR``) is "unknown: not run on
    CPU: ...", and a probe that raised is that backend's "unknown: probe failed: ..."."""
    patches, modules = _layout_stubs(ox)
    out: dict[str, str] = {}
    with _patched(patches, modules):
        for backend in _probe_members(ox):
            if backend.name in LAYOUT_NEEDS_VENDOR:
                out[backend.name] = "unknown: not run on CPU: " + LAYOUT_NEEDS_VENDOR[backend.name]
                continue
            try:
                out[backend.name] = one(ox, backend)
            except Exception as exc:
                out[backend.name] = "unknown: probe failed: " + _error(exc)[len("error: ") :]
    return out


def _needs_biases_one(ox: types.ModuleType, backend: Any) -> str:
    """Whether vLLM's conversion takes a GPT-OSS layer without biases for ``backend``: "required"
    where it stops at an assertion on them, "optional" where it converts, "unknown: ..." where it
    raised anything else (a conversion that needs a vendor library on CPU, say)."""
    layer = _layout_layer()
    layer.w13_bias = None  # a layer without biases, as the model config's has_bias=False makes it
    layer.w2_bias = None
    try:
        _convert(ox, backend, layer)
    except AssertionError as exc:
        line = traceback.extract_tb(exc.__traceback__)[-1].line or ""
        return "required" if "bias" in line else f"unknown: conversion asserted `{line}`"
    except Exception as exc:
        return "unknown: conversion raised " + _error(exc)[len("error: ") :]
    return "optional"


# ----------------------------------------------------------------------------------------------


def _vllm_version() -> str:
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if version and version != "dev":
            return str(version)
    except Exception as exc:
        _log(f"import vllm: {_error(exc)}")
    from importlib import metadata

    return metadata.version("vllm")


def probe(arch: str) -> dict[str, Any]:
    """Everything the harness compares against, for one architecture, as JSON-ready data.

    Patches vLLM's module globals for good: call it once per process.
    """
    if arch not in PROBE_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(PROBE_ARCHS)}; got {arch!r}")
    t0 = time.monotonic()
    _set_environment(arch)
    result: dict[str, Any] = {"vllm_version": None, "arch": arch}

    def section(key: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        try:
            result[key] = fn()
        except Exception as exc:
            result[key] = _error(exc)
        _log(f"{key}: {time.monotonic() - t:.2f}s")
        return result[key]

    stubbed = _stub_missing_imports()
    section("vllm_version", _vllm_version)
    ox: types.ModuleType | None = None
    setup_error: str | None = None
    try:
        ox = _import_oracle()
        _log(f"oracle imported in {time.monotonic() - t0:.1f}s")
        swept = _install_platform(arch)
        vendors = _pretend_vendors(arch)
        # Standalone there is no VllmConfig to read quantization_config.moe.activation from.
        ox._user_moe_activation_override = lambda: None
        _log(f"platform {arch}: {swept} bindings re-pointed; vendor checks rebound {vendors}")
    except Exception as exc:
        setup_error = _error(exc)[len("error: ") :]
        _log(f"setup failed: {setup_error}")

    def oracle() -> types.ModuleType:
        if ox is None or setup_error is not None:
            raise RuntimeError(f"oracle set-up failed: {setup_error}")
        return ox

    section("backends", lambda: _backends(oracle()))
    strings = section("moe_backend_strings", lambda: _moe_backend_strings(oracle()))
    if isinstance(strings, dict):
        try:
            rejected = _rejected_strings(list(strings))
        except Exception as exc:
            _log(f"rejected_moe_backend_strings: {_error(exc)}")
            rejected = None
        if rejected is not None:
            result["rejected_moe_backend_strings"] = rejected
    section("gpt_oss_priority", lambda: _gpt_oss_priority(oracle()))
    section("round_up", lambda: _round_up(oracle()))
    section("selection", lambda: _selection(oracle(), list(strings) if isinstance(strings, dict) else []))
    section("kernel_classes", lambda: _kernel_classes(oracle()))
    section("supports", lambda: _supports(oracle()))
    section("routing_method_names", lambda: _routing_method_names(oracle()))
    section("w13_layout", lambda: _each_converted(oracle(), _w13_layout_one))
    section("needs_biases", lambda: _each_converted(oracle(), _needs_biases_one))
    result["stubbed_imports"] = [name for name in stubbed if name in sys.modules]  # those vLLM did import
    _log(f"{arch} done in {time.monotonic() - t0:.1f}s")
    return result


def main(argv: list[str] | None = None) -> int:
    """Print the probe's JSON for ``--arch`` on stdout; 0 whenever the JSON was written."""
    parser = argparse.ArgumentParser(
        prog="python -m mxmoe.harness.upstream.vllm_probe",
        description="Report what vLLM's MXFP4 MoE oracle decides for one architecture, as JSON.",
    )
    parser.add_argument(
        "--arch",
        required=True,
        choices=PROBE_ARCHS,
        help=f"architecture to pretend to be: one of {', '.join(PROBE_ARCHS)}",
    )
    args = parser.parse_args(argv)
    with _stdout_to_stderr():
        result = probe(args.arch)
    # One line: callers read the last line of stdout.
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
