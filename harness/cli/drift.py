"""``python -m harness vllm-drift``: vLLM's own MXFP4 oracle, run under fake platforms, against the
declarations (``harness.upstream.vllm_drift``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from mxmoe.harness.cli.tables import format_table


def _cmd_vllm_drift(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from mxmoe.harness.contract.platforms import host_fingerprint
    from mxmoe.harness.run.registry import discover
    from mxmoe.harness.upstream import vllm_drift as vd
    from mxmoe.harness.upstream.fetch import NEWEST_VLLM, VendorMissing

    if not vd.vllm_fetched(args.vllm_version):
        # The drift check fetches what it reads (once; cached), so no set-up has to.
        print(f"vllm-drift: fetching vLLM {args.vllm_version}'s Python sources into the cache", file=sys.stderr)
        try:
            vd.fetch_vllm(args.vllm_version)
        except VendorMissing as exc:
            print(f"vllm-drift: {exc}", file=sys.stderr)
            return 2
    declarations = [item.backend.declaration for item in discover()]
    drifts: list = []
    facts = {}
    for arch in args.arch or vd.PROBE_ARCHS:
        try:
            facts[arch] = vd.probe(arch, args.vllm_version)
        except VendorMissing as exc:
            print(f"vllm-drift: {exc}", file=sys.stderr)
            return 2
        drifts += vd.compare(facts[arch], declarations)
    rows = vd.mark_known(vd.unique(drifts))
    stale = vd.stale_known(rows, args.vllm_version) if not args.arch else []
    version = next(iter(facts.values())).get("vllm_version", "?") if facts else "?"
    print(
        f"vLLM {version} (its own oracle, fake platforms) against this project's declarations "
        f"(which follow vLLM {NEWEST_VLLM})\n"
    )
    table = [(d.kind, d.subject, d.arch, d.ours, d.vllm, d.known or "UNEXPLAINED") for d in rows]
    print(format_table(("what", "of", "arch", "ours", "vLLM", "known"), table))
    for key in stale:
        print(f"STALE: a known drift no longer occurs: {key}")
    unexplained = [d for d in rows if d.known is None]
    print(f"\n{len(rows)} differences: {len(rows) - len(unexplained)} known, {len(unexplained)} unexplained")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"host": host_fingerprint(), "vllm_version": version, "facts": facts,
                       "drift": [asdict(d) for d in rows], "stale_known": stale}, f, indent=1)  # fmt: skip
    return 1 if unexplained or stale else 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``vllm-drift`` to ``python -m harness``."""
    from mxmoe.harness.upstream.fetch import DEFAULT_VLLM, NEWEST_VLLM
    from mxmoe.harness.upstream.vllm_drift import PROBE_ARCHS

    p = sub.add_parser("vllm-drift", help="run vLLM's own MXFP4 oracle (fake platforms) against the declarations")
    p.add_argument("--arch", action="append", choices=PROBE_ARCHS, help="(repeatable; default all)")
    p.add_argument(
        "--vllm-version",
        default=NEWEST_VLLM,
        help=f"the vLLM release to check, fetched if missing (default %(default)s, the one the declarations follow; "
        f"{DEFAULT_VLLM} is checked too)",
    )
    p.add_argument("--json", default="results/vllm-drift.json", help="where it is recorded (default %(default)s)")
    p.set_defaults(fn=_cmd_vllm_drift, parser=p)
