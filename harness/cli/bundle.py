"""``python -m harness bundle``: one folder with everything a GPU machine without network needs for
the sign-off's production kernels (``harness.upstream.bundle``), for that machine's Python and
platform; there, ``./dev signoff --device cuda --offline BUNDLE`` installs and builds from it alone."""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def _cmd_bundle(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.upstream import bundle
    from mxmoe.harness.upstream.fetch import VendorMissing

    if not re.fullmatch(r"3\.\d+", args.python_version):
        raise UsageError(f"--python-version: a Python version such as 3.12, not {args.python_version!r}")
    out = Path(args.out)
    if out.exists():
        raise UsageError(f"--out: {out} exists; a bundle is written into a new folder")
    try:
        data = bundle.make(out, args.python_version, args.platform, flashinfer=tuple(args.flashinfer_version or ()))
    except VendorMissing as exc:
        print(f"bundle failed: {exc}")
        return 1
    biggest = sorted(data["files"], key=lambda f: -f["bytes"])[:5]
    print("largest: " + ", ".join(f"{f['path']} {f['bytes'] / 2**20:.1f} MiB" for f in biggest))
    releases = bundle.flashinfer_releases(data)
    one = f" --flashinfer-version {releases[0]}" if len(releases) == 1 else " --flashinfer-version V"
    print(f"flashinfer-python: {', '.join(releases)}")
    print(f"on the GPU machine: ./dev signoff --device cuda --offline {out}{one}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``bundle`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import flashinfer_version

    p = sub.add_parser("bundle", help="one folder with what a GPU machine without network needs for the sign-off")
    p.add_argument("--out", required=True, metavar="DIR", help="the bundle's folder (must not exist)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default %(default)s)")
    p.add_argument("--platform", default="manylinux_2_28_x86_64",
                   help="the GPU machine's wheel platform (default %(default)s)")  # fmt: skip
    p.add_argument("--flashinfer-version", type=flashinfer_version, action="append", metavar="V",
                   help="a flashinfer-python release to carry (repeatable; default: the one the vLLM under test "
                   "pins, or the nearest newer release PyPI has)")
    p.set_defaults(fn=_cmd_bundle, parser=p)
