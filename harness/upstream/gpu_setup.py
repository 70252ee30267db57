"""Setting up a GPU machine for the sign-off: every production kernel the device can run, each
piece only where it is missing, each into the cache, and none of it replacing an installed torch
or triton.

On a fresh GPU machine the vendor adapters find none of what they call: OpenAI's triton_kernels,
FlashInfer (and on Hopper the project's subset of its SM90 MoE module, without which the first
call compiles the whole module for an hour), and, where vLLM is not installed, the carryable
vLLM runtime and the build of the compiled ops its layer calls. ``plan`` decides from what this
host has (``probe``) which of those set-up steps run, and says for each one that does not why
not; ``run`` runs them one at a time, each as its own process, printing what it does and how long
it took. Offline, each piece comes from one bundle folder (``bundle``) instead of PyPI, and the
builds run from its sources. A step that fails says why, and the sign-off goes on without the backends that needed it
(their cases SKIP, naming what is missing), never without the others.

Which steps apply is decided by the architecture: triton_kernels on every GPU; FlashInfer on
NVIDIA's (its MXFP4 MoE kernels are CUDA only); the SM90 subset on Hopper; vLLM's runtime, its
source package and the ops build on NVIDIA's, where vLLM itself is not installed (an installed
vLLM brings its own compiled ops).

The FlashInfer release is the one the vLLM under test pins, or the nearest newer one PyPI has
(``flashinfer_releases``), or the one ``--flashinfer-version`` names; a release already installed
stays unless another is named (an installed vLLM may need it). The SM90 subset is built for the
release that ends up installed, into a folder of its own, so builds of several releases lie side by
side in the cache and each loads only under its own release.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from mxmoe.harness.upstream.fetch import DEFAULT_VLLM, NEWEST_VLLM
from mxmoe.harness.upstream.flashinfer_releases import Resolution, resolve

TVM_FFI = {(0, 6): "0.1.10", (0, 7): "0.1.11"}
"""The FFI layer FlashInfer imports, by release series: the lowest each series accepts (0.7.x
requires apache-tvm-ffi >= 0.1.11; 0.6.14 is measured with 0.1.10)."""


def flashinfer_packages(release: str) -> tuple[str, str]:
    """flashinfer-python ``release`` without its CUDA dependencies (cudnn-frontend, cutlass-dsl,
    cuda-python: the MoE kernels the adapters call need none of them), and the FFI layer it imports."""
    from mxmoe.harness.upstream.flashinfer_releases import version_key

    series = version_key(release)[0][:2]
    return f"flashinfer-python=={release}", f"apache-tvm-ffi=={TVM_FFI.get(series, TVM_FFI[max(TVM_FFI)])}"


FLASHINFER_LIGHT_DEPS = ("einops", "nvidia-ml-py", "click", "requests", "tabulate", "tqdm", "packaging", "ninja")
"""FlashInfer's pure-Python dependencies, installed with the installed torch, triton and numpy
pinned (``./dev``'s ``keep-installed.txt``)."""
NVIDIA_ARCHS = ("sm80", "sm90", "sm100", "sm120")
FLASHINFER_ARCHS = ("sm90", "sm100", "sm120")
"""The architectures the FlashInfer adapters declare."""


@dataclass(frozen=True)
class Host:
    """What the set-up decides from (``probe``); a test fakes it to plan for a GPU on a CPU."""

    arch: str
    flashinfer: str | None  # the installed flashinfer-python's version
    triton_kernels: bool  # OpenAI's triton_kernels importable (installed, or fetched into the cache)
    vllm_installed: bool  # a vLLM with its compiled extensions
    runtime: bool  # vLLM's carryable runtime fetched for this Python
    source: bool  # vLLM's source package fetched (what build-vllm-ops reads)
    ops: bool  # the ops build made for this vLLM release and arch
    subset: bool  # the SM90 subset of FlashInfer's MoE module built for the installed FlashInfer


@dataclass(frozen=True)
class Step:
    """One set-up step: what it does, for which backends, the commands it runs (each an argv,
    run in order as processes), or why it does not run here (``skip``)."""

    name: str
    what: str
    backends: tuple[str, ...]  # the ids of the backends that cannot run without it
    commands: tuple[tuple[str, ...], ...]
    skip: str | None = None


def installed_flashinfer() -> str | None:
    """The flashinfer-python release installed here, or None; read from its metadata, not by
    importing it (``setup-gpu --cache-key`` prints the key alone, before anything is set up)."""
    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return None


def probe(arch: str) -> Host:
    """What this host has, for ``plan``."""
    from mxmoe.harness.upstream import flashinfer_sm90, vllm_ops, vllm_runtime
    from mxmoe.harness.upstream.fetch import VendorMissing, import_triton_kernels

    version = installed_flashinfer()
    try:
        import_triton_kernels()
        tk = True
    except (VendorMissing, ImportError):
        tk = False
    subset = False
    if version is not None and arch == "sm90":
        try:
            subset = flashinfer_sm90.built_record() is not None
        except Exception:  # FlashInfer installed but not importable: the subset cannot load either
            subset = False
    try:
        ops = vllm_ops.built_record(NEWEST_VLLM, arch) is not None
    except Exception:
        ops = False
    return Host(
        arch=arch,
        flashinfer=version,
        triton_kernels=tk,
        vllm_installed=vllm_runtime.installed_vllm() is not None,
        runtime=vllm_runtime.runtime_fetched(NEWEST_VLLM),
        source=vllm_ops.source_tarball(NEWEST_VLLM).is_file(),
        ops=ops,
        subset=subset,
    )


def _harness(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "harness", *args)


def _copy(src: Path, dest: Path) -> tuple[str, ...]:
    """A command copying a bundle's file or folder into the cache (a process like every step's)."""
    code = ("import shutil, sys, pathlib; s, d = map(pathlib.Path, sys.argv[1:]); d.parent.mkdir(parents=True, "
            "exist_ok=True); shutil.copytree(s, d, dirs_exist_ok=True) if s.is_dir() else shutil.copyfile(s, d)")
    return (sys.executable, "-c", code, str(src), str(dest))


def kept_release(fi: Resolution, installed: str | None) -> str:
    """The FlashInfer release a machine ends its set-up with: an installed release stays unless
    another one was asked for (``--flashinfer-version``), since it may be the one an installed vLLM
    pins; else ``fi``'s."""
    return installed if installed and not fi.requested else fi.release


def flashinfer_step(host: Host, fi: Resolution, pip: tuple[str, ...]) -> tuple[Step, str | None]:
    """The FlashInfer install, and the release the SM90 subset is then built for (None: none will
    be installed). An installed release stays unless another one was asked for
    (``--flashinfer-version``): it may be the one an installed vLLM pins."""
    backends = ("flashinfer-cutlass-mxfp4-bf16", "vllm-flashinfer-cutlass-mxfp4-bf16")
    packages = flashinfer_packages(fi.release)
    why = f" ({fi.note})" if fi.note else f" (vLLM {fi.vllm}'s pin)"
    replacing = f", replacing the installed {host.flashinfer}" if host.flashinfer else ""
    what = f"flashinfer-python {fi.release}{why} without its CUDA dependencies{replacing}, torch and triton kept"
    commands = ((*pip, *FLASHINFER_LIGHT_DEPS, packages[1]), (*pip, "--no-deps", packages[0]))
    if host.arch not in FLASHINFER_ARCHS:
        skip = f"FlashInfer's MXFP4 MoE runs on {', '.join(FLASHINFER_ARCHS)}; this host is {host.arch}"
        return Step("flashinfer", what, backends, commands, skip), None
    if host.flashinfer == fi.release:
        return Step("flashinfer", what, backends, commands, f"flashinfer-python {fi.release} is installed"), fi.release
    release = kept_release(fi, host.flashinfer)
    if release != fi.release:
        skip = (f"flashinfer-python {host.flashinfer} is installed (vLLM {fi.vllm} would take {fi.release}: "
                f"`--flashinfer-version {fi.release}` replaces it)")  # fmt: skip
        return Step("flashinfer", what, backends, commands, skip), release
    return Step("flashinfer", what, backends, commands), release


def plan(host: Host, keep_installed: str | None = None, offline: dict[str, Path] | None = None,
         flashinfer: Resolution | None = None) -> list[Step]:  # fmt: skip
    """The set-up steps for ``host``, in the order they run, each with ``skip`` set where it does
    not run here. ``keep_installed``: a pip constraints file pinning the installed torch and
    triton (``./dev`` writes one), so that no install replaces them. ``offline``: where a bundle
    holds each piece (``bundle.offline_sources``); then nothing is fetched: wheels are installed
    from the bundle alone and the rest is copied from it into the cache. ``flashinfer``: the
    release to install (``flashinfer_releases.choose``; default the one ``NEWEST_VLLM`` pins)."""
    from mxmoe.harness.upstream.fetch import triton_kernels_root
    from mxmoe.harness.upstream.vllm_ops import source_tarball
    from mxmoe.harness.upstream.vllm_runtime import runtime_root

    arch = host.arch
    gpu = arch != "cpu"
    nvidia = arch in NVIDIA_ARCHS
    pin = ("-c", keep_installed) if keep_installed else ()
    index = ("--no-index", "--find-links", str(offline["wheels"])) if offline else ()
    pip = (sys.executable, "-m", "pip", "install", "-q", *pin, *index)
    fetch = {
        "triton-kernels": _harness("fetch", "triton-kernels", "--vllm-version", DEFAULT_VLLM),
        "vllm-runtime": _harness("fetch", "vllm-runtime"),
        "vllm-source": _harness("fetch", "vllm-source"),
    }
    if offline:
        fetch = {
            "triton-kernels": _copy(offline["triton-kernels"], triton_kernels_root(DEFAULT_VLLM)),
            "vllm-runtime": _copy(offline["vllm-runtime"], runtime_root(NEWEST_VLLM)),
            "vllm-source": _copy(offline["vllm-source"], source_tarball(NEWEST_VLLM)),
        }
    fi_step, fi_release = flashinfer_step(host, flashinfer or resolve(), pip)
    subset_same = host.subset and fi_release == host.flashinfer
    build_for = ("--flashinfer-version", fi_release) if fi_release else ()
    vllm_skip = None if nvidia else f"the project runs vLLM's layer without vLLM on NVIDIA GPUs; this host is {arch}"
    if host.vllm_installed:
        vllm_skip = "vLLM is installed, with its own compiled ops"
    steps = [
        Step("triton-kernels", "OpenAI's triton_kernels, as vLLM vendors it, into the cache",
             ("triton", "triton-modular", "triton-unfused", "vllm-triton", "vllm-triton-unfused"),
             (fetch["triton-kernels"],),
             "no GPU" if not gpu else "importable already" if host.triton_kernels else None),
        fi_step,
        Step("flashinfer-sm90-subset", f"the bf16 x MXFP4 subset of FlashInfer {fi_release}'s SM90 MoE module "
             "(at 16 cores about 3 minutes for 0.6.14, up to 11 for 0.7.x; once per FlashInfer release)",
             ("flashinfer-cutlass-mxfp4-bf16", "vllm-flashinfer-cutlass-mxfp4-bf16"),
             (_harness("build-flashinfer", "--if-missing", *build_for),),
             "only Hopper's module is built by the project" if arch != "sm90"
             else "built already for this FlashInfer" if subset_same else None),
        Step("vllm-runtime", f"vLLM {NEWEST_VLLM}'s carryable runtime (its Python and 26 pinned packages, 25 MiB)",
             ("vllm-triton", "vllm-triton-unfused", "vllm-flashinfer-cutlass-mxfp4-bf16", "marlin"),
             (fetch["vllm-runtime"],),
             vllm_skip or ("fetched already" if host.runtime else None)),
        Step("vllm-source", f"vLLM {NEWEST_VLLM}'s source package (build-vllm-ops reads its csrc/)",
             ("marlin", "vllm-triton-unfused"), (fetch["vllm-source"],),
             vllm_skip or ("the ops are built already" if host.ops else "fetched already" if host.source else None)),
        Step("vllm-ops", "the compiled ops vLLM's layer calls (Marlin MoE, repack, align/sum, activations; "
             "about a minute)", ("marlin", "vllm-triton-unfused"), (_harness("build-vllm-ops", "--arch", arch),),
             vllm_skip or ("built already for this vLLM release and arch" if host.ops else None)),
    ]  # fmt: skip
    return steps


@dataclass
class Done:
    """What a step did: ``ran`` (every command exited 0), ``failed`` (with the reason), or
    ``skipped`` (with why it was not needed)."""

    step: Step
    status: str
    seconds: float = 0.0
    reason: str = ""


def run(steps: list[Step], log: Callable[[str], None] = print,
        runner: Callable[[tuple[str, ...]], subprocess.CompletedProcess] | None = None) -> list[Done]:  # fmt: skip
    """Run ``steps`` in order, each command as its own process (``runner``: a test's stand-in).
    A failing command ends its step as failed, naming the backends that go without it; the next
    steps still run, except those that need what failed (the SM90 subset without FlashInfer, the
    ops build without the source package)."""
    runner = runner or (lambda argv: subprocess.run(list(argv), capture_output=True, text=True))
    needs = {"flashinfer-sm90-subset": "flashinfer", "vllm-ops": "vllm-source"}
    failed: set[str] = set()
    out = []
    for step in steps:
        if step.skip is not None:
            out.append(Done(step, "skipped", reason=step.skip))
            log(f"setup: {step.name}: not needed ({step.skip})")
            continue
        if needs.get(step.name) in failed:
            done = Done(step, "failed", reason=f"needs {needs[step.name]}, which failed")
            out.append(done)
            failed.add(step.name)
            log(f"setup: {step.name}: not run: {done.reason}; the sign-off goes on without {', '.join(step.backends)}")
            continue
        log(f"setup: {step.name}: {step.what} ...")
        t0 = time.perf_counter()
        reason = ""
        for argv in step.commands:
            proc = runner(argv)
            if proc.returncode != 0:
                tail = [line for line in f"{proc.stdout}\n{proc.stderr}".splitlines() if line.strip()][-1:]
                reason = f"`{' '.join(argv[1:] if argv[0] == sys.executable else argv)}` exited {proc.returncode}" + (
                    f": {tail[0].strip()}" if tail else "")  # fmt: skip
                break
        seconds = time.perf_counter() - t0
        if reason:
            failed.add(step.name)
            out.append(Done(step, "failed", seconds, reason))
            log(f"setup: {step.name}: FAILED after {seconds:.0f} s: {reason}; the sign-off goes on without "
                f"{', '.join(step.backends)}")  # fmt: skip
        else:
            out.append(Done(step, "ran", seconds))
            log(f"setup: {step.name}: done in {seconds:.0f} s")
    return out


def cache_key(arch: str, flashinfer: str) -> str:
    """What a CI cache of the set-up's builds is keyed by (``setup-gpu --cache-key``): the
    architecture, the FlashInfer release the set-up ends with (``flashinfer``: ``kept_release``) and
    the vLLM release it builds for, and the torch, triton, CUDA or ROCm and Python they were built
    against. A build made against another torch is not reused: its
    compiled ops would load and fail, or not load."""
    import platform

    import torch
    import triton

    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    toolkit = f"cuda{cuda}" if cuda else f"rocm{hip}" if hip else "cpu"
    python = ".".join(platform.python_version_tuple()[:2])
    return (f"mxmoe-{arch}-flashinfer{flashinfer}-vllm{NEWEST_VLLM}-torch{torch.__version__}-"
            f"triton{triton.__version__}-{toolkit}-py{python}")  # fmt: skip
