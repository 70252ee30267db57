"""``python -m harness fetch``: vendor code that is not installed (OpenAI triton_kernels from a vLLM
wheel; vLLM's Python sources; the packages of FlashInfer releases other than the installed one) into
the git-ignored cache (``harness.upstream.fetch``, ``harness.upstream.vllm_drift``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from mxmoe.harness.cli.args import UsageError


def _fetched(args: argparse.Namespace) -> Path | None:
    """Where ``args.what`` (not flashinfer: ``_fetch_flashinfer``) already is in the cache, or None."""
    from mxmoe.harness.upstream.fetch import triton_kernels_root
    from mxmoe.harness.upstream.vllm_drift import vllm_fetched, vllm_root

    if args.what == "vllm":
        return vllm_root(args.vllm_version) if vllm_fetched(args.vllm_version) else None
    if args.what == "vllm-source":
        from mxmoe.harness.upstream.vllm_ops import source_tarball

        tar = source_tarball(args.vllm_version)
        return tar if tar.is_file() else None
    if args.what == "vllm-runtime":
        from mxmoe.harness.upstream.vllm_runtime import runtime_fetched, runtime_root

        py = args.python_version
        return runtime_root(args.vllm_version, py) if runtime_fetched(args.vllm_version, py) else None
    where = triton_kernels_root(args.vllm_version)
    return where if (where / "triton_kernels" / "__init__.py").is_file() else None


def flashinfer_versions(version: str | None) -> tuple[str, ...]:
    """The FlashInfer releases ``fetch flashinfer`` puts in the cache: ``--flashinfer-version``, else
    every release the layout cross-checks read from there (vLLM's pin and the newest)."""
    from mxmoe.kernels.flashinfer_common import CACHED_FLASHINFERS

    return (version,) if version else CACHED_FLASHINFERS


def _fetch_flashinfer(versions: tuple[str, ...], if_missing: bool) -> int:
    """Each FlashInfer release of ``versions`` into the cache; 1 if one of them failed."""
    from mxmoe.harness.upstream.fetch import VendorMissing, fetch_flashinfer, flashinfer_root

    rc = 0
    for version in versions:
        root = flashinfer_root(version)
        if if_missing and (root / "flashinfer" / "__init__.py").is_file():
            print(f"flashinfer {version}: already fetched, at {root}")
            continue
        try:
            path = fetch_flashinfer(version)
        except VendorMissing as exc:
            print(f"fetch: {exc}", file=sys.stderr)
            rc = 1
            continue
        print(f"flashinfer-python {version}'s package is at {path} (layout cross-checks)")
    return rc


def _cmd_fetch(args: argparse.Namespace) -> int:
    from mxmoe.harness.upstream.fetch import (
        DEFAULT_VLLM,
        NEWEST_VLLM,
        VendorMissing,
        fetch_triton_kernels,
    )
    from mxmoe.harness.upstream.vllm_drift import fetch_vllm

    if args.vllm_version is None:
        args.vllm_version = NEWEST_VLLM if args.what in ("vllm-runtime", "vllm-source") else DEFAULT_VLLM
    if args.python_version is not None and not re.fullmatch(r"3\.\d+", args.python_version):
        raise UsageError(f"--python-version: a Python version such as 3.12, not {args.python_version!r}")
    if args.wheel and not os.path.isfile(args.wheel):
        raise UsageError(f"--wheel: no such file {args.wheel!r}")
    if args.wheel and args.what in ("flashinfer", "vllm-source"):
        raise UsageError(f"--wheel: a vLLM wheel; {args.what} is fetched from PyPI")
    if args.what == "flashinfer":
        return _fetch_flashinfer(flashinfer_versions(args.flashinfer_version), args.if_missing)
    wheel = Path(args.wheel) if args.wheel else None
    if args.if_missing and (found := _fetched(args)) is not None:
        print(f"{args.what}: already fetched, at {found}")
        return 0
    try:
        if args.what == "triton-kernels":
            path = fetch_triton_kernels(args.vllm_version, wheel)
            print(f"triton_kernels (from vLLM {args.vllm_version}'s wheel) is at {path}; it is found there at run time")
        elif args.what == "vllm-source":
            from mxmoe.harness.upstream.vllm_ops import fetch_source

            path = fetch_source(args.vllm_version)
            print(f"vLLM {args.vllm_version}'s source package is at {path} (build-vllm-ops reads its csrc/)")
        elif args.what == "vllm-runtime":
            from mxmoe.harness.upstream.vllm_runtime import fetch_runtime

            path = fetch_runtime(args.vllm_version, wheel, args.python_version, args.platform)
            m = json.loads((path / "runtime.json").read_text())
            print(
                f"vLLM {args.vllm_version}'s runtime for Python {m['python']} on {m['platform']} is at {path} "
                f"({m['size_bytes'] / 2**20:.1f} MiB: {m['sources']['files']} source files, {len(m['deps'])} wheels); "
                "copy that folder to the same place on the GPU machine (or set MXMOE_CACHE there)"
            )
        else:
            path = fetch_vllm(args.vllm_version, wheel)
            print(f"vLLM {args.vllm_version}'s Python sources are at {path} (for `python -m harness vllm-drift`)")
    except VendorMissing as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 1
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``fetch`` to ``python -m harness``."""
    from mxmoe.harness.upstream.fetch import DEFAULT_VLLM, NEWEST_VLLM
    from mxmoe.kernels.flashinfer_common import CACHED_FLASHINFERS

    p = sub.add_parser(
        "fetch", help="put vendor code (triton_kernels, vLLM's sources or runtime, FlashInfer) into the ignored cache"
    )
    p.add_argument(
        "what", choices=["triton-kernels", "vllm", "vllm-runtime", "vllm-source", "flashinfer"],
        help="triton_kernels, vLLM's Python sources (for vllm-drift), vLLM's carryable runtime (its Python and the "
        "packages its MoE layer imports, ~25 MiB, for a GPU machine without vLLM or network), vLLM's source package "
        "(what build-vllm-ops compiles), or FlashInfer releases' packages (layout cross-checks; never installed)",
    )
    p.add_argument(
        "--vllm-version",
        help=f"the vLLM release whose wheel it comes from (default {NEWEST_VLLM} for vllm-runtime, "
        f"else {DEFAULT_VLLM})",
    )
    p.add_argument("--wheel", metavar="PATH", help="a vLLM wheel already on this machine (no download)")
    p.add_argument(
        "--flashinfer-version",
        help=f"with flashinfer: the release (default: the cross-checked ones, {' and '.join(CACHED_FLASHINFERS)})",
    )
    p.add_argument(
        "--python-version", metavar="X.Y",
        help="with vllm-runtime: the GPU machine's Python (default: this one's); its wheels are fetched for it",
    )
    p.add_argument(
        "--platform", default="manylinux_2_28_x86_64",
        help="with vllm-runtime: the GPU machine's wheel platform tag (default %(default)s)",
    )
    p.add_argument("--if-missing", action="store_true", help="do nothing where it is already in the cache")
    p.set_defaults(fn=_cmd_fetch, parser=p)
