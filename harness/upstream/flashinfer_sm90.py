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
  grouped GEMM for bf16 x MXFP4 (``Generation.launcher``): 10 of 154 at 0.6.14;
- FlashInfer's ``cutlass_fused_moe_instantiation.cu``, which instantiates the runner for every type
  pair, replaced by ``instantiation`` (the one runner, and the bf16 finalize);
- the binding's runner selection, cut to the bf16 x MXFP4 runner by two line edits
  (``binding_edits``, applied like the mutation patches: each old line exactly once, or an
  error naming it). Any other activation/weight pair is refused by the binding's own check
  ("Could not construct fused moe op ...").

How a release spells that path is its ``Generation``: 0.6.14 names MXFP4 ``__nv_fp4_e2m1``
everywhere; 0.7.x names it ``Fp4Type`` in the runner (``cutlass::float_e2m1_t`` on the Hopper TMA
path) and ``SafeFP4`` in the generated kernel files, and generates 220 kernel files, not 154. The
list of FlashInfer's own sources is the same in 0.6.14, 0.7.2.post1 and 0.7.4. The generation is
read from the release's sources (the runner its binding constructs, the launchers its generator
writes); a release that matches none is refused, and the refusal is recorded beside its build
folder (``FAILED``) so that the FlashInfer backends' SKIP names the release and the reason.

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

0.7.x keeps 23 of its 220 generated files (38 of 248 sources). Each kept file, in all three
releases, is one include, FlashInfer's namespaces and 8 explicit instantiations of the launcher;
0.7.x's tiles are larger (N 256, K 512, M 256 among them) and cost more to compile. Timed one at a
time on a CPU with nvcc 13.0 (sm_90a, the build's own flags): one 0.7.4 file takes 543 s of CPU
and 7 GB, half of it 290-306 s, the headers alone 38 s; one 0.6.14 file 138 s. So 0.7.4's subset
is about 13,000 CPU-seconds of work, and on an H100's 16 jobs it took 651 s (0.6.14's: 159 s):
the build is bound by the work, not by its slowest unit, and splitting the files would add the
headers' 38 s to each piece for a shorter tail only. A module built once is carried to the next
machine of the same image instead (docs/setup.md).
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

from mxmoe.harness.upstream.patches import Edit, PatchError, replace_line

SUBSET_NAME = "mxmoe_fused_moe_90_w4a16"
"""The module's name (FlashInfer's full module is ``fused_moe_90``)."""
BINDING = "fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
INSTANTIATION_FILE = "cutlass_fused_moe_instantiation.cu"
KEPT_GEMM = "moe_gemm_kernels_bf16_fp4.cu"
GEMM_PREFIX = "moe_gemm_kernels_"
FAILED = "build-failed.json"
"""Beside a release's build folder: why the subset could not be built for that release (the
FlashInfer backends' SKIP names it)."""


@dataclass(frozen=True)
class Generation:
    """How one generation of FlashInfer's sources spells the bf16 x MXFP4 path: the runner the
    binding constructs for WFP4A16, MXFP4's type in the instantiation file's namespace, and what a
    generated kernel file must instantiate to be kept (FlashInfer's generator names the type)."""

    read_in: str  # the releases whose sources it was read from
    runner: str
    weight: str
    launcher: str


GENERATIONS: tuple[Generation, ...] = (
    Generation("0.6.14", "kernels::CutlassMoeFCRunner<__nv_bfloat16, __nv_fp4_e2m1>", "__nv_fp4_e2m1",
               "sm90_generic_mixed_moe_gemm_kernelLauncher<__nv_bfloat16, __nv_fp4_e2m1,"),
    # 0.7: MXFP4 is `Fp4Type` (cutlass::float_e2m1_t on the Hopper TMA path), `SafeFP4` in the
    # generated files; the generator lists 116 configurations per GEMM (0.6.14: 28).
    Generation("0.7.2.post1, 0.7.4", "kernels::CutlassMoeFCRunner<__nv_bfloat16, kernels::Fp4Type>", "Fp4Type",
               "sm90_generic_mixed_moe_gemm_kernelLauncher<__nv_bfloat16, SafeFP4,"),
)  # fmt: skip
"""The generations the subset knows, each checked against the sources of the releases it names
(``suites/jitbuild/test_flashinfer_subset.py``). A release whose sources match none is refused
with the reason (``BuildError``), never built from a guess."""


def binding_edits(gen: Generation) -> tuple[Edit, Edit]:
    """The runner selection of FusedMoeRunner's constructor, cut to WFP4A16 with bf16 activations."""
    return (
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
            f"      mKernelRunner = std::make_shared<{gen.runner}>();\n"
            "    }\n"
            "    if (!mKernelRunner) {",
        ),
    )


def instantiation(gen: Generation) -> str:
    """The one CutlassMoeFCRunner of FlashInfer's instantiation file that the bf16 x MXFP4 path
    constructs, and the bf16 finalize."""
    return f"""\
// Written by mxmoe's harness/upstream/flashinfer_sm90.py: the one CutlassMoeFCRunner of FlashInfer's
// cutlass_fused_moe_instantiation.cu that the bf16 x MXFP4 path constructs (that file has them all).
#include "cutlass_fused_moe_kernels.cuh"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {{
template class CutlassMoeFCRunner<__nv_bfloat16, {gen.weight}>;
INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);
}}  // namespace tensorrt_llm::kernels::cutlass_kernels
"""


def generation_of(version: str, binding: str, generated: list[str]) -> Generation:
    """The generation whose runner the binding constructs and whose launcher a generated file
    instantiates; BuildError naming the release and what was looked for where none matches."""
    for gen in GENERATIONS:
        if gen.runner in binding and any(gen.launcher in text for text in generated):
            return gen
    looked = "; ".join(
        f"{g.read_in}: runner {g.runner} in the binding ({'found' if g.runner in binding else 'absent'}), "
        f"{g.launcher}...> in a generated file ({sum(g.launcher in t for t in generated)} of {len(generated)})"
        for g in GENERATIONS
    )
    raise BuildError(f"flashinfer {version}'s fused_moe_90 sources match none of the subset's generations ({looked})")


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


def _spec_class(base: type) -> type:
    """FlashInfer's own spec class (``base``: JitSpec in 0.6, its nvcc subclass JitSpecNvcc in 0.7,
    where JitSpec is abstract), with its folders moved into ``root`` (FlashInfer keeps them in its
    workspace by name; the subset's live in the project's cache)."""

    @dataclass
    class SubsetSpec(base):
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
    generation: Generation


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
    binding_src = jit_env.FLASHINFER_CSRC_DIR / BINDING
    if not binding_src.is_file():
        raise BuildError(f"flashinfer {__version__} has no {BINDING}: the subset edits that binding")
    generated = [s for s in full.sources if s.name.endswith(".generated.cu")]
    texts = {s: s.read_text() for s in generated}
    gen = generation_of(__version__, binding_src.read_text(), list(texts.values()))
    edits = binding_edits(gen)
    text = binding_src.read_text()
    for edit in edits:
        try:
            text = replace_line(text, edit, f"the fused_moe_90 subset (flashinfer {__version__})")
        except PatchError as exc:
            raise BuildError(str(exc)) from None
    src_dir = root / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    binding = src_dir / binding_src.name
    instantiation_src = src_dir / "mxmoe_cutlass_fused_moe_instantiation.cu"
    for path, content in ((binding, text), (instantiation_src, instantiation(gen))):
        if not path.is_file() or path.read_text() != content:  # unchanged sources keep their objects
            path.write_text(content)

    sources: list[Path] = []
    for s in full.sources:
        if s.name == binding_src.name:
            sources.append(binding)
        elif s.name == INSTANTIATION_FILE:
            sources.append(instantiation_src)
        elif s.name.startswith(GEMM_PREFIX) and s.name != KEPT_GEMM:
            continue
        elif s in texts:
            if gen.launcher in texts[s]:
                sources.append(s)
        else:
            sources.append(s)
    names = {s.name for s in sources}
    missing = [n for n in (binding.name, instantiation_src.name, KEPT_GEMM) if n not in names]
    if missing:
        raise BuildError(f"flashinfer {__version__}'s fused_moe_90 spec no longer has the parts the subset is made of "
                         f"(missing: {', '.join(missing)}; {INSTANTIATION_FILE} replaced: "
                         f"{instantiation_src in sources})")  # fmt: skip
    generated_kept = sum(s in texts for s in sources)
    include = [*(full.extra_include_dirs or []), binding_src.parent]  # the copies' "cutlass_fused_moe_kernels.cuh"
    recipe = hashlib.sha256(
        json.dumps(
            {
                "flashinfer": __version__,
                "sources": sorted(s.name for s in sources),
                "edits": [e.new for e in edits],
                "instantiation": instantiation(gen),
                "cuda_cflags": [f for f in full.extra_cuda_cflags or [] if not f.startswith("-I")],
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    spec = _spec_class(type(full))(
        name=SUBSET_NAME,
        sources=sources,
        extra_cflags=full.extra_cflags,
        extra_cuda_cflags=full.extra_cuda_cflags,
        extra_ldflags=full.extra_ldflags,
        extra_include_dirs=include,
        needs_device_linking=full.needs_device_linking,
        root=root,
    )
    return Subset(spec, recipe, len(full.sources), len(sources), len(generated), generated_kept, gen)


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
    every core) and check it; the ``build.json`` record. Raises BuildError naming the step, and
    records it in ``root``'s ``FAILED`` (removed by a build that succeeds)."""
    from flashinfer import __version__

    root = root or build_root()
    failed = root / FAILED
    try:
        record = _build(jobs, root)
    except BuildError as exc:
        root.mkdir(parents=True, exist_ok=True)
        failed.write_text(json.dumps({"flashinfer": __version__, "reason": str(exc)}, indent=1) + "\n")
        raise
    failed.unlink(missing_ok=True)
    return record


def failed_record(root: Path | None = None) -> dict[str, object] | None:
    """Why the last build for the installed FlashInfer failed (``FAILED``), or None."""
    from flashinfer import __version__

    path = (root or build_root()) / FAILED
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if record.get("flashinfer") == __version__ else None


def _build(jobs: int | None, root: Path) -> dict[str, object]:
    from flashinfer import __version__
    from flashinfer.jit.cpp_ext import get_cuda_version, run_ninja

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
        "generation": subset.generation.read_in,
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
