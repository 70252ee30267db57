"""Project-owned builds of the parts of vendors' JIT modules that the harness's kernels need.

FlashInfer compiles its SM90 CUTLASS MoE (``fused_moe_90``) on first use from ~180 translation
units: every activation x weight type the runner supports, each GEMM tile shape, about an hour
at 16 cores. The harness calls one path of it, MXFP4 weights x bf16 activations
(FLASHINFER_CUTLASS_MXFP4_BF16, the backend of vLLM PR #32564's bug; docs/shipped-bugs.md), which needs about a
tenth of those units. ``flashinfer_sm90`` builds just that subset with FlashInfer's own sources,
flags and ninja generator, into the ignored cache, and makes ``flashinfer.fused_moe`` load it;
nothing of FlashInfer is copied into this repository. What is left out of the module is left
out by construction (the runner is only ever built for bf16 x MXFP4), and the build refuses a
module that would still need a symbol of the parts left out.

FlashInfer's SM90 CUTLASS MoE, bf16 activations x MXFP4 weights only: the subset, its build,
and how ``flashinfer.fused_moe`` is made to load it.

The subset is FlashInfer's own JIT spec for ``fused_moe_90`` (``gen_cutlass_fused_moe_sm90_module``:
its sources, nvcc flags, include paths and generated kernel files), less what the bf16 x MXFP4
runner never reaches:

- the MoE GEMM runners of the other type pairs (``moe_gemm_kernels_<act>_<weight>.cu`` other than
  ``bf16_fp4``), and the generated kernel files that do not instantiate the SM90 mixed-input
  grouped GEMM for ``__nv_bfloat16`` x ``__nv_fp4_e2m1`` (``MIXED_LAUNCHER``): 10 of 154 at 0.6.14;
- FlashInfer's ``cutlass_fused_moe_instantiation.cu``, which instantiates the runner for every type
  pair, replaced by ``INSTANTIATION`` (the one runner, and the bf16 finalize);
- the binding's runner selection, cut to the bf16 x MXFP4 runner by two line edits
  (``BINDING_EDITS``, applied like the mutation patches: each old line exactly once, or an
  error naming it). Any other activation/weight pair is refused by the binding's own check
  ("Could not construct fused moe op ...").

Every other source of the spec (the routing, permutation, finalize and activation kernels, the
DeepSeek block-scale runner every CutlassMoeFCRunner constructs, the heuristics, the logging) is
built as FlashInfer builds it. After linking, the module's undefined dynamic symbols are read
with ``nm``: one from TensorRT-LLM's or CUTLASS's namespaces (a part the subset left out) fails
the build rather than a call at run time.

``build.json`` beside the module records the recipe (a hash of the FlashInfer version, the
sources' names, the edits and the flags), the build time, the module's size and the symbol
check; ``install`` loads the module only where it was built for the installed FlashInfer
release, so a module carried from another machine of the same image is used without
rebuilding, and one of another release never is.

Measured on the H200 (16 cores, nvcc 13.0, FlashInfer 0.6.14): 25 of fused_moe_90's 182 sources
(10 of 154 generated kernel files), 200 s at 16 jobs, a 9.9 MiB module; each generated file
takes 150-200 s alone, so the build is as long as its slowest unit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mxmoe.harness.upstream.patches import Edit, replace_line

SUBSET_NAME = "mxmoe_fused_moe_90_w4a16"
"""The module's name (FlashInfer's full module is ``fused_moe_90``)."""
BINDING = "fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
INSTANTIATION_FILE = "cutlass_fused_moe_instantiation.cu"
KEPT_GEMM = "moe_gemm_kernels_bf16_fp4.cu"
GEMM_PREFIX = "moe_gemm_kernels_"
MIXED_LAUNCHER = "sm90_generic_mixed_moe_gemm_kernelLauncher<__nv_bfloat16, __nv_fp4_e2m1,"
"""What a generated kernel file must instantiate to be kept."""

BINDING_EDITS: tuple[Edit, ...] = (
    Edit(
        BINDING,
        "    if (mActivationDtype == dl_float16 && mWeightDtype == dl_float16) {",
        "#if 0  // mxmoe subset: only the bf16 x MXFP4 runner is built (see below)\n"
        "    if (mActivationDtype == dl_float16 && mWeightDtype == dl_float16) {",
    ),
    Edit(
        BINDING,
        "    if (!mKernelRunner) {",
        "#endif  // mxmoe subset\n"
        "    if (isWFP4A16Quant() && mActivationDtype == dl_bfloat16) {\n"
        "      mInnerDimMultiplier = 2;\n"
        "      mKernelRunner =\n"
        "          std::make_shared<kernels::CutlassMoeFCRunner<__nv_bfloat16, __nv_fp4_e2m1>>();\n"
        "    }\n"
        "    if (!mKernelRunner) {",
    ),
)
"""The runner selection of FusedMoeRunner's constructor, cut to WFP4A16 with bf16 activations."""

INSTANTIATION = """\
// Written by mxmoe's harness/upstream/flashinfer_sm90.py: the one CutlassMoeFCRunner of FlashInfer's
// cutlass_fused_moe_instantiation.cu that the bf16 x MXFP4 path constructs (that file has them all).
#include "cutlass_fused_moe_kernels.cuh"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {
template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp4_e2m1>;
INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);
}  // namespace tensorrt_llm::kernels::cutlass_kernels
"""

LEFT_OUT_NAMESPACES = ("tensorrt_llm::", "cutlass::", "cutlass_kernels")
"""An undefined symbol naming one of these is a part of FlashInfer's module the subset left out."""


class BuildError(RuntimeError):
    """The subset could not be built or would not be complete; the message says which step."""


def build_root() -> Path:
    """``<cache>/flashinfer-jit/<flashinfer version>/``: the edited sources, ninja file, objects,
    the module and its ``build.json``."""
    from flashinfer import __version__

    from mxmoe.harness.upstream.fetch import cache_dir

    return cache_dir() / "flashinfer-jit" / __version__


def module_path(root: Path | None = None) -> Path:
    """Where the built module lies."""
    return (root or build_root()) / SUBSET_NAME / f"{SUBSET_NAME}.so"


@contextmanager
def _in_root(root: Path) -> Iterator[None]:
    """FlashInfer's JIT and generated-source folders pointed into ``root`` while the subset's
    sources are generated and its ninja file written and run (FlashInfer reads them at each call;
    its own modules keep its workspace)."""
    from flashinfer.jit import env as jit_env

    saved = jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR
    jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR = root, root / "generated"
    try:
        yield
    finally:
        jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR = saved


def _spec_class() -> type:
    """FlashInfer's JitSpec, with its folders moved into ``root`` (FlashInfer keeps them in its
    workspace by name; the subset's live in the project's cache)."""
    from flashinfer.jit.core import JitSpec

    @dataclass
    class SubsetSpec(JitSpec):
        root: Path = Path()

        @property
        def build_dir(self) -> Path:
            return self.root / self.name

        @property
        def ninja_path(self) -> Path:
            return self.build_dir / "build.ninja"

        @property
        def jit_library_path(self) -> Path:
            return self.build_dir / f"{self.name}.so"

        @property
        def lock_path(self) -> Path:
            return self.root / f"{self.name}.lock"

        @property
        def aot_path(self) -> Path:
            return self.jit_library_path

        @property
        def is_aot(self) -> bool:
            return False

    return SubsetSpec


@dataclass(frozen=True)
class Subset:
    """What ``subset_spec`` chose: the spec, and the counts a note or a test reads."""

    spec: object
    recipe: str
    full_sources: int
    kept_sources: int
    generated_full: int
    generated_kept: int


def subset_spec(root: Path | None = None) -> Subset:
    """The subset's JitSpec, from FlashInfer's own ``fused_moe_90`` spec (which also writes
    FlashInfer's generated kernel files into its workspace). Needs ``FLASHINFER_CUDA_ARCH_LIST``
    or a GPU only as FlashInfer's spec does."""
    from flashinfer import __version__
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    root = root or build_root()
    with _in_root(root):
        full = gen_cutlass_fused_moe_sm90_module()
    src_dir = root / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    binding_src = jit_env.FLASHINFER_CSRC_DIR / BINDING
    text = binding_src.read_text()
    for edit in BINDING_EDITS:
        text = replace_line(text, edit, f"the fused_moe_90 subset (flashinfer {__version__})")
    binding = src_dir / binding_src.name
    instantiation = src_dir / "mxmoe_cutlass_fused_moe_instantiation.cu"
    for path, content in ((binding, text), (instantiation, INSTANTIATION)):
        if not path.is_file() or path.read_text() != content:  # unchanged sources keep their objects
            path.write_text(content)

    sources: list[Path] = []
    generated_full = generated_kept = 0
    for s in full.sources:
        if s.name == binding_src.name:
            sources.append(binding)
        elif s.name == INSTANTIATION_FILE:
            sources.append(instantiation)
        elif s.name.startswith(GEMM_PREFIX) and s.name != KEPT_GEMM:
            continue
        elif s.name.endswith(".generated.cu"):
            generated_full += 1
            if MIXED_LAUNCHER in s.read_text():
                generated_kept += 1
                sources.append(s)
        else:
            sources.append(s)
    if generated_kept == 0 or binding not in sources or instantiation not in sources:
        raise BuildError(
            f"flashinfer {__version__}'s fused_moe_90 spec no longer has the parts the subset is made of "
            f"({generated_kept} generated files instantiate {MIXED_LAUNCHER}...>; binding kept: {binding in sources}; "
            f"{INSTANTIATION_FILE} replaced: {instantiation in sources})"
        )
    include = [*(full.extra_include_dirs or []), binding_src.parent]  # the copies' "cutlass_fused_moe_kernels.cuh"
    recipe = hashlib.sha256(
        json.dumps(
            {
                "flashinfer": __version__,
                "sources": sorted(s.name for s in sources),
                "edits": [e.new for e in BINDING_EDITS],
                "instantiation": INSTANTIATION,
                "cuda_cflags": [f for f in full.extra_cuda_cflags or [] if not f.startswith("-I")],
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    spec = _spec_class()(
        name=SUBSET_NAME,
        sources=sources,
        extra_cflags=full.extra_cflags,
        extra_cuda_cflags=full.extra_cuda_cflags,
        extra_ldflags=full.extra_ldflags,
        extra_include_dirs=include,
        needs_device_linking=full.needs_device_linking,
        root=root,
    )
    return Subset(spec, recipe, len(full.sources), len(sources), generated_full, generated_kept)


def undefined_left_out(so: Path) -> list[str] | None:
    """The module's undefined dynamic symbols that name a left-out part (demangled); None where
    this host has no ``nm`` to read them."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-D", "-C", "--undefined-only", str(so)], capture_output=True, text=True, check=True)
    return [line.split(None, 1)[-1] for line in out.stdout.splitlines() if any(n in line for n in LEFT_OUT_NAMESPACES)]


def build(jobs: int | None = None, root: Path | None = None) -> dict[str, object]:
    """Build the subset with FlashInfer's ninja generator (``jobs`` parallel compiles; default
    every core) and check it; the ``build.json`` record. Raises BuildError naming the step."""
    from flashinfer import __version__
    from flashinfer.jit.cpp_ext import get_cuda_version, run_ninja

    root = root or build_root()
    t0 = time.monotonic()
    subset = subset_spec(root)
    spec = subset.spec
    prepared = time.monotonic() - t0
    jobs = jobs or os.cpu_count() or 1
    previous = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = str(jobs)
    t1 = time.monotonic()
    try:
        with _in_root(root):
            spec.write_ninja()
            run_ninja(spec.build_dir, spec.ninja_path, verbose=False)
    except RuntimeError as exc:
        tail = str(exc)[-4000:]
        raise BuildError(f"ninja failed building {SUBSET_NAME} in {spec.build_dir}:\n{tail}") from exc
    finally:
        if previous is None:
            os.environ.pop("MAX_JOBS", None)
        else:
            os.environ["MAX_JOBS"] = previous
    seconds = time.monotonic() - t1
    so = spec.jit_library_path
    missing = undefined_left_out(so)
    if missing:
        raise BuildError(
            f"{so} still needs {len(missing)} symbols of the parts the subset leaves out, e.g. "
            + "; ".join(missing[:5])
        )
    record = {
        "module": SUBSET_NAME,
        "flashinfer": __version__,
        "recipe": subset.recipe,
        "cuda": str(get_cuda_version()),
        "jobs": jobs,
        "build_seconds": round(seconds, 1),
        "prepare_seconds": round(prepared, 1),
        "size_bytes": so.stat().st_size,
        "sources": {"full": subset.full_sources, "kept": subset.kept_sources},
        "generated": {"full": subset.generated_full, "kept": subset.generated_kept},
        "left_out_symbols_checked": missing is not None,
    }
    (so.parent / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def built_record(root: Path | None = None) -> dict[str, object] | None:
    """The ``build.json`` of a module built for the installed FlashInfer, or None (none built, or
    built by another FlashInfer release)."""
    from flashinfer import __version__

    so = module_path(root)
    meta = so.parent / "build.json"
    if not so.is_file() or not meta.is_file():
        return None
    record = json.loads(meta.read_text())
    return record if record.get("flashinfer") == __version__ else None


def install(root: Path | None = None) -> dict[str, object] | None:
    """Make ``flashinfer.fused_moe``'s SM90 CUTLASS MoE the built subset (its ``build.json``), or
    return None where none is built for this FlashInfer. FlashInfer asks
    ``gen_cutlass_fused_moe_sm90_module`` for its module; that name is pointed at the subset."""
    record = built_record(root)
    if record is None:
        return None
    import tvm_ffi
    from flashinfer.fused_moe import core

    so = module_path(root)

    class _Built:
        """What FlashInfer calls on its spec: ``build_and_load``."""

        name = SUBSET_NAME

        def build_and_load(self) -> object:
            return tvm_ffi.load_module(str(so))

    core.gen_cutlass_fused_moe_sm90_module = lambda use_fast_build=False: _Built()
    core.get_cutlass_fused_moe_module.cache_clear()
    return record
