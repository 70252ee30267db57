"""The race hunt's company (``harness.run.contention``): the flags by which a worker calls up the
companion on its GPU around a hunted case's calls, a companion that cannot start failing the check
rather than letting it claim company it did not have, the engine entering the company around the
calls of hunted cases alone, and the report counting towards the power only calls made beside the
policy's contention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.judge.engine import run_case
from mxmoe.harness.run.contention import CompanionFailed, Companions, Contention, _flagged, check_contention
from mxmoe.harness.run.registry import load_spec
from mxmoe.reports.build import _race_hunt
from mxmoe.reports.policy import load_policy

CASE = make_case("tiny", 7)


def test_a_worker_raises_its_flag_around_the_calls_and_takes_it_down_after(tmp_path):
    (tmp_path / "gpu1").mkdir()
    contention = Contention("copy", str(tmp_path))
    assert not _flagged(tmp_path / "gpu1")
    with contention.beside(1) as said:
        assert said == "copy"
        assert _flagged(tmp_path / "gpu1")
        assert not (tmp_path / "gpu0").exists()  # another GPU's companion is not called up
    assert not _flagged(tmp_path / "gpu1")


def test_a_dead_workers_flag_is_taken_down_and_calls_up_nothing(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"active-{dead.pid}").touch()
    assert not _flagged(tmp_path)
    assert not (tmp_path / f"active-{dead.pid}").exists()
    (tmp_path / f"active-{os.getpid()}").touch()
    assert _flagged(tmp_path)


def test_an_unknown_contention_is_refused_naming_the_accepted():
    with pytest.raises(ValueError, match=r"--contention: 'loud' is not a contention; accepted: copy, matmul, none"):
        check_contention("loud")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a companion starts on a GPU; this checks one that cannot")
def test_a_companion_that_cannot_start_fails_the_hunt_saying_why():
    """Without a GPU the companion cannot make its CUDA context: the check must not go on as if it
    had company (its records would say "copy" of calls that ran alone)."""
    with pytest.raises(CompanionFailed, match=r"the race hunt's companion \(copy\) on cuda:0 did not start: \w+"):
        with Companions("copy", 1):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a companion works on a GPU; this host has none")
def test_a_companion_starts_on_each_gpu_works_while_called_up_and_ends_with_the_sweep():
    import time

    companions = Companions("copy", torch.cuda.device_count())
    with companions as contention:
        folder = Path(contention.flags)
        assert all((folder / f"gpu{g}" / "ready").is_file() for g in range(torch.cuda.device_count()))
        procs = list(companions._procs)
        with contention.beside(0):
            time.sleep(0.5)
        assert all(p.poll() is None for p in procs)  # working, and still there after
    assert all(p.poll() is not None for p in procs) and not folder.exists()  # gone with the sweep, flags too


def test_the_engine_makes_company_around_a_hunted_cases_calls_only():
    loaded = load_spec("mxmoe.kernels.emulation:Emulation")
    entered = []

    class Company:
        def __enter__(self) -> str:
            entered.append("in")
            return "copy"

        def __exit__(self, *exc: object) -> None:
            entered.append("out")

    arch = host_arch()
    result, _ = run_case(loaded.backend, CASE, arch, repeat=2, contend=Company)
    assert result.outcome == "PASS" and result.metrics.runs == 4, result.reason
    assert entered == ["in", "out"] and result.contention == "copy"
    entered.clear()
    result, _ = run_case(loaded.backend, CASE, arch, contend=Company)  # not hunted: no company, none said
    assert entered == [] and result.contention == ""
    result, _ = run_case(loaded.backend, CASE, arch, repeat=1)  # hunted without company: says so
    assert result.contention == "none"


def _rec(contention: str, runs: int, differing: int = 0) -> dict:
    return {"outcome": "PASS", "contention": contention, "declaration": {"deterministic": True},
            "metrics": {"elements": 10, "runs": runs, "runs_differing": differing}}  # fmt: skip


def test_on_a_gpu_only_calls_beside_the_policys_contention_count_towards_the_power():
    policy = load_policy()  # [races]: rate 0.01, confidence 0.999, contention copy
    beside = [_rec("copy", 400), _rec("copy", 400)]
    hunt = _race_hunt("k", "sm90", beside, policy, True)
    assert hunt["calls"] == 800 and hunt["confidence"] > 0.999 and hunt["contention"] == "copy"
    assert "beside a process looping a 1 GiB device-to-device copy" in hunt["line"], hunt["line"]
    alone = [_rec("copy", 400), _rec("none", 400), _rec("", 2)]
    hunt = _race_hunt("k", "sm90", alone, policy, True)
    assert hunt["calls"] == 400 and hunt["confidence"] < 0.999, hunt
    assert ("2 of its 3 cases not counted, their two guarded runs alone, not hunted; hunted beside no other work "
            "on the GPU") in hunt["line"], hunt["line"]  # fmt: skip
    # on a CPU there is no GPU to share: every call counts, whatever the records say
    assert _race_hunt("k", "cpu", alone, policy, True)["calls"] == 802
    # a race seen is said, wherever it was seen; it leaves no power
    raced = _race_hunt("k", "sm90", [_rec("copy", 400), _rec("none", 400, differing=3)], policy, True)
    assert raced["confidence"] == 0.0 and "3 differed from their case's first run" in raced["line"]
    nothing = _race_hunt("k", "sm90", [_rec("", 2)], policy, True)
    assert nothing["calls"] == 0 and "no call beside" in nothing["line"] and nothing["confidence"] == 0.0


def test_a_check_on_a_cpu_says_its_hunt_has_no_company(tmp_path):
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "harness", "check", "--backend", "emulation", "-k", "tiny", "-k", "t7", "--repeat",
           "1", "--results", str(tmp_path)]  # fmt: skip
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "race hunt: no GPU here, so its calls have no company" in run.stdout, run.stdout[-2000:]
