"""``python -m harness mutants``: the catalogue of faulty kernels and the honest variants, caught and
clean; with ``--vendor``, a vendor's real kernels patched (``harness.audits.mutation``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from mxmoe.harness.cli.args import UsageError, host_line
from mxmoe.harness.cli.tables import format_table


def _cmd_mutants(args: argparse.Namespace) -> int:
    from mxmoe.harness.audits.catalogue import BAD_VERDICTS, PEER_RULES, run_catalogue
    from mxmoe.harness.contract.platforms import device_for, host_arch
    from mxmoe.harness.run.profiles import profile_cases
    from mxmoe.harness.run.results import stamp

    arch = host_arch()
    cases = [
        c for c in profile_cases(args.profile)
        if all(k in c.id for k in args.k) and not any(x in c.id for x in args.exclude)
        and (not args.case or c.id in args.case)
    ]  # fmt: skip
    if not cases:
        raise UsageError(f"-k {args.k} and --exclude {args.exclude} select none of the {args.profile} profile's cases")
    print(f"{host_line(device_for(arch))} | arch {arch}")
    if args.vendor:
        if args.full:
            raise UsageError("--full is the catalogue's (every fault on every case); a vendor's patches run every case")
        return _vendor_mutants(args, arch, cases)
    if args.patch or args.backend:
        which = "--patch" if args.patch else "--backend"
        raise UsageError(f"{which} names a vendor's patches or adapters: give --vendor too")
    print(f"mutants: the catalogue and the honest variants, profile {args.profile} ({len(cases)} cases)\n", flush=True)
    rows = run_catalogue(cases, arch, full=args.full)

    def outcome(r: object) -> str:
        if not r.runs:
            return "-"
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
            f"{r.worst_energy:.3g}",
            r.z_only or "-",
            *(f"{r.peer_catches.get(rule, 0)}/{r.runs}" for rule in PEER_RULES),
            r.fault,
        )
        for r in rows
    ]
    headers = (
        "fault", "verdict", "outcome", "cases to catch", "caught/run", "worst err/bound", "worst z", "worst energy",
        "by z only", "vLLM 80%/0.3", "triton_kernels", "what it does",
    )  # fmt: skip
    print(format_table(headers, table))
    print(
        "\ncases to catch: cases run, in profile order, up to the first FAIL or ERROR (a fault stops there, except"
        "\nthe control and routing-weights-bf16, run on every case for their rates); honest variants run every case;"
        "\n(--full: every fault on every case); *-bf16-gemm1: the sub-bound faults again on bf16 GEMMs with GEMM1's"
        "\noutput in bf16, required as the others are;"
        "\n'not reached': a fault no case of the selection can change (a token bucket's, at production shapes"
        "\nonly: the nightly profile reaches it), run on none;"
        "\nworst z: the systematic-error test's largest z (threshold about 7: harness.judge.systematic);"
        " worst energy: the error's"
        "\nenergy over the declared arithmetic's prediction (its threshold is the case's: 1.25 at gpt-oss-20b"
        " T=128); by z only: FAILs"
        "\nwith every element within the bound, caught by either test; vLLM 80%/0.3, triton_kernels: the cases"
        "\nof the same runs that those peers' acceptance rules reject"
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
    """``mutants --vendor V``: the vendor's patched kernels through its adapters (harness.audits.mutation)."""
    from mxmoe.harness.audits.catalogue import UNPATCHED_FAILS
    from mxmoe.harness.audits.mutation.patched import PEER_RULES, run_vendor, vendor
    from mxmoe.harness.run.results import stamp

    try:
        v = vendor(args.vendor)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.backend:  # a patch of one adapter's preparation (vLLM's MARLIN) need not run the other six
        unknown = sorted(set(args.backend) - set(v.backends))
        if unknown:
            names = ", ".join(v.backends)
            raise UsageError(f"--backend must name adapters of {v.name}: {names}; got {', '.join(unknown)}")
        v = dataclasses.replace(v, backends=tuple(b for b in v.backends if b in args.backend))
    interpreted = arch == "cpu" and v.interpret_as is not None
    if interpreted:  # harness.audits.mutation.interpret: that architecture's code path, under Triton's interpreter
        arch = v.interpret_as
    where = f"{arch}, interpreted on this cpu" if interpreted else arch
    patches = len(set(args.patch)) if args.patch else len(v.patches)  # what runs, not what the vendor has
    print(f"mutants --vendor {v.name}: {patches} patches x adapters {', '.join(v.backends)} on {where}, "
          f"profile {args.profile} ({len(cases)} cases)\n", flush=True)  # fmt: skip
    from mxmoe.harness.upstream.fetch import VendorMissing

    try:
        rows = run_vendor(v, args.profile, [c.id for c in cases], jobs=args.jobs, only=args.patch or None,
                          tactics=args.tactics)  # fmt: skip
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except (RuntimeError, VendorMissing) as exc:
        print(f"mutants --vendor {v.name}: {exc}", file=sys.stderr)
        return 2
    table = [
        (
            r.id.split(":", 1)[1], r.backend, r.category, r.verdict, f"{r.fails + r.errors}/{r.runs}",
            f"{r.differs}/{r.runs}" if r.kind != "control" else "-",
            f"{r.material - r.material_missed}/{r.material}" if r.kind != "control" else "-",
            "inf" if r.worst_ratio == float("inf") else f"{r.worst_ratio:.3g}", f"{r.worst_z:.3g}",
            f"{r.worst_energy:.3g}", r.z_only or "-",
            *(f"{r.peer_catches.get(rule, 0)}/{r.runs}" for rule in PEER_RULES), r.fault,
        )
        for r in rows
    ]  # fmt: skip
    headers = ("patch", "adapter", "category", "verdict", "caught/run", "differs", "caught/material",
               "worst err/bound", "worst z", "worst energy", "by z only", "vLLM 80%/0.3", "triton_kernels",
               "what it does")  # fmt: skip
    print()
    print(format_table(headers, table))
    print(
        "\ndiffers: cases whose output differs bit for bit from the unpatched kernel's (or that raise): a patch"
        "\nthat differs nowhere has no effect on these cases and is not a miss; material: of those, the cases where"
        "\nthe change alone (patched less unpatched output) FAILs the same tests, i.e. is more than honest rounding"
        "\ncould be (a raise counts): caught only where every one of them FAILs, below noise where none is;"
        "\nby z only: FAILs with every element within the bound (harness.judge.systematic); vLLM 80%/0.3,"
        " triton_kernels: the same runs under those peers' rules"
    )
    bad = [f"{r.id} ({r.backend})" for r in rows if r.verdict in ("MISSED", UNPATCHED_FAILS)]
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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``mutants`` to ``python -m harness``."""
    from mxmoe.harness.run.profiles import PROFILES

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
        help="mutate a vendor's real kernels instead (harness.audits.mutation): triton (OpenAI triton_kernels, "
        "on a GPU), aiter (AITER's Triton a16w4; on a CPU, under Triton's interpreter on gfx942's code path) or "
        "vllm (vLLM's own weight preparation, through vLLM's layer and the direct adapters; on a GPU) or "
        "flashinfer (the Python wrapper of FlashInfer's CUTLASS MoE, on SM90; with --tactics all under each tactic)",
    )
    p.add_argument("--case", action="append", default=[], metavar="ID", help="only these case ids (repeatable)")
    p.add_argument(
        "--full", action="store_true",
        help="run every fault on every case (catch rates; by default a fault stops at its first catch)",
    )  # fmt: skip
    p.add_argument("--patch", action="append", default=[], help="with --vendor: only these patches (repeatable)")
    p.add_argument(
        "--backend", action="append", default=[], metavar="ADAPTER",
        help="with --vendor: only these of its adapters, the control's included (repeatable; default all of them)",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="with --vendor: patched copies run at once (default 1)")
    p.add_argument(
        "--tactics", default="default", metavar="default|all|NAME,...",
        help="with --vendor: also run the adapters under their declared tactics, each a row of its own",
    )  # fmt: skip
    p.set_defaults(fn=_cmd_mutants, parser=p)
