"""``python -m harness report``: merge result folders into the sign-off report."""

from __future__ import annotations

import argparse
from pathlib import Path


def run_report(results: list[str], out: str | Path, baseline: list[str] | None = None,
               policy: str | None = None) -> tuple[dict, dict[str, Path]]:  # fmt: skip
    """Collect, judge and write; returns the report and its files. Raises ``ResultFileError`` or
    ``PolicyError`` (both name the file) before anything is written."""
    from mxmoe.reports.build import build
    from mxmoe.reports.collect import collect
    from mxmoe.reports.policy import load_policy
    from mxmoe.reports.write import write_report

    rules = load_policy(policy)
    collection = collect(results)
    before = collect(baseline) if baseline else None
    report = build(collection, rules, before)
    return report, write_report(report, out)


def print_verdict(report: dict, files: dict[str, Path]) -> None:
    """The end of a report run: the verdict, every reason, the files."""
    from mxmoe.reports.build import headline, production_line

    print(f"\nverdict: {headline(report)}")
    print(f"  {production_line(report)}")
    for r in report["reasons"]:
        print(f"  BLOCKS {r['rule']}: {r['text']}")
    if report["warnings"]:
        print(f"  ({len(report['warnings'])} warnings, not blocking: see signoff.md)")
    print("report: " + ", ".join(str(p) for p in files.values()))


def _cmd_report(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.reports.collect import ResultFileError
    from mxmoe.reports.policy import PolicyError
    from mxmoe.reports.write import PageUnavailable

    try:
        report, files = run_report(args.results, args.out, args.baseline, args.policy)
    except (ResultFileError, PolicyError) as exc:
        raise UsageError(str(exc)) from None
    except PageUnavailable as exc:
        raise UsageError(str(exc)) from None
    inp = report["inputs"]
    print(f"report: {inp['files']} files, {inp['records']} case records from {len(inp['hosts'])} host(s), "
          f"{inp['duplicates']} duplicates counted once, {len(inp['flaky'])} flaky")  # fmt: skip
    print_verdict(report, files)
    return 0 if report["verdict"] == "SHIP" else 1


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``report`` to ``python -m harness``."""
    p = sub.add_parser("report", help="merge result folders of many jobs and hosts into the sign-off report")
    p.add_argument("results", nargs="+", metavar="RESULTS",
                   help="result folders (searched recursively) or files: results-*.jsonl, gpqa-*.json, "
                        "model-check-*.json, mutants*.json, padding*.json")  # fmt: skip
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where signoff.md, signoff.html, signoff.json and junit.xml go")  # fmt: skip
    p.add_argument("--baseline", action="append", metavar="DIR",
                   help="a previous run's results (repeatable): new and fixed failures, ratio and accuracy changes")
    p.add_argument("--policy", metavar="FILE",
                   help="the verdict's rules: a TOML file (default and documentation: reports/policy.toml) or a "
                        "policy's name: default, or kernels-only (every evidence but the kernel checks waived)")
    p.set_defaults(fn=_cmd_report, parser=p)
