"""``python -m harness build-vllm-ops``: build the compiled vLLM ops its MXFP4 MoE layer calls on CUDA."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_build_vllm_ops(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.upstream import vllm_ops
    from mxmoe.harness.upstream.fetch import VendorMissing

    try:
        vllm_ops.gencode(args.arch)
    except ValueError as exc:
        raise UsageError(f"--arch: {exc}") from None
    for flag, path in (("--torch-wheel", args.torch_wheel), ("--sdist", args.sdist)):
        if path and not Path(path).is_file():
            raise UsageError(f"{flag}: no such file {path!r}")
    torch_root = vllm_ops.torch_from_wheel(Path(args.torch_wheel)) if args.torch_wheel else None
    where = vllm_ops.build_root(args.vllm_version, args.arch)
    print(f"building vLLM {args.vllm_version}'s MXFP4 MoE ops for {args.arch} into {where} ...", flush=True)
    try:
        sdist = Path(args.sdist) if args.sdist else None
        record = vllm_ops.build(args.vllm_version, args.arch, torch_root, args.jobs, sdist)
    except (vllm_ops.BuildError, VendorMissing) as exc:
        print(f"build failed: {exc}")
        return 1
    r = record["recipe"]
    print(
        f"built {record['library']} ({record['size_bytes'] / 2**20:.1f} MiB, build {record['hash']}): "
        f"{', '.join(r['ops'])}; {record['kernels']['kept']} of {record['kernels']['generated']} Marlin kernels "
        f"(bf16 x fe2m1f x fe8m0fnu); torch {r['torch']}, CUDA {r['nvcc']}, {record['jobs']} jobs, "
        f"{record['build_seconds']:.0f} s"
    )
    if not record["undefined_own_checked"]:
        print("note: no `nm` on this host: the library's undefined symbols were not checked")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``build-vllm-ops`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import positive
    from mxmoe.harness.upstream.fetch import NEWEST_VLLM

    p = sub.add_parser(
        "build-vllm-ops",
        help="build the few compiled vLLM ops its MXFP4 MoE layer calls (Marlin, align, sum, activation) from "
        "vLLM's source package into the cache",
    )
    p.add_argument("--vllm-version", default=NEWEST_VLLM, help="the vLLM release (default %(default)s)")
    p.add_argument("--arch", default="sm90", help="the NVIDIA architecture to build for (default %(default)s)")
    p.add_argument(
        "--torch-wheel", metavar="PATH",
        help="build against this torch wheel's headers and libraries (the GPU machine's torch) instead of the "
        "installed torch",
    )  # fmt: skip
    p.add_argument("--sdist", metavar="PATH", help="vLLM's source package already on this machine (no download)")
    p.add_argument("--jobs", type=positive(int), help="parallel compiles (default: every core)")
    p.add_argument("--json", metavar="FILE", help="also write the build record here")
    p.set_defaults(fn=_cmd_build_vllm_ops, parser=p)
