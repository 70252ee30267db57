"""A project-owned build of the few compiled vLLM ops that vLLM's MXFP4 MoE layer calls on CUDA.

vLLM's wheel is 321 MiB, 633 MiB of it compiled extensions; its MXFP4 MoE layer calls a handful
of them. On CUDA, per backend (vLLM 0.34.0, read from ``fused_moe/`` and ``_custom_ops.py``; the
same ops as 0.33.0's):

- TRITON calls none (OpenAI triton_kernels' routing and ``matmul_ogs``);
- TRITON_UNFUSED calls the activation op (``_C::swigluoai_and_mul``, or
  ``_C::silu_and_mul_with_clamp``);
- MARLIN calls ``_C::gptq_marlin_repack`` (at load, per expert and weight),
  ``_moe_C::moe_align_block_size``, ``_moe_C::moe_wna16_marlin_gemm`` (once per GEMM), the
  activation op and ``_moe_C::moe_sum``;
- FLASHINFER_CUTLASS_MXFP4_BF16 calls FlashInfer's own module (``harness.upstream.flashinfer_sm90``).

``build`` compiles exactly those from vLLM's source package (``vllm-<version>.tar.gz`` from
PyPI, read from the cache at build time; nothing of vLLM is committed here):

- ``csrc/moe/marlin_moe_wna16/ops.cu`` with the kernels vLLM's own generator
  (``csrc/quantization/marlin/generate_kernels.py``) writes, cut to the one type triple MXFP4
  uses: bf16 activations x ``kFE2M1f`` weights x ``kFE8M0fnu`` scales, bf16 out (15 kernels, and
  their lines of ``kernel_selector.h``: any other type triple finds no kernel and vLLM's own
  check refuses it);
- ``csrc/quantization/marlin/gptq_marlin_repack.cu``, ``csrc/moe/moe_align_sum_kernels.cu`` and
  ``csrc/activation_kernels.cu``;
- a binding (``BINDING_NAME``) that registers them under vLLM's op names with vLLM's own schemas:
  each ``def`` and ``impl`` statement is copied at build time from vLLM's
  ``csrc/torch_bindings.cpp`` and ``csrc/moe/torch_bindings.cpp`` (the statements of ``OPS``), so
  a release's schemas come with its sources: 0.34.0 dropped Marlin's 8-bit activations, and with
  them ``is_a_8bit`` from ``gptq_marlin_repack`` and ``a_scales`` from ``moe_wna16_marlin_gemm``,
  as its ``_custom_ops.py`` no longer passes them.

The flags are vLLM's (``CMakeLists.txt``): the libtorch stable ABI with ``TORCH_TARGET_VERSION``
2.11 (0.33.0 and 0.34.0 alike, though both pin torch 2.14.0), so the library loads in any torch from
2.11 on; ``--expt-relaxed-constexpr --expt-extended-lambda -DENABLE_FP8``; Marlin (MoE GEMM and
repack) as compute_80 PTX only, as vLLM's wheel ships it for sm90 (its ``MARLIN_MOE_ARCHS`` is
"8.0+PTX"; 0.34.0 dropped the native SM12x variant 0.33.0 added with CUDA 12.8; the driver compiles
the PTX at first load); the other sources for the target architecture. After linking, the library's
undefined dynamic symbols are read with ``nm``: one of vLLM's own (a source the build left out)
fails the build rather than a call at run time.

``build.json`` beside the library records the recipe (vLLM release, architecture, the torch it
was built against, sources, op names), its hash, the time and the size; ``load`` uses a library
only where its recipe matches, and every result of the vLLM driver names the build it ran.
Against another machine's torch (a GPU host with no compiler, say), build with ``--torch-wheel``:
that wheel's headers and libraries are used instead of the installed torch's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mxmoe.harness.upstream.fetch import NEWEST_VLLM, VendorMissing, cache_dir, release

LIBRARY = "mxmoe_vllm_ops"
"""The library's name (``lib<LIBRARY>.so`` is what ``load`` passes to ``torch.ops.load_library``)."""
BINDING_NAME = "mxmoe_vllm_ops_binding.cpp"
MXFP4_KERNEL_FILE = "sm80_kernel_bfloat16_fe2m1f_bfloat16.cu"
"""The generator's file for bf16 x fe2m1f -> bf16 (its scales, kFE8M0fnu, are MXFP4's)."""
MXFP4_SELECTOR = ("a_type == vllm::kBFloat16", "b_type == vllm::kFE2M1f", "c_type == vllm::kBFloat16",
                  "s_type == vllm::kFE8M0fnu")  # fmt: skip
"""The conditions a ``kernel_selector.h`` entry must have to be kept."""


@dataclass(frozen=True)
class Op:
    """One op: its namespace, name, and the vLLM binding file whose ``def`` (and, where the impl is
    not in its own source, ``impl``) statement registers it."""

    namespace: str
    name: str
    binding: str
    impl_in_binding: bool


OPS = (
    Op("_C", "gptq_marlin_repack", "csrc/torch_bindings.cpp", False),
    Op("_C", "swigluoai_and_mul", "csrc/torch_bindings.cpp", True),
    Op("_C", "silu_and_mul_with_clamp", "csrc/torch_bindings.cpp", True),
    Op("_moe_C", "moe_align_block_size", "csrc/moe/torch_bindings.cpp", True),
    Op("_moe_C", "moe_sum", "csrc/moe/torch_bindings.cpp", True),
    Op("_moe_C", "moe_wna16_marlin_gemm", "csrc/moe/torch_bindings.cpp", False),
)
"""The ops vLLM's MXFP4 MoE layer calls on CUDA (see the module docstring)."""
MARLIN_SOURCES = ("csrc/moe/marlin_moe_wna16/ops.cu", f"csrc/moe/marlin_moe_wna16/{MXFP4_KERNEL_FILE}",
                  "csrc/quantization/marlin/gptq_marlin_repack.cu")  # fmt: skip
"""Built as compute_80 PTX (vLLM's Marlin archs, "8.0+PTX")."""
OTHER_SOURCES = ("csrc/moe/moe_align_sum_kernels.cu", "csrc/activation_kernels.cu")
"""Built for the target architecture."""
NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-DENABLE_FP8",
              "-DUSE_CUDA", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL",
              "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1", "-D_GLIBCXX_USE_CXX11_ABI=1",
              f"-DTORCH_EXTENSION_NAME={LIBRARY}", "-Xcompiler", "-fPIC")  # fmt: skip
"""vLLM's flags for its stable-ABI extensions (CMakeLists.txt, cmake/utils.cmake)."""
MARLIN_FLAGS = ("-static-global-template-stub=false",)
"""vLLM adds this to its Marlin kernel files with nvcc >= 12.8."""
MARLIN_GENCODE = ("-gencode", "arch=compute_80,code=compute_80")
OWN_SYMBOLS = re.compile(r"vllm|marlin|MARLIN|moe_align|moe_sum|swigluoai|silu_and_mul|gptq")
"""An undefined symbol matching this is one of vLLM's own, from a source the build left out."""
TORCH_LIBS = ("torch", "torch_cpu", "torch_cuda", "c10", "c10_cuda")


class BuildError(Exception):
    """The build could not run or produced a library that would fail at run time."""


def gencode(arch: str) -> tuple[str, ...]:
    """nvcc's ``-gencode`` for the project's arch name (``sm90`` -> sm_90 SASS)."""
    m = re.fullmatch(r"sm(\d{2,3})([af]?)", arch)
    if not m:
        raise ValueError(f"an NVIDIA architecture such as sm90 or sm100a, not {arch!r}")
    return ("-gencode", f"arch=compute_{m[1]}{m[2]},code=sm_{m[1]}{m[2]}")


def source_tarball(version: str = NEWEST_VLLM) -> Path:
    """Where vLLM ``version``'s source package is cached."""
    return cache_dir() / "sdist" / f"vllm-{version}.tar.gz"


def fetch_source(version: str = NEWEST_VLLM, tarball: Path | None = None) -> Path:
    """vLLM's source package, from ``tarball`` or PyPI's simple index (its sha256 checked), into the
    cache. It is downloaded, not built: its metadata build wants torch and CUDA."""
    dest = source_tarball(version)
    if tarball is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if Path(tarball).resolve() != dest.resolve():
            shutil.copyfile(tarball, dest)
        return dest
    if dest.is_file():
        return dest
    name = f"vllm-{version}.tar.gz"
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
    req = urllib.request.Request("https://pypi.org/simple/vllm/", headers=accept)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        entry = next(f for f in files if f["filename"] == name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(name + ".partial")
        urllib.request.urlretrieve(entry["url"], partial)
    except StopIteration:
        raise VendorMissing(f"PyPI lists no {name}") from None
    except OSError as exc:
        raise VendorMissing(f"could not download {name} from PyPI ({exc}); give one with --sdist PATH") from exc
    digest = hashlib.sha256(partial.read_bytes()).hexdigest()
    if digest != entry["hashes"].get("sha256", digest):
        partial.unlink()
        raise VendorMissing(f"{name}: sha256 {digest} is not PyPI's {entry['hashes']['sha256']}")
    partial.rename(dest)
    return dest


def build_root(version: str = NEWEST_VLLM, arch: str = "sm90") -> Path:
    """Where the build of ``version``'s ops for ``arch`` lives."""
    return cache_dir() / "vllm-ops" / f"{version}-{arch}"


def library_path(version: str = NEWEST_VLLM, arch: str = "sm90") -> Path:
    return build_root(version, arch) / f"lib{LIBRARY}.so"


def _statement(text: str, start: int) -> str:
    """The C++ statement starting at ``start``, up to its ``;`` outside parentheses and strings."""
    depth, i, in_str = 0, start, False
    while i < len(text):
        c = text[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == ";" and depth == 0:
            return text[start : i + 1]
        i += 1
    raise BuildError(f"unterminated statement at offset {start}")


def binding_source(src: Path) -> str:
    """The binding: each op's ``def`` (and ``impl``) statement, copied from vLLM's bindings."""
    blocks: dict[tuple[str, str], list[str]] = {}
    for op in OPS:
        text = (src / op.binding).read_text()
        wanted = [("FRAGMENT", rf"(?:ops|m)\.def\(\s*\"{op.name}\(")]
        if op.impl_in_binding:
            wanted.append(("CUDA", rf"(?:ops|m)\.impl\(\s*\"{op.name}\""))
        for kind, pattern in wanted:
            hits = [m.start() for m in re.finditer(pattern, text)]
            if len(hits) != 1:
                raise BuildError(f"{op.binding}: {len(hits)} {kind} statements for {op.namespace}::{op.name}, not 1")
            stmt = _statement(text, hits[0]).strip()
            stmt = re.sub(r"^(ops|m)\.", "m.", stmt)
            blocks.setdefault((op.namespace, kind), []).append(stmt)
    out = ["// Generated by mxmoe (harness/upstream/vllm_ops.py) from vLLM's csrc/torch_bindings.cpp and",
           "// csrc/moe/torch_bindings.cpp: the statements of the ops vLLM's MXFP4 MoE layer calls.",
           '#include "ops.h"', '#include "moe/moe_ops.h"', "#include <torch/csrc/stable/library.h>", ""]  # fmt: skip
    for (ns, kind), stmts in blocks.items():
        head = f"STABLE_TORCH_LIBRARY_FRAGMENT({ns}, m)"
        if kind == "CUDA":
            head = f"STABLE_TORCH_LIBRARY_IMPL({ns}, CUDA, m)"
        out += [head + " {", *("  " + s for s in stmts), "}", ""]
    return "\n".join(out)


def cut_selector(text: str) -> tuple[str, int, int]:
    """``kernel_selector.h`` cut to the MXFP4 entries: (text, kept, all). Each entry is an
    ``if (...)`` / ``else if (...)`` line and its ``kernel = ...;`` line."""
    lines = text.splitlines()
    head = [ln for ln in lines if ln.startswith("//")]
    entries, i = [], 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith(("if (", "else if (")) and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("kernel ="):
            entries.append((ln, lines[i + 1]))
            i += 2
            continue
        i += 1
    kept = [(c, k) for c, k in entries if all(cond in c for cond in MXFP4_SELECTOR)]
    body = []
    for n, (cond, kernel) in enumerate(kept):
        cond = re.sub(r"^(else )?if ", "if " if n == 0 else "else if ", cond)
        body += [cond, kernel]
    return "\n".join(head + body) + "\n", len(kept), len(entries)


def _torch_dirs(torch_root: Path) -> tuple[list[Path], Path]:
    inc = [torch_root / "include", torch_root / "include" / "torch" / "csrc" / "api" / "include"]
    lib = torch_root / "lib"
    if not (inc[0] / "torch" / "csrc" / "stable" / "library.h").is_file():
        raise BuildError(f"{torch_root} has no torch/csrc/stable/library.h (torch >= 2.11 with headers needed)")
    for name in TORCH_LIBS:
        if not (lib / f"lib{name}.so").is_file():
            raise BuildError(f"{lib} has no lib{name}.so (a CUDA build of torch is needed to link against)")
    return inc, lib


def torch_from_wheel(wheel: Path) -> Path:
    """A torch wheel's headers and libraries, extracted into the cache; its ``torch`` folder."""
    m = re.match(r"torch-([^-]+)-", Path(wheel).name)
    if not m:
        raise BuildError(f"--torch-wheel: {wheel} is not a torch wheel")
    root = cache_dir() / f"torch-{m[1]}"
    if not (root / "torch" / "include" / "torch" / "csrc" / "stable" / "library.h").is_file():
        with zipfile.ZipFile(wheel) as z:
            wanted = ("torch/include/", "torch/lib/", "torch/version.py")
            names = [n for n in z.namelist() if n.startswith(wanted)]
            z.extractall(root, names)
    return root / "torch"


def _torch_version(torch_root: Path) -> str:
    text = (torch_root / "version.py").read_text() if (torch_root / "version.py").is_file() else ""
    m = re.search(r"__version__\s*=\s*'([^']+)'", text)
    return m[1] if m else "unknown"


def recipe(version: str, arch: str, torch_version: str, nvcc: str) -> dict[str, object]:
    """What the build depends on; its hash decides whether a built library may be loaded."""
    return {
        "vllm": version,
        "arch": arch,
        "torch": torch_version,
        "nvcc": nvcc,
        "ops": [f"{o.namespace}::{o.name}" for o in OPS],
        "sources": [*MARLIN_SOURCES, *OTHER_SOURCES, BINDING_NAME],
        "selector": list(MXFP4_SELECTOR),
        "flags": [*NVCC_FLAGS, *MARLIN_FLAGS, *MARLIN_GENCODE, *gencode(arch)],
    }


def recipe_hash(r: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16]


def _nvcc() -> tuple[str, str]:
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.isfile(nvcc):
        raise BuildError("no nvcc on PATH or in $CUDA_HOME/bin: the ops are compiled with CUDA's compiler")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return nvcc, m[1] if m else "unknown"


def _prepare(tar: Path, work: Path, arch: str) -> tuple[int, int]:
    """Extract ``csrc/`` into ``work``, run vLLM's kernel generator, cut its output to MXFP4 and
    write the binding. Returns (selector entries kept, entries generated)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with tarfile.open(tar) as t:
        members = [m for m in t.getmembers() if "/csrc/" in m.name and ".." not in m.name and (m.isfile() or m.isdir())]
        top = members[0].name.split("/")[0] if members else ""
        for m in members:
            m.name = m.name[len(top) + 1 :]
        t.extractall(work, members, filter="data")
    src = work
    gen = src / "csrc/quantization/marlin/generate_kernels.py"
    out_dir = src / "csrc/moe/marlin_moe_wna16"
    digits = re.fullmatch(r"sm(\d+)(\d)[af]?", arch)
    cuda_arch = f"{digits[1]}.{digits[2]}"  # sm90 -> 9.0, as vLLM's CMake passes its CUDA archs
    proc = subprocess.run([sys.executable, str(gen), cuda_arch, str(out_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"vLLM's generate_kernels.py failed: {proc.stderr[-2000:]}")
    if not (out_dir / MXFP4_KERNEL_FILE).is_file():
        raise BuildError(f"vLLM's generator wrote no {MXFP4_KERNEL_FILE}: the MXFP4 variant is gone from this release")
    for f in out_dir.glob("*kernel_*.cu"):
        if f.name != MXFP4_KERNEL_FILE:
            f.unlink()
    selector, kept, total = cut_selector((out_dir / "kernel_selector.h").read_text())
    if kept == 0:
        raise BuildError("kernel_selector.h has no bf16 x fe2m1f x fe8m0fnu entry")
    (out_dir / "kernel_selector.h").write_text(selector)
    (src / "csrc" / BINDING_NAME).write_text(binding_source(src))
    return kept, total


def _compile_jobs(src: Path, out: Path, nvcc: str, inc: list[Path], arch: str) -> list[tuple[list[str], Path]]:
    py_inc = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    includes = [f"-I{p}" for p in (src / "csrc", *inc, *cuda_includes())] + ([f"-I{py_inc}"] if py_inc else [])
    jobs = []
    for rel in (*MARLIN_SOURCES, *OTHER_SOURCES, f"csrc/{BINDING_NAME}"):
        obj = out / (Path(rel).name + ".o")
        extra = [*MARLIN_FLAGS, *MARLIN_GENCODE] if rel in MARLIN_SOURCES else list(gencode(arch))
        if rel.endswith(".cpp"):
            extra = ["-x", "cu", *gencode(arch)]  # nvcc compiles the binding with the same defines
        jobs.append(([nvcc, *NVCC_FLAGS, *extra, *includes, "-c", str(src / rel), "-o", str(obj)], obj))
    return jobs


def cuda_includes() -> list[Path]:
    """CUDA library headers beyond the compiler's own (vLLM's ``torch_utils.h`` includes cuBLAS's):
    those of NVIDIA's pip packages on ``sys.path`` (``nvidia/<lib>/include``), and the folders in
    ``$MXMOE_CUDA_INCLUDE`` (``os.pathsep``-separated)."""
    found = [Path(p) for p in os.environ.get("MXMOE_CUDA_INCLUDE", "").split(os.pathsep) if p]
    for entry in sys.path:
        found += sorted(Path(entry).glob("nvidia/*/include"))
    return [p for p in dict.fromkeys(found) if p.is_dir()]


def undefined_own(so: Path) -> list[str] | None:
    """Undefined dynamic symbols of ``so`` that are vLLM's own (demangled), or None without ``nm``."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-D", "-C", "--undefined-only", str(so)], capture_output=True, text=True).stdout
    return sorted({ln.split(None, 1)[-1] for ln in out.splitlines() if OWN_SYMBOLS.search(ln)})


def build(version: str = NEWEST_VLLM, arch: str = "sm90", torch_root: Path | None = None,
          jobs: int | None = None, tarball: Path | None = None) -> dict[str, object]:  # fmt: skip
    """Build the ops (see the module docstring) into ``build_root``; the build record."""
    gencode(arch)
    if torch_root is None:
        import torch

        torch_root = Path(torch.__file__).parent
    inc, lib = _torch_dirs(Path(torch_root))
    nvcc, nvcc_version = _nvcc()
    tar = fetch_source(version, tarball)
    root = build_root(version, arch)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    kept, total = _prepare(tar, root / "src", arch)
    objdir = root / "obj"
    shutil.rmtree(objdir, ignore_errors=True)
    objdir.mkdir()
    compile_jobs = _compile_jobs(root / "src", objdir, nvcc, inc, arch)
    width = max(1, min(jobs or os.cpu_count() or 1, len(compile_jobs)))
    running: list[tuple[subprocess.Popen, list[str]]] = []
    pending = list(compile_jobs)
    failed: list[str] = []
    log = open(root / "build.log", "w")  # noqa: SIM115 (every compile writes into it)
    while pending or running:
        while pending and len(running) < width:
            cmd, _ = pending.pop(0)
            log.write(" ".join(cmd) + "\n")
            log.flush()
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), cmd))
        time.sleep(0.5)
        for p, cmd in list(running):
            if p.poll() is not None:
                running.remove((p, cmd))
                if p.returncode != 0:
                    failed.append(cmd[cmd.index("-c") + 1])
    log.close()
    if failed:
        raise BuildError(f"nvcc failed on {', '.join(failed)}; see {root / 'build.log'}")
    so = library_path(version, arch)
    link = [nvcc, "-shared", *(str(o) for _, o in compile_jobs), f"-L{lib}", *(f"-l{n}" for n in TORCH_LIBS),
            "-lcudart", "-o", str(so)]  # fmt: skip
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"link failed: {proc.stderr[-2000:]}")
    own = undefined_own(so)
    if own:
        so.unlink()
        raise BuildError(f"the library still needs {len(own)} of vLLM's own symbols (a source left out): {own[:5]}")
    r = recipe(version, arch, _torch_version(Path(torch_root)), nvcc_version)
    record = {
        "recipe": r,
        "hash": recipe_hash(r),
        "library": str(so),
        "size_bytes": so.stat().st_size,
        "kernels": {"kept": kept, "generated": total},
        "build_seconds": round(time.time() - t0, 1),
        "jobs": width,
        "undefined_own_checked": own is not None,
    }
    (root / "build.json").write_text(json.dumps(record, indent=1))
    return record


def built_record(version: str = NEWEST_VLLM, arch: str = "sm90") -> dict[str, object] | None:
    """The record of a finished build of ``version`` for ``arch``, or None."""
    path = build_root(version, arch) / "build.json"
    if not path.is_file() or not library_path(version, arch).is_file():
        return None
    return json.loads(path.read_text())


def load(version: str = NEWEST_VLLM, arch: str = "sm90") -> dict[str, object] | None:
    """Load the built ops into torch (their ``_C`` and ``_moe_C`` namespaces) where a build for this
    vLLM release and arch exists and its torch is no newer than the running one; the build record,
    or None where there is none."""
    import torch

    record = built_record(version, arch)
    if record is None:
        return None
    r = record["recipe"]
    if record["hash"] != recipe_hash(recipe(version, arch, str(r["torch"]), str(r["nvcc"]))):
        raise BuildError(
            f"the vLLM ops build at {build_root(version, arch)} is of another recipe (hash {record['hash']}): "
            f"rebuild with `python -m harness build-vllm-ops --vllm-version {version} --arch {arch}`"
        )
    built_torch = str(record["recipe"]["torch"]).split("+")[0]
    running = torch.__version__.split("+")[0]
    if release(built_torch) > release(running):
        raise BuildError(f"the vLLM ops were built against torch {built_torch}; this is torch {running}")
    torch.ops.load_library(str(library_path(version, arch)))
    return record
