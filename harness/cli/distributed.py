"""``python -m harness dist-check``: sharded checks, one process per rank."""

from __future__ import annotations

import argparse


def _cmd_dist_check(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError, discover, host_line
    from mxmoe.harness.cli.tables import format_table
    from mxmoe.harness.contract.cases import MODELS, make_case
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.distributed.launch import run_dist
    from mxmoe.harness.distributed.shard import Plan
    from mxmoe.harness.run.registry import select
    from mxmoe.harness.run.results import Recorder

    mode, world = ("tp", args.tp) if args.tp else ("ep", args.ep)
    if args.model not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}; got {args.model!r}")
    try:
        backends = select(discover(args), tuple(args.backend))
        plans = [Plan(make_case(args.model, t), mode, world, args.fault) for t in args.tokens]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    arch = args.arch or host_arch()
    recorder = Recorder(args.results)
    print(f"{host_line('cpu' if arch == 'cpu' else 'cuda')} | arch {arch}")
    fault = f", fault {args.fault}" if args.fault else ""
    print(f"dist-check: {mode.upper()} {world} over {args.model} T={','.join(map(str, args.tokens))}{fault}; "
          f"results in {recorder.path}\n", flush=True)  # fmt: skip
    rows, bad = [], 0
    for loaded in backends:
        for plan in plans:
            result = run_dist(loaded, plan, arch, timeout=args.timeout)
            recorder.record(result, loaded)
            m = result.metrics
            ratio = f"{m.worst_ratio:.3g}" if result.outcome != "SKIP" else "-"
            reason = result.reason.splitlines()[0][:110] if result.reason else ""
            rows.append((result.test_id, result.outcome, ratio, f"{result.seconds:.1f}", reason))
            print(f"  {result.outcome:<5} {result.test_id} ({result.seconds:.1f} s)", flush=True)
            if result.outcome in ("FAIL", "ERROR"):
                bad += 1
                if result.traceback:
                    print(result.traceback.rstrip())
    print()
    print(format_table(("test", "outcome", "worst err/bound", "seconds", "reason"), rows))
    print(f"\nresults: {recorder.path}")
    return 1 if bad else 0


def _cmd_matrix(args: argparse.Namespace) -> int:
    from mxmoe.harness.distributed.matrix import render

    text = render(args.format)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"written: {args.out}")
    else:
        print(text, end="")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``dist-check`` and ``matrix`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import backend_file, int_list, positive
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.distributed.shard import FAULTS

    p = sub.add_parser("dist-check", help="a layer sharded over ranks (TP or EP, torch.distributed) vs the oracle")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tp", type=positive(int), metavar="N", help="tensor parallel over N ranks")
    how.add_argument("--ep", type=positive(int), metavar="N", help="expert parallel over N ranks")
    p.add_argument("--backend", action="append", default=[], metavar="ID",
                   help="backend id or glob (repeatable; default: every backend of kind 'backend')")  # fmt: skip
    p.add_argument("--backend-file", action="append", default=[], type=backend_file, metavar="PATH.py:Class")
    p.add_argument("--model", default="tpsmall", help="zoo model of the layer (default tpsmall: uneven TP shards)")
    p.add_argument("--tokens", type=int_list, default=[9], metavar="T,T,...", help="token counts (default 9)")
    p.add_argument("--fault", choices=tuple(FAULTS), help="plant a sharding fault (the check must FAIL)")
    p.add_argument("--results", default="results", metavar="DIR", help="results folder (default ./results)")
    p.add_argument("--arch", choices=("cpu", host_arch()) if host_arch() != "cpu" else ("cpu",), default=None,
                   help="where the ranks run: this host's GPUs (NCCL; the default) or cpu (gloo, on any host)")
    p.add_argument("--timeout", type=positive(float), default=600.0, metavar="SECONDS",
                   help="per check, on top of the ranks' start (default 600)")  # fmt: skip
    p.set_defaults(fn=_cmd_dist_check, parser=p)

    from mxmoe.harness.distributed.matrix import FORMATS

    p = sub.add_parser("matrix", help="the nightly CI matrix (architecture x backend group x shard, distributed jobs)")
    p.add_argument("--format", choices=FORMATS, default="json", help="github, buildkite or json (default json)")
    p.add_argument("--out", metavar="FILE", help="write it there (default: standard output)")
    p.set_defaults(fn=_cmd_matrix, parser=p)
