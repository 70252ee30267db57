"""``python -m harness backends``: every backend (built-in, installed entry points, files) and whether
it runs here (``availability``)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from mxmoe.harness.cli.args import discover
from mxmoe.harness.cli.tables import format_table

if TYPE_CHECKING:
    from mxmoe.harness.run.registry import Loaded


def availability(loaded: Loaded, arch: str) -> str | None:
    """None if the backend can run on ``arch`` on this host, else why not: its module did not
    load, it does not declare ``arch``, this host is another arch, or its ``load`` fails."""
    from mxmoe.harness.contract.backend import BackendUnavailable
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.run.registry import BrokenBackend

    backend = loaded.backend
    d = backend.declaration
    if isinstance(backend, BrokenBackend):
        return f"failed to load {backend.failure}"
    if arch not in d.archs:
        return f"{d.id} does not run on {arch} (declared: {', '.join(d.archs)})"
    if arch != host_arch():
        return f"needs {arch} hardware; this host is {host_arch()}"
    try:
        backend.load()
    except (ImportError, BackendUnavailable) as exc:
        return f"cannot run here: {exc}"
    except Exception as exc:
        return f"load() raised {type(exc).__name__}: {exc}"
    return None


def _cmd_backends(args: argparse.Namespace) -> int:
    from mxmoe.harness.contract.platforms import ARCHS, host_arch
    from mxmoe.harness.run.results import declaration_to_dict
    from mxmoe.reference.activation import ACTIVATIONS
    from mxmoe.reference.routing import ROUTING_METHODS

    arch = args.arch or host_arch()
    entries = []
    for loaded in discover(args):
        why = availability(loaded, arch)
        entries.append(
            {
                "spec": loaded.spec,
                **declaration_to_dict(loaded.backend.declaration),
                "arch": arch,
                "runs_here": why is None,
                "why_not": why or "",
            }
        )
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    rows = [
        (
            e["id"],
            e["kind"],
            "all" if tuple(e["archs"]) == ARCHS else ",".join(e["archs"]),
            e["quant"],
            "all" if tuple(e["activations"]) == ACTIVATIONS else ",".join(e["activations"]),
            e["w13_layout"],
            f"{len(e['routing_methods'])}/{len(ROUTING_METHODS)}",
            f"H%{e['hidden_align']} I%{e['intermediate_align']}",
            "yes" if e["runs_here"] else "no",
            e["why_not"],
        )
        for e in entries
    ]
    print(f"backends on {arch} (this host: {host_arch()})\n")
    headers = (
        "id",
        "kind",
        "archs",
        "quant",
        "activations",
        "w13 layout",
        "routing",
        "padding",
        f"runs on {arch}",
        "why not",
    )
    print(format_table(headers, rows))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``backends`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import BACKEND_FILE_HELP, arch, backend_file

    p = sub.add_parser("backends", help="list every backend and whether it can run on this host")
    p.add_argument(
        "--backend-file",
        action="append",
        default=[],
        type=backend_file,
        metavar="PATH.py:Class",
        help=BACKEND_FILE_HELP,
    )
    p.add_argument("--arch", type=arch, help="the architecture to ask about (default: this host's)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(fn=_cmd_backends, parser=p)
