"""Vendor code that is not installed as a package: where it is cached, how it is fetched, how it
is imported.

OpenAI's ``triton_kernels`` (the TRITON and TRITON_UNFUSED kernels) is not on PyPI under its own
name: PyPI's ``triton-kernels`` is an unrelated package that takes the import name, so it is never
installed. vLLM's wheels vendor the copy vLLM runs (``vllm/third_party/triton_kernels``, v3.5.1 in
vLLM 0.26.0, MIT). ``python -m harness fetch triton-kernels`` takes that folder out of the wheel
(downloaded with ``pip download --no-deps``, or a wheel given on the command line for machines with
no network) into the cache; it is never committed. ``import_triton_kernels`` then finds, in order:
an installed OpenAI ``triton_kernels``, an installed vLLM's vendored copy, the cached copy.

The cache is ``$MXMOE_CACHE`` if set, else ``.cache/`` of a source checkout (git-ignored), else
``~/.cache/mxmoe``.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

from mxmoe.harness.contract.platforms import cache_dir

DEFAULT_VLLM = "0.26.0"
"""The vLLM release whose vendored triton_kernels (v3.5.1, the API vLLM runs on triton 3.6) is fetched."""
NEWEST_VLLM = "0.34.0"
"""The vLLM release the project follows: the declarations, the selection oracle, the drift check's
default, the carryable runtime, the ops build and the vendor patches are its."""
PREVIOUS_VLLM = "0.33.0"
"""The release before NEWEST_VLLM, kept: ``vllm-drift`` checks it too, the runtime and the ops build
can be made for it (``--vllm-version``), and ``MXMOE_VLLM_VERSION`` runs vLLM's layer from it."""
TRITON_KERNELS_IN_WHEEL = "vllm/third_party/triton_kernels/"


def release(version: str) -> tuple[int, ...]:
    """``"0.34.0+cu130"`` -> (0, 34, 0); parts that are not numbers end it."""
    out = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


class VendorMissing(Exception):
    """Vendor code that is neither installed nor cached; the message says how to get it."""


def triton_kernels_root(vllm_version: str = DEFAULT_VLLM) -> Path:
    """The folder put on ``sys.path`` for the cached copy (it holds ``triton_kernels/``)."""
    return cache_dir() / "vendor" / f"triton_kernels-vllm-{vllm_version}"


def download_vllm_wheel(vllm_version: str = DEFAULT_VLLM, dest: Path | None = None) -> Path:
    """``pip download --no-deps vllm==<version>`` into the cache (about 300 MB); the wheel's path.
    An existing download is reused."""
    dest = dest or cache_dir() / "wheels"
    found = sorted(dest.glob(f"vllm-{vllm_version}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"vllm=={vllm_version}", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"vllm-{vllm_version}-*.whl"))
    if proc.returncode != 0 or not found:
        raise VendorMissing(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return found[0]


def flashinfer_root(version: str) -> Path:
    """The cached copy of flashinfer-python ``version``'s package (put first on ``sys.path`` by the
    processes that read it; never installed into the environment under test)."""
    return cache_dir() / "vendor" / f"flashinfer-{version}"


def fetch_flashinfer(version: str) -> Path:
    """``pip install --no-deps --target`` flashinfer-python ``version`` into the cache (about 600 MB
    unpacked), for the layout cross-checks against a FlashInfer release other than the installed one;
    an existing copy is reused. Returns its folder."""
    root = flashinfer_root(version)
    if (root / "flashinfer" / "__init__.py").is_file():
        return root
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
           f"flashinfer-python=={version}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (partial / "flashinfer" / "__init__.py").is_file():
        shutil.rmtree(partial, ignore_errors=True)
        raise VendorMissing(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


def extract_triton_kernels(wheel: Path, root: Path) -> Path:
    """Copy ``vllm/third_party/triton_kernels`` of ``wheel`` to ``root/triton_kernels`` (replacing
    what is there); the package folder's path. Only that folder is read from the wheel."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(TRITON_KERNELS_IN_WHEEL) and not n.endswith("/")]
        if not any(n == TRITON_KERNELS_IN_WHEEL + "__init__.py" for n in names):
            raise VendorMissing(
                f"{wheel} has no {TRITON_KERNELS_IN_WHEEL}__init__.py (not a vLLM wheel that vendors it)"
            )
        target = root / "triton_kernels"
        tmp = root / "triton_kernels.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        for name in names:
            rel = name[len(TRITON_KERNELS_IN_WHEEL) :]
            if ".." in Path(rel).parts:
                raise VendorMissing(f"{wheel}: refusing the path {name!r}")
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
        (tmp / "SOURCE.txt").write_text(f"extracted from {wheel.name} ({TRITON_KERNELS_IN_WHEEL}); MIT, (c) OpenAI\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def fetch_triton_kernels(vllm_version: str = DEFAULT_VLLM, wheel: Path | None = None) -> Path:
    """Put vLLM's vendored triton_kernels into the cache, from ``wheel`` or a download; its path."""
    wheel = wheel or download_vllm_wheel(vllm_version)
    return extract_triton_kernels(Path(wheel), triton_kernels_root(vllm_version))


def _is_openai_triton_kernels(package_dir: Path) -> bool:
    """OpenAI's package has the ``matmul_ogs`` and ``routing`` modules (v3.5.1, vLLM's pin);
    PyPI's unrelated ``triton-kernels`` has neither."""
    return (package_dir / "matmul_ogs.py").is_file() and (package_dir / "routing.py").is_file()


def _package_dir(module: ModuleType) -> Path:
    return Path(getattr(module, "__file__", "") or "").parent


def import_triton_kernels(vllm_version: str = DEFAULT_VLLM) -> ModuleType:
    """OpenAI's ``triton_kernels`` (v3.5.1 API) under its own name: installed, vLLM's vendored
    copy, or the cache. Raises VendorMissing, saying how to fetch it, when none is there."""
    tried = []
    if "triton_kernels" in sys.modules:
        mod = sys.modules["triton_kernels"]
        if _is_openai_triton_kernels(_package_dir(mod)):
            return mod
        tried.append(f"the imported triton_kernels at {getattr(mod, '__file__', '?')} is not OpenAI's v3.5.1 API")
    elif (spec := importlib.util.find_spec("triton_kernels")) is not None:
        base = Path(spec.origin or "").parent
        if _is_openai_triton_kernels(base):
            return importlib.import_module("triton_kernels")
        tried.append(
            f"an installed triton_kernels at {base} is not OpenAI's v3.5.1 API (PyPI's 'triton-kernels' is an "
            "unrelated package; triton_kernels >= 3.6 dropped the routing module vLLM 0.26 uses)"
        )
    if importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("vllm.third_party.triton_kernels"):
        mod = importlib.import_module("vllm.third_party.triton_kernels")
        sys.modules["triton_kernels"] = mod  # its modules import it as `triton_kernels`, as vLLM arranges
        return mod
    tried.append("vLLM is not installed")
    root = triton_kernels_root(vllm_version)
    if (root / "triton_kernels" / "__init__.py").is_file():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        mod = importlib.import_module("triton_kernels")
        if _is_openai_triton_kernels(_package_dir(mod)):
            return mod
        tried.append(f"{root} holds no OpenAI triton_kernels")
    else:
        tried.append(f"no cached copy at {root}")
    raise VendorMissing(
        "OpenAI triton_kernels not found (" + "; ".join(tried) + "). Fetch vLLM's vendored copy with "
        "`python -m harness fetch triton-kernels` (downloads the vLLM wheel, ~300 MB; `--wheel PATH` takes one "
        "you carried), or install vLLM. Never `pip install triton-kernels`: that is an unrelated package."
    )
