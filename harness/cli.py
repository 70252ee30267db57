"""``python -m harness`` (installed: ``mxmoe``): the harness's command line.

* ``signoff``: the main job on this machine. Today it is the oracle's self-check on built-in
  cases; a non-zero exit means the oracle cannot be trusted here.
* ``bench-reference``: times the reference layer at gpt-oss shapes next to a float64 matmul.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence

import torch

from mxmoe.harness.tables import format_table


def _device(value: str) -> str:
    """argparse type for --device: cpu, cuda or cuda:N, and only where it exists."""
    dev = value.strip()
    if dev != "cpu" and not (dev == "cuda" or dev.startswith("cuda:")):
        raise argparse.ArgumentTypeError(f"accepted values are cpu, cuda, cuda:N; got {value!r}")
    if dev != "cpu" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value!r} asked for, but torch {torch.__version__} sees no CUDA device")
    return dev


def _int_list(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not out or any(v < 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {value!r}")
    return out


def _host_line(device: str) -> str:
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor()
    return f"host: {platform.node()} | device {device} ({gpu or 'cpu'}) | torch {torch.__version__}"


def _cmd_signoff(args: argparse.Namespace) -> int:
    from mxmoe.harness.selfcheck import run_selfcheck

    print(_host_line(args.device))
    print("oracle self-check: the batched float64 reference vs its plain per-token definitions\n")
    results = run_selfcheck(args.device)
    rows = [
        (
            r.name,
            r.cases,
            f"{r.worst:.2e}",
            f"{r.tolerance:.0e}",
            f"{r.seconds:.2f}",
            "PASS" if r.passed else "FAIL",
            r.detail,
        )
        for r in results
    ]
    print(format_table(("check", "cases", "worst rel diff", "tolerance", "seconds", "verdict", "what"), rows))
    failed = [r.name for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _cmd_bench_reference(args: argparse.Namespace) -> int:
    from mxmoe.harness.bench import bench_reference

    print(_host_line(args.device))
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
            json.dump({"host": _host_line(args.device), "matmul_flops": rate, "rows": rows}, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    from mxmoe.harness.bench import MODEL_SHAPES

    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("signoff", help="the main job: the oracle's self-check on built-in cases")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.set_defaults(fn=_cmd_signoff)

    p = sub.add_parser("bench-reference", help="time the reference layer at gpt-oss shapes vs a float64 matmul")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--models",
        type=lambda v: v.split(","),
        default=list(MODEL_SHAPES),
        help=f"comma-separated, from {', '.join(MODEL_SHAPES)} (default all)",
    )
    p.add_argument("--tokens", type=_int_list, default=[1, 128, 4096], help="comma-separated T (default 1,128,4096)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row; the median is shown (default 3)")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the float64 matmul (default 8192)")
    p.add_argument("--json", help="also write the rows to this file")
    p.set_defaults(fn=_cmd_bench_reference)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    from mxmoe.harness.bench import MODEL_SHAPES

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench-reference":
        unknown = [m for m in args.models if m not in MODEL_SHAPES]
        if unknown:
            parser.error(f"--models: unknown {', '.join(unknown)}; accepted values are {', '.join(MODEL_SHAPES)}")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
