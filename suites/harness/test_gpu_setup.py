"""The GPU machine's set-up (``harness.upstream.gpu_setup``, ``python -m harness setup-gpu``): what
it would fetch and build on a GPU host, planned here with the GPU faked, and how it runs its steps
(each a process; a failure named, the rest going on)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from mxmoe.harness.run.registry import discover
from mxmoe.harness.upstream import bundle, gpu_setup
from mxmoe.harness.upstream.fetch import NEWEST_VLLM, VendorMissing
from mxmoe.harness.upstream.flashinfer_releases import resolve
from mxmoe.harness.upstream.gpu_setup import Host, plan, run

FRESH = Host(arch="sm90", flashinfer=None, triton_kernels=False, vllm_installed=False, runtime=False, source=False,
             ops=False, subset=False)  # fmt: skip
"""A fresh Hopper machine: a CUDA torch and triton, nothing else of the production kernels'."""
PRODUCTION_SM90 = {"triton", "triton-modular", "triton-unfused", "flashinfer-cutlass-mxfp4-bf16", "vllm-triton",
                   "vllm-triton-unfused", "vllm-flashinfer-cutlass-mxfp4-bf16", "marlin"}  # fmt: skip
"""The production kernels that run on an H200 once everything is set up (measured there)."""
ROOT = Path(__file__).resolve().parents[2]


def _argvs(steps: list) -> list[str]:
    return [" ".join(a.removeprefix(sys.executable) for a in argv).strip() for s in steps for argv in s.commands]


def test_a_fresh_hopper_host_gets_every_piece_of_every_production_kernel_and_never_a_torch_or_triton():
    steps = plan(FRESH, ".cache/keep-installed.txt")
    assert [s.name for s in steps] == ["triton-kernels", "flashinfer", "flashinfer-sm90-subset", "vllm-runtime",
                                       "vllm-source", "vllm-ops"]  # fmt: skip
    assert all(s.skip is None for s in steps)
    # every production kernel that runs on an H200 has each of its pieces planned, and every id named is one
    assert set().union(*(s.backends for s in steps)) == PRODUCTION_SM90
    ids = {item.backend.declaration.id for item in discover()}
    assert PRODUCTION_SM90 <= ids
    argvs = _argvs(steps)
    assert argvs[0] == "-m harness fetch triton-kernels --vllm-version 0.26.0"
    release = resolve().release  # the release NEWEST_VLLM pins (or the nearest newer one)
    assert argvs[2] == f"-m pip install -q -c .cache/keep-installed.txt --no-deps flashinfer-python=={release}"
    assert argvs[3:] == [f"-m harness build-flashinfer --if-missing --flashinfer-version {release}",
                         "-m harness fetch vllm-runtime",
                         "-m harness fetch vllm-source", "-m harness build-vllm-ops --arch sm90"]  # fmt: skip
    pip_args = [a for s in steps for argv in s.commands if "pip" in argv for a in argv[argv.index("install") + 1 :]]
    assert not [a for a in pip_args if a.split("=")[0] in ("torch", "triton", "numpy", "pytorch-triton-rocm")]
    assert all("-c" in argv for s in steps for argv in s.commands if "pip" in argv)  # the installed ones pinned


def test_what_a_host_has_is_never_fetched_or_built_again():
    release = resolve().release
    have = replace(FRESH, flashinfer=release, triton_kernels=True, runtime=True, source=True, ops=True, subset=True)
    steps = plan(have)
    assert [s.skip for s in steps] == ["importable already", f"flashinfer-python {release} is installed",
                                       "built already for this FlashInfer", "fetched already",
                                       "the ops are built already",
                                       "built already for this vLLM release and arch"]  # fmt: skip
    installed = plan(replace(FRESH, vllm_installed=True))
    assert [s.name for s in installed if s.skip is None] == ["triton-kernels", "flashinfer", "flashinfer-sm90-subset"]
    assert {s.skip for s in installed[3:]} == {"vLLM is installed, with its own compiled ops"}


@pytest.mark.parametrize(("arch", "runs"), [
    ("sm100", ["triton-kernels", "flashinfer", "vllm-runtime", "vllm-source", "vllm-ops"]),
    ("sm80", ["triton-kernels", "vllm-runtime", "vllm-source", "vllm-ops"]),
    ("gfx942", ["triton-kernels"]),
    ("cpu", []),
])  # fmt: skip
def test_each_architecture_gets_the_pieces_its_kernels_run_on(arch, runs):
    steps = plan(replace(FRESH, arch=arch))
    assert [s.name for s in steps if s.skip is None] == runs
    assert all(s.skip for s in steps if s.name not in runs)
    if "vllm-ops" in runs:
        assert steps[-1].commands[-1][-2:] == ("--arch", arch)


def test_a_failing_step_is_named_with_its_reason_and_the_rest_goes_on():
    """FlashInfer's install fails: the SM90 subset, which needs it, does not run, and says so; vLLM's
    pieces still run; every line says what and how long, or why not and what goes without it."""
    calls, lines = [], []

    def runner(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
        calls.append(argv)
        failing = "--no-deps" in argv and any(a.startswith("flashinfer-python") for a in argv)
        return subprocess.CompletedProcess(argv, 1 if failing else 0, "", "ERROR: No matching distribution" if failing
                                           else "")  # fmt: skip

    done = run(plan(FRESH), lines.append, runner)
    assert [(d.step.name, d.status) for d in done] == [
        ("triton-kernels", "ran"), ("flashinfer", "failed"), ("flashinfer-sm90-subset", "failed"),
        ("vllm-runtime", "ran"), ("vllm-source", "ran"), ("vllm-ops", "ran")]  # fmt: skip
    assert done[1].reason.endswith("exited 1: ERROR: No matching distribution")
    assert done[2].reason == "needs flashinfer, which failed"
    assert not [c for c in calls if "build-flashinfer" in c]
    text = "\n".join(lines)
    assert "setup: flashinfer: FAILED after 0 s: `-m pip install" in text
    assert "the sign-off goes on without flashinfer-cutlass-mxfp4-bf16, vllm-flashinfer-cutlass-mxfp4-bf16" in text
    assert "setup: vllm-ops: done in 0 s" in text


def test_the_probe_and_the_plan_command_run_here():
    host = gpu_setup.probe("sm90")  # this host's real cache and packages, asked as a Hopper host would
    assert host.arch == "sm90" and isinstance(host.runtime, bool)
    proc = subprocess.run([sys.executable, "-m", "harness", "setup-gpu", "--plan"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "set-up plan for this" in proc.stdout, proc.stderr


def _bundle(tmp_path: Path) -> Path:
    """A bundle folder of the real layout with stand-in contents (the real one is 50 MiB of
    downloads: docs/setup.md has its measured size and manifest)."""
    root = tmp_path / "bundle"
    src = bundle.offline_sources(root)
    src["wheels"].mkdir(parents=True)
    (src["triton-kernels"] / "triton_kernels").mkdir(parents=True)
    (src["triton-kernels"] / "triton_kernels" / "__init__.py").write_text("")
    src["vllm-runtime"].mkdir(parents=True)
    (src["vllm-runtime"] / "runtime.json").write_text("{}")
    src["vllm-source"].parent.mkdir(parents=True)
    src["vllm-source"].write_bytes(b"tarball")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    (root / bundle.MANIFEST).write_text(json.dumps(bundle.manifest(root, here, "manylinux_2_28_x86_64")))
    return root


def test_a_bundle_made_from_an_empty_cache_holds_triton_kernels_where_the_set_up_reads_it(tmp_path, monkeypatch):
    """The fetch answers with the package folder inside the cache's root: a bundle made from an
    empty cache once copied that folder under the wrong name, and the GPU set-up found nothing."""
    from mxmoe.harness.upstream import fetch

    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux1_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fetch.TRITON_KERNELS_IN_WHEEL + "__init__.py", "")
        z.writestr(fetch.TRITON_KERNELS_IN_WHEEL + "matmul_ogs.py", "# stand-in\n")
    real = fetch.fetch_triton_kernels
    monkeypatch.setattr(fetch, "fetch_triton_kernels", lambda version: real(version, wheel=wheel))
    partial = tmp_path / "bundle.partial"
    copied = bundle.copy_triton_kernels(partial)
    assert copied == bundle.offline_sources(partial)["triton-kernels"]
    assert (copied / "triton_kernels" / "matmul_ogs.py").read_text() == "# stand-in\n"
    # The GPU host's set-up, from that bundle into its own empty cache, really copies it.
    gpu_cache = tmp_path / "gpu-cache"
    monkeypatch.setenv("MXMOE_CACHE", str(gpu_cache))
    steps = [s for s in plan(FRESH, ".cache/keep-installed.txt", bundle.offline_sources(partial))
             if s.name == "triton-kernels"]  # fmt: skip
    (done,) = run(steps, lambda line: None)
    assert done.status == "ran", done.reason
    assert (gpu_cache / "vendor" / copied.name / "triton_kernels" / "matmul_ogs.py").is_file()


def test_offline_every_piece_comes_from_the_bundle_and_nothing_is_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path / "cache"))
    root = _bundle(tmp_path)
    steps = plan(FRESH, ".cache/keep-installed.txt", bundle.offline_sources(root))
    argvs = _argvs(steps)
    assert not [a for a in argvs if " fetch " in a or "pypi" in a]
    pips = [argv for s in steps for argv in s.commands if "pip" in argv]
    assert pips and all(("--no-index" in a and str(root / "wheels") in a and "-c" in a) for a in pips)
    assert [s.name for s in steps if "build-" in " ".join(map(" ".join, s.commands))] == [
        "flashinfer-sm90-subset", "vllm-ops"]  # fmt: skip
    copies = [argv for s in steps for argv in s.commands if argv[1] == "-c"]
    for argv in copies:  # the copies themselves, for real, into the cache
        assert subprocess.run(list(argv), capture_output=True).returncode == 0
    from mxmoe.harness.upstream.fetch import triton_kernels_root
    from mxmoe.harness.upstream.vllm_ops import source_tarball
    from mxmoe.harness.upstream.vllm_runtime import runtime_root

    assert (triton_kernels_root() / "triton_kernels" / "__init__.py").is_file()
    assert (runtime_root() / "runtime.json").is_file() and source_tarball().read_bytes() == b"tarball"


def test_a_bundle_is_checked_before_use_and_its_pieces_are_cut_as_documented(tmp_path):
    root = _bundle(tmp_path)
    data = bundle.read_manifest(root)
    assert data["kind"] == "mxmoe-gpu-bundle" and data["total_bytes"] == sum(f["bytes"] for f in data["files"])
    carried = {f"sdist/vllm-{NEWEST_VLLM}.tar.gz", "vendor/triton_kernels-vllm-0.26.0/triton_kernels/__init__.py"}
    assert {f["path"] for f in data["files"]} >= carried
    other = json.loads((root / bundle.MANIFEST).read_text()) | {"python": "3.9"}
    (root / bundle.MANIFEST).write_text(json.dumps(other))
    with pytest.raises(VendorMissing, match="was made for Python 3.9; this is Python .*--python-version"):
        bundle.read_manifest(root)
    with pytest.raises(VendorMissing, match="is not a bundle"):
        bundle.read_manifest(tmp_path)

    wheel = tmp_path / "lm_eval-0.4.13-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("lm_eval/__init__.py", "lm_eval/tasks/__init__.py", "lm_eval/tasks/gsm8k/gsm8k.yaml",
                     "lm_eval/tasks/mmlu/sub/x.yaml"):  # fmt: skip
            z.writestr(name, "x")
        z.writestr("lm_eval-0.4.13.dist-info/RECORD", "lm_eval/__init__.py,,\nlm_eval/tasks/__init__.py,,\n"
                   "lm_eval/tasks/gsm8k/gsm8k.yaml,,\n")  # fmt: skip
    with zipfile.ZipFile(bundle.without_tasks(wheel)) as z:
        assert sorted(z.namelist()) == ["lm_eval-0.4.13.dist-info/RECORD", "lm_eval/__init__.py",
                                        "lm_eval/tasks/__init__.py"]  # fmt: skip
        record = z.read("lm_eval-0.4.13.dist-info/RECORD").decode().split()
        assert record == ["lm_eval/__init__.py,,", "lm_eval/tasks/__init__.py,,"]

    sdist = tmp_path / "vllm-0.33.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        for name in ("vllm-0.33.0/csrc/ops.cu", "vllm-0.33.0/vllm/__init__.py", "vllm-0.33.0/setup.py"):
            info = tarfile.TarInfo(name)
            info.size = 1
            t.addfile(info, io.BytesIO(b"x"))
    with tarfile.open(bundle.csrc_only(sdist, tmp_path / "cut" / sdist.name)) as t:
        assert t.getnames() == ["vllm-0.33.0/csrc/ops.cu"]


def test_dev_refuses_an_offline_folder_that_is_not_a_bundle_before_setting_anything_up(tmp_path):
    proc = subprocess.run(["./dev", "signoff", "--device", "cuda", "--offline", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert f"dev: --offline {tmp_path}: not a bundle (no bundle.json); make one with" in proc.stderr


def test_a_subset_build_carried_in_is_reused_not_built_again(tmp_path, monkeypatch):
    """A fresh machine installs FlashInfer after the set-up's probe, so the plan cannot know that a
    subset built elsewhere was carried into the cache; ``build-flashinfer --if-missing`` learns it
    itself (the H200 rebuilt a carried module for 207 s before this)."""
    try:
        import flashinfer
    except ImportError as exc:
        pytest.skip(f"flashinfer-python is not importable ({exc}); on a host without a GPU `./dev test` installs it")
    from mxmoe.harness.upstream import flashinfer_sm90 as fs

    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path))
    so = fs.module_path()
    assert str(so).startswith(str(tmp_path))
    so.parent.mkdir(parents=True)
    so.write_bytes(b"\x7fELF carried")
    (so.parent / "build.json").write_text(json.dumps({"flashinfer": flashinfer.__version__}))
    proc = subprocess.run([sys.executable, "-m", "harness", "build-flashinfer", "--if-missing"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"built already for flashinfer {flashinfer.__version__}" in proc.stdout
    assert so.read_bytes() == b"\x7fELF carried"
    # a module of another FlashInfer release is not this one's: it would be built (not run here: no GPU)
    (so.parent / "build.json").write_text(json.dumps({"flashinfer": "0.0.1"}))
    assert fs.built_record() is None


def test_an_installed_flashinfer_stays_unless_another_is_asked_for_and_the_cache_key_names_the_one_kept():
    """A CI cache keyed by the release the set-up would choose, where it keeps an installed one
    instead, would file one release's builds under another's name."""
    from mxmoe.harness.upstream.flashinfer_releases import choose
    from mxmoe.harness.upstream.gpu_setup import cache_key, kept_release

    default = choose(None, "0.34.0")
    assert kept_release(default, None) == "0.7.4" and kept_release(default, "0.6.14") == "0.6.14"
    asked = choose("0.7.2.post1", "0.34.0")
    assert kept_release(asked, "0.6.14") == "0.7.2.post1"
    assert "-flashinfer0.6.14-" in cache_key("sm90", kept_release(default, "0.6.14"))
