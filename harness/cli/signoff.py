"""``python -m harness signoff``: the main job on this machine, every step recorded into one results
folder and the sign-off report built from those records (``app``'s docstring lists the steps)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

from mxmoe.harness.cli.args import dispatch, host_line
from mxmoe.harness.cli.backends import availability
from mxmoe.harness.cli.check import add_parsers as add_check
from mxmoe.harness.cli.gpqa import add_parsers as add_gpqa
from mxmoe.harness.cli.model import add_parsers as add_model
from mxmoe.harness.cli.mutants import add_parsers as add_mutants
from mxmoe.harness.cli.padding import add_parsers as add_padding
from mxmoe.harness.cli.tables import format_table
from mxmoe.reports.build import SIGNOFF_STEPS

SIGNOFF_GPQA_LIMIT = 4
"""Default questions of the tiny GPQA for backends under Triton's CPU interpreter (about 15 s per
question on 2 cores); every other backend answers all 200. So few questions conclude nothing (the
run is UNJUDGED: it has no power to see a 5-point drop); they show that the backend answers through
lm-eval as the oracle-MoE model does, and the model check (step 5) judges its layers. 8 took four
minutes of a 2-core sign-off for the same conclusion."""


class StepSkipped(Exception):
    """A sign-off step that cannot run here (a package missing); the message says why."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT during the sign-off (a CI job's time limit, Ctrl-C). A BaseException, as
    KeyboardInterrupt is, so that no step's ``except Exception`` takes it for the step's own failure:
    it ends the step it came in as "interrupted", the manifest is written, and the sign-off stops."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM and SIGINT raise ``Interrupted`` in the main thread for the duration; the handlers
    before are put back after."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def _run(argv: Sequence[str]) -> int:
    """Run a step's command as ``python -m harness ARGV`` would: parsed by that command's own parser
    (the arguments and defaults its module's ``add_parsers`` gives it), a UsageError reported by it.
    The parser holds the steps' commands only: ``app`` imports this module, so ``app.main`` is not
    imported here (no cycle)."""
    parser = argparse.ArgumentParser(prog="python -m harness")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_check, add_mutants, add_padding, add_model, add_gpqa):
        add(sub)
    return dispatch(parser.parse_args(argv))


def _cmd_signoff(args: argparse.Namespace) -> int:
    """The whole sign-off on this machine; every step records into ``--results`` and the report is
    built from those records alone. A step that fails does not stop the next (the report says what
    failed), except the oracle's self-check: an untrustworthy oracle judges nothing. What each step
    did (ran, skipped and why, failed with its exit status, interrupted) is written to
    ``signoff-steps.json`` with the steps planned, which the report reads: a step that failed, was
    interrupted or is missing from it did not run, and blocks. SIGTERM or SIGINT ends the step it
    came in as interrupted, writes the manifest and exits with 128 + the signal's number."""
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.reports.policy import PolicyError, load_policy

    try:
        load_policy(args.policy)  # a policy that cannot be read fails here, before any step runs
    except PolicyError as exc:
        raise UsageError(str(exc)) from None
    try:
        with _interruptible():
            return _signoff(args)
    except Interrupted as exc:
        print(f"\nsign-off interrupted by {exc}: the manifest says in which step and that the rest did not "
              f"run; `python -m harness report {args.results} --out DIR` reports it (BLOCKED)", file=sys.stderr)
        return 128 + exc.signum


def _signoff(args: argparse.Namespace) -> int:
    """``_cmd_signoff``'s steps (``Interrupted`` passes through, after the manifest is written)."""
    import time
    import traceback

    from mxmoe.harness.audits.selfcheck import run_selfcheck
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.run.results import stamp

    start = time.perf_counter()
    results = args.results
    os.makedirs(results, exist_ok=True)
    manifest = os.path.join(results, "signoff-steps.json")
    steps: list[dict] = []

    def write_manifest() -> None:
        """Whole or not at all: a signal arriving while it is written must not leave half a file."""
        tmp = f"{manifest}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(stamp("signoff-steps") | {"planned": list(SIGNOFF_STEPS[:-1]), "steps": steps}, f, indent=1)
        os.replace(tmp, manifest)

    write_manifest()  # before the first step: a sign-off stopped in it leaves a manifest saying so

    def step(n: int, run: Callable[[], int] | Background, makes: str | None = None) -> int:
        """Run step ``n``; it ran when it returned a verdict status (0 or 1) and wrote ``makes``. A
        ``Background`` step started earlier is waited for here, its time counted from its start."""
        name = SIGNOFF_STEPS[n - 1]
        print(f"\n[{n}/{len(SIGNOFF_STEPS)}] {name} ({time.perf_counter() - start:.0f} s elapsed)\n", flush=True)
        t0 = time.perf_counter()
        entry: dict[str, object] = {"name": name, "status": "ran", "exit_status": None, "reason": ""}
        before = os.path.getmtime(makes) if makes and os.path.exists(makes) else None
        if isinstance(run, Background):
            entry["beside"] = run.beside
            t0, before, run = run.started, run.before, run.wait
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
        except Interrupted as exc:
            entry["status"], entry["seconds"] = "interrupted", round(time.perf_counter() - t0, 1)
            entry["reason"] = f"{exc} received {entry['seconds']:.0f} s into it: the sign-off stopped here"
            steps.append(entry)
            write_manifest()
            raise
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

    print(host_line(args.device))

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
        kernels that run here also at production shapes (``check --production-shapes``), in the same
        sweep: one set of workers loads each backend once, as many per GPU as memory and cores hold
        (``--workers auto``; on a CPU one per core)."""
        argv = ["check", "--profile", "pr", "--results", results, "--workers", str(args.workers)]
        production = _production_backends(here)
        if host_arch() != "cpu" and not production:
            print("production shapes: no production kernel runs here, none judged at gpt-oss shapes\n")
        elif host_arch() != "cpu":
            print(f"production shapes: {', '.join(production)} over the nightly profile's gpt-oss cases\n", flush=True)
            argv.append("--production-shapes")
        return _run(argv + race_hunt_args(production, args.policy))

    # detection power: the catalogue of faulty kernels is caught, the honest variants are not
    mutants = os.path.join(results, "mutants.json")
    padding = os.path.join(results, "padding.json")
    catalogue = ["mutants", "--profile", "pr", "--json", mutants]
    audit = ["padding", "--json", padding]
    # On a GPU the steps that need nothing from each other run at once, each in a process of its
    # own beside the kernel check: the catalogue, the padding audit and GPQA (they use a small share
    # of the GPU and of the host's cores; GPQA after it was a third of a GPU sign-off's time). GPQA
    # then runs every backend that loads here: one that declines the tiny GPT-OSS is its SKIP, as in
    # the kernel check. On a CPU every step needs all of its few cores, and they run one after the
    # other, GPQA on the backends that ran a kernel case.
    beside = host_arch() != "cpu"
    started: list[Background] = []
    try:
        gpqa = None
        if beside:
            kernels = SIGNOFF_STEPS[1]
            started += [Background(catalogue, results, "fault-catalogue", mutants, beside=kernels),
                        Background(audit, results, "padding-audit", padding, beside=kernels)]  # fmt: skip
            if here and _gpqa_missing() is None:
                started.append(gpqa := Background(_gpqa_argv(results, here), results, "gpqa", beside=kernels))
        step(2, kernel_check)
        step(3, started[0] if beside else (lambda: _run(catalogue)), makes=mutants)
        step(4, started[1] if beside else (lambda: _run(audit)), makes=padding)
        ran, declined = _ran_kernel_cases(results, here, host_arch())
        for ident, why in declined.items():
            print(f"\nnot through the tiny GPT-OSS's model check: {ident} declined every kernel case here ({why})")
        step(5, lambda: _signoff_models(results, ran))  # the tiny GPT-OSS's MoE through each backend that ran here
        step(6, gpqa or (lambda: _signoff_gpqa(results, ran, args.interpreter_gpqa_questions)))
    finally:
        for bg in started:
            bg.stop()
    from mxmoe.harness.cli.report import print_verdict, run_report

    print(f"\n[7/{len(SIGNOFF_STEPS)}] {SIGNOFF_STEPS[6]} ({time.perf_counter() - start:.0f} s elapsed)\n")
    report, files = run_report([results], os.path.join(results, "report"), policy=args.policy)
    _print_not_run(report)
    print_verdict(report, files)
    print(f"sign-off took {time.perf_counter() - start:.0f} s: " + ", ".join(
        f"{st['name']} {st['seconds']:.0f} s ({st['status']}{_beside(st)})"
        for st in steps))  # fmt: skip
    return 0 if report["verdict"] == "SHIP" else 1


def _beside(step: dict) -> str:
    """", beside the STEP" for a step that ran beside another, else nothing."""
    return f", beside the {step['beside']}" if step.get("beside") else ""


class Background:
    """A sign-off step's command (``python -m mxmoe ARGV``) started now in a process of its own,
    its output kept in ``RESULTS/logs/NAME.log`` and printed when it is waited for; ``makes``' time
    stamp is taken at the start, so that the step is judged on what it wrote since."""

    command: ClassVar[tuple[str, ...]] = (sys.executable, "-m", "mxmoe")
    """What runs ARGV (a test's stand-in replaces it)."""

    def __init__(self, argv: Sequence[str], results: str, name: str, makes: str | None = None, *,
                 beside: str) -> None:  # fmt: skip
        import subprocess
        import time

        self.beside = beside
        """The step it runs beside (the manifest's ``beside``)."""
        self.started = time.perf_counter()
        self.before = os.path.getmtime(makes) if makes and os.path.exists(makes) else None
        os.makedirs(os.path.join(results, "logs"), exist_ok=True)
        self.log = os.path.join(results, "logs", f"{name}.log")
        with open(self.log, "w", encoding="utf-8") as out:
            self.proc = subprocess.Popen([*self.command, *argv], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)  # fmt: skip
        print(f"started beside it: python -m mxmoe {' '.join(argv)} (output in {self.log})", flush=True)

    def wait(self) -> int:
        """Its exit status, once it has ended; its output printed."""
        rc = self.proc.wait()
        with open(self.log, encoding="utf-8", errors="replace") as f:
            sys.stdout.write(f.read())
        sys.stdout.flush()
        return rc

    def stop(self) -> None:
        """End it if it still runs (the sign-off was interrupted, or a step before raised)."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _signoff_backends() -> list[str]:
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.run.registry import discover, select

    arch = host_arch()
    return [item.backend.declaration.id for item in select(discover()) if availability(item, arch) is None]


def _ran_kernel_cases(results: str, ids: list[str], arch: str) -> tuple[list[str], dict[str, str]]:
    """Of ``ids``, those with a kernel case recorded on ``arch`` in ``results`` that was not a SKIP,
    and for each other one its first skip's reason. A backend that loads but declines every case
    here (vLLM's oracle refusing the deployment on this host, for instance EMULATION without
    amd-quark) cannot run the tiny GPT-OSS either: its decline is a SKIP of the kernel check, not a
    failure of the model check or of GPQA, so those steps leave it out and say why."""
    from mxmoe.harness.run.results import read_results

    records = [r for r in read_results(results) if r.get("arch") == arch]
    ran = {r["backend"] for r in records if r["outcome"] != "SKIP"}
    declined = {}
    for ident in ids:
        skips = [r for r in records if r["backend"] == ident and r["outcome"] == "SKIP"]
        if ident not in ran and skips:
            declined[ident] = str(skips[0].get("reason", "")).splitlines()[0]
    return [b for b in ids if b not in declined], declined


def race_hunt_args(production: list[str], policy: str | None) -> list[str]:
    """``check``'s race-hunt arguments for the sign-off's kernel check: the production kernels of
    ``production`` that the policy's ``[races]`` hunts, at its rate and confidence, beside its
    contention; none where no kernel is hunted."""
    from mxmoe.reports.policy import load_policy

    rules = load_policy(policy)
    hunted = [b for b in production if rules.hunted(b)]
    if not hunted:
        return []
    power = f"{rules.races_rate:g},{rules.races_confidence:g}"
    return ["--race-power", power, "--contention", rules.races_contention, *(a for b in hunted for a in ("--hunt", b))]


def _production_backends(ids: list[str]) -> list[str]:
    """Of ``ids``, the production kernels (``Declaration.production``; not the harness's own)."""
    from mxmoe.harness.run.registry import discover

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
    from mxmoe.harness.contract.platforms import host_arch

    missing = _model_packages()
    if missing:
        raise StepSkipped(missing)
    print(f"the tiny GPT-OSS through {', '.join(here)}\n", flush=True)
    batch = "2" if host_arch() == "cpu" else "8"
    argv = ["model-check", "--model", "tiny", "--batch", batch, "--repeats", "1", "--results", results]
    return _run([*argv, *(a for b in here for a in ("--backend", b))])


def _gpqa_missing() -> str | None:
    """Why GPQA cannot run here (a package missing), or None."""
    missing = _model_packages()
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        missing = missing or f"it needs lm-eval ({exc})"
    return missing


GPQA_ARGV = ("gpqa", "--model", "tiny", "--baseline", "oracle", "--batch", "8")


def _gpqa_argv(results: str, backends: list[str]) -> list[str]:
    return [*GPQA_ARGV, "--results", results, *(a for b in backends for a in ("--backend", b))]


def _signoff_gpqa(results: str, here: list[str], limit: int = SIGNOFF_GPQA_LIMIT) -> int:
    """The tiny GPT-OSS's GPQA, each backend against the oracle-MoE model's answers on the same
    samples. On a CPU, backends under Triton's interpreter answer ``limit`` questions (in their own
    folder: another sample of questions is another test), or none when it is 0."""
    from mxmoe.harness.contract.platforms import host_arch

    missing = _gpqa_missing()
    if missing:
        raise StepSkipped(missing)
    slow = [b for b in here if host_arch() == "cpu" and "triton" in b]
    full = [b for b in here if b not in slow]
    status = 0
    argv = list(GPQA_ARGV)
    if full:
        status = _run(_gpqa_argv(results, full))
    if slow and not limit:
        print(f"\nnot run under Triton's CPU interpreter (--interpreter-gpqa-questions 0): {', '.join(slow)}")
    elif slow:
        sub = os.path.join(results, f"gpqa-limit{limit}")
        print(f"\nunder Triton's CPU interpreter: {', '.join(slow)} on {limit} questions\n", flush=True)
        status = max(status, _run([*argv, "--limit", str(limit), "--results", sub,
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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``signoff`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import count, device, workers

    p = sub.add_parser(
        "signoff", help="the main job: self-check, kernel check, fault catalogue, model check, GPQA, report"
    )
    p.add_argument("--device", type=device, default="cpu", help="self-check device: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--results", default="results", help="results folder of every step (default results/); the "
                                                            "report goes to its report/")  # fmt: skip
    p.add_argument("--policy", metavar="FILE", help="the verdict's rules (default reports/policy.toml)")
    p.add_argument("--workers", type=workers, default="auto", metavar="N|auto",
                   help="the kernel check's worker processes (default auto: one per core on a CPU, on GPUs as many "
                   "per GPU as memory and cores hold)")  # fmt: skip
    p.add_argument("--interpreter-gpqa-questions", type=count, default=SIGNOFF_GPQA_LIMIT, metavar="N",
                   help="tiny-GPQA questions for backends under Triton's CPU interpreter, about 15 s each on 2 cores "
                        "(default %(default)s; 0: none)")  # fmt: skip
    p.set_defaults(fn=_cmd_signoff)
