"""``python -m harness bench-reference`` and ``bench-backend``: the reference layer and one backend
timed at gpt-oss shapes, next to a matmul of the same run."""

from __future__ import annotations

import argparse
import json
import sys

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


def _cmd_bench_check(args: argparse.Namespace) -> int:
    import tempfile

    from mxmoe.harness.audits.bench import bench_check
    from mxmoe.harness.cli.args import discover
    from mxmoe.harness.cli.check import select_pairs
    from mxmoe.harness.contract.platforms import device_for, host_arch
    from mxmoe.harness.diagnosis.explain import summarize
    from mxmoe.harness.judge.engine import STAGES
    from mxmoe.harness.run.profiles import profile_cases
    from mxmoe.harness.run.registry import select

    arch = host_arch()
    try:
        backends = select(discover(args), tuple(args.backend))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    cases = [c for c in profile_cases(args.profile) if not args.cases or c.id in args.cases]
    pairs = select_pairs(backends, cases, arch, args.k, args.exclude)
    if not pairs:
        raise UsageError(f"-k {args.k} -x {args.exclude} select no test of profile {args.profile} on {arch}")
    print(host_line(device_for(arch)))
    print(f"bench-check: {len(pairs)} tests in this process, in the sweep's order\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="mxmoe-bench-check-") as tmp:

        def progress(r: dict) -> None:
            print(f"{r['backend']} {r['case']}: {r['outcome']} in {r['seconds']:.2f} s", file=sys.stderr, flush=True)

        rows = bench_check(pairs, arch, args.results or tmp, diagnose=summarize, on_row=progress)
    shown = [s for s in (*STAGES, "other", "reproducer") if any(r["stages"][s] >= 0.005 for r in rows)]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    skipped = [r for r in rows if r["outcome"] == "SKIP"]
    table = [
        (r["case"], r["backend"], r["outcome"], f"{r['seconds']:.2f}", *(ms(r["stages"][s]) for s in shown),
         ms(r["oracle_seconds"]), "-" if r["ratio"] is None else f"{r['ratio']:.0f}")
        for r in rows
        if r["outcome"] != "SKIP"
    ]  # fmt: skip
    print(format_table(("case", "backend", "outcome", "test s", *(f"{s} ms" for s in shown), "oracle ms",
                        "test/oracle"), table))  # fmt: skip
    if skipped:
        print(f"\n{len(skipped)} tests skipped (not shown; their time is counted below)")
    total = sum(r["seconds"] for r in rows)
    print(f"\nwhere the {total:.1f} s of {len(rows)} tests went:")
    spent = {s: sum(r["stages"][s] for r in rows) for s in (*STAGES, "other", "reproducer")}
    print(format_table(("stage", "seconds", "share"), [(s, f"{v:.1f}", f"{100 * v / total:.0f}%")
                                                       for s, v in spent.items()]))  # fmt: skip
    oracle = sum(r["oracle_seconds"] for r in rows if r["oracle_seconds"])
    if oracle:
        print(f"\nthe oracle alone, once per test: {oracle:.1f} s (the tests took {total / oracle:.0f}x that)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host_line(device_for(arch)), "rows": rows}, f, indent=1)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``bench-reference``, ``bench-backend`` and ``bench-check`` to ``python -m harness``."""
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

    from mxmoe.harness.cli.check import add_selection

    p = sub.add_parser(
        "bench-check", help="where a check's time goes: each stage of each test, next to the oracle's own time"
    )
    add_selection(p, "nightly")
    p.add_argument("--cases", type=lambda v: v.split(","), default=[], metavar="ID,ID",
                   help="only these case ids of the profile (default: all)")  # fmt: skip
    p.add_argument("--results", metavar="DIR", help="keep the recorded results here (default: a temporary folder)")
    p.add_argument("--json", help="also write the rows to this file")
    p.set_defaults(fn=_cmd_bench_check, parser=p)  # fmt: skip
