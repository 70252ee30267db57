"""flashinfer-python's wheel cut to what the harness reads of it on a GPU machine, for the offline
bundle (``bundle``): the Python modules its FlashInfer backends import, and the sources and headers
the SM90 MoE module is compiled from (the project's subset, and FlashInfer's whole ``fused_moe_90``
for ``MXMOE_FLASHINFER_JIT=1``).

Why: the wheel grew from 13.9 MiB (0.6.14) to 59 MiB (0.7.2.post1) and 97 MiB (0.7.4), mostly the
sources of other products (attention, sampling, communication, experimental kernels) that FlashInfer
compiles on first use; what travels to an air-gapped GPU machine is capped with the project and the
rest of the bundle.

Why a cut wheel and not a cut tree: the set-up installs the bundle's wheels with pip, offline, as
it installs them online. A wheel keeps that one path: pip replaces an installed release the same
way, ``importlib.metadata`` reports the release (the adapters pick the SM90 layout and the subset
folder from it), ``pip uninstall`` removes it, and the FlashInfer backends find it where they
find an installed one. A tree beside the environment would need its own place on ``sys.path``, its
own version record and its own clean-up, and would disagree with an installed release the moment
one is there. The cut wheel keeps the name, version and tags of the original (pip takes it from
the bundle's folder alone, with ``--no-index``), lists only what it holds in its RECORD, and says
what was cut in ``mxmoe-cut.json`` beside its metadata.

What is kept, each found from the release's own files, never from a list of names:

* Python: every module reachable by the import statements (anywhere in a file, function bodies
  included, so lazy imports count) from ``ENTRY_MODULES``, with each package's non-source files
  (tables, templates). ``flashinfer/__init__.py`` imports most of the package, so this is most of
  its Python; what falls away are the subpackages nothing imports (0.7.4: the experimental kernels).
* Sources: every source of FlashInfer's ``fused_moe_90`` spec, and every header of FlashInfer's own
  reachable from them, and from the kernel files FlashInfer's generator writes, by ``#include``
  through the build's include folders (in every branch of every ``#if``: a superset of what nvcc
  reads); each vendored header library the build reaches (CUTLASS, CCCL, spdlog: ``OWN_SOURCES``
  says why), whole.
* Nothing else of ``flashinfer/data``: the other products' sources, CUTLASS's examples, Python
  package and docs, and CCCL's tests.

Only the SM90 module is compiled by the harness from sources; Blackwell's TRT-LLM-gen kernels come
as cubins FlashInfer downloads on first use, so a bundle for an air-gapped Blackwell machine is
out of reach either way. ``suites/packaging/test_flashinfer_cut.py`` checks a cut against the
imports of the adapters and the subset build, and against the compiler's own list of what the
build reads.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ENTRY_MODULES = (
    "flashinfer",
    "flashinfer.autotuner",
    "flashinfer.fused_moe",
    "flashinfer.fused_moe.core",
    "flashinfer.jit",
    "flashinfer.jit.core",
    "flashinfer.jit.cpp_ext",
    "flashinfer.jit.env",
    "flashinfer.jit.fused_moe",
    "flashinfer.tllm_enums",
    "flashinfer.fp4_quantization",
    "flashinfer.utils",
)
"""What the FlashInfer backends, the subset build and vLLM's FlashInfer MXFP4 path import (a
test reads the adapters' and the build's imports and checks each is here); a release lacking one
(``tllm_enums`` is new in 0.7) is skipped."""
CUT_NOTE = "mxmoe-cut.json"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".hh", ".inl", ".cpp", ".cc", ".c", ".ptx", ".py", ".pyi")
"""Files that are code: kept only where reached. Anything else in a kept Python package stays."""
OWN_SOURCES = ("csrc", "include")
"""FlashInfer's own source folders under ``flashinfer/data``, cut to what is reached. The header
libraries it vendors beside them (CUTLASS, CCCL, spdlog) are kept whole wherever the build reaches
one of their files: they include through macros (CUTLASS's ``CUDA_STD_HEADER(x)``, Thrust's
per-system dispatch) that no scan of ``#include`` lines can follow."""
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)


class CutError(RuntimeError):
    """The wheel could not be cut (the message says why)."""


def module_file(pkg_parent: Path, name: str) -> Path | None:
    """The file of module ``name`` under ``pkg_parent`` (the folder holding ``flashinfer/``)."""
    base = pkg_parent.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imports(path: Path, name: str) -> set[str]:
    """Every module name an import statement of ``path`` (module ``name``) may load, relative ones
    resolved: ``from a import b`` gives ``a`` and ``a.b`` (which may be a module or a name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def python_closure(pkg_parent: Path, entries: tuple[str, ...] = ENTRY_MODULES, top: str = "flashinfer") -> set[Path]:
    """The module files reachable from ``entries`` by import statements, with every package's
    ``__init__.py`` on the way."""
    seen: set[str] = set()
    todo = [e for e in entries if module_file(pkg_parent, e) is not None]
    files: set[Path] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(pkg_parent, name)
        if path is None:
            continue
        files.add(path)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [m for m in _imports(path, name) if m == top or m.startswith(top + ".")]
    return files


def include_closure(seeds: list[Path], include_dirs: list[Path]) -> set[Path]:
    """Every file reachable from ``seeds`` by ``#include``, looked up beside the including file
    (quoted names) and then in ``include_dirs``; names found nowhere (CUDA's, the system's) are
    left out. Every ``#include`` counts, whatever ``#if`` it sits under."""
    found: set[Path] = set()
    todo = [p.resolve() for p in seeds]
    dirs = [d.resolve() for d in include_dirs if d.is_dir()]
    while todo:
        path = todo.pop()
        if path in found or not path.is_file():
            continue
        found.add(path)
        for name in INCLUDE.findall(path.read_text(errors="replace")):
            for base in (path.parent, *dirs):
                hit = base / name
                if hit.is_file():
                    todo.append(hit.resolve())
                    break
    return found


_READS = r"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import flashinfer
from flashinfer.jit import core, cpp_ext, env as jit_env
cpp_ext.get_cuda_version = lambda: __import__("packaging.version").version.Version("13.0")
core.current_compilation_context.TARGET_CUDA_ARCHS = {(9, "0a")}
from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module
from mxmoe.harness.upstream import flashinfer_sm90 as fs
root = Path(sys.argv[2])
with fs._in_root(root):
    full = gen_cutlass_fused_moe_sm90_module()
out = {"flashinfer": flashinfer.__version__, "package": str(Path(flashinfer.__file__).parent),
       "sources": [str(s) for s in full.sources], "error": None, "subset": []}
try:
    sub = fs.subset_spec(root)
    out["subset"] = [str(s) for s in sub.spec.sources]
    out["generation"] = sub.generation.read_in
    include = list(sub.spec.extra_include_dirs)
except fs.BuildError as exc:
    out["error"] = str(exc)
    include = list(full.extra_include_dirs or [])
include += [jit_env.FLASHINFER_INCLUDE_DIR, jit_env.FLASHINFER_CSRC_DIR, *jit_env.CUTLASS_INCLUDE_DIRS,
            jit_env.SPDLOG_INCLUDE_DIR, *getattr(jit_env, "CCCL_INCLUDE_DIRS", [])]
out["include_dirs"] = [str(d) for d in include]
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Reads:
    """What the SM90 build of one unpacked release reads: FlashInfer's ``fused_moe_90`` sources,
    the subset's (empty where the subset refuses the release: ``error``), the include folders, and
    every file reached from them (``files``: the package's own, generated ones left out)."""

    flashinfer: str
    sources: tuple[Path, ...]
    subset: tuple[Path, ...]
    include_dirs: tuple[Path, ...]
    files: frozenset[Path]
    error: str | None
    generation: str | None


def build_reads(pkg_parent: Path, work: Path) -> Reads:
    """Run FlashInfer's own ``fused_moe_90`` spec and the subset's from the release unpacked in
    ``pkg_parent`` (a process of its own: one process imports one flashinfer; no GPU or nvcc is
    asked, the target is sm90a and CUDA 13.0), its generated files written into ``work``."""
    proc = subprocess.run([sys.executable, "-c", _READS, str(pkg_parent), str(work)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    if proc.returncode != 0:
        raise CutError(f"FlashInfer's fused_moe_90 spec failed from {pkg_parent}: {proc.stderr.strip()[-2000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    sources = tuple(Path(s) for s in data["sources"])
    subset = tuple(Path(s) for s in data["subset"])
    include = tuple(Path(d) for d in data["include_dirs"])
    files = include_closure([*sources, *subset], list(include))
    package = Path(data["package"]).resolve()
    own = frozenset(f for f in files if package in f.parents)
    return Reads(data["flashinfer"], sources, subset, include, own, data["error"], data.get("generation"))


def kept(pkg_parent: Path, reads: Reads) -> set[str]:
    """The wheel members (``flashinfer/...`` paths) the cut keeps (module docstring)."""
    pkg = pkg_parent / "flashinfer"
    modules = python_closure(pkg_parent)
    keep = {str(p.relative_to(pkg_parent)) for p in modules}
    packages = {p.parent for p in modules}
    for path in pkg.rglob("*"):
        if path.is_file() and path.parent in packages and path.suffix not in SOURCE_SUFFIXES:
            keep.add(str(path.relative_to(pkg_parent)))
    keep |= {str(p.relative_to(pkg_parent.resolve())) for p in reads.files}
    own = [(pkg / "data" / d).resolve() for d in OWN_SOURCES]
    for root in {d.resolve() for d in reads.include_dirs}:
        vendored = (pkg / "data").resolve() in root.parents and not any(o == root or o in root.parents for o in own)
        if vendored and any(root in f.parents for f in reads.files):
            keep |= {str(f.relative_to(pkg_parent.resolve())) for f in root.rglob("*") if f.is_file()}
    return keep


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def cut_wheel(wheel: Path, out_dir: Path) -> dict[str, object]:
    """Write ``wheel`` cut (module docstring) into ``out_dir`` under its own name; what was kept,
    in bytes and files, and the subset's verdict on the release (``subset_error``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mxmoe-cut-") as tmp:
        unpacked = Path(tmp) / "pkg"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpacked)
            infos = z.infolist()
        reads = build_reads(unpacked, Path(tmp) / "work")
        keep = kept(unpacked, reads)
        dist_info = next(i.filename.split("/")[0] for i in infos if i.filename.endswith(".dist-info/RECORD"))
        note = {
            "cut_by": "mxmoe harness/upstream/flashinfer_cut.py",
            "flashinfer": reads.flashinfer,
            "kept_files": 0,
            "dropped_files": 0,
            "subset_generation": reads.generation,
            "subset_error": reads.error,
        }
        dest = out_dir / wheel.name
        partial = dest.with_suffix(".partial")
        records = []
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in infos:
                name = info.filename
                if name.endswith("/") or name == f"{dist_info}/RECORD":
                    continue
                if name.startswith("flashinfer/") and name not in keep:
                    note["dropped_files"] += 1
                    continue
                note["kept_files"] += 1
                data = (unpacked / name).read_bytes()
                dst.writestr(info, data)
                records.append(_record_line(name, data))
            text = json.dumps(note, indent=1).encode()
            dst.writestr(f"{dist_info}/{CUT_NOTE}", text)
            records.append(_record_line(f"{dist_info}/{CUT_NOTE}", text))
            records.append(f"{dist_info}/RECORD,,")
            dst.writestr(f"{dist_info}/RECORD", "\n".join(records) + "\n")
        partial.replace(dest)
    return {**note, "wheel": dest.name, "bytes": dest.stat().st_size, "full_bytes": wheel.stat().st_size}
