"""vLLM's Python, carried to a GPU machine that has no vLLM and no network, and booted there on CUDA.

vLLM's wheel is 321 MiB, almost all of it compiled extensions; its MXFP4 MoE layer needs few of
them (``harness.upstream.vllm_ops`` builds those). ``fetch_runtime`` packs what the layer's path
needs into ``runtime_root(version)``, about 21 MiB, small enough to copy to a machine with no
network:

- ``vllm-py.tar.gz``: the wheel's ``vllm/`` package without its compiled modules and C/C++
  headers (``.py``, ``.json`` configs, templates), and its dist-info (vLLM's platform detection
  reads its version from the METADATA);
- ``wheels/``: the pure-Python (and a few small binary) packages vLLM imports on that path that a
  GPU image with torch, triton and transformers typically lacks (``RUNTIME_DEPS`` and what they
  need), for the target's Python version;
- ``runtime.json``: what is in it.

``boot`` makes it importable in this process, on CUDA: it unpacks the runtime once (beside it,
``site/``), puts that folder first on ``sys.path`` (it holds only vLLM and the pinned
``RUNTIME_DEPS``, never torch, triton or numpy, so those stay the installed ones; the pinned
packages shadow installed copies of themselves in this process; nothing is installed into the
environment), and arranges, before the first ``import vllm``:

- ``vllm._C_stable_libtorch`` and ``vllm._moe_C_stable_libtorch`` (the compiled extensions vLLM
  imports to register its ops): modules that load the project's build of the ops, where built;
- placeholders for ``vllm.vllm_flash_attn`` and, where not installed, the grammar libraries
  vLLM imports on the layer's path but never calls there (``vllm_probe.IMPORT_ONLY_STUBS``).
  ``vllm.vllm_flash_attn`` (its ``__init__`` raises without its compiled attention
  kernels; the MoE layer reaches it only through imports of the attention backends);
- the three CUTLASS capability queries vLLM asks at import (``_C::cutlass_scaled_mm_supports_fp8``,
  ``..._block_fp8``, ``_C::cutlass_group_gemm_supported``): registered to answer False, which is
  the truth here (no CUTLASS FP8 GEMM is built; the MXFP4 MoE layer never calls one);
- OpenAI's ``triton_kernels``: the copy the project's own Triton adapters run
  (``harness.upstream.fetch.import_triton_kernels``), imported first, so that vLLM's TRITON
  backends and the direct adapters run the same kernel source (vLLM prefers an importable
  ``triton_kernels`` to its vendored copy).

An installed vLLM is used as it is: ``boot`` then only reports it. Every stub is named in the
boot record, which the vLLM driver puts into each result.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path
from typing import Any

from mxmoe.harness.upstream.fetch import NEWEST_VLLM, VendorMissing, cache_dir, download_vllm_wheel
from mxmoe.harness.upstream.vllm_probe import IMPORT_ONLY_STUBS, placeholder_module

RUNTIME_DEPS = (
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0", "openai==3.57.0", "jiter==0.19.0", "sniffio==1.3.1", "anyio==4.16.0",
    "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "openai-harmony==0.0.8", "pyzmq==27.3.0",
    "msgspec==0.23.0", "cbor2==6.3.0", "fastapi==0.136.1", "starlette==1.10.0", "annotated-doc==0.0.7",
    "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "cachetools==8.0.2", "psutil==7.2.2",
    "uvloop==0.23.0", "prometheus-client==0.26.0", "opentelemetry-api==1.45.2",
)  # fmt: skip
"""The packages vLLM 0.33.0's MoE layer path imports that a GPU image with torch, triton and
transformers lacks, pinned to a set that imports together (``--no-deps``: nothing else is fetched,
so torch, triton and numpy never are). Found by booting the runtime in a fresh environment holding
only torch, triton, transformers and the GPU image's other packages. vLLM 0.34.0 (NEWEST_VLLM) is
carried with the same set: every pin meets its requirements, and its layer imports with them on
torch 2.11 and 2.13; its layer path no longer imports openai, openai-harmony, fastapi, starlette or
partial-json-parser (and their own dependencies), which stay for PREVIOUS_VLLM's runtime."""
KEEP_SUFFIXES = (".py", ".json", ".jinja", ".typed", ".txt")
DIST_INFO_FILES = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt")
PLACEHOLDERS = {
    "vllm.vllm_flash_attn": "vLLM's flash-attention package raises at import without its compiled kernels; "
    "the MoE layer reaches it only through the attention backends' imports",
}
CAPABILITY_QUERIES = (
    "cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool",
    "cutlass_group_gemm_supported(int cuda_device_capability) -> bool",
)
"""vLLM's ``_C`` capability queries asked at import (w8a8_utils.py): answered False here."""


def this_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def runtime_root(version: str = NEWEST_VLLM, python: str | None = None) -> Path:
    """Where vLLM ``version``'s carryable runtime for Python ``python`` (default: this one) lives:
    its wheels are that Python's."""
    return cache_dir() / f"vllm-runtime-{version}-py{python or this_python()}"


def runtime_fetched(version: str = NEWEST_VLLM, python: str | None = None) -> bool:
    return (runtime_root(version, python) / "runtime.json").is_file()


def _pack_sources(wheel: Path, dest: Path) -> dict[str, int]:
    """vLLM's package without compiled modules and headers, and its dist-info, as tar.gz (xz would save
    4 MiB at 15 times the time)."""
    counts = {"files": 0, "bytes": 0}
    with zipfile.ZipFile(wheel) as z, tarfile.open(dest, "w:gz", compresslevel=6) as tar:
        for info in z.infolist():
            name = info.filename
            top = name.split("/", 1)[0]
            keep = (top == "vllm" and name.endswith(KEEP_SUFFIXES)) or (
                top.endswith(".dist-info") and name.split("/")[-1] in DIST_INFO_FILES
            )
            if not keep or ".." in Path(name).parts:
                continue
            data = z.read(name)
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
            counts["files"] += 1
            counts["bytes"] += len(data)
    if counts["files"] == 0:
        raise VendorMissing(f"{wheel} holds no vllm/ package")
    return counts


def fetch_runtime(version: str = NEWEST_VLLM, wheel: Path | None = None, python_version: str | None = None,
                  platform: str = "manylinux_2_28_x86_64") -> Path:  # fmt: skip
    """Pack vLLM ``version``'s runtime (see the module docstring) for a target running
    ``python_version`` (default: this interpreter's) on ``platform``; its folder."""
    py = python_version or this_python()
    wheel = Path(wheel) if wheel else download_vllm_wheel(version)
    root = runtime_root(version, py)
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "wheels").mkdir(parents=True)
    sources = _pack_sources(wheel, tmp / "vllm-py.tar.gz")
    platforms = [platform, "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    if not platform.endswith("x86_64"):
        platforms = [platform]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", py,
           "--implementation", "cp", "--no-deps", *(a for p in platforms for a in ("--platform", p)),
           "-d", str(tmp / "wheels"), *RUNTIME_DEPS]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise VendorMissing(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    wheels = sorted(p.name for p in (tmp / "wheels").glob("*.whl"))
    manifest = {
        "vllm": version,
        "wheel": wheel.name,
        "python": py,
        "platform": platform,
        "sources": sources,
        "deps": wheels,
        "size_bytes": sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()),
    }
    (tmp / "runtime.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def site_dir(version: str = NEWEST_VLLM) -> Path:
    """Where ``boot`` unpacks the runtime (beside it; $MXMOE_VLLM_SITE overrides)."""
    env = os.environ.get("MXMOE_VLLM_SITE")
    return Path(env) if env else runtime_root(version) / "site"


def unpack(version: str = NEWEST_VLLM) -> Path:
    """Unpack the runtime's sources and wheels into ``site_dir`` once; the folder."""
    root, site = runtime_root(version), site_dir(version)
    stamp = site / ".unpacked"
    manifest = (root / "runtime.json").read_text() if (root / "runtime.json").is_file() else None
    if manifest is None:
        raise VendorMissing(
            f"no vLLM {version} runtime at {root}: run `python -m harness fetch vllm-runtime --vllm-version {version}` "
            "(on a machine with network; add --python-version of the GPU machine) and copy the folder"
        )
    if stamp.is_file() and stamp.read_text() == manifest:
        return site
    import fcntl

    site.parent.mkdir(parents=True, exist_ok=True)
    with open(site.with_name(site.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # worker processes booting at once: one unpacks, the others wait
        if stamp.is_file() and stamp.read_text() == manifest:
            return site
        tmp = site.with_name(site.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(root / "vllm-py.tar.gz") as tar:
            tar.extractall(tmp, filter="data")
        for whl in sorted((root / "wheels").glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                z.extractall(tmp)
        (tmp / ".unpacked").write_text(manifest)
        shutil.rmtree(site, ignore_errors=True)
        tmp.rename(site)
    return site


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on ``sys.meta_path``: NAMES (and their submodules) become placeholder packages."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == p or fullname.startswith(p + ".") for p in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return placeholder_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _register_capability_queries() -> list[str]:
    import torch

    have = [q.split("(")[0] for q in CAPABILITY_QUERIES if hasattr(torch.ops._C, q.split("(")[0])]
    if len(have) == len(CAPABILITY_QUERIES):
        return []
    lib = torch.library.Library("_C", "FRAGMENT")
    _register_capability_queries.lib = lib  # type: ignore[attr-defined]  # kept alive with the process
    done = []
    for schema in CAPABILITY_QUERIES:
        name = schema.split("(")[0]
        if name in have:
            continue
        lib.define(schema)
        lib.impl(name, lambda cap: False, "CompositeExplicitAutograd")
        done.append(f"_C::{name}")
    return done


BOOTED: dict[str, Any] | None = None
"""This process's boot record (vLLM binds its platform once per process)."""


def driven_release() -> str:
    """The vLLM release vLLM's layer is run from where vLLM is not installed: ``$MXMOE_VLLM_VERSION``
    (PREVIOUS_VLLM, say, or another fetched runtime), else NEWEST_VLLM. The driver boots it and the
    mutation worker patches its sources, so that both run the same release."""
    return os.environ.get("MXMOE_VLLM_VERSION") or NEWEST_VLLM


def boot(version: str = NEWEST_VLLM, arch: str | None = None) -> dict[str, Any]:
    """Make vLLM importable here (see the module docstring); the boot record: where vLLM comes from,
    what was stubbed, and the ops build that was loaded (None where none is built)."""
    global BOOTED
    if BOOTED is not None:
        return BOOTED
    installed = installed_vllm()
    if installed is not None:
        import vllm

        BOOTED = {"vllm": vllm.__version__, "source": f"installed at {installed}", "stubs": [], "ops": None}
        return BOOTED
    from mxmoe.harness.upstream import vllm_ops
    from mxmoe.harness.upstream.fetch import import_triton_kernels

    site = unpack(version)
    stubs = []
    try:  # before vLLM is on the path: else its vendored copy would be found first
        tk = import_triton_kernels()
        stubs.append(f"triton_kernels from {Path(tk.__file__).parent} (the direct adapters' copy)")
    except VendorMissing as exc:
        stubs.append(f"triton_kernels: vLLM's vendored copy ({exc})")
    if str(site) not in sys.path:  # first, but after a vLLM source tree put first on purpose
        sys.path.insert(1 if "vllm" in sys.modules else 0, str(site))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    names = dict(PLACEHOLDERS)
    names.update({n: why for n, why in IMPORT_ONLY_STUBS.items() if importlib.util.find_spec(n) is None})
    stubs += [f"{name} (placeholder: {why})" for name, why in names.items()]
    if not any(isinstance(f, _Placeholders) for f in sys.meta_path):
        sys.meta_path.insert(0, _Placeholders(frozenset(names)))
    ops = None
    if arch is not None:
        ops = vllm_ops.load(version, arch)
    for ext in ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
        sys.modules.setdefault(ext, types.ModuleType(ext))
    where = "the project's build " + str(ops["hash"]) if ops else "none built: only TRITON can run"
    stubs.append(f"vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch (the ops vLLM's MoE layer calls: {where})")
    stubs += [f"{q} (answers False: no CUTLASS FP8 GEMM is built)" for q in _register_capability_queries()]
    import vllm

    where = Path(vllm.__file__).parent
    source = f"runtime {runtime_root(version)}"
    if where != site / "vllm":
        source = f"sources at {where} (the runtime's packages)"
    BOOTED = {"vllm": vllm.__version__, "source": source, "stubs": stubs, "ops": ops}
    return BOOTED


def installed_vllm() -> Path | None:
    """An installed vLLM's package folder: one with its compiled extensions (a source tree without
    them, such as a patched copy put first on ``sys.path``, is booted as the runtime is)."""
    spec = importlib.util.find_spec("vllm") if "vllm" not in sys.modules else sys.modules["vllm"].__spec__
    if spec is None or not spec.origin:
        return None
    folder = Path(spec.origin).parent
    return folder if any(folder.glob("_C*.so")) else None
