"""The command line as a user meets it: ``backends`` lists what can run here and why not; ``check``
survives backends that exit, segfault, hang or fail to import, records every case and exits 1
when anything failed; ``replay`` reproduces a recorded FAIL; bad arguments name what is accepted.

The sweep with the faulty backends runs once for the module (worker restarts cost seconds) and
each test reads its own part of the verdicts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mxmoe.harness.contract.platforms import ARCHS, host_arch
from mxmoe.harness.run.registry import BUILTIN, load_spec
from mxmoe.harness.run.results import read_results

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FAULTY = HERE / "faulty_backends.py"
BROKEN = HERE / "broken_backend.py"
CASES = ["tiny-interleaved-t0", "tiny-interleaved-t1", "tiny-interleaved-t7", "tiny-interleaved-t33"]
"""What ``-k tiny-interleaved-t`` keeps of the pr profile, besides tiny-interleaved-t16-wide."""
OTHER_ARCH = "sm90" if host_arch() != "sm90" else "sm100"


def harness(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


SWEPT = ("emulation", "crash-fp32", "hang-fp32", "wrongsign-fp32", "splitoutmoe")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One check over emulation and four faulty backends on five small cases, two workers."""
    results = tmp_path_factory.mktemp("results")
    files = [f"{FAULTY}:CrashFp32", f"{FAULTY}:HangFp32", f"{FAULTY}:WrongSignFp32", f"{BROKEN}:SplitOutMoE"]
    proc = harness(
        "check",
        *(a for f in files for a in ("--backend-file", f)),
        *(a for b in SWEPT for a in ("--backend", b)),
        *("-k", "tiny-interleaved-t", "--timeout", "5", "--workers", "2", "--results", str(results)),
    )
    records = {r["test_id"]: r for r in read_results(results)}
    return proc, records, results


def outcome(records, backend, case):
    r = records[f"{backend}-{host_arch()}-{case}"]
    return r["outcome"], r["reason"]


def test_backends_table_lists_every_builtin_and_why_not(tmp_path):
    proc = harness("backends", "--arch", OTHER_ARCH)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    for spec in BUILTIN:
        assert load_spec(spec).backend.declaration.id in rows
    assert f"needs {OTHER_ARCH} hardware; this host is {host_arch()}" in rows["emulation"]


def test_backends_json_lists_files_too(tmp_path):
    proc = harness("backends", "--json", "--arch", OTHER_ARCH, "--backend-file", f"{BROKEN}:SplitOutMoE")
    assert proc.returncode == 0, proc.stderr
    entries = {e["id"]: e for e in json.loads(proc.stdout)}
    assert {load_spec(s).backend.declaration.id for s in BUILTIN} <= set(entries)
    emu = entries["emulation"]
    assert emu["runs_here"] is False and emu["why_not"] == f"needs {OTHER_ARCH} hardware; this host is {host_arch()}"
    assert emu["archs"] == list(ARCHS) and emu["arithmetic"]["precision"]["gemm1_output"] == "bf16"
    broken = entries["splitoutmoe"]
    assert broken["runs_here"] is False and "NameError" in broken["why_not"]


DOTTED = """
from mxmoe.harness.contract.backend import Declaration
from mxmoe.harness.instruments.torch_moe import TorchMoE


class DottedId(TorchMoE):
    declaration = Declaration(id="my.kernel", archs=("cpu",), description="an id with a dot")
"""


def test_a_backend_file_failing_at_import_is_named_with_its_exception_wherever_backends_are_named(tmp_path):
    """A class that raises while its module imports (a declaration id with a dot) has no id to be
    selected by: ``check``, ``backends`` and pytest name its file, class and exception, not only a
    made-up id in a list."""
    path = tmp_path / "dotted.py"
    path.write_text(DOTTED)
    failure = f"failed to load {path}:DottedId: ValueError: Declaration.id must be lower-case tokens joined by '-'"
    proc = harness("check", "--backend-file", f"{path}:DottedId", "--backend", "my-*", "-k", "tiny-interleaved-t1")
    assert proc.returncode == 2 and "--backend 'my-*' matches no backend" in proc.stderr
    assert f"; {failure}" in proc.stderr and "dottedid" not in proc.stderr.split("available:")[1].split(";")[0]
    proc = harness("backends", "--backend-file", f"{path}:DottedId")
    assert proc.returncode == 0 and f"warning: backend {failure}" in proc.stderr
    assert failure in next(line for line in proc.stdout.splitlines() if line.startswith("dottedid"))
    pytest_argv = [sys.executable, "-m", "pytest", "suites/engine/test_differential.py", "--co", "-p",
                   "no:cacheprovider", "--backend-file", f"{path}:DottedId"]  # fmt: skip
    proc = subprocess.run([*pytest_argv, "--backend", "my-*"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and failure in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = subprocess.run([*pytest_argv, "--backend", "dottedid"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0 and f"backend {failure}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_backends_here_runs_the_emulation():
    proc = harness("backends", "--json")
    emu = next(e for e in json.loads(proc.stdout) if e["id"] == "emulation")
    assert emu["runs_here"] is True and emu["why_not"] == "" and emu["arch"] == host_arch()


def test_check_honest_backend_passes_and_records(tmp_path):
    proc = harness("check", "--backend", "honest-fp32", "-k", "tiny-interleaved-t1", "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_results(tmp_path)
    ids = sorted(r["test_id"] for r in records)
    assert ids == [
        f"honest-fp32-{host_arch()}-tiny-interleaved-t1",
        f"honest-fp32-{host_arch()}-tiny-interleaved-t16-wide",
    ]
    assert all(r["outcome"] == "PASS" and r["repro"] is None for r in records)
    assert not (tmp_path / "repro").exists()
    assert "honest-fp32  2     0     0" in proc.stdout  # the summary row: PASS FAIL ERROR


def test_check_records_every_case_and_exits_1(sweep):
    proc, records, _ = sweep
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(records) == 5 * 5
    assert "25/25 done" in proc.stderr
    for name in ("emulation", "crash-fp32", "hang-fp32", "wrongsign-fp32", "splitoutmoe"):
        assert name in proc.stdout


def test_a_backend_that_exits_is_one_error_and_the_sweep_goes_on(sweep):
    _, records, _ = sweep
    got, reason = outcome(records, "crash-fp32", "tiny-interleaved-t1")
    assert got == "ERROR" and reason == "the backend's process crashed: exit code 3"
    got, reason = outcome(records, "crash-fp32", "tiny-interleaved-t7")
    assert got == "ERROR" and "crashed: killed by signal SIGSEGV" in reason
    for case in ("tiny-interleaved-t0", "tiny-interleaved-t33", "tiny-interleaved-t16-wide"):
        assert outcome(records, "crash-fp32", case)[0] == "PASS"
    rec = records[f"crash-fp32-{host_arch()}-tiny-interleaved-t1"]
    assert rec["repro"] and Path(rec["repro"]).is_file() and Path(rec["repro"]).with_suffix(".safetensors").is_file()


def test_each_record_of_a_sweep_says_where_its_time_went(sweep):
    """Every test a worker ran records its time per stage: the stages cover the check's seconds,
    and a FAIL's reproducer has its own line; a test decided without a worker has none."""
    from mxmoe.harness.judge.engine import STAGES

    _, records, _ = sweep
    timed = [r for r in records.values() if r["outcome"] in ("PASS", "FAIL")]
    assert timed and all(r["stages"] for r in timed)
    for r in timed:
        stages = r["stages"]
        assert set(stages) <= {*STAGES, "other", "reproducer"} and min(stages.values()) >= 0, stages
        covered = sum(v for k, v in stages.items() if k != "reproducer")
        # the case's inputs and oracle, made once for every backend on it, are charged to the test
        # that made them, outside its own seconds
        shared = stages.get("inputs", 0.0) + stages.get("oracle and bound", 0.0)
        slack = 0.01 + 0.05 * r["seconds"]
        assert r["seconds"] - slack <= covered <= r["seconds"] + shared + slack, (r["test_id"], stages, r["seconds"])
        assert "kernel runs" in stages and "compare" in stages
    failed = [r for r in timed if r["outcome"] == "FAIL"]
    assert failed and all(r["stages"]["reproducer"] > 0 for r in failed)
    assert all(not r["stages"] for r in records.values() if r["outcome"] == "SKIP")


def test_a_backend_that_hangs_is_a_timeout_and_the_sweep_goes_on(sweep):
    _, records, _ = sweep
    rec = records[f"hang-fp32-{host_arch()}-tiny-interleaved-t1"]
    assert rec["outcome"] == "ERROR" and rec["reason"].startswith("timeout: no verdict within 5 s")
    assert 5 <= rec["seconds"] < 60
    for case in ("tiny-interleaved-t0", "tiny-interleaved-t7", "tiny-interleaved-t33"):
        assert outcome(records, "hang-fp32", case)[0] == "PASS"


def test_a_module_that_fails_to_import_errors_its_cases_only(sweep):
    proc, records, _ = sweep
    for case in CASES:
        rec = records[f"splitoutmoe-{host_arch()}-{case}"]
        assert rec["outcome"] == "ERROR"
        assert "NameError: name 'MXFP4_DECLARATION' is not defined" in rec["traceback"]
        assert outcome(records, "emulation", case)[0] == "PASS"
    assert "NameError" in proc.stdout  # the summary names the cause


def test_the_summary_lists_failures_with_replay_commands(sweep):
    proc, records, results = sweep
    bad = sorted(t for t, r in records.items() if r["outcome"] in ("FAIL", "ERROR"))
    assert len(bad) == 2 + 1 + 4 + 5  # crash, hang, wrong sign (T=0 has no elements), broken
    for t in bad:
        assert f"python -m harness replay {results.resolve() / 'repro' / t}.json" in proc.stdout


def test_replay_of_a_saved_fail_fails_again(sweep):
    _, records, _ = sweep
    rec = records[f"wrongsign-fp32-{host_arch()}-tiny-interleaved-t7"]
    assert rec["outcome"] == "FAIL"
    proc = harness("replay", rec["repro"])
    assert proc.returncode == 1
    assert f"FAIL wrongsign-fp32-{host_arch()}-tiny-interleaved-t7: {rec['reason']}" in proc.stdout
    assert "Mismatched elements" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("check", "--arch", "sm91"), "argument --arch: accepted values are cpu, sm80"),
        (("check", "--backend", "nope"), "--backend 'nope' matches no backend; available: emulation"),
        (("check", "--backend", "emulation", "-k", "nomatch"), "-k nomatch selects none of"),
        (("check", "--profile", "weekly"), "argument --profile: invalid choice: 'weekly' (choose from"),
        (("check", "--workers", "0"), "argument --workers: expected a positive int or 'auto', got '0'"),
        (("backends", "--backend-file", "missing.py:X"), "argument --backend-file: no such file"),
    ],
    ids=["arch", "backend", "k", "profile", "workers", "file"],
)
def test_bad_arguments_name_the_accepted_values(args, message):
    proc = harness(*args)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def test_auto_workers_are_one_per_core_or_per_gpu_as_many_as_cores_hold_and_memory_admits_cases(monkeypatch):
    """``--workers auto``: a CPU one per core; GPUs as many each as the cores hold at
    ``WORKER_CPUS``. Memory then admits cases (``case_gpu_gib`` within ``gpu_share_gib``): a
    gpt-oss-120b case takes a worker's measured share, so an H200 runs two of them at once as 2
    workers did, and the small cases beside them."""
    import torch

    from mxmoe.harness.contract import platforms
    from mxmoe.harness.contract.cases import make_case

    monkeypatch.setattr(platforms.os, "cpu_count", lambda: 16)
    assert platforms.auto_workers("cpu") == 16
    gib = 1 << 30
    free = {0: 139 * gib, 1: 139 * gib}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 141 * gib))
    assert platforms.auto_workers("sm90") == 4  # an H200 on 16 cores
    monkeypatch.setattr(platforms.os, "cpu_count", lambda: 3)
    assert platforms.auto_workers("sm90") == 1  # fewer cores than one worker's: still one
    monkeypatch.setattr(platforms.os, "cpu_count", lambda: 128)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert platforms.auto_workers("sm90") == 32  # 16 per GPU
    free[1] = 100 * gib
    assert platforms.gpu_share_gib() == pytest.approx(0.9 * 100)  # the fullest GPU decides
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platforms.gpu_share_gib() is None and platforms.auto_workers("sm90") == 128
    share = 0.9 * 139
    need = {m: platforms.case_gpu_gib(make_case(m, 128)) for m in ("gptoss120b", "gptoss20b", "tiny", "dsv3")}
    assert need["gptoss120b"] == platforms.WORKER_GPU_GIB and 2 * need["gptoss120b"] <= share
    assert need["gptoss20b"] == platforms.WORKER_GPU_GIB / 4 and need["tiny"] == 1.0
    assert need["dsv3"] > share  # runs where its GPU has no other case
    # what a worker keeps converted for a layer scales as its admission does, and stays inside it
    kept = {m: platforms.converted_gpu_gib(make_case(m, 128)) for m in need}
    assert kept["gptoss120b"] == platforms.CONVERTED_GPU_GIB and kept["gptoss20b"] == platforms.CONVERTED_GPU_GIB / 4
    ratio = platforms.CONVERTED_GPU_GIB / platforms.WORKER_GPU_GIB
    assert all(kept[m] < need[m] for m in need) and kept["tiny"] == need["tiny"] * ratio and kept["dsv3"] == 12


def test_production_shapes_add_each_production_kernel_at_the_gpt_oss_cases_once(tmp_path, capsys):
    """``check --production-shapes`` (what a GPU sign-off runs): the pr profile for every backend,
    and the nightly gpt-oss cases for the production kernels only, a test id shared by both once.
    On another arch every test is a SKIP decided without a worker."""
    from mxmoe.harness.cli.app import main
    from mxmoe.harness.run.profiles import RACE_CASES, production_cases, profile_cases

    main(["check", "--arch", OTHER_ARCH, "--production-shapes", "--backend", "triton", "--backend", "emulation",
          "--results", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert "(2 backends x profile pr, and 1 production kernels x 93 production shapes)" in out
    records = read_results(tmp_path)
    ids = [r["test_id"] for r in records]
    assert len(ids) == len(set(ids))
    by = {b: {r["case_id"] for r in records if r["backend"] == b} for b in ("triton", "emulation")}
    pr = {c.id for c in profile_cases("pr")}
    production = {c.id for c in production_cases()}
    assert len(production) == 93 and production - {c for c in production if "gptoss" in c} == set(RACE_CASES)
    assert by["emulation"] == pr and by["triton"] == pr | production
    assert len(pr & production) == 1  # gpt-oss-20b at T=1: once


@pytest.fixture
def fake_host():
    """The host's fingerprint is cached per process: a test that fakes the host's arch must leave
    none of it to the tests after it in the same worker (a record once said ``sm90`` on a CPU)."""
    from mxmoe.harness.contract import platforms

    platforms.host_fingerprint.cache_clear()
    yield
    platforms.host_fingerprint.cache_clear()


def test_the_gpu_sign_off_judges_production_shapes_in_the_same_workers(tmp_path, monkeypatch, fake_host):
    """On a GPU the sign-off's kernel check is one sweep: the pr profile and the production
    kernels at production shapes, ``--workers auto`` unless told, with the race hunt in the
    production kernels at the policy's power; on a CPU the pr profile alone (with the hunt in
    any production kernel that runs there)."""
    import mxmoe.harness.audits.selfcheck as selfcheck
    from mxmoe.harness.cli import signoff
    from mxmoe.harness.cli.app import main
    from mxmoe.harness.contract import platforms

    ran = []
    monkeypatch.setattr(selfcheck, "run_selfcheck", lambda device: [])
    monkeypatch.setattr(signoff, "_signoff_backends", lambda: ["emulation", "triton"])
    monkeypatch.setattr(signoff, "_run", lambda argv: ran.append(list(argv)) or 0)
    monkeypatch.setattr(signoff, "_signoff_models", lambda results, here: 0)
    monkeypatch.setattr(signoff, "_signoff_gpqa", lambda results, here, limit: 0)
    monkeypatch.setattr(signoff.Background, "command", (sys.executable, "-c", "pass"))  # the steps beside it
    hunt = ["--race-power", "0.01,0.999", "--contention", "copy", "--hunt", "triton"]
    for arch, extra, expect in (("sm90", [], ["--workers", "auto", "--production-shapes", *hunt]),
                                ("sm90", ["--workers", "2"], ["--workers", "2", "--production-shapes", *hunt]),
                                ("cpu", [], ["--workers", "auto", *hunt])):  # fmt: skip
        ran.clear()
        monkeypatch.setattr(platforms, "host_arch", lambda arch=arch: arch)
        main(["signoff", "--results", str(tmp_path / arch), *extra])
        checks = [a for a in ran if a[0] == "check"]
        assert len(checks) == 1 and checks[0][-len(expect):] == expect, checks


def test_a_test_standing_in_for_a_cpu_host_leaves_a_gpu_process_triton_compiled(monkeypatch):
    """The test above stands in for a CPU host by replacing ``host_arch`` and runs the CLI, whose
    first act picks Triton's interpreter on a host without a GPU. TRITON_INTERPRET is process-wide
    and read once per kernel, so on an H100 the pytest worker that ran it afterwards imported vLLM's
    routing kernel interpreted, and `vllm-triton-unfused` raised ("Cannot call @triton.jit'd outside
    of the scope of a kernel"): the whole suite's one failure there. The pick follows the GPU torch
    sees, not the host a test stands in for."""
    import torch

    from mxmoe.harness.contract import platforms

    monkeypatch.setenv("TRITON_INTERPRET", "")  # recorded, so whatever this test sets is undone
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(platforms, "host_arch", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU process
    platforms.use_triton_interpreter_without_gpu()
    assert "TRITON_INTERPRET" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a process without one
    platforms.use_triton_interpreter_without_gpu()
    assert os.environ["TRITON_INTERPRET"] == "1"


FAKE_STEP = """
import sys, time
argv = sys.argv[1:]
time.sleep(3)
print("stand-in for", argv[0], flush=True)
if "--json" in argv:
    open(argv[argv.index("--json") + 1], "w").write("{}")
"""


def test_the_gpu_sign_off_runs_the_steps_that_need_nothing_from_each_other_at_once(
    tmp_path, monkeypatch, capsys, fake_host
):
    """On a GPU the catalogue, the padding audit and GPQA run beside the kernel check, each in its
    own process (stand-ins of 3 s each here): every step is in the manifest in order, with the step
    it ran beside, judged on what it wrote since it started, its output printed; the whole takes
    less than the steps one after the other. A step still running when the sign-off stops is ended."""
    import time

    import mxmoe.harness.audits.selfcheck as selfcheck
    from mxmoe.harness.cli import signoff
    from mxmoe.harness.cli.app import main
    from mxmoe.harness.contract import platforms

    monkeypatch.setattr(selfcheck, "run_selfcheck", lambda device: [])
    monkeypatch.setattr(signoff, "_signoff_backends", lambda: ["emulation"])
    monkeypatch.setattr(signoff, "_ran_kernel_cases", lambda results, ids, arch: (ids, {}))
    monkeypatch.setattr(signoff, "_gpqa_missing", lambda: None)
    results = tmp_path / "r"
    began_beside = []

    def kernel_check(argv):  # in-process; GPQA has begun beside it by the time it ends
        time.sleep(3)
        began_beside.append((results / "logs" / "gpqa.log").exists())
        return 0

    monkeypatch.setattr(signoff, "_run", kernel_check)
    monkeypatch.setattr(signoff, "_signoff_models", lambda results, here: time.sleep(3) or 0)
    monkeypatch.setattr(signoff.Background, "command", (sys.executable, "-c", FAKE_STEP))
    monkeypatch.setattr(platforms, "host_arch", lambda: "sm90")
    from mxmoe.harness.cli import report  # the stand-ins write no records to report on

    monkeypatch.setattr(report, "run_report", lambda *a, **k: ({"verdict": "BLOCKED", "rows": []}, {}))
    monkeypatch.setattr(report, "print_verdict", lambda *a: None)
    t0 = time.perf_counter()
    main(["signoff", "--results", str(results)])
    wall = time.perf_counter() - t0
    out = capsys.readouterr().out
    manifest = json.loads((results / "signoff-steps.json").read_text())
    steps = manifest["steps"]
    assert [st["name"] for st in steps] == manifest["planned"]
    assert [st["status"] for st in steps] == ["ran"] * 6, steps
    kernels = "kernel check"
    assert [st.get("beside") for st in steps] == [None, None, kernels, kernels, None, kernels]
    assert began_beside == [True]
    assert all(st["seconds"] >= 2.9 for st in steps[1:])
    assert wall < 4 * 3 + 1.5  # 15 s of steps after the self-check, in about 6 s of waiting (plus the report)
    assert re.search(r"GPQA \d+ s \(ran, beside the kernel check\)", out), out
    for name in ("mutants", "padding", "gpqa"):
        assert f"stand-in for {name}" in out
    assert (results / "logs" / "gpqa.log").read_text().startswith("stand-in for gpqa")
    bg = signoff.Background(["sleeps"], str(tmp_path), "left-running", beside="kernel check")
    assert bg.proc.poll() is None
    bg.stop()
    assert bg.proc.poll() is not None
