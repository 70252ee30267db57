"""``python -m harness bench-reference`` and ``bench-backend``: the reference layer and one backend
timed at gpt-oss shapes, next to a matmul of the same run."""

from __future__ import annotations

import argparse
import json

from mxmoe.harness.cli.args import UsageError, host_line
from mxmoe.harness.cli.tables import format_table


def _cmd_bench_reference(args: argparse.Namespace) -> int:
    from mxmoe.harness.audits.bench import bench_reference

    print(host_line(args.device))
    rate, rows = bench_reference(args.device, args.models, args.tokens, args.repeats, args.matmul_n)
    print(f"float64 matmul {args.matmul_n}^3 in the same run: {rate / 1e12:.2f} TFLOP/s\n")
    table = [
        (
            r["model"],
            r["tokens"],
            f"{r['packed_ms']:.2f}",
            f"{r['packed_tflops']:.2f}",
            f"{r['packed_ratio']:.2f}",
            f"{r['prepared_ms']:.2f}",
            f"{r['prepared_tflops']:.2f}",
            f"{r['prepared_ratio']:.2f}",
        )
        for r in rows
    ]
    headers = ("model", "T", "packed ms", "TFLOP/s", "of matmul", "prepared ms", "TFLOP/s", "of matmul")
    print(format_table(headers, table))
    print("\npacked: dequantization inside the call; prepared: weights dequantized once (dequantize_weights)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host_line(args.device), "matmul_flops": rate, "rows": rows}, f, indent=1)
    return 0


def _cmd_bench_backend(args: argparse.Namespace) -> int:
    from mxmoe.harness.audits.bench import bench_backend
    from mxmoe.harness.contract.platforms import device_for, host_arch
    from mxmoe.harness.run.registry import discover, select

    arch = args.arch or host_arch()
    try:
        chosen = select(discover(), (args.backend,))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if len(chosen) != 1:
        raise UsageError(f"--backend {args.backend!r} must name one backend; it matches {len(chosen)}")
    backend = chosen[0].backend
    print(host_line(device_for(arch)))
    rate, rows = bench_backend(backend, arch, args.models, args.tokens, args.repeats, args.matmul_n)
    n = args.matmul_n
    print(f"{backend.declaration.id} on {arch}; bf16 matmul {n}^3 in the same run: {rate / 1e12:.1f} TFLOP/s\n")
    table = [(r["model"], r["tokens"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", f"{r['ratio']:.3f}") for r in rows]
    print(format_table(("model", "T", "ms", "TFLOP/s", "of bf16 matmul"), table))
    print("\nms: median of the timed run() calls (weights converted once, before); FLOPs of the two expert GEMMs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host_line(device_for(arch)), "bf16_matmul_flops": rate, "rows": rows}, f, indent=1)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``bench-reference`` and ``bench-backend`` to ``python -m harness``."""
    from mxmoe.harness.audits.bench import MODEL_SHAPES
    from mxmoe.harness.cli.args import arch, device, int_list

    p = sub.add_parser("bench-reference", help="time the reference layer at gpt-oss shapes vs a float64 matmul")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--models",
        type=lambda v: v.split(","),
        default=list(MODEL_SHAPES),
        help=f"comma-separated, from {', '.join(MODEL_SHAPES)} (default all)",
    )
    p.add_argument("--tokens", type=int_list, default=[1, 128, 4096], help="comma-separated T (default 1,128,4096)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row; the median is shown (default 3)")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the float64 matmul (default 8192)")
    p.add_argument("--json", help="also write the rows to this file")
    p.set_defaults(fn=_cmd_bench_reference)

    p = sub.add_parser("bench-backend", help="time one backend at gpt-oss shapes vs a bf16 matmul of the same run")
    p.add_argument("--backend", required=True, metavar="ID", help="the backend id, e.g. portable-triton")
    p.add_argument("--arch", type=arch, help="architecture to run as (default: this host's)")
    p.add_argument(
        "--models",
        type=lambda v: v.split(","),
        default=list(MODEL_SHAPES),
        help=f"comma-separated, from {', '.join(MODEL_SHAPES)} (default all)",
    )
    p.add_argument(
        "--tokens", type=int_list, default=[1, 7, 128, 4096], help="comma-separated T (default 1,7,128,4096)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row; the median is shown (default 5)")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the bf16 matmul (default 8192)")
    p.add_argument("--json", help="also write the rows to this file")
    p.set_defaults(fn=_cmd_bench_backend, parser=p)
