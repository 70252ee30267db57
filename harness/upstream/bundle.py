"""One folder with everything a GPU machine without network needs for the sign-off's production
kernels, made on a machine with network for the GPU machine's Python and platform.

Many GPU clusters have no network on their compute nodes. There the set-up (``gpu_setup``) reads
this folder instead of PyPI, and nothing else:

* ``wheels/``: FlashInfer (without its CUDA dependencies; each release asked for, by default the
  one the vLLM under test pins, each wheel cut to what the harness reads of it:
  ``flashinfer_cut``) and the FFI layer it imports, its light
  pure-Python dependencies, and lm-eval with the packages it imports that a GPU image with torch,
  transformers, pandas and scipy lacks (``LM_EVAL_DEPS``), pinned to a set that installs together.
  lm-eval's own task folders are left out of its wheel (9 of its 13 MiB): the harness reads only
  its own tasks. Three of those packages exist on PyPI as source packages only; they are pure
  Python and are built into wheels here. No wheel is torch, triton or numpy;
* ``vendor/``: OpenAI's triton_kernels as vLLM vendors it;
* vLLM's carryable runtime for that Python (``vllm_runtime``);
* ``sdist/``: vLLM's source package cut to its ``csrc/`` (what ``build-vllm-ops`` reads: 1.1 of
  45 MiB);
* ``bundle.json``: what is in it, each file's size and sha256, and for which Python and platform.

Measured for Python 3.12 on manylinux x86_64: see docs/setup.md.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from mxmoe.harness.upstream.fetch import DEFAULT_VLLM, NEWEST_VLLM, VendorMissing, triton_kernels_root
from mxmoe.harness.upstream.gpu_setup import FLASHINFER_LIGHT_DEPS, flashinfer_packages

MANIFEST = "bundle.json"
LM_EVAL = "lm-eval==0.4.13"
LM_EVAL_DEPS = (
    "datasets==5.2.0", "evaluate==0.4.6", "dill==0.4.1", "multiprocess==0.70.19", "nltk==3.10.4",
    "defusedxml==0.7.1", "more-itertools==11.2.1", "pytablewriter==1.2.1", "dataproperty==1.1.1",
    "tabledata==1.3.5", "typepy==1.3.5", "mbstrdecoder==1.1.5", "chardet==6.0.0.post1", "pathvalidate==3.3.1",
    "tcolorpy==0.1.7", "pytz==2026.6", "tenacity==9.2.1", "rouge-score==0.1.2", "sqlitedict==2.1.0",
    "word2number==1.1",
)  # fmt: skip
"""What lm-eval 0.4.13 (with its ``api`` extra) imports that the H200's image (torch, transformers,
pandas, scipy, aiohttp, ...) lacks, pinned to versions that install and import together there."""
SOURCE_ONLY = ("rouge-score", "sqlitedict", "word2number")
"""Of ``LM_EVAL_DEPS``, those PyPI has as source packages only (pure Python: built here)."""


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise VendorMissing(f"`pip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def without_tasks(wheel: Path) -> Path:
    """lm-eval's wheel rewritten in place without its task folders (``lm_eval/tasks/<name>/``; the
    modules directly in ``lm_eval/tasks/`` stay) and their RECORD lines."""
    tmp = wheel.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            parts = info.filename.split("/")
            if parts[:2] == ["lm_eval", "tasks"] and len(parts) > 3:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "\n".join(x for x in lines if not (x.startswith("lm_eval/tasks/") and x.count("/") > 2)).encode()
            dst.writestr(info, data)
    tmp.replace(wheel)
    return wheel


def csrc_only(sdist: Path, dest: Path) -> Path:
    """vLLM's source package cut to the members under its ``csrc/`` (what ``build-vllm-ops`` reads)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as src, tarfile.open(dest, "w:gz") as dst:
        for m in src.getmembers():
            if "/csrc/" in m.name and (m.isfile() or m.isdir()):
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(root: Path, python: str, platform: str, flashinfer: tuple[str, ...] = ()) -> dict[str, object]:
    """``bundle.json``'s content for the folder ``root`` as it is."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    items = [{"path": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files]
    return {
        "kind": "mxmoe-gpu-bundle",
        "python": python,
        "platform": platform,
        "vllm": NEWEST_VLLM,
        "flashinfer": list(flashinfer),
        "lm_eval": LM_EVAL.split("==")[1],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "total_bytes": sum(i["bytes"] for i in items),
        "files": items,
    }


def flashinfer_releases(data: dict[str, object]) -> tuple[str, ...]:
    """The FlashInfer releases a bundle's manifest lists (one name in bundles made before the list)."""
    held = data.get("flashinfer") or ()
    return (held,) if isinstance(held, str) else tuple(held)


def read_manifest(root: Path) -> dict[str, object]:
    """A bundle's manifest, checked for this interpreter: a bundle made for another Python holds
    binary wheels and a runtime that do not load here."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise VendorMissing(f"{root} is not a bundle (no {MANIFEST}): make one with `python -m harness bundle`")
    data = json.loads(path.read_text(encoding="utf-8"))
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if data.get("python") != here:
        raise VendorMissing(f"{root} was made for Python {data.get('python')}; this is Python {here}: make one with "
                            f"`python -m harness bundle --python-version {here}`")  # fmt: skip
    return data


def make(out: Path, python: str, platform: str = "manylinux_2_28_x86_64", log: Callable[[str], None] = print,
         flashinfer: tuple[str, ...] = ()) -> dict[str, object]:  # fmt: skip
    """Write the bundle (module docstring) into ``out`` (which must not exist yet), with each
    FlashInfer release of ``flashinfer`` (default: the one ``NEWEST_VLLM`` pins); its manifest."""
    from mxmoe.harness.upstream.flashinfer_cut import cut_wheel
    from mxmoe.harness.upstream.flashinfer_releases import resolve
    from mxmoe.harness.upstream.vllm_ops import fetch_source
    from mxmoe.harness.upstream.vllm_runtime import fetch_runtime, runtime_fetched, runtime_root

    if out.exists():
        raise VendorMissing(f"{out} exists: a bundle is written into a new folder")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    wheels = partial / "wheels"
    wheels.mkdir(parents=True)
    platforms = [platform, "any"]
    if platform.endswith("x86_64"):
        platforms[1:1] = ["manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                          "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
    target = ["--python-version", python, "--implementation", "cp", *(a for p in platforms for a in ("--platform", p))]
    binary = [d for d in LM_EVAL_DEPS if d.split("==")[0] not in SOURCE_ONLY]
    releases = tuple(dict.fromkeys(flashinfer)) or (resolve().release,)
    ffi = sorted({flashinfer_packages(r)[1] for r in releases})
    log(f"bundle: wheels for Python {python} on {platform} (lm-eval, FlashInfer's dependencies) ...")
    _pip("download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(wheels),
         *ffi, *FLASHINFER_LIGHT_DEPS, LM_EVAL, *binary)  # fmt: skip
    full = out.with_name(out.name + ".flashinfer")
    shutil.rmtree(full, ignore_errors=True)
    cuts = {}
    for release in releases:
        log(f"bundle: flashinfer-python {release}, cut to what the harness reads of it ...")
        _pip("download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(full),
             flashinfer_packages(release)[0])  # fmt: skip
        (wheel,) = full.glob(f"flashinfer_python-{release}-*.whl")
        cut = cut_wheel(wheel, wheels)
        cuts[release] = {k: cut[k] for k in ("wheel", "bytes", "full_bytes", "subset_generation", "subset_error")}
        log(f"bundle: flashinfer-python {release}: {cut['full_bytes'] / 2**20:.1f} MiB cut to "
            f"{cut['bytes'] / 2**20:.1f} MiB" + (f"; the SM90 subset cannot be built for it: {cut['subset_error']}"
                                                 if cut["subset_error"] else ""))  # fmt: skip
    shutil.rmtree(full, ignore_errors=True)
    _pip("wheel", "-q", "--no-deps", "-w", str(wheels), *(d for d in LM_EVAL_DEPS if d.split("==")[0] in SOURCE_ONLY))
    (lm_eval,) = wheels.glob("lm_eval-*.whl")
    without_tasks(lm_eval)
    log("bundle: triton_kernels, vLLM's runtime and vLLM's csrc/ ...")
    copy_triton_kernels(partial)
    runtime = runtime_root(NEWEST_VLLM, python)
    if not runtime_fetched(NEWEST_VLLM, python):
        runtime = fetch_runtime(NEWEST_VLLM, None, python, platform)
    shutil.copytree(runtime, partial / runtime.name, ignore=shutil.ignore_patterns("site", "site.*"))
    sdist = fetch_source(NEWEST_VLLM)
    csrc_only(sdist, partial / "sdist" / sdist.name)
    data = manifest(partial, python, platform, releases) | {"flashinfer_cut": cuts}
    (partial / MANIFEST).write_text(json.dumps(data, indent=1), encoding="utf-8")
    partial.rename(out)
    log(f"bundle: {out}, {data['total_bytes'] / 2**20:.1f} MiB in {len(data['files'])} files")
    return data


def copy_triton_kernels(partial: Path) -> Path:
    """Copy the cached triton_kernels (fetched first where missing) to where ``offline_sources``
    looks for it; the copy's path. The cache's root folder is copied, whatever the fetch returned:
    ``fetch_triton_kernels`` answers with the package folder inside it, and a bundle made from an
    empty cache once held that folder under the wrong name, so the GPU set-up found none."""
    from mxmoe.harness.upstream.fetch import fetch_triton_kernels

    root = triton_kernels_root(DEFAULT_VLLM)
    if not (root / "triton_kernels" / "__init__.py").is_file():
        fetch_triton_kernels(DEFAULT_VLLM)
    dest = offline_sources(partial)["triton-kernels"]
    shutil.copytree(root, dest)
    return dest


def offline_sources(root: Path) -> dict[str, Path]:
    """Where a bundle holds each piece the set-up copies from it (``gpu_setup.plan``)."""
    from mxmoe.harness.upstream.vllm_runtime import runtime_root

    return {
        "wheels": root / "wheels",
        "triton-kernels": root / "vendor" / triton_kernels_root(DEFAULT_VLLM).name,
        "vllm-runtime": root / runtime_root(NEWEST_VLLM).name,
        "vllm-source": root / "sdist" / f"vllm-{NEWEST_VLLM}.tar.gz",
    }
