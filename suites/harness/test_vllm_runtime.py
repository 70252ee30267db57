"""``harness.upstream.vllm_runtime``, vLLM's carryable runtime: what the pack keeps of a wheel, the
unpack, the boot of the real cached runtime for this Python (``python -m harness fetch
vllm-runtime``) in a process of its own (a boot changes ``sys.path`` and ``sys.modules`` for good),
with a patched copy of vLLM first on the path as the mutation worker puts one, ``installed_vllm``,
and the fetch command's refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import types
import zipfile
from pathlib import Path

import pytest

from mxmoe.harness.upstream.fetch import NEWEST_VLLM, VendorMissing
from mxmoe.harness.upstream.vllm_probe import IMPORT_ONLY_STUBS
from mxmoe.harness.upstream.vllm_runtime import (
    CAPABILITY_QUERIES,
    PLACEHOLDERS,
    _pack_sources,
    installed_vllm,
    runtime_fetched,
    runtime_root,
    this_python,
    unpack,
)

LAYER_MODULES = ("vllm.model_executor.layers.fused_moe.oracle.mxfp4", "vllm.model_executor.layers.quantization.mxfp4")
"""What the vLLM driver imports (``kernels/vllm_layer.py``'s ``check_call``)."""

_WHEEL = {
    "vllm/__init__.py": b"__version__ = '0.0'\n",
    "vllm/_C.abi3.so": b"\x7fELF compiled",
    "vllm/x/y.json": b'{"a": 1}\n',
    "vllm/include/a.h": b"#pragma once\n",
    "vllm/templates/t.jinja": b"{{ x }}\n",
    "vllm/../evil.py": b"raise SystemExit\n",
    "other/__init__.py": b"",
    "vllm-0.0.dist-info/METADATA": b"Name: vllm\nVersion: 0.0\n",
    "vllm-0.0.dist-info/RECORD": b"vllm/__init__.py,,\n",
}


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def _members(tar_path: Path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_the_pack_keeps_vllms_python_configs_and_metadata_and_drops_compiled_code_headers_and_record(tmp_path):
    dest = tmp_path / "vllm-py.tar.gz"
    counts = _pack_sources(_wheel(tmp_path / "vllm-0.0-cp38-abi3-linux_x86_64.whl", _WHEEL), dest)
    got = _members(dest)
    kept = ["vllm/__init__.py", "vllm/x/y.json", "vllm/templates/t.jinja", "vllm-0.0.dist-info/METADATA"]
    assert sorted(got) == sorted(kept)
    assert all(got[n] == _WHEEL[n] for n in kept)  # byte for byte
    assert counts == {"files": len(kept), "bytes": sum(len(_WHEEL[n]) for n in kept)}


def test_the_pack_of_a_wheel_without_vllm_is_refused(tmp_path):
    wheel = _wheel(tmp_path / "other.whl", {"other/__init__.py": b"", "vllm/_C.abi3.so": b"", "vllm/a.h": b""})
    with pytest.raises(VendorMissing, match="holds no vllm/ package"):
        _pack_sources(wheel, tmp_path / "out.tar.gz")


def _runtime(cache: Path, manifest: dict) -> Path:
    """A synthetic runtime for this Python in ``cache``: a one-module vLLM and one dependency wheel."""
    root = cache / f"vllm-runtime-{NEWEST_VLLM}-py{this_python()}"
    (root / "wheels").mkdir(parents=True)
    _pack_sources(_wheel(root / "src.whl", {"vllm/__init__.py": b"X = 1\n"}), root / "vllm-py.tar.gz")
    (root / "src.whl").unlink()
    _wheel(root / "wheels" / "dep-1.0-py3-none-any.whl", {"dep/__init__.py": b"Y = 2\n"})
    (root / "runtime.json").write_text(json.dumps(manifest))
    return root


def test_unpack_extracts_the_runtime_once_beside_it_and_again_when_it_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path))
    monkeypatch.delenv("MXMOE_VLLM_SITE", raising=False)
    assert not runtime_fetched()
    with pytest.raises(VendorMissing, match=f"python -m harness fetch vllm-runtime --vllm-version {NEWEST_VLLM}"):
        unpack()
    root = _runtime(tmp_path, {"vllm": NEWEST_VLLM, "n": 1})
    assert runtime_fetched() and runtime_root() == root
    site = unpack()
    assert site == root / "site"
    assert (site / "vllm/__init__.py").read_text() == "X = 1\n" and (site / "dep/__init__.py").is_file()
    (site / "dep/__init__.py").write_text("edited\n")
    assert unpack() == site and (site / "dep/__init__.py").read_text() == "edited\n"  # once: not again
    (root / "runtime.json").write_text(json.dumps({"vllm": NEWEST_VLLM, "n": 2}))
    assert unpack() == site and (site / "dep/__init__.py").read_text() == "Y = 2\n"  # a new runtime: again
    assert not (root / "site.partial").exists()
    monkeypatch.setenv("MXMOE_VLLM_SITE", str(tmp_path / "elsewhere"))
    assert unpack() == tmp_path / "elsewhere" and (tmp_path / "elsewhere/vllm/__init__.py").is_file()


def test_processes_unpacking_one_runtime_at_once_all_get_it(monkeypatch, tmp_path):
    import subprocess
    import sys

    root = _runtime(tmp_path, {"vllm": NEWEST_VLLM, "n": 1})
    env = {**__import__("os").environ, "MXMOE_CACHE": str(tmp_path)}
    env.pop("MXMOE_VLLM_SITE", None)
    code = "from mxmoe.harness.upstream.vllm_runtime import unpack; print(unpack())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-800:] for _, e in outs]
    assert {o.strip() for o, _ in outs} == {str(root / "site")}
    assert (root / "site/vllm/__init__.py").read_text() == "X = 1\n" and not (root / "site.partial").exists()


# ---- installed_vllm, on synthetic packages (this process's import state restored after each)


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    """This process without any vLLM: none imported, and a path of the tests' own folders only."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty")])
    return monkeypatch


def _package(where: Path, compiled: bool) -> Path:
    pkg = where / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if compiled:
        (pkg / "_C.abi3.so").write_bytes(b"")
    return pkg


def test_installed_vllm_is_a_package_with_its_compiled_extensions_only(no_vllm, tmp_path):
    import importlib

    assert installed_vllm() is None  # nothing at all
    tree = _package(tmp_path / "tree", compiled=False)
    no_vllm.setattr(sys, "path", [str(tmp_path / "tree")])
    importlib.invalidate_caches()
    assert installed_vllm() is None  # a source tree (a patched copy): booted as the runtime is
    assert "vllm" not in sys.modules  # asked, not imported
    installed = _package(tmp_path / "installed", compiled=True)
    no_vllm.setattr(sys, "path", [str(tmp_path / "installed"), str(tmp_path / "tree")])
    importlib.invalidate_caches()
    assert installed_vllm() == installed
    # an imported vLLM is the one that counts, wherever the path points now
    imported = types.ModuleType("vllm")
    imported.__spec__ = importlib.util.spec_from_file_location("vllm", tree / "__init__.py")
    no_vllm.setitem(sys.modules, "vllm", imported)
    assert installed_vllm() is None


# ---- the real runtime, booted in a process of its own

_BOOT = textwrap.dedent(
    """
    import importlib, importlib.util, json, sys
    copy = sys.argv[1]
    from mxmoe.harness.upstream import vllm_runtime as vr
    if copy:  # as the mutation worker does: a copy of the package first on the path, imported first
        sys.path.insert(0, copy)
        import vllm
    missing = [n for n in vr.IMPORT_ONLY_STUBS if importlib.util.find_spec(n) is None]
    record = vr.boot()
    again = vr.boot() is record
    layer = {n: importlib.import_module(n).__file__ for n in sys.argv[2:]}
    import numpy, torch, triton, vllm
    import vllm.vllm_flash_attn as fa
    queries = {q.split("(")[0]: getattr(torch.ops._C, q.split("(")[0])(90) for q in vr.CAPABILITY_QUERIES}
    print(json.dumps({
        "record": record, "again": again, "layer": layer, "missing": missing, "queries": queries,
        "files": {m.__name__: m.__file__ for m in (numpy, torch, triton, vllm)},
        "flash_attn": type(fa).__name__ + ":" + str(getattr(fa, "__file__", None)),
        "site": str(vr.site_dir()), "root": str(vr.runtime_root()), "ext": "vllm._C_stable_libtorch" in sys.modules,
    }))
    """
)


def unpacked_runtime() -> Path:
    """The runtime's site (``unpack`` locks: xdist workers may call it at once)."""
    if not runtime_fetched():
        pytest.skip(f"vLLM {NEWEST_VLLM}'s runtime for Python {this_python()} is not at {runtime_root()}: python -m "
                    "harness fetch vllm-runtime")  # fmt: skip
    return unpack()


@pytest.fixture(scope="module")
def boots(tmp_path_factory) -> dict[str, dict]:
    """The runtime booted in two fresh interpreters at once: as the driver boots it ("runtime"),
    and with a copy of its vllm package first on the path and imported before the boot, as the
    mutation worker runs a patched copy ("copy", the copy in ``copy_dir``). What each saw, as JSON
    (or its failure)."""
    if installed_vllm() is not None:
        pytest.skip(f"vLLM is installed here ({installed_vllm()}): boot uses it as it is, the runtime is not booted")
    site = unpacked_runtime()
    tmp = tmp_path_factory.mktemp("vllm-boot")
    script = tmp / "boot.py"
    script.write_text(_BOOT)
    copy = tmp / "copy"
    # the site's compiled modules come along (except any being written this moment)
    shutil.copytree(site / "vllm", copy / "vllm", ignore=shutil.ignore_patterns("*.pyc.*"))
    import mxmoe

    here = str(Path(mxmoe.__file__).resolve().parents[1])  # the checkout (or site-packages) holding mxmoe
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = os.environ | {"VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": path}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(script), arg, *LAYER_MODULES],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, arg in (("runtime", ""), ("copy", str(copy)))
    }
    got: dict[str, dict] = {"copy_dir": {"path": str(copy)}}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        got[name] = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else {"failed": err[-4000:]}
    return got


def _under(path: str, folder: str) -> bool:
    return Path(folder).resolve() in Path(path).resolve().parents


@pytest.mark.long(20)
def test_boot_makes_vllms_layer_importable_from_the_runtime_on_this_python(boots):
    got = boots["runtime"]
    assert "failed" not in got, got.get("failed")
    record, site = got["record"], got["site"]
    assert site == str(unpacked_runtime())
    assert record["vllm"] == NEWEST_VLLM and record["ops"] is None
    assert record["source"] == f"runtime {got['root']}"
    assert got["again"]  # once per process
    assert _under(got["files"]["vllm"], site) and Path(got["files"]["vllm"]).parent == Path(site) / "vllm"
    assert set(got["layer"]) == set(LAYER_MODULES)
    assert all(_under(f, str(Path(site) / "vllm")) for f in got["layer"].values()), got["layer"]
    for name in ("torch", "triton", "numpy"):  # the environment's, never the runtime's
        assert not _under(got["files"][name], site) and not _under(got["files"][name], got["root"]), got["files"]
    stubs = record["stubs"]
    for name in [*PLACEHOLDERS, *got["missing"]]:
        assert any(s.startswith(f"{name} (placeholder: ") for s in stubs), (name, stubs)
    for name in set(IMPORT_ONLY_STUBS) - set(got["missing"]):
        assert not any(s.startswith(f"{name} (placeholder") for s in stubs), (name, stubs)
    queries = [q.split("(")[0] for q in CAPABILITY_QUERIES]
    for q in queries:
        assert f"_C::{q} (answers False: no CUTLASS FP8 GEMM is built)" in stubs, stubs
    assert got["queries"] == dict.fromkeys(queries, False)
    ext = "vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch"
    assert any(s.startswith(ext) and "none built: only TRITON can run" in s for s in stubs), stubs
    assert any(s.startswith("triton_kernels") for s in stubs)
    assert got["flash_attn"].startswith("module:") and got["ext"]


@pytest.mark.long(20)
def test_boot_with_a_copy_of_vllm_first_on_the_path_runs_the_copy(boots):
    got, copy = boots["copy"], Path(boots["copy_dir"]["path"])
    assert "failed" not in got, got.get("failed")
    record = got["record"]
    assert record["vllm"] == NEWEST_VLLM
    assert record["source"].startswith(f"sources at {copy / 'vllm'}"), record["source"]
    assert Path(got["files"]["vllm"]).parent == copy / "vllm"
    assert all(_under(f, str(copy / "vllm")) for f in got["layer"].values()), got["layer"]
    assert all(not _under(f, got["site"]) for f in got["layer"].values())


# ---- the fetch command's refusals (``python -m harness``'s main, in this process: nothing is fetched)


def harness(capsys, *args: str) -> tuple[int, str]:
    """``python -m harness ARGS``' exit status and stderr."""
    from mxmoe.harness.cli.app import main

    try:
        status = main(list(args))
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err


def test_fetch_refuses_a_python_version_that_is_not_major_dot_minor(capsys):
    status, err = harness(capsys, "fetch", "vllm-runtime", "--python-version", "3")
    assert status == 2, err
    assert "--python-version: a Python version such as 3.12, not '3'" in err


def test_fetch_of_vllms_source_package_takes_no_wheel(capsys, tmp_path):
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    status, err = harness(capsys, "fetch", "vllm-source", "--wheel", str(wheel))
    assert status == 2, err
    assert "--wheel: a vLLM wheel; vllm-source is fetched from PyPI" in err
