"""``python -m harness build-flashinfer``: build FlashInfer's SM90 bf16 x MXFP4 MoE subset."""

from __future__ import annotations

import argparse
import json


def _cmd_build_flashinfer(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError

    try:
        import flashinfer
    except ImportError as exc:
        raise UsageError(f"flashinfer-python is not installed ({exc}): the subset is built from its sources") from None
    from mxmoe.harness.upstream import flashinfer_sm90 as fs

    if args.flashinfer_version and args.flashinfer_version != flashinfer.__version__:
        raise UsageError(
            f"--flashinfer-version {args.flashinfer_version}: the subset is built from the installed FlashInfer's "
            f"sources, and flashinfer {flashinfer.__version__} is installed; install {args.flashinfer_version} first "
            f"(`python -m harness setup-gpu --flashinfer-version {args.flashinfer_version}`)"
        )
    if args.if_missing and (made := fs.built_record()) is not None:
        # A build carried in from another machine (the same FlashInfer release) is reused: FlashInfer's
        # installation comes after the set-up's probe, so only here can the set-up learn it is there.
        print(f"{fs.SUBSET_NAME}: built already for flashinfer {made['flashinfer']}, at {fs.module_path()}")
        return 0
    print(f"building {fs.SUBSET_NAME} from flashinfer {flashinfer.__version__} into {fs.build_root()} ...", flush=True)
    try:
        record = fs.build(jobs=args.jobs)
    except fs.BuildError as exc:
        print(f"build failed for flashinfer {flashinfer.__version__}: {exc}")
        return 1
    print(
        f"built {fs.module_path()} ({record['size_bytes'] / 2**20:.1f} MiB): {record['sources']['kept']} of "
        f"{record['sources']['full']} sources of fused_moe_90 ({record['generated']['kept']} of "
        f"{record['generated']['full']} generated kernel files), CUDA {record['cuda']}, {record['jobs']} jobs, "
        f"{record['build_seconds']:.0f} s"
    )
    if not record["left_out_symbols_checked"]:
        print("note: no `nm` on this host: the module's undefined symbols were not checked")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``build-flashinfer`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import flashinfer_version, positive

    p = sub.add_parser(
        "build-flashinfer",
        help="build FlashInfer's SM90 CUTLASS MoE for bf16 x MXFP4 only (a tenth of fused_moe_90) into the cache",
    )
    p.add_argument("--jobs", type=positive(int), help="parallel compiles (default: every core)")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing where a module is built already for the installed FlashInfer")
    p.add_argument("--flashinfer-version", type=flashinfer_version, metavar="V",
                   help="the release to build for: it must be the installed one (a check, for scripts)")
    p.add_argument("--json", metavar="FILE", help="also write the build record (time, size, recipe) here")
    p.set_defaults(fn=_cmd_build_flashinfer, parser=p)
