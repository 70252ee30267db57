"""The bundle's cut of flashinfer-python (``harness.upstream.flashinfer_cut``): what the FlashInfer
backends import and what the SM90 build reads must all be in it. Checked on the newest release
(``NEWEST_FLASHINFER``, the largest wheel), from the copy ``./dev test`` fetches into the cache:
the adapters' and the subset build's imports are read from their sources and imported from the
cut; FlashInfer's ``fused_moe_90`` spec and the subset's are made from the cut, and every file of
theirs, and every header the full release resolves for them, is there. The wheel's packaging (its
RECORD, an offline pip install) is checked on a small wheel made here."""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mxmoe.harness.upstream import flashinfer_cut as cut
from mxmoe.harness.upstream.fetch import flashinfer_root
from mxmoe.kernels.flashinfer_common import NEWEST_FLASHINFER

ROOT = Path(__file__).resolve().parents[2]
READERS = (*sorted((ROOT / "kernels").glob("flashinfer*.py")), ROOT / "kernels" / "vllm_layer.py",
           ROOT / "harness" / "upstream" / "flashinfer_sm90.py")  # fmt: skip
"""The project's files that import FlashInfer on a GPU machine."""


def flashinfer_imports(path: Path) -> set[str]:
    """The flashinfer modules ``path`` imports, by statement or by name in a tuple of names (the
    adapters look the enums up in the first of several modules that has them)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, (ast.Tuple, ast.List)):
            out |= {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return {m for m in out if re.fullmatch(r"flashinfer(\.\w+)*", m)}


def test_every_flashinfer_module_the_harness_imports_is_an_entry_of_the_cut():
    imported = set().union(*(flashinfer_imports(p) for p in READERS))
    assert {"flashinfer.fused_moe", "flashinfer.jit.fused_moe", "flashinfer.autotuner"} <= imported  # the reader works
    assert imported <= set(cut.ENTRY_MODULES), sorted(imported - set(cut.ENTRY_MODULES))


@pytest.fixture(scope="module")
def newest(tmp_path_factory):
    """The newest release's cut, as a tree: (full package parent, cut package parent, reads)."""
    full = flashinfer_root(NEWEST_FLASHINFER)
    if not (full / "flashinfer" / "__init__.py").is_file():
        pytest.skip(f"flashinfer-python {NEWEST_FLASHINFER} is not in {full}: `./dev test` fetches it on hosts "
                    f"without a GPU, or run `python -m harness fetch flashinfer --flashinfer-version "
                    f"{NEWEST_FLASHINFER}`")  # fmt: skip
    tmp = tmp_path_factory.mktemp("cut")
    reads = cut.build_reads(full, tmp / "work")
    kept = cut.kept(full, reads)
    dest = tmp / "pkg"
    for name in kept:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(full / name, dest / name)
    return full, dest, reads


_FROM_CUT = r"""
import importlib, json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from mxmoe.harness.upstream import flashinfer_cut as cut
imported = [m for m in cut.ENTRY_MODULES if importlib.import_module(m)]
import flashinfer
print(json.dumps({"imported": imported, "file": flashinfer.__file__, "version": flashinfer.__version__}))
"""


def test_the_cut_imports_what_the_backends_import_and_nothing_comes_from_elsewhere(newest):
    full, dest, _ = newest
    present = [m for m in cut.ENTRY_MODULES if cut.module_file(full, m) is not None]
    proc = subprocess.run([sys.executable, "-c", _FROM_CUT, str(dest)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)  # fmt: skip
    if proc.returncode != 0 and "No module named" in proc.stderr:
        missing = proc.stderr.strip().splitlines()[-1]
        pytest.fail(f"the cut of flashinfer {NEWEST_FLASHINFER} lacks a module the harness imports: {missing}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(out["imported"]) == sorted(present)
    assert Path(out["file"]).resolve().is_relative_to(dest.resolve()) and out["version"] == NEWEST_FLASHINFER


def test_the_cut_holds_every_source_and_header_of_the_sm90_build(newest):
    full, dest, reads = newest
    assert reads.error is None, reads.error  # the subset knows this release
    assert len(reads.sources) > 150 and 0 < len(reads.subset) < len(reads.sources)
    again = cut.build_reads(dest, dest.parent / "work-cut")  # the specs, made from the cut alone
    assert again.error is None and [s.name for s in again.subset] == [s.name for s in reads.subset]
    assert all(s.is_file() for s in again.sources), [str(s) for s in again.sources if not s.is_file()][:5]
    full_root, cut_root = (full / "flashinfer").resolve(), (dest / "flashinfer").resolve()
    wanted = {f.relative_to(full_root) for f in reads.files}
    have = {f.relative_to(cut_root) for f in again.files}
    assert wanted - have == set(), sorted(map(str, wanted - have))[:10]
    assert len(wanted) > 500  # CUTLASS, CCCL and TensorRT-LLM's headers were followed


def _tiny_wheel(path: Path) -> Path:
    wheel = path / "flashinfer_python-9.9.9-py3-none-any.whl"
    info = "flashinfer_python-9.9.9.dist-info"
    files = {"flashinfer/__init__.py": b"__version__ = '9.9.9'\n", "flashinfer/data/csrc/other_product.cu": b"x" * 100,
             "flashinfer/fused_moe/__init__.py": b"",
             f"{info}/METADATA": b"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 9.9.9\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}  # fmt: skip
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("flashinfer_python-9.9.9.dist-info/RECORD", "".join(f"{n},,\n" for n in files))
    return wheel


def test_a_cut_wheel_lists_what_it_holds_and_pip_installs_it_offline(tmp_path, monkeypatch):
    wheel = _tiny_wheel(tmp_path)
    reads = cut.Reads("9.9.9", (), (), (), frozenset(), "a stand-in: no fused_moe_90 here", None)
    monkeypatch.setattr(cut, "build_reads", lambda pkg, work: reads)
    note = cut.cut_wheel(wheel, tmp_path / "out")
    assert note["dropped_files"] == 1 and note["subset_error"] == "a stand-in: no fused_moe_90 here"
    got = tmp_path / "out" / wheel.name
    with zipfile.ZipFile(got) as z:
        names = set(z.namelist())
        assert "flashinfer/data/csrc/other_product.cu" not in names and "flashinfer/fused_moe/__init__.py" in names
        for line in z.read("flashinfer_python-9.9.9.dist-info/RECORD").decode().split():
            name, digest, size = line.split(",")
            if digest:
                data = z.read(name)
                want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert (digest, int(size)) == (f"sha256={want}", len(data)), name
        assert {line.split(",")[0] for line in z.read("flashinfer_python-9.9.9.dist-info/RECORD").decode().split()} == (
            names)  # fmt: skip
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                           str(target), str(got)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (target / "flashinfer" / "fused_moe" / "__init__.py").is_file()
    assert json.loads((target / "flashinfer_python-9.9.9.dist-info" / cut.CUT_NOTE).read_text())["kept_files"] == 4
