"""``python -m harness check``: a sweep of backends x a profile's cases in crash-proof worker processes,
recorded in a results folder with a reproducer for every FAIL and ERROR."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING

from mxmoe.harness.cli.args import UsageError, discover, host_line
from mxmoe.harness.cli.tables import format_table

if TYPE_CHECKING:
    from mxmoe.harness.contract.cases import Case
    from mxmoe.harness.run.registry import Loaded


def select_pairs(
    backends: list[Loaded], cases: list[Case], arch: str, keep: list[str], drop: list[str]
) -> list[tuple[Loaded, Case]]:
    """The (backend, case) pairs whose test id contains every ``keep`` and no ``drop``, case by
    case: the backends of one case follow each other, so that a worker draws the case's inputs and
    computes its oracle once for all of them (``sweep.check_pair``)."""
    from mxmoe.harness.judge.engine import test_id

    def wanted(loaded: Loaded, case: Case) -> bool:
        tid = test_id(loaded.backend.declaration.id, arch, case)
        return all(k in tid for k in keep) and not any(x in tid for x in drop)

    return [(loaded, case) for case in cases for loaded in backends if wanted(loaded, case)]


def _cmd_check(args: argparse.Namespace) -> int:
    import torch

    from mxmoe.harness.contract.platforms import auto_workers, gpu_share_gib, host_arch
    from mxmoe.harness.diagnosis.explain import summarize
    from mxmoe.harness.judge.engine import failure_message, test_id
    from mxmoe.harness.run.contention import COMPANION_GIB, CONTENTIONS, CompanionFailed, Companions
    from mxmoe.harness.run.profiles import production_cases, profile_cases
    from mxmoe.harness.run.registry import select, with_tactics
    from mxmoe.harness.run.results import Recorder, replay_command
    from mxmoe.harness.run.sweep import Progress, Sweep, worst_ratio

    arch = args.arch or host_arch()
    try:
        backends = with_tactics(select(discover(args), tuple(args.backend)), args.tactics)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cases = profile_cases(args.profile)
    pairs = select_pairs(backends, cases, arch, args.k, args.exclude)
    what = f"{len(backends)} backends x profile {args.profile}"
    if args.production_shapes:
        production = [b for b in backends if b.backend.declaration.production]
        extra = select_pairs(production, production_cases(), arch, args.k, args.exclude)
        seen = {test_id(b.backend.declaration.id, arch, c) for b, c in pairs}
        pairs += [(b, c) for b, c in extra if test_id(b.backend.declaration.id, arch, c) not in seen]
        what += f", and {len(production)} production kernels x {len(production_cases())} production shapes"
    if not pairs:
        raise UsageError(
            " ".join([*(f"-k {k}" for k in args.k), *(f"-x {x}" for x in args.exclude)]) + " selects none of the "
            f"{len(backends) * len(cases)} test ids of "
            f"{', '.join(b.backend.declaration.id for b in backends)} on {arch} (profile {args.profile})"
        )
    recorder = Recorder(args.results)
    workers = auto_workers(arch) if args.workers == "auto" else args.workers
    share = gpu_share_gib() if arch == host_arch() else None  # None on a CPU
    gpus = torch.cuda.device_count() if share is not None else 1
    print(f"{host_line('cpu' if host_arch() == 'cpu' else 'cuda')} | arch {arch}")
    print(
        f"check: {len(pairs)} tests ({what}), {workers} worker(s){' (auto)' if args.workers == 'auto' else ''}"
        + (f" on {gpus} GPU(s), their cases within {share:.0f} GiB per GPU" if share is not None else "")
        + f", timeout {args.timeout:g} s per case; results in {recorder.path}\n",
        flush=True,
    )
    repeat, said = _hunt_repeats(pairs, arch, args)
    if repeat:
        print("race hunt: " + "; ".join(said) + "\n", flush=True)
    company = args.contention if repeat and share is not None else "none"
    if repeat and share is None and args.contention != "none":
        print(f"race hunt: no GPU here, so its calls have no company (--contention {args.contention} makes "
              "work beside them on a GPU)\n", flush=True)  # fmt: skip
    elif company != "none":
        share -= COMPANION_GIB
        print(f"race hunt: its calls run beside {CONTENTIONS[company]} ({gpus} companion process(es), "
              f"{COMPANION_GIB:g} GiB each, working only while a hunted case's calls run)\n", flush=True)  # fmt: skip
    progress = Progress(len(pairs))
    sweep = Sweep(
        recorder, workers=workers, timeout=args.timeout, on_verdict=lambda v: progress.add(v.result.outcome),
        diagnose=summarize, gpu_gib=share, gpus=gpus, on_memory=progress.memory,
        repeat=lambda loaded, case: repeat.get(loaded.backend.declaration.id, {}).get(case.id, 0),
    )  # fmt: skip
    try:
        with Companions(company, gpus) if company != "none" else contextlib.nullcontext() as contention:
            sweep.contention = contention
            verdicts = sweep.run(pairs, arch)
    except CompanionFailed as exc:
        raise UsageError(f"{exc}; --contention none hunts without company") from None
    finally:
        progress.close()
    print(sweep.time_line(), file=sys.stderr, flush=True)
    memory = sweep.memory_line()
    if memory:
        print(memory, file=sys.stderr, flush=True)
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
    if repeat:
        from mxmoe.harness.run.races import company_of, hunt_line

        print("\nrace hunt (calls of each kernel on the same inputs, each compared bit for bit with its case's first):")
        rate = args.race_power[0] if args.race_power else None
        declared = {v.loaded.backend.declaration.id: v.loaded.backend.declaration.deterministic for v in verdicts}
        for b in repeat:
            # a call that writes nothing (T = 0) shows no race; a race seen anywhere else is said
            ran = [v.result for v in verdicts if v.result.backend == b and v.result.metrics.runs
                   and v.result.metrics.elements]  # fmt: skip
            if not ran:  # a backend that ran no case here made no call to hunt in
                continue
            deterministic = declared.get(b, True)
            # the power counts the hunt's repeated cases (their record names their company, "none"
            # where there was none): a case left at its two guarded runs had no company on a GPU,
            # and the report (reports.build._race_hunt) does not count it there either
            hunted = [r for r in ran if r.contention]
            seen = deterministic and any(r.metrics.runs_differing for r in ran)
            shown = ran if seen else hunted
            if not shown:
                print(f"  {b} ({arch}): no hunted call wrote output: no power against a race")
                continue
            calls = [(r.metrics.runs, r.metrics.runs_differing) for r in shown]
            beside = company_of(r.contention for r in shown) if arch != "cpu" else None
            print("  " + hunt_line(b, arch, calls, rate, deterministic, beside))
    print(f"\nresults: {recorder.path}")
    return 1 if bad else 0


def _hunt_repeats(
    pairs: list[tuple[Loaded, Case]], arch: str, args: argparse.Namespace
) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The race hunt's repeats per hunted backend id and case id, over the cases each hunted
    backend supports here (``--repeat``: that many on each; ``--race-power``: ``races.hunt_plan``,
    at the production shapes), and what they are in words; backends not hunted are left out."""
    import fnmatch

    from mxmoe.harness.run.profiles import production_cases
    from mxmoe.harness.run.races import hunt_plan, plan_line

    if not args.repeat and args.race_power is None:
        return {}, []
    cases: dict[str, list[str]] = {}
    empty = {case.id for _, case in pairs if not case.tokens}  # their calls write no output
    for loaded, case in pairs:
        d = loaded.backend.declaration
        if args.hunt and not any(fnmatch.fnmatchcase(d.id, p) for p in args.hunt):
            continue
        mine = cases.setdefault(d.id, [])
        if loaded.backend.supports(case, arch) is None:
            mine.append(case.id)
    if args.race_power is None:
        return ({b: dict.fromkeys(ids, args.repeat) for b, ids in cases.items()},
                [f"{args.repeat} repeats per case: {', '.join(cases)}"])  # fmt: skip
    # a sign-off's check (--production-shapes) hunts at the shapes serving runs; any other, over
    # every case it runs (a pr profile's one gpt-oss decode case is no production sweep)
    shapes = {c.id for c in production_cases()} if args.production_shapes else set()
    plans = {b: hunt_plan(*args.race_power, ids, shapes, empty) for b, ids in cases.items()}
    return plans, [plan_line(b, plans[b], shapes, empty) for b in plans]


def add_selection(p: argparse.ArgumentParser, profile: str) -> None:
    """The arguments that choose a check's tests (``select_pairs``): ``--backend``, ``--backend-file``,
    ``--profile`` (default ``profile``), ``-k`` and ``-x``; ``check`` and ``bench-check`` share them."""
    from mxmoe.harness.cli.args import BACKEND_FILE_HELP, backend_file
    from mxmoe.harness.run.profiles import PROFILES

    p.add_argument(
        "--backend", action="append", default=[], metavar="PATTERN",
        help="shell glob on backend ids (repeatable; default: every backend of kind 'backend' and every file)",
    )  # fmt: skip
    p.add_argument("--backend-file", action="append", default=[], type=backend_file, metavar="PATH.py:Class",
                   help=BACKEND_FILE_HELP)  # fmt: skip
    p.add_argument("--profile", choices=PROFILES, default=profile, help=f"case list (default {profile})")
    p.add_argument(
        "-k", action="append", default=[], metavar="SUBSTRING", help="keep test ids containing it (repeatable: all)"
    )
    p.add_argument("-x", "--exclude", action="append", default=[], metavar="SUBSTRING",
                   help="drop test ids containing it (repeatable: any), e.g. -x gptoss -x dsv3 on a CPU")  # fmt: skip


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``check`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import arch, count, positive, workers
    from mxmoe.harness.run.contention import CONTENTIONS, DEFAULT_CONTENTION

    p = sub.add_parser("check", help="check backends on a profile's cases (worker processes, recorded results)")
    add_selection(p, "pr")
    p.add_argument(
        "--tactics", default="default", metavar="default|all|NAME,...",
        help="also run each backend under its declared tactics (each a backend <id>-tactic-<name>): 'all' or "
        "names (default: each kernel's own pick only)",
    )  # fmt: skip
    p.add_argument("--arch", type=arch, help="architecture token of the test ids (default: this host's)")
    p.add_argument("--results", default="results", metavar="DIR", help="results folder (default ./results)")
    p.add_argument("--workers", type=workers, default=1, metavar="N|auto",
                   help="worker processes (default 1); auto: one per core on a CPU, on GPUs as many per GPU as its "
                   "free memory and the host's cores hold (each case's backends run in one worker, which draws its "
                   "inputs and oracle once for them)")  # fmt: skip
    p.add_argument("--production-shapes", action="store_true",
                   help="also each selected production kernel at the production shapes (the nightly profile's gpt-oss "
                   "cases) in the same workers: what a GPU sign-off judges")  # fmt: skip
    p.add_argument("--timeout", type=positive(float), default=600.0, metavar="SECONDS", help="per case (default 600)")
    hunt = p.add_mutually_exclusive_group()
    hunt.add_argument("--repeat", type=count, default=0, metavar="N",
                      help="the race hunt: each hunted backend's kernel runs N more times per case on the same inputs "
                      "and converted weights, each run compared bit for bit with the first (default 0)")  # fmt: skip
    hunt.add_argument("--race-power", type=race_power, default=None, metavar="RATE,CONFIDENCE",
                      help="the race hunt with as many repeats per case as it takes each hunted backend, over the "
                      "cases it runs here, to see a race that corrupts RATE of its calls with probability "
                      "CONFIDENCE (the sign-off passes its policy's [races]); its power is printed last")  # fmt: skip
    p.add_argument("--contention", choices=CONTENTIONS, default=DEFAULT_CONTENTION,
                   help="what runs beside the race hunt's calls on each GPU, in a companion process: "
                   + "; ".join(f"{k}: {v}" for k, v in CONTENTIONS.items())
                   + f" (default {DEFAULT_CONTENTION}: a race shows beside other work, seldom alone)")  # fmt: skip
    p.add_argument("--hunt", action="append", default=[], metavar="PATTERN",
                   help="the backends the race hunt runs on (shell globs over ids, repeatable; default every selected "
                   "backend)")  # fmt: skip
    p.set_defaults(fn=_cmd_check, parser=p)


def race_power(value: str) -> tuple[float, float]:
    """``--race-power RATE,CONFIDENCE``: two numbers strictly between 0 and 1."""
    from mxmoe.harness.run.races import check_rate_confidence

    try:
        rate, confidence = (float(v) for v in value.split(","))
        check_rate_confidence(rate, confidence)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"RATE,CONFIDENCE, each a number strictly between 0 and 1 (such as 0.01,0.999), not {value!r} ({exc})"
        ) from None
    return rate, confidence
