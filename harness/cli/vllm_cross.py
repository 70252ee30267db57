"""``python -m harness vllm-cross``: each case through vLLM's own layer and through the direct adapter
of the same backend (``harness.audits.vllm_cross``)."""

from __future__ import annotations

import argparse
import json

from mxmoe.harness.cli.args import UsageError, discover, host_line
from mxmoe.harness.cli.tables import format_table


def _cmd_vllm_cross(args: argparse.Namespace) -> int:
    from mxmoe.harness.audits.vllm_cross import BLAMING, PREFIX, cross, pairs
    from mxmoe.harness.contract.platforms import device_for, host_arch
    from mxmoe.harness.run.profiles import profile_cases

    arch = host_arch()
    backends = [item.backend for item in discover(args)]
    chosen = [(v, a) for v, a in pairs(backends) if not args.backend or a.declaration.id in args.backend]
    if not chosen:
        known = sorted(b.declaration.id[len(PREFIX) :] for b in backends if b.declaration.id.startswith(PREFIX))
        raise UsageError(f"--backend: one of {', '.join(known)} (a backend with a vLLM driver), got {args.backend}")
    cases = [c for c in profile_cases(args.profile) if all(k in c.id for k in args.k)
             and not any(x in c.id for x in args.exclude)]  # fmt: skip
    if not cases:
        raise UsageError(f"-k/-x select none of profile {args.profile}'s cases")
    print(host_line(device_for(arch)) + f" | arch {arch}", flush=True)
    rows = []
    for vllm, adapter in chosen:
        for case in cases:
            row = cross(vllm, adapter, case, arch)
            rows.append(row)
            print(f"{row.case}  {row.adapter}: {row.verdict} ({row.detail})", flush=True)
    fmt = "{:.3g}".format
    table = [[r.case, r.adapter, r.vllm_outcome, r.adapter_outcome, "-" if r.vllm_worst is None else fmt(r.vllm_worst),
              "-" if r.adapter_worst is None else fmt(r.adapter_worst), "-" if r.differing is None else r.differing,
              r.verdict] for r in rows]  # fmt: skip
    print()
    print(format_table(["case", "backend", "via vLLM", "direct", "worst (vLLM)", "worst (direct)", "differ", "verdict"],
                       table))  # fmt: skip
    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    return 1 if any(r.verdict in BLAMING for r in rows) else 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``vllm-cross`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import BACKEND_FILE_HELP, backend_file
    from mxmoe.harness.run.profiles import PROFILES

    p = sub.add_parser(
        "vllm-cross",
        help="each case through vLLM's own layer and through the direct adapter of the same backend: identical, "
        "or which side differs from the oracle",
    )
    p.add_argument("--backend", action="append", default=[], metavar="ID",
                   help="a directly adapted backend with a vLLM driver, e.g. triton (repeatable; default: "
                   "all)")  # fmt: skip
    p.add_argument("--backend-file", action="append", default=[], type=backend_file, metavar="PATH.py:Class",
                   help=BACKEND_FILE_HELP)  # fmt: skip
    p.add_argument("--profile", choices=PROFILES, default="pr", help="case list (default pr)")
    p.add_argument("-k", action="append", default=[], metavar="SUBSTRING", help="keep case ids containing it (all)")
    p.add_argument("-x", "--exclude", action="append", default=[], metavar="SUBSTRING", help="drop case ids (any)")
    p.add_argument("--json", metavar="FILE", help="also write the rows here")
    p.set_defaults(fn=_cmd_vllm_cross, parser=p)
