"""``python -m harness replay``: rerun one reproducer written by ``check``."""

from __future__ import annotations

import argparse
import json

from mxmoe.harness.cli.args import UsageError


def _cmd_replay(args: argparse.Namespace) -> int:
    from mxmoe.harness.diagnosis.explain import summarize
    from mxmoe.harness.judge.engine import failure_message, run_case
    from mxmoe.harness.run.results import load_repro

    try:
        loaded, case, arch, inputs = load_repro(args.file)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"FILE: cannot read reproducer {args.file}: {type(exc).__name__}: {exc}") from None
    recorded = json.loads(open(args.file, encoding="utf-8").read())
    print(f"replaying {recorded['test_id']} (recorded {recorded['outcome']}: {recorded['reason']})")
    result, _ = run_case(loaded.backend, case, arch, inputs=inputs, diagnose=summarize)
    if result.outcome == "PASS":
        print(f"PASS {result.test_id}: {result.reason}")
        return 0
    print(f"{result.outcome} " + failure_message(result))
    return 1


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``replay`` to ``python -m harness``."""
    p = sub.add_parser("replay", help="rerun a reproducer written by check (results/repro/<test id>.json)")
    p.add_argument("file", metavar="FILE", help="the reproducer's .json file")
    p.set_defaults(fn=_cmd_replay, parser=p)
