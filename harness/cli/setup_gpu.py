"""``python -m harness setup-gpu``: fetch and build what the production kernels need on this GPU
machine, each piece only where missing (``harness.upstream.gpu_setup``); ``./dev signoff`` runs it
first where a GPU is visible."""

from __future__ import annotations

import argparse
from pathlib import Path


def _cmd_setup_gpu(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.cli.tables import format_table
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.upstream import gpu_setup

    if args.keep_installed and not Path(args.keep_installed).is_file():
        raise UsageError(f"--keep-installed: no such file {args.keep_installed!r}")
    offline = None
    available = None
    if args.offline:
        from mxmoe.harness.upstream import bundle
        from mxmoe.harness.upstream.fetch import VendorMissing

        try:
            made = bundle.read_manifest(Path(args.offline))
        except VendorMissing as exc:
            raise UsageError(f"--offline: {exc}") from None
        offline = bundle.offline_sources(Path(args.offline))
        available = bundle.flashinfer_releases(made)
        print(f"setup-gpu: offline, from {args.offline} (made {made['created']} for Python {made['python']} on "
              f"{made['platform']}, {made['total_bytes'] / 2**20:.1f} MiB)")  # fmt: skip
    from mxmoe.harness.upstream.fetch import NEWEST_VLLM
    from mxmoe.harness.upstream.flashinfer_releases import choose

    try:
        fi = choose(args.flashinfer_version, NEWEST_VLLM, available)
    except ValueError as exc:
        raise UsageError(f"--flashinfer-version: {exc}") from None
    arch = host_arch()
    if args.cache_key:  # alone on standard output: CI reads it
        print(gpu_setup.cache_key(arch, gpu_setup.kept_release(fi, gpu_setup.installed_flashinfer())))
        return 0
    print(f"setup-gpu: flashinfer-python {fi.release} for vLLM {fi.vllm}" + (f": {fi.note}" if fi.note else ""))
    steps = gpu_setup.plan(gpu_setup.probe(arch), args.keep_installed, offline, fi)
    if args.plan:
        rows = [(s.name, "skip" if s.skip else "run", s.skip or s.what, ", ".join(s.backends)) for s in steps]
        print(f"set-up plan for this {arch} host\n")
        print(format_table(("step", "here", "what, or why not", "for"), rows))
        return 0
    if arch == "cpu":
        print("setup-gpu: no GPU here; nothing to set up")
        return 0
    done = gpu_setup.run(steps)
    failed = [d for d in done if d.status == "failed"]
    total = sum(d.seconds for d in done)
    print(f"setup-gpu: {sum(d.status == 'ran' for d in done)} ran, {len(failed)} failed, "
          f"{sum(d.status == 'skipped' for d in done)} not needed, in {total:.0f} s")  # fmt: skip
    return 1 if failed else 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``setup-gpu`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import flashinfer_version

    p = sub.add_parser("setup-gpu", help="fetch and build what this GPU machine's production kernels need, "
                                         "each only where missing")  # fmt: skip
    p.add_argument("--plan", action="store_true", help="print what would run here and why, and run nothing")
    p.add_argument("--keep-installed", metavar="FILE",
                   help="a pip constraints file pinning the installed torch and triton (./dev passes its own)")
    p.add_argument("--cache-key", action="store_true",
                   help="print what a CI cache of the builds is keyed by (architecture, FlashInfer and vLLM releases, "
                   "torch, triton, CUDA or ROCm, Python), and run nothing")  # fmt: skip
    p.add_argument("--offline", metavar="BUNDLE",
                   help="install and copy from this bundle alone (`python -m harness bundle`), fetching nothing")
    p.add_argument("--flashinfer-version", type=flashinfer_version, metavar="V",
                   help="the flashinfer-python release to install and build for, replacing an installed one "
                   "(default: the one the vLLM under test pins, or the nearest newer release PyPI has)")
    p.set_defaults(fn=_cmd_setup_gpu, parser=p)
