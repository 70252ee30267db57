"""``python -m harness`` (installed: ``mxmoe``): the harness's command line.

* ``signoff``: the main job on this machine: the oracle's self-check on built-in cases (a failure
  there stops everything: the oracle cannot be trusted here), then ``check`` of the default
  backends over the pr profile on this host's architecture (on a GPU also the nightly profile's
  gpt-oss cases, T = 1 to 4096: production kernels at production shapes), the catalogue of faulty
  kernels, the padding audit, ``model-check`` and GPQA of the tiny GPT-OSS through each default
  backend that runs here, and the sign-off report built from those records (``report``). What each
  step did is written to ``signoff-steps.json``; a step that failed or did not run blocks.
* ``bench-reference``: times the reference layer at gpt-oss shapes next to a float64 matmul.
* ``backends``: every backend (built-in, installed entry points, files) and whether it runs here.
* ``check``: a sweep of backends x a profile's cases in crash-proof worker processes, recorded in a
  results folder with a reproducer for every FAIL and ERROR.
* ``replay``: rerun one reproducer.
* ``fetch``: vendor code that is not a package (OpenAI triton_kernels from a vLLM wheel; vLLM's
  Python sources) into the git-ignored cache (``harness.vendor``, ``harness.vllm_drift``).
* ``vllm-drift``: vLLM's own MXFP4 oracle, run under fake platforms, against the declarations.
* ``model-check``, ``make-tiny``: model-level checks of GPT-OSS (``harness.e2e.cli``).
* ``gpqa``: GPQA through lm-eval, in this process or against a server (``harness.gpqa.cli``).
* ``diagnose``, ``shrink``: name the catalogue fault that explains a reproducer's failure; cut it
  down to the smallest failing slice of its inputs (``harness.diagnosis``).
* ``dist-check``: a layer sharded over ranks (TP or EP) with torch.distributed (``harness.distributed``).
* ``report``: merge result folders of many jobs and hosts into the sign-off report (``reports``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mxmoe.harness.tables import format_table

if TYPE_CHECKING:
    from mxmoe.harness.registry import Loaded


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


def _count(value: str) -> int:
    """argparse type for a count that may be 0."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def _host_line(device: str) -> str:
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor()
    return f"host: {platform.node()} | device {device} ({gpu or 'cpu'}) | torch {torch.__version__}"


SIGNOFF_STEPS = ("oracle self-check", "kernel check", "fault catalogue", "padding audit", "model check", "GPQA",
                 "report")  # fmt: skip
SIGNOFF_GPQA_LIMIT = 8
"""Default questions of the tiny GPQA for backends under Triton's CPU interpreter (seconds per
question); every other backend answers all 200 (a --limit run is judged against the oracle's
answers alone)."""


class StepSkipped(Exception):
    """A sign-off step that cannot run here (a package missing); the message says why."""


def _cmd_signoff(args: argparse.Namespace) -> int:
    """The whole sign-off on this machine; every step records into ``--results`` and the report is
    built from those records alone. A step that fails does not stop the next (the report says what
    failed), except the oracle's self-check: an untrustworthy oracle judges nothing. What each step
    did (ran, skipped and why, failed with its exit status) is written to
    ``signoff-steps.json``, which the report reads: a step that failed or did not run blocks."""
    import time
    import traceback

    from mxmoe.harness.platforms import host_arch
    from mxmoe.harness.results import stamp
    from mxmoe.harness.selfcheck import run_selfcheck

    start = time.perf_counter()
    results = args.results
    os.makedirs(results, exist_ok=True)
    manifest = os.path.join(results, "signoff-steps.json")
    steps: list[dict] = []

    def write_manifest() -> None:
        with open(manifest, "w", encoding="utf-8") as f:
            json.dump(stamp("signoff-steps") | {"steps": steps}, f, indent=1)

    def step(n: int, run: Callable[[], int], makes: str | None = None) -> int:
        """Run step ``n``; it ran when it returned a verdict status (0 or 1) and wrote ``makes``."""
        name = SIGNOFF_STEPS[n - 1]
        print(f"\n[{n}/{len(SIGNOFF_STEPS)}] {name} ({time.perf_counter() - start:.0f} s elapsed)\n", flush=True)
        t0 = time.perf_counter()
        entry: dict[str, object] = {"name": name, "status": "ran", "exit_status": None, "reason": ""}
        before = os.path.getmtime(makes) if makes and os.path.exists(makes) else None
        try:
            rc = run()
            entry["exit_status"] = rc
            if rc not in (0, 1):
                entry["status"], entry["reason"] = "failed", f"exited with status {rc}"
            elif makes and (not os.path.exists(makes) or os.path.getmtime(makes) == before):
                entry["status"], entry["reason"] = "failed", f"it did not write {makes}"
        except StepSkipped as exc:
            entry["status"], entry["reason"] = "skipped", str(exc)
            print(f"{name} skipped: {exc}")
        except SystemExit as exc:  # argparse's error exit inside a step
            entry["status"], entry["exit_status"] = "failed", exc.code
            entry["reason"] = f"exited with status {exc.code}"
        except Exception as exc:
            entry["status"], entry["reason"] = "failed", f"raised {type(exc).__name__}: {exc}"
            print(f"{name} raised:\n{traceback.format_exc()}", file=sys.stderr)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        steps.append(entry)
        write_manifest()
        return int(entry["exit_status"] or 0)

    print(_host_line(args.device))

    def selfcheck() -> int:
        print("the batched float64 reference vs its plain per-token definitions\n")
        checks = run_selfcheck(args.device)
        rows = [(r.name, r.cases, f"{r.worst:.2e}", f"{r.tolerance:.0e}", f"{r.seconds:.2f}",
                 "PASS" if r.passed else "FAIL", r.detail) for r in checks]  # fmt: skip
        print(format_table(("check", "cases", "worst rel diff", "tolerance", "seconds", "verdict", "what"), rows))
        failed = [r.name for r in checks if not r.passed]
        print(f"\n{len(checks) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0

    if step(1, selfcheck) != 0 or steps[-1]["status"] != "ran":
        print("the oracle is not trustworthy on this machine: no backend is judged by it\n\nverdict: BLOCKED")
        return 1

    here = _signoff_backends()

    def kernel_check() -> int:
        """Every default backend on this host's arch over the pr profile; on a GPU, the production
        kernels that run here also at production shapes (the nightly profile's gpt-oss cases, T = 1
        to 4096), in one worker per GPU."""
        rc = main(["check", "--profile", "pr", "--results", results])
        production = _production_backends(here)
        if host_arch() != "cpu" and not production:
            print("\nproduction shapes: no production kernel runs here, none judged at gpt-oss shapes")
        elif host_arch() != "cpu":
            print(f"\nproduction shapes: {', '.join(production)} over the nightly profile's gpt-oss cases\n",
                  flush=True)  # fmt: skip
            workers = str(max(1, torch.cuda.device_count()))
            rc = max(rc, main(["check", "--profile", "nightly", "-k", "gptoss", "--results", results,
                               "--workers", workers, *(a for b in production for a in ("--backend", b))]))  # fmt: skip
        return rc

    step(2, kernel_check)
    # detection power: the catalogue of faulty kernels is caught, the honest variants are not
    mutants = os.path.join(results, "mutants.json")
    step(3, lambda: main(["mutants", "--profile", "pr", "--json", mutants]), makes=mutants)
    padding = os.path.join(results, "padding.json")
    step(4, lambda: main(["padding", "--json", padding]), makes=padding)
    step(5, lambda: _signoff_models(results, here))  # the tiny GPT-OSS's MoE through each backend here
    step(6, lambda: _signoff_gpqa(results, here, args.interpreter_gpqa_questions))
    from mxmoe.reports.cli import print_verdict, run_report

    print(f"\n[7/{len(SIGNOFF_STEPS)}] {SIGNOFF_STEPS[6]} ({time.perf_counter() - start:.0f} s elapsed)\n")
    report, files = run_report([results], os.path.join(results, "report"), policy=args.policy)
    _print_not_run(report)
    print_verdict(report, files)
    print(f"sign-off took {time.perf_counter() - start:.0f} s: " + ", ".join(
        f"{st['name']} {st['seconds']:.0f} s ({st['status']})" for st in steps))  # fmt: skip
    return 0 if report["verdict"] == "SHIP" else 1


def _signoff_backends() -> list[str]:
    from mxmoe.harness.platforms import host_arch
    from mxmoe.harness.registry import discover, select

    arch = host_arch()
    return [item.backend.declaration.id for item in select(discover()) if availability(item, arch) is None]


def _production_backends(ids: list[str]) -> list[str]:
    """Of ``ids``, the production kernels (``Declaration.production``; not the harness's own)."""
    from mxmoe.harness.registry import discover

    prod = {item.backend.declaration.id for item in discover() if item.backend.declaration.production}
    return [b for b in ids if b in prod]


def _model_packages() -> str | None:
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"it needs transformers and tokenizers ({exc})"
    return None


def _signoff_models(results: str, here: list[str]) -> int:
    from mxmoe.harness.platforms import host_arch

    missing = _model_packages()
    if missing:
        raise StepSkipped(missing)
    print(f"the tiny GPT-OSS through {', '.join(here)}\n", flush=True)
    batch = "2" if host_arch() == "cpu" else "8"
    argv = ["model-check", "--model", "tiny", "--batch", batch, "--repeats", "1", "--results", results]
    return main([*argv, *(a for b in here for a in ("--backend", b))])


def _signoff_gpqa(results: str, here: list[str], limit: int = SIGNOFF_GPQA_LIMIT) -> int:
    """The tiny GPT-OSS's GPQA, each backend against the oracle-MoE model's answers on the same
    samples. On a CPU, backends under Triton's interpreter answer ``limit`` questions (in their own
    folder: another sample of questions is another test), or none when it is 0."""
    from mxmoe.harness.platforms import host_arch

    missing = _model_packages()
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        missing = missing or f"it needs lm-eval ({exc})"
    if missing:
        raise StepSkipped(missing)
    slow = [b for b in here if host_arch() == "cpu" and "triton" in b]
    full = [b for b in here if b not in slow]
    status = 0
    argv = ["gpqa", "--model", "tiny", "--baseline", "oracle", "--batch", "8"]
    if full:
        status = main([*argv, "--results", results, *(a for b in full for a in ("--backend", b))])
    if slow and not limit:
        print(f"\nnot run under Triton's CPU interpreter (--interpreter-gpqa-questions 0): {', '.join(slow)}")
    elif slow:
        sub = os.path.join(results, f"gpqa-limit{limit}")
        print(f"\nunder Triton's CPU interpreter: {', '.join(slow)} on {limit} questions\n", flush=True)
        status = max(status, main([*argv, "--limit", str(limit), "--results", sub,
                                   *(a for b in slow for a in ("--backend", b))]))  # fmt: skip
    return status


def _print_not_run(report: dict) -> None:
    """Per backend that did not run, one line per skip reason (not one per skipped case)."""
    from mxmoe.reports.render import ran

    idle = [r for r in report["rows"] if not ran(r)]
    if not idle:
        return
    print(f"\ndid not run here ({len(idle)} backend/arch pairs; skips are never counted as passes):")
    for r in idle:
        for reason, n in r["skip_reasons"].items():
            print(f"  {r['backend']} ({r['arch']}): {n} SKIP: {reason}")


def _cmd_bench_backend(args: argparse.Namespace) -> int:
    from mxmoe.harness.bench import bench_backend
    from mxmoe.harness.platforms import device_for, host_arch
    from mxmoe.harness.registry import discover, select

    arch = args.arch or host_arch()
    try:
        chosen = select(discover(), (args.backend,))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if len(chosen) != 1:
        raise UsageError(f"--backend {args.backend!r} must name one backend; it matches {len(chosen)}")
    backend = chosen[0].backend
    print(_host_line(device_for(arch)))
    rate, rows = bench_backend(backend, arch, args.models, args.tokens, args.repeats, args.matmul_n)
    n = args.matmul_n
    print(f"{backend.declaration.id} on {arch}; bf16 matmul {n}^3 in the same run: {rate / 1e12:.1f} TFLOP/s\n")
    table = [(r["model"], r["tokens"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", f"{r['ratio']:.3f}") for r in rows]
    print(format_table(("model", "T", "ms", "TFLOP/s", "of bf16 matmul"), table))
    print("\nms: median of the timed run() calls (weights converted once, before); FLOPs of the two expert GEMMs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": _host_line(device_for(arch)), "bf16_matmul_flops": rate, "rows": rows}, f, indent=1)
    return 0


def _cmd_select(args: argparse.Namespace) -> int:
    from mxmoe.harness.registry import discover
    from mxmoe.harness.selection import Deployment, NoBackend, describe, select_backend

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
    return 0


def _cmd_padding(args: argparse.Namespace) -> int:
    from mxmoe.harness.padding_audit import audit
    from mxmoe.harness.registry import discover, select
    from mxmoe.harness.results import stamp

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


def _cmd_mutants(args: argparse.Namespace) -> int:
    from mxmoe.harness.mutants import BAD_VERDICTS, PEER_RULES, run_catalogue
    from mxmoe.harness.platforms import device_for, host_arch
    from mxmoe.harness.results import stamp
    from mxmoe.harness.zoo import profile_cases

    arch = host_arch()
    cases = [
        c for c in profile_cases(args.profile)
        if all(k in c.id for k in args.k) and not any(x in c.id for x in args.exclude)
        and (not args.case or c.id in args.case)
    ]  # fmt: skip
    if not cases:
        raise UsageError(f"-k {args.k} and --exclude {args.exclude} select none of the {args.profile} profile's cases")
    print(f"{_host_line(device_for(arch))} | arch {arch}")
    if args.vendor:
        return _vendor_mutants(args, arch, cases)
    if args.patch:
        raise UsageError("--patch names patches of a vendor: give --vendor too")
    print(f"mutants: the catalogue and the honest variants, profile {args.profile} ({len(cases)} cases)\n", flush=True)
    rows = run_catalogue(cases, arch)

    def outcome(r: object) -> str:
        parts = [f"FAIL x{r.fails}"] * bool(r.fails) + [f"ERROR x{r.errors}"] * bool(r.errors)
        return ", ".join(parts) or "PASS"

    def ratio(v: float) -> str:
        return "inf" if v == float("inf") else f"{v:.3g}"

    table = [
        (
            r.id.removeprefix("mutant-"),
            r.verdict,
            outcome(r),
            r.first_catch or "-",
            f"{r.fails + r.errors}/{r.runs}",
            ratio(r.worst_ratio),
            f"{r.worst_z:.3g}",
            r.z_only or "-",
            *(f"{r.peer_catches.get(rule, 0)}/{r.runs}" for rule in PEER_RULES),
            r.fault,
        )
        for r in rows
    ]
    headers = (
        "fault", "verdict", "outcome", "cases to catch", "caught/run", "worst err/bound", "worst z", "by z only",
        "vLLM 80%/0.3", "triton_kernels", "what it does",
    )  # fmt: skip
    print(format_table(headers, table))
    print(
        "\ncases to catch: cases run, in profile order, up to the first FAIL or ERROR (a fault stops there, except"
        "\nthe control and routing-weights-bf16, run on every case for their rates); honest variants run every case;"
        "\nworst z: the systematic-error test's largest z (threshold about 7: harness.systematic); by z only: FAILs"
        "\nwith every element within the bound; vLLM 80%/0.3, triton_kernels: the cases of the same runs that those"
        "\npeers' acceptance rules reject"
    )
    bad = [r.id for r in rows if r.verdict in BAD_VERDICTS]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            stamp("mutants") | {"profile": args.profile, "arch": arch, "rows": [r.to_dict() for r in rows]},
            f,
            indent=1,
        )
    print(f"recorded: {args.json}")
    if bad:
        print(f"NOT AS EXPECTED: {', '.join(bad)}")
    return 1 if bad else 0


def _vendor_mutants(args: argparse.Namespace, arch: str, cases: list) -> int:
    """``mutants --vendor V``: the vendor's patched kernels through its adapters (harness.mutation)."""
    from mxmoe.harness.mutation.vendor import PEER_RULES, run_vendor, vendor
    from mxmoe.harness.results import stamp

    try:
        v = vendor(args.vendor)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    interpreted = arch == "cpu" and v.interpret_as is not None
    if interpreted:  # harness.mutation.interpret: that architecture's code path, under Triton's interpreter
        arch = v.interpret_as
    where = f"{arch}, interpreted on this cpu" if interpreted else arch
    print(f"mutants --vendor {v.name}: {len(v.patches)} patches x adapters {', '.join(v.backends)} on {where}, "
          f"profile {args.profile} ({len(cases)} cases)\n", flush=True)  # fmt: skip
    from mxmoe.harness.vendor import VendorMissing

    try:
        rows = run_vendor(v, args.profile, [c.id for c in cases], jobs=args.jobs, only=args.patch or None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except (RuntimeError, VendorMissing) as exc:
        print(f"mutants --vendor {v.name}: {exc}", file=sys.stderr)
        return 2
    table = [
        (
            r.id.split(":", 1)[1], r.backend, r.category, r.verdict, f"{r.fails + r.errors}/{r.runs}",
            f"{r.differs}/{r.runs}" if r.kind != "control" else "-",
            "inf" if r.worst_ratio == float("inf") else f"{r.worst_ratio:.3g}", f"{r.worst_z:.3g}", r.z_only or "-",
            *(f"{r.peer_catches.get(rule, 0)}/{r.runs}" for rule in PEER_RULES), r.fault,
        )
        for r in rows
    ]  # fmt: skip
    headers = ("patch", "adapter", "category", "verdict", "caught/run", "differs", "worst err/bound", "worst z",
               "by z only", "vLLM 80%/0.3", "triton_kernels", "what it does")  # fmt: skip
    print()
    print(format_table(headers, table))
    print(
        "\ndiffers: cases whose output differs bit for bit from the unpatched kernel's (or that raise): a patch"
        "\nthat differs nowhere has no effect on these cases and is not a miss; by z only: FAILs with every element"
        "\nwithin the bound (harness.systematic); vLLM 80%/0.3, triton_kernels: the same runs under those peers' rules"
    )
    bad = [f"{r.id} ({r.backend})" for r in rows if r.verdict in ("MISSED", "FALSE ALARM")]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            stamp("mutants") | {"profile": args.profile, "arch": arch, "vendor": v.name, "interpreted": interpreted,
                                "rows": [r.to_dict() for r in rows]},
            f, indent=1,
        )  # fmt: skip
    print(f"recorded: {args.json}")
    if bad:
        print(f"NOT AS EXPECTED: {', '.join(bad)}")
    return 1 if bad else 0


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


class UsageError(Exception):
    """A bad argument found after parsing (a --backend pattern that matches nothing): reported by
    the subcommand's parser, as argparse reports its own errors."""


def _arch(value: str) -> str:
    """argparse type for --arch: one of the architecture tokens."""
    from mxmoe.harness.platforms import ARCHS

    if value not in ARCHS:
        raise argparse.ArgumentTypeError(f"accepted values are {', '.join(ARCHS)}; got {value!r}")
    return value


def _backend_file(value: str) -> str:
    """argparse type for --backend-file: ``path/to/file.py:ClassName`` naming an existing file (a
    file that exists but fails to import is not an argument error: its cases become ERRORs)."""
    path, _, cls = value.rpartition(":")
    if not path.endswith(".py") or not cls.isidentifier():
        raise argparse.ArgumentTypeError(f"expected PATH.py:ClassName, got {value!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file {path!r} (in {value!r})")
    return value


def _positive(kind: type) -> Callable[[str], float]:
    """argparse type for counts and seconds: zero workers or a zero timeout is a typo, not a plan."""

    def parse(value: str) -> float:
        try:
            out = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {value!r}") from None
        if out <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {value!r}")
        return out

    return parse


def _discover(args: argparse.Namespace) -> list[Loaded]:
    from mxmoe.harness.registry import discover

    try:
        return discover(tuple(args.backend_file))
    except ValueError as exc:  # two backends with one id
        raise UsageError(f"--backend-file: {exc}") from None


def availability(loaded: Loaded, arch: str) -> str | None:
    """None if the backend can run on ``arch`` on this host, else why not: its module did not
    load, it does not declare ``arch``, this host is another arch, or its ``load`` fails."""
    from mxmoe.harness.backend import BackendUnavailable
    from mxmoe.harness.platforms import host_arch
    from mxmoe.harness.registry import BrokenBackend

    backend = loaded.backend
    d = backend.declaration
    if isinstance(backend, BrokenBackend):
        last = [line for line in backend.error.strip().splitlines() if line.strip()][-1:]
        return f"failed to load {loaded.spec}: {last[0].strip() if last else 'unknown error'}"
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
    from mxmoe.harness.platforms import ARCHS, host_arch
    from mxmoe.harness.results import declaration_to_dict
    from mxmoe.reference.activation import ACTIVATIONS
    from mxmoe.reference.routing import ROUTING_METHODS

    arch = args.arch or host_arch()
    entries = []
    for loaded in _discover(args):
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


def _cmd_fetch(args: argparse.Namespace) -> int:
    from mxmoe.harness.vendor import VendorMissing, fetch_triton_kernels
    from mxmoe.harness.vllm_drift import fetch_vllm

    if args.wheel and not os.path.isfile(args.wheel):
        raise UsageError(f"--wheel: no such file {args.wheel!r}")
    wheel = Path(args.wheel) if args.wheel else None
    try:
        if args.what == "triton-kernels":
            path = fetch_triton_kernels(args.vllm_version, wheel)
            print(f"triton_kernels (from vLLM {args.vllm_version}'s wheel) is at {path}; it is found there at run time")
        else:
            path = fetch_vllm(args.vllm_version, wheel)
            print(f"vLLM {args.vllm_version}'s Python sources are at {path} (for `python -m harness vllm-drift`)")
    except VendorMissing as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_vllm_drift(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from mxmoe.harness import vllm_drift as vd
    from mxmoe.harness.platforms import host_fingerprint
    from mxmoe.harness.registry import discover
    from mxmoe.harness.vendor import VendorMissing

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
    stale = vd.stale_known(rows) if not args.arch else []
    version = next(iter(facts.values())).get("vllm_version", "?") if facts else "?"
    print(f"vLLM {version} (its own oracle, fake platforms) against this project's declarations\n")
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


def _cmd_check(args: argparse.Namespace) -> int:
    from mxmoe.harness.engine import failure_message, test_id
    from mxmoe.harness.platforms import host_arch
    from mxmoe.harness.registry import select
    from mxmoe.harness.results import Recorder, replay_command
    from mxmoe.harness.sweep import Progress, Sweep, worst_ratio
    from mxmoe.harness.zoo import profile_cases

    arch = args.arch or host_arch()
    try:
        backends = select(_discover(args), tuple(args.backend))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cases = profile_cases(args.profile)
    pairs = [
        (loaded, case)
        for loaded in backends
        for case in cases
        if all(k in test_id(loaded.backend.declaration.id, arch, case) for k in args.k)
        and not any(x in test_id(loaded.backend.declaration.id, arch, case) for x in args.exclude)
    ]
    if not pairs:
        raise UsageError(
            " ".join([*(f"-k {k}" for k in args.k), *(f"-x {x}" for x in args.exclude)]) + " selects none of the "
            f"{len(backends) * len(cases)} test ids of "
            f"{', '.join(b.backend.declaration.id for b in backends)} on {arch} (profile {args.profile})"
        )
    recorder = Recorder(args.results)
    print(f"{_host_line('cpu' if host_arch() == 'cpu' else 'cuda')} | arch {arch}")
    print(
        f"check: {len(pairs)} tests ({len(backends)} backends x profile {args.profile}), {args.workers} worker(s), "
        f"timeout {args.timeout:g} s per case; results in {recorder.path}\n",
        flush=True,
    )
    progress = Progress(len(pairs))
    sweep = Sweep(
        recorder, workers=args.workers, timeout=args.timeout, on_verdict=lambda v: progress.add(v.result.outcome)
    )
    try:
        verdicts = sweep.run(pairs, arch)
    finally:
        progress.close()
    rows = []
    for loaded in backends:
        mine = [v for v in verdicts if v.loaded is loaded]
        if not mine:
            continue
        n = {o: sum(v.result.outcome == o for v in mine) for o in ("PASS", "FAIL", "ERROR", "SKIP", "XFAIL")}
        rows.append(
            (
                loaded.backend.declaration.id,
                *n.values(),
                f"{worst_ratio(mine):.3g}",
                f"{sum(v.result.seconds for v in mine):.1f}",
            )
        )
    print()
    print(format_table(("backend", "PASS", "FAIL", "ERROR", "SKIP", "XFAIL", "worst err/bound", "seconds"), rows))
    bad = [v for v in verdicts if v.result.outcome in ("FAIL", "ERROR")]
    if bad:
        print(f"\n{len(bad)} FAIL/ERROR:")
        for v in sorted(bad, key=lambda v: v.result.test_id):
            first = failure_message(v.result).splitlines()[0]
            last = [line.strip() for line in v.result.traceback.splitlines() if line.strip()][-1:]
            print(f"{v.result.outcome} {first}" + (f" ({last[0]})" if last else ""))
            if v.result.diagnosis:
                print(f"    diagnosis: {v.result.diagnosis}")
            if v.repro is not None:
                print(f"    replay: {replay_command(v.repro)}")
    print(f"\nresults: {recorder.path}")
    return 1 if bad else 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from mxmoe.harness.engine import failure_message, run_case
    from mxmoe.harness.results import load_repro

    try:
        loaded, case, arch, inputs = load_repro(args.file)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"FILE: cannot read reproducer {args.file}: {type(exc).__name__}: {exc}") from None
    recorded = json.loads(open(args.file, encoding="utf-8").read())
    print(f"replaying {recorded['test_id']} (recorded {recorded['outcome']}: {recorded['reason']})")
    result, _ = run_case(loaded.backend, case, arch, inputs=inputs, diagnose=True)
    if result.outcome == "PASS":
        print(f"PASS {result.test_id}: {result.reason}")
        return 0
    print(f"{result.outcome} " + failure_message(result))
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    from mxmoe.harness.bench import MODEL_SHAPES
    from mxmoe.harness.zoo import PROFILES

    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "signoff", help="the main job: self-check, kernel check, fault catalogue, model check, GPQA, report"
    )
    p.add_argument("--device", type=_device, default="cpu", help="self-check device: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--results", default="results", help="results folder of every step (default results/); the "
                                                            "report goes to its report/")  # fmt: skip
    p.add_argument("--policy", metavar="FILE", help="the verdict's rules (default reports/policy.toml)")
    p.add_argument("--interpreter-gpqa-questions", type=_count, default=SIGNOFF_GPQA_LIMIT, metavar="N",
                   help="tiny-GPQA questions for backends under Triton's CPU interpreter, about 12 s each on 2 cores "
                        "(default %(default)s; 0: none)")  # fmt: skip
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

    p = sub.add_parser("bench-backend", help="time one backend at gpt-oss shapes vs a bf16 matmul of the same run")
    p.add_argument("--backend", required=True, metavar="ID", help="the backend id, e.g. portable-triton")
    p.add_argument("--arch", type=_arch, help="architecture to run as (default: this host's)")
    p.add_argument(
        "--models",
        type=lambda v: v.split(","),
        default=list(MODEL_SHAPES),
        help=f"comma-separated, from {', '.join(MODEL_SHAPES)} (default all)",
    )
    p.add_argument(
        "--tokens", type=_int_list, default=[1, 7, 128, 4096], help="comma-separated T (default 1,7,128,4096)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row; the median is shown (default 5)")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the bf16 matmul (default 8192)")
    p.add_argument("--json", help="also write the rows to this file")
    p.set_defaults(fn=_cmd_bench_backend, parser=p)

    from mxmoe.harness.selection import ACTIVATION_QUANTS, MOE_BACKENDS
    from mxmoe.reference.activation import ACTIVATIONS
    from mxmoe.reference.routing import ROUTING_METHODS

    p = sub.add_parser("select", help="which MXFP4 MoE backend vLLM's oracle picks, and why not the others")
    p.add_argument("--arch", type=_arch, required=True, help="the architecture, e.g. sm90, sm100, gfx942, gfx950")
    p.add_argument("--activation", choices=ACTIVATIONS, default="swigluoai", help="(default swigluoai)")
    p.add_argument(
        "--activation-quant", choices=list(ACTIVATION_QUANTS), help="asked-for activation quantization (default none)"
    )
    p.add_argument("--routing", choices=ROUTING_METHODS, default="Renormalize", help="(default Renormalize)")
    p.add_argument("--tp", type=_positive(int), default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--ep", type=_positive(int), default=1, help="expert-parallel size (default 1)")
    p.add_argument(
        "--moe-backend", choices=list(MOE_BACKENDS), default="auto", help="as vLLM's --moe-backend (default auto)"
    )
    p.set_defaults(fn=_cmd_select, parser=p)

    p = sub.add_parser("mutants", help="the catalogue of faulty kernels and the honest variants: caught and clean?")
    p.add_argument("--profile", choices=PROFILES, default="pr", help="case list (default pr)")
    p.add_argument("--json", default="results/mutants.json", help="where the matrix is recorded (default %(default)s)")
    p.add_argument(
        "-k", action="append", default=[], metavar="SUBSTRING", help="keep case ids containing it (repeatable: all)"
    )
    p.add_argument(
        "--exclude", action="append", default=[], metavar="SUBSTRING",
        help="drop case ids containing it (repeatable: any), e.g. the production shapes on a CPU",
    )  # fmt: skip
    p.add_argument(
        "--vendor",
        help="mutate a vendor's real kernels instead (harness.mutation): triton (OpenAI triton_kernels, on a GPU) "
        "or aiter (AITER's Triton a16w4; on a CPU, under Triton's interpreter on gfx942's code path)",
    )
    p.add_argument("--case", action="append", default=[], metavar="ID", help="only these case ids (repeatable)")
    p.add_argument("--patch", action="append", default=[], help="with --vendor: only these patches (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="with --vendor: patched copies run at once (default 1)")
    p.set_defaults(fn=_cmd_mutants, parser=p)

    p = sub.add_parser("padding", help="weight memory each backend's padding costs at gpt-oss TP 1, 2, 4, 8")
    p.add_argument("--json", default="results/padding.json", help="where the rows are recorded (default %(default)s)")
    p.set_defaults(fn=_cmd_padding, parser=p)

    file_help = "a backend class in a file, PATH.py:ClassName (repeatable)"
    p = sub.add_parser("backends", help="list every backend and whether it can run on this host")
    p.add_argument(
        "--backend-file", action="append", default=[], type=_backend_file, metavar="PATH.py:Class", help=file_help
    )
    p.add_argument("--arch", type=_arch, help="the architecture to ask about (default: this host's)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(fn=_cmd_backends, parser=p)

    p = sub.add_parser("check", help="check backends on a profile's cases (worker processes, recorded results)")
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="PATTERN",
        help="shell glob on backend ids (repeatable; default: every backend of kind 'backend' and every file)",
    )
    p.add_argument(
        "--backend-file", action="append", default=[], type=_backend_file, metavar="PATH.py:Class", help=file_help
    )
    p.add_argument("--profile", choices=PROFILES, default="pr", help="case list (default pr)")
    p.add_argument("--arch", type=_arch, help="architecture token of the test ids (default: this host's)")
    p.add_argument(
        "-k", action="append", default=[], metavar="SUBSTRING", help="keep test ids containing it (repeatable: all)"
    )
    p.add_argument(
        "-x",
        "--exclude",
        action="append",
        default=[],
        metavar="SUBSTRING",
        help="drop test ids containing it (repeatable: any), e.g. -x gptoss -x dsv3 on a CPU",
    )
    p.add_argument("--results", default="results", metavar="DIR", help="results folder (default ./results)")
    p.add_argument("--workers", type=_positive(int), default=1, help="worker processes (default 1)")
    p.add_argument("--timeout", type=_positive(float), default=600.0, metavar="SECONDS", help="per case (default 600)")
    p.set_defaults(fn=_cmd_check, parser=p)

    from mxmoe.harness.vendor import DEFAULT_VLLM

    p = sub.add_parser("fetch", help="put OpenAI triton_kernels (vLLM's vendored copy) into the ignored cache")
    p.add_argument(
        "what", choices=["triton-kernels", "vllm"], help="triton_kernels, or vLLM's Python sources (for vllm-drift)"
    )
    p.add_argument(
        "--vllm-version", default=DEFAULT_VLLM, help="the vLLM release whose wheel vendors it (default %(default)s)"
    )
    p.add_argument("--wheel", metavar="PATH", help="a vLLM wheel already on this machine (no download)")
    p.set_defaults(fn=_cmd_fetch, parser=p)

    from mxmoe.harness.vllm_drift import PROBE_ARCHS

    p = sub.add_parser("vllm-drift", help="run vLLM's own MXFP4 oracle (fake platforms) against the declarations")
    p.add_argument("--arch", action="append", choices=PROBE_ARCHS, help="(repeatable; default all)")
    p.add_argument("--vllm-version", default=DEFAULT_VLLM, help="the fetched vLLM release (default %(default)s)")
    p.add_argument("--json", default="results/vllm-drift.json", help="where it is recorded (default %(default)s)")
    p.set_defaults(fn=_cmd_vllm_drift, parser=p)

    p = sub.add_parser("replay", help="rerun a reproducer written by check (results/repro/<test id>.json)")
    p.add_argument("file", metavar="FILE", help="the reproducer's .json file")
    p.set_defaults(fn=_cmd_replay, parser=p)

    from mxmoe.harness.diagnosis.cli import add_parsers as add_diagnosis
    from mxmoe.harness.distributed.cli import add_parsers as add_dist
    from mxmoe.harness.e2e.cli import add_parsers as add_e2e
    from mxmoe.harness.gpqa.cli import add_parsers as add_gpqa
    from mxmoe.harness.jitbuild.cli import add_parsers as add_jitbuild
    from mxmoe.reports.cli import add_parsers as add_report

    add_e2e(sub)
    add_gpqa(sub)
    add_dist(sub)
    add_diagnosis(sub)
    add_report(sub)
    add_jitbuild(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    from mxmoe.harness.bench import MODEL_SHAPES
    from mxmoe.harness.platforms import use_triton_interpreter_without_gpu

    use_triton_interpreter_without_gpu()  # before anything imports triton; worker processes inherit it
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("bench-reference", "bench-backend"):
        unknown = [m for m in args.models if m not in MODEL_SHAPES]
        if unknown:
            parser.error(f"--models: unknown {', '.join(unknown)}; accepted values are {', '.join(MODEL_SHAPES)}")
    try:
        return args.fn(args)
    except UsageError as exc:
        args.parser.error(str(exc))  # exits with status 2, naming the subcommand


if __name__ == "__main__":
    sys.exit(main())
