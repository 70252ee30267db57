"""Workers that share a GPU share its memory (``harness.run.ledger``, the plugin's shares): what the
shares held at once add up to stays within the budget, a large request is not starved by small
ones, a dead worker's share is freed, and a test that runs out of memory beside others runs again
alone, recorded once. The ledger is the same code on every host; here it runs on processes and
files alone, and the plugin's sharing is forced on with ``--device-share`` where there is no GPU."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mxmoe.harness.run.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]


def _hold(t0: float, path: str, budget: float, name: str, gib: float, delay: float, seconds: float, log: str) -> None:
    time.sleep(max(0.0, t0 + delay - time.time()))
    with Ledger(Path(path), budget).hold(gib):
        start = time.time()
        time.sleep(seconds)
        end = time.time()
    Path(log, f"{name}.json").write_text(json.dumps({"gib": gib, "start": start, "end": end}))


def _spans(log: Path) -> dict[str, dict[str, float]]:
    return {p.stem: json.loads(p.read_text()) for p in log.glob("*.json")}


def _run(ledger: Path, budget: float, log: Path, plan: list[tuple[str, float, float, float]]) -> dict:
    ctx = multiprocessing.get_context("fork")  # started at once; the children only read and write files
    t0 = time.time() + 0.5  # every delay counts from one moment, whenever each child started
    procs = [ctx.Process(target=_hold, args=(t0, str(ledger), budget, *p, str(log))) for p in plan]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return _spans(log)


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_what_is_held_at_once_stays_within_the_budget_and_a_need_over_it_runs_alone(tmp_path):
    # budget 10: three 4s (two fit at once), a 12 (over the budget: alone), two 1s
    plan = [("a", 4, 0.0, 0.4), ("b", 4, 0.0, 0.4), ("c", 4, 0.0, 0.4), ("big", 12, 0.1, 0.3),
            ("s1", 1, 0.2, 0.2), ("s2", 1, 0.2, 0.2)]  # fmt: skip
    spans = _run(tmp_path / "gpu0.ledger", 10, tmp_path, plan)
    assert set(spans) == {p[0] for p in plan}
    for name, span in spans.items():
        beside = [o for o, other in spans.items() if o != name and _overlap(span, other)]
        if name == "big":
            assert beside == [], beside
            continue
        # at the moment each share started, what was held with it fits the budget
        at = span["start"]
        held = sum(s["gib"] for s in spans.values() if s["start"] <= at < s["end"])
        assert held <= 10, (name, held)
    assert not all(_overlap(spans[x], spans[y]) for x, y in (("a", "b"), ("a", "c"), ("b", "c")))


def test_a_large_request_waits_before_later_small_ones(tmp_path):
    # "held" holds 6 of 10; "large" (8) asks next and must wait; "late" (3) asks after it: it would
    # fit beside "held" (6 + 3), but "large" waits before it and cannot run beside it (8 + 3), so
    # "late" runs after "large", not before it
    plan = [("held", 6, 0.0, 1.5), ("large", 8, 0.3, 0.3), ("late", 3, 0.9, 0.2)]
    spans = _run(tmp_path / "gpu0.ledger", 10, tmp_path, plan)
    assert spans["large"]["start"] >= spans["held"]["end"]
    assert spans["late"]["start"] >= spans["large"]["end"], spans


def _hold_forever(path: str) -> None:
    with Ledger(Path(path), 10).hold(9):
        time.sleep(600)


def test_a_dead_workers_share_is_given_back(tmp_path):
    path = tmp_path / "gpu0.ledger"
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_hold_forever, args=(str(path),))
    proc.start()
    ledger = Ledger(path, 10)
    deadline = time.monotonic() + 60
    while proc.pid not in ledger.holders():
        assert time.monotonic() < deadline, "the worker never took its share"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # as a kernel fault ends an xdist worker
    proc.join(10)
    with ledger.alone() as waited:
        assert waited < 5
        assert list(ledger.holders()) == [os.getpid()]
    assert ledger.holders() == {}


_SHARED_TESTS = """
import json, os, pathlib, tempfile, time
import pytest
from mxmoe.harness.contract.cases import make_case

LOG = pathlib.Path(os.environ["LEDGER_LOG"])

def _span(name):
    start = time.time()
    time.sleep(0.5)
    ledgers = sorted(p.name for p in pathlib.Path(tempfile.gettempdir()).glob("mxmoe-ledger-*"))
    (LOG / f"{name}.json").write_text(json.dumps({"start": start, "end": time.time(), "ledgers": ledgers}))

@pytest.mark.parametrize("n", range(4))
@pytest.mark.device_case(make_case("gptoss20b", 1))
def test_big(n):
    _span(f"big{n}")

@pytest.mark.parametrize("n", range(4))
def test_small(n):
    _span(f"small{n}")

def test_oom_once(tmp_path):
    assert not (tmp_path / "first").exists()  # a run again alone has a fresh tmp_path
    (tmp_path / "first").touch()
    mark = LOG / "oom-once"
    if not mark.exists():
        mark.touch()
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

def test_oom_always():
    with open(LOG / "oom-always.count", "a") as f:
        f.write("x")
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

def test_fails_otherwise():
    with open(LOG / "fails.count", "a") as f:
        f.write("x")
    assert False, "a plain failure"
"""


def _shared_run(tmp_path: Path, share: float) -> tuple[subprocess.CompletedProcess, Path]:
    suite = tmp_path / f"suite{share:g}"
    log, temp = suite / "log", suite / "temp"
    log.mkdir(parents=True)
    temp.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ["mxmoe.harness.plugin"]\n')
    (suite / "test_shared.py").write_text(_SHARED_TESTS)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--device-share", str(share),
           "test_shared.py"]  # fmt: skip
    run = subprocess.run(cmd, cwd=suite, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, LEDGER_LOG=str(log), TMPDIR=str(temp), PYTHONPATH=os.pathsep.join(
                             p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)))  # fmt: skip
    return run, log


def test_workers_share_a_gpu_and_a_test_out_of_memory_beside_others_runs_again_alone(tmp_path):
    """Two workers, a share of 20 GiB: gpt-oss-20b's tests (18.75 GiB each) never run at once, small
    ones run beside them; a test out of memory beside others runs again alone in a fresh tmp_path
    and is named in the summary; out of memory alone too, it fails; another failure runs once."""
    run, log = _shared_run(tmp_path, 20)
    assert run.returncode == 1, run.stdout
    assert "2 failed, 9 passed" in run.stdout, run.stdout
    spans = _spans(log)
    bigs = [spans[f"big{n}"] for n in range(4)]
    assert not any(_overlap(a, b) for i, a in enumerate(bigs) for b in bigs[i + 1 :]), bigs
    assert (log / "oom-always.count").read_text() == "xx"  # beside others, then alone
    assert (log / "fails.count").read_text() == "x"
    lines = run.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if "ran out of device memory beside other tests' shares" in line)
    assert lines[head].startswith("2 test(s)"), lines[head]
    named = [line.strip().partition(": ")[0] for line in lines[head + 1 : head + 3]]
    assert sorted(named) == ["test_shared.py::test_oom_always", "test_shared.py::test_oom_once"], lines[head:]
    seen = {tuple(span["ledgers"]) for span in spans.values()}
    assert len(seen) == 1 and len(next(iter(seen))) == 1, seen  # one run, one ledger folder, while it ran
    assert not list((log.parent / "temp").glob("mxmoe-ledger-*"))  # and none once it ended


def test_a_share_that_holds_two_large_tests_runs_them_at_once(tmp_path):
    """The control of the test above: with room for two, the same four tests overlap (so that test's
    "never at once" is the ledger's doing, not xdist's scheduling)."""
    run, log = _shared_run(tmp_path, 40)
    assert "2 failed, 9 passed" in run.stdout, run.stdout
    spans = _spans(log)
    bigs = [spans[f"big{n}"] for n in range(4)]
    assert any(_overlap(a, b) for i, a in enumerate(bigs) for b in bigs[i + 1 :]), bigs


_OOM_ONCE_BACKEND = """
import dataclasses
import torch
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.kernels.emulation import Emulation

RAISED = []

class OomOnce(Emulation):
    declaration = dataclasses.replace(Emulation.declaration, id="oom-once", archs=(host_arch(),))

    def run(self, prepared, inputs, out):
        if not RAISED:
            RAISED.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        super().run(prepared, inputs, out)
"""


def test_a_differential_out_of_memory_beside_others_is_recorded_once_from_its_run_alone(tmp_path, host_arch):
    backend = tmp_path / "oom_once.py"
    backend.write_text(_OOM_ONCE_BACKEND)
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "suites/engine/test_differential.py",
           "-n", "2", "--device-share", "4", "--backend-file", f"{backend}:OomOnce", "--backend", "oom-once",
           "-k", f"oom-once-{host_arch}-tiny-interleaved-t7", "--results", str(results)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout
    assert "1 passed" in run.stdout and "1 test(s) ran out of device memory" in run.stdout, run.stdout
    from mxmoe.harness.run.results import read_results

    records = read_results(results)
    assert [(r["test_id"], r["outcome"]) for r in records] == [(f"oom-once-{host_arch}-tiny-interleaved-t7", "PASS")]


OUT_OF_MEMORY = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 254.00 MiB",
                 "torch.AcceleratorError: CUDA error: out of memory", "HIP out of memory"]  # fmt: skip


@pytest.mark.parametrize("text", OUT_OF_MEMORY)
def test_out_of_memory_is_read_from_torch_and_the_runtimes_words(text):
    from mxmoe.harness.contract.platforms import says_out_of_memory

    assert says_out_of_memory(text)
    assert not says_out_of_memory("RuntimeError: illegal memory access was encountered")
