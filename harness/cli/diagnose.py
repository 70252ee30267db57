"""``python -m harness diagnose REPRO.json``: rerun a reproducer and explain its failure."""

from __future__ import annotations

import argparse


def _cmd_diagnose(args: argparse.Namespace) -> int:
    import torch

    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.diagnosis.explain import explain
    from mxmoe.harness.judge.engine import poisoned
    from mxmoe.harness.run.results import load_repro

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


def _cmd_shrink(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.diagnosis.shrink import shrink
    from mxmoe.harness.run.results import load_repro, replay_command, save_repro

    try:
        loaded, case, arch, inputs = load_repro(args.file)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"FILE: cannot read reproducer {args.file}: {type(exc).__name__}: {exc}") from None
    before = sum(t.numel() * t.element_size() for t in inputs.tensors().values())
    print(f"shrinking {loaded.backend.declaration.id} on {case.id} ({arch}, {before / 2**20:.1f} MiB of inputs)",
          flush=True)  # fmt: skip
    try:
        found = shrink(loaded.backend, inputs, arch, max_checks=args.max_checks)
    except ValueError as exc:
        print(f"shrink: {exc}")
        return 1
    after = sum(t.numel() * t.element_size() for t in found.inputs.tensors().values())
    for step in found.steps:
        print(f"  {step}")
    out = Path(args.out) if args.out else Path(args.file).resolve().parent.parent
    repro = save_repro(out, found.result, found.inputs, loaded.spec)
    print(f"\n{found.result.outcome} {found.result.test_id}: {found.result.reason}")
    print(f"inputs {before / 2**20:.1f} MiB -> {after / 2**10:.1f} KiB; reproducer: {repro}")
    print(f"replay: {replay_command(repro)}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``diagnose`` and ``shrink`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import positive

    p = sub.add_parser("diagnose", help="rerun a reproducer and name the catalogue fault that explains its output")
    p.add_argument("file", metavar="REPRO.json", help="a reproducer written by check (results/repro/)")
    p.add_argument("--top", type=positive(int), default=5, help="closest faults listed (default 5)")
    p.set_defaults(fn=_cmd_diagnose, parser=p)

    p = sub.add_parser("shrink", help="cut a failing reproducer down to the smallest slice that still fails")
    p.add_argument("file", metavar="REPRO.json", help="a reproducer written by check (results/repro/)")
    p.add_argument("--out", metavar="DIR", help="results folder for the new reproducer (default: the input's)")
    p.add_argument("--max-checks", type=positive(int), default=200, help="checks to spend at most (default 200)")
    p.set_defaults(fn=_cmd_shrink, parser=p)
