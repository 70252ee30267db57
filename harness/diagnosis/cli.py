"""``python -m harness diagnose REPRO.json``: rerun a reproducer and explain its failure."""

from __future__ import annotations

import argparse


def _cmd_diagnose(args: argparse.Namespace) -> int:
    import torch

    from mxmoe.harness.cli import UsageError
    from mxmoe.harness.diagnosis.explain import explain
    from mxmoe.harness.engine import poisoned
    from mxmoe.harness.results import load_repro

    try:
        loaded, case, arch, inputs = load_repro(args.file)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"FILE: cannot read reproducer {args.file}: {type(exc).__name__}: {exc}") from None
    backend = loaded.backend
    d = backend.declaration
    out = poisoned((case.tokens, case.hidden), d.arithmetic.precision.output, inputs.x.device)
    try:
        backend.load()
        backend.run(backend.convert(inputs), inputs, out)
    except Exception as exc:  # nothing to explain numerically: the engine's ERROR says why
        print(f"{d.id} raised on {case.id}: {type(exc).__name__}: {exc}")
        return 1
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    found = explain(inputs, out, d.arithmetic)
    print(f"diagnosis of {d.id} on {case.id} ({arch}):")
    print(found.summary())
    print("\nclosest catalogue faults (worst |got - fault| / (kernel bound + fault bound); under 1 explains):")
    for c in found.candidates[: args.top]:
        print(f"  {c.worst_ratio:10.3g}  {c.slug:<24} {c.fault}")
    return 0 if found.explained_by else 1


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``diagnose`` to ``python -m harness``."""
    from mxmoe.harness.cli import _positive

    p = sub.add_parser("diagnose", help="rerun a reproducer and name the catalogue fault that explains its output")
    p.add_argument("file", metavar="REPRO.json", help="a reproducer written by check (results/repro/)")
    p.add_argument("--top", type=_positive(int), default=5, help="closest faults listed (default 5)")
    p.set_defaults(fn=_cmd_diagnose, parser=p)
