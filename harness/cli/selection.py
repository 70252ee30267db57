"""``python -m harness select``: which MXFP4 MoE backend vLLM's oracle picks for a deployment, and why
not the others (``harness.upstream.selection``, which follows the vLLM release NEWEST_VLLM)."""

from __future__ import annotations

import argparse

from mxmoe.harness.cli.args import UsageError
from mxmoe.harness.cli.tables import format_table


def _cmd_select(args: argparse.Namespace) -> int:
    from mxmoe.harness.run.registry import discover
    from mxmoe.harness.upstream.fetch import NEWEST_VLLM
    from mxmoe.harness.upstream.selection import Deployment, NoBackend, describe, select_backend

    try:
        dep = Deployment(
            arch=args.arch,
            activation=args.activation,
            activation_quant=args.activation_quant,
            routing=args.routing,
            tp=args.tp,
            ep=args.ep,
            moe_backend=args.moe_backend,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    decls = [item.backend.declaration for item in discover()]
    print(f"follows vLLM {NEWEST_VLLM}'s MXFP4 oracle")
    print(describe(dep))
    try:
        sel = select_backend(dep, decls)
    except NoBackend as exc:
        print(f"error: {exc}")
        return 1
    by_name = {d.vllm_backend: d.id for d in decls if d.vllm_backend}
    table = [
        (name, by_name.get(name, "-"), "CHOSEN" if reason is None else f"rejected: {reason}")
        for name, reason in sel.candidates
    ]
    print(format_table(("candidate (in order)", "module", "verdict"), table))
    print(f"\nchosen: {sel.chosen.vllm_backend} ({sel.chosen.id})")
    if sel.bf16_fallback:
        print(
            f"warning: no backend takes {dep.activation_quant} activations here; {sel.chosen.vllm_backend} runs with "
            "bf16 activations (vLLM warns the same)"
        )
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``select`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import arch, positive
    from mxmoe.harness.upstream.fetch import NEWEST_VLLM
    from mxmoe.harness.upstream.selection import ACTIVATION_QUANTS, MOE_BACKENDS
    from mxmoe.reference.activation import ACTIVATIONS
    from mxmoe.reference.routing import ROUTING_METHODS

    p = sub.add_parser(
        "select", help=f"which MXFP4 MoE backend vLLM {NEWEST_VLLM}'s oracle picks, and why not the others"
    )
    p.add_argument("--arch", type=arch, required=True, help="the architecture, e.g. sm90, sm100, gfx942, gfx950")
    p.add_argument("--activation", choices=ACTIVATIONS, default="swigluoai", help="(default swigluoai)")
    p.add_argument(
        "--activation-quant", choices=list(ACTIVATION_QUANTS), help="asked-for activation quantization (default none)"
    )
    p.add_argument("--routing", choices=ROUTING_METHODS, default="Renormalize", help="(default Renormalize)")
    p.add_argument("--tp", type=positive(int), default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--ep", type=positive(int), default=1, help="expert-parallel size (default 1)")
    p.add_argument(
        "--moe-backend", choices=list(MOE_BACKENDS), default="auto", help="as vLLM's --moe-backend (default auto)"
    )
    p.set_defaults(fn=_cmd_select, parser=p)
