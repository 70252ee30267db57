"""Where backends come from: the project's own, installed packages' entry points, and files.

* built-in: the modules of ``kernels/`` and the harness's instruments (``BUILTIN``);
* installed packages: the entry-point group ``mxmoe.backends`` (``name = "pkg.module:Class"``);
* a file written outside the project: ``path/to/file.py:ClassName`` (``--backend-file``).

Loading a backend module must never take a run down: a module that fails to import (the
NameError of vLLM PR #50622's split-out module) becomes a ``BrokenBackend`` whose every case is
an ERROR carrying the import traceback, and the other backends run on.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from mxmoe.harness.contract.backend import Backend, Declaration
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import ARCHS

ENTRY_POINT_GROUP = "mxmoe.backends"

BUILTIN = (
    "mxmoe.kernels.emulation:Emulation",
    "mxmoe.kernels.portable_triton:PortableTriton",
    "mxmoe.kernels.portable_triton:PortableTritonChunked",
    "mxmoe.kernels.flashinfer_trtllm_mxfp4_bf16:FlashInferTrtllmMxfp4Bf16",
    "mxmoe.kernels.flashinfer_trtllm_mxfp4_mxfp8:FlashInferTrtllmMxfp4Mxfp8",
    "mxmoe.kernels.flashinfer_cutlass_mxfp4_bf16:FlashInferCutlassMxfp4Bf16",
    "mxmoe.kernels.flashinfer_cutlass_mxfp4_bf16:FlashInferCutlassMxfp4Bf16OldLayout",
    "mxmoe.kernels.flashinfer_cutlass_mxfp4_mxfp8:FlashInferCutlassMxfp4Mxfp8",
    "mxmoe.kernels.oai_triton:OaiTriton",
    "mxmoe.kernels.oai_triton:OaiTritonModular",
    "mxmoe.kernels.oai_triton:OaiTritonUnpaddedScales",
    "mxmoe.kernels.oai_triton_unfused:OaiTritonUnfused",
    "mxmoe.kernels.marlin:Marlin",
    "mxmoe.kernels.aiter_mxfp4_bf16:AiterMxfp4Bf16",
    "mxmoe.kernels.aiter_mxfp4_bf16:AiterMxfp4Bf16Prefill",
    "mxmoe.kernels.aiter_triton_mxfp4_bf16:AiterTritonMxfp4Bf16",
    "mxmoe.kernels.aiter_mxfp4_fp8:AiterMxfp4Fp8",
    *(f"mxmoe.kernels.vllm_layer:{name}" for name in (
        "VllmTriton", "VllmTritonUnfused", "VllmEmulation", "VllmFlashInferTrtllmMxfp4Bf16",
        "VllmFlashInferTrtllmMxfp4Mxfp8", "VllmFlashInferCutlassMxfp4Bf16", "VllmFlashInferCutlassMxfp4Mxfp8",
        "VllmAiterMxfp4Bf16", "VllmAiterTritonMxfp4Bf16", "VllmAiterMxfp4Fp8",
    )),  # fmt: skip
    "mxmoe.harness.instruments.honest:HonestFp32",
    "mxmoe.harness.instruments.honest:HonestSplitK",
    "mxmoe.harness.instruments.honest:HonestBf16Gemm",
    "mxmoe.harness.instruments.honest:HonestBiasAfter",
    "mxmoe.harness.instruments.honest:HonestBf16Weights",
    "mxmoe.harness.instruments.honest:HonestMxfp8",
    "mxmoe.harness.instruments.honest:Oracle",
)


class BrokenBackend(Backend):
    """Stands in for a backend whose module or class could not be loaded; every case it is asked
    to run is an ERROR with the original traceback."""

    def __init__(self, spec: str, error: str) -> None:
        self.spec = spec
        self.error = error
        name = spec.rsplit(":", 1)[-1].lower()
        ident = "".join(c if c.isalnum() else "-" for c in name).strip("-") or "broken"
        self.declaration = Declaration(id=ident, archs=ARCHS, description=f"failed to load {spec}")

    @property
    def failure(self) -> str:
        """Where and why, in one line: the spec (file or module, and class) and the exception."""
        lines = [line.strip() for line in self.error.strip().splitlines() if line.strip()]
        return f"{self.spec}: {lines[-1] if lines else 'unknown error'}"

    def convert(self, inputs: CaseInputs) -> None:
        """Re-raise the load failure, so that the engine records it as this case's ERROR."""
        raise RuntimeError(f"backend {self.spec} failed to load:\n{self.error}")


def load_failures(loaded: list[Loaded]) -> list[str]:
    """One line per backend that failed to load (``BrokenBackend.failure``): what every front-end
    shows where backends are named, since a broken class has no declared id to be found by."""
    return [f"failed to load {item.backend.failure}" for item in loaded if isinstance(item.backend, BrokenBackend)]


@dataclass(frozen=True)
class Loaded:
    """A backend instance and where it came from (for replay)."""

    backend: Backend
    spec: str


def _instantiate(spec: str, cls: object) -> Backend:
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{spec} is not a subclass of mxmoe.harness.contract.backend.Backend")
    if not isinstance(getattr(cls, "declaration", None), Declaration):
        raise TypeError(f"{spec} has no `declaration` (a mxmoe.harness.contract.backend.Declaration)")
    return cls()


TACTIC_MARK = "#tactic="
"""What a spec carries after the class to force one of its declared tactics:
``kernels.oai_triton:OaiTriton#tactic=bm64`` (``with_tactics``)."""


def load_spec(spec: str) -> Loaded:
    """Load ``module.path:Class`` or ``file.py:Class`` (with ``#tactic=NAME``: that declared tactic
    forced); failures become a BrokenBackend."""
    if TACTIC_MARK in spec:
        base, _, name = spec.partition(TACTIC_MARK)
        loaded = load_spec(base)
        if isinstance(loaded.backend, BrokenBackend):
            return loaded
        try:
            loaded.backend.with_tactic(name)
        except Exception:
            return Loaded(BrokenBackend(spec, traceback.format_exc()), spec)
        return Loaded(loaded.backend, f"{loaded.spec}{TACTIC_MARK}{name}")
    try:
        target, _, cls_name = spec.rpartition(":")
        if not target or not cls_name:
            raise ValueError(f"a backend spec is 'module.path:Class' or 'path/to/file.py:Class', got {spec!r}")
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no backend file {path}")
            mod_name = f"mxmoe_backend_file_{abs(hash(str(path)))}"
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
            spec = f"{path}:{cls_name}"
        else:
            module = importlib.import_module(target)
        return Loaded(_instantiate(spec, getattr(module, cls_name)), spec)
    except Exception:
        return Loaded(BrokenBackend(spec, traceback.format_exc()), spec)


def entry_point_specs() -> list[str]:
    """``module:Class`` of every backend installed packages declare in ENTRY_POINT_GROUP."""
    return [ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]


def discover(backend_files: tuple[str, ...] = ()) -> list[Loaded]:
    """Every available backend: built-in, installed, then files; ids must be unique."""
    loaded = [load_spec(s) for s in (*BUILTIN, *entry_point_specs(), *backend_files)]
    seen: dict[str, str] = {}
    for item in loaded:
        ident = item.backend.declaration.id
        if ident in seen:
            raise ValueError(f"backend id {ident!r} is declared by both {seen[ident]} and {item.spec}")
        seen[ident] = item.spec
    return loaded


def select(loaded: list[Loaded], patterns: tuple[str, ...] = ()) -> list[Loaded]:
    """The backends to run: those matching any of ``patterns`` (shell globs on the id), or, with
    no patterns, every backend of kind ``backend`` plus every file-given one. A pattern matching
    nothing is an error that lists the ids."""
    if not patterns:
        return [
            item for item in loaded if item.backend.declaration.kind == "backend" or not item.spec.startswith("mxmoe.")
        ]
    chosen = []
    for pat in patterns:
        hits = [item for item in loaded if fnmatch.fnmatchcase(item.backend.declaration.id, pat)]
        if not hits:
            ids = ", ".join(i.backend.declaration.id for i in loaded if not isinstance(i.backend, BrokenBackend))
            broken = "".join(f"; {line}" for line in load_failures(loaded))
            raise ValueError(f"--backend {pat!r} matches no backend; available: {ids}{broken}")
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


def with_tactics(loaded: list[Loaded], tactics: str = "default") -> list[Loaded]:
    """``loaded`` with their declared tactics: ``default`` adds none (each kernel picks its own),
    ``all`` adds every declared tactic of each backend after it, and a comma-separated list of
    names adds those (a name no selected backend declares is an error listing the declared ones).
    Each tactic is a backend of its own, ``<id>-tactic-<name>``."""
    if tactics == "default":
        return list(loaded)
    wanted = None if tactics == "all" else [t for t in tactics.split(",") if t]
    declared = {t.name for item in loaded for t in item.backend.declaration.tactics}
    unknown = sorted(set(wanted or ()) - declared)
    if unknown or wanted == []:
        raise ValueError(f"--tactics must be 'default', 'all' or names the selected backends declare "
                         f"({', '.join(sorted(declared)) or 'none'}); got {tactics!r}")  # fmt: skip
    out = []
    for item in loaded:
        out.append(item)
        if TACTIC_MARK in item.spec:
            continue
        for t in item.backend.declaration.tactics:
            if wanted is None or t.name in wanted:
                out.append(load_spec(f"{item.spec}{TACTIC_MARK}{t.name}"))
    return out
