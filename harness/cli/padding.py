"""``python -m harness padding``: the weight memory each backend's padding costs at gpt-oss TP 1, 2, 4, 8
(``harness.audits.padding_audit``)."""

from __future__ import annotations

import argparse
import json
import os

from mxmoe.harness.cli.tables import format_table


def _cmd_padding(args: argparse.Namespace) -> int:
    from mxmoe.harness.audits.padding_audit import audit
    from mxmoe.harness.run.registry import discover, select
    from mxmoe.harness.run.results import stamp

    backends = [item.backend for item in select(discover())]
    rows = audit(backends)
    table = [
        (
            r.model,
            r.tp,
            r.backend,
            f"{r.hidden}->{r.padded_hidden}",
            f"{r.partition}->{r.padded_intermediate}",
            f"{100 * (r.padded_intermediate / r.partition - 1):.1f}%",
            f"{r.converted_bytes / 2**30:.3f}",
            f"{r.ideal_bytes / 2**30:.3f}",
            f"{100 * r.waste:.1f}%",
        )
        for r in rows
    ]
    headers = ("model", "TP", "backend", "H", "I per rank", "I padding", "GiB (all ranks)", "ideal GiB", "waste")
    print(format_table(headers, table))
    print(
        "\nI per rank: vLLM's partition I/TP and the padded size the backend allocates on every rank;"
        "\nGiB: the converted MXFP4 blocks and scales (biases excluded) of one layer, all ranks;"
        "\nideal: the unsharded layer with no padding; waste = converted / ideal - 1"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(stamp("padding") | {"rows": [r.to_dict() for r in rows]}, f, indent=1)
    print(f"recorded: {args.json}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``padding`` to ``python -m harness``."""
    p = sub.add_parser("padding", help="weight memory each backend's padding costs at gpt-oss TP 1, 2, 4, 8")
    p.add_argument("--json", default="results/padding.json", help="where the rows are recorded (default %(default)s)")
    p.set_defaults(fn=_cmd_padding, parser=p)
