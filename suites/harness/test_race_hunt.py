"""The race hunt from the command line: ``check --repeat`` and ``--race-power``, the sign-off's
policy (``[races]``) that sets them, and a kernel written apart from the project that races in
about 1 of 100 calls, caught by the sign-off's hunt while honest layers stay clean under it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.run.races import calls_needed, confidence_from, hunt_line, hunt_plan, plan_line

ROOT = Path(__file__).resolve().parents[2]
RARE = Path(__file__).with_name("rare_race.py")


def test_the_hunt_makes_the_calls_that_see_a_race_of_the_policys_rate():
    assert calls_needed(0.01, 0.999) == 688  # log(0.001) / log(0.99) = 687.3
    assert confidence_from(687, 0.01) < 0.999 <= confidence_from(688, 0.01)
    for bad in ((0.0, 0.9), (0.01, 1.0), (1.5, 0.5)):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            calls_needed(*bad)


def test_a_sign_offs_hunt_puts_its_repeats_at_the_production_shapes():
    """Where the check runs the production shapes, their calls alone make the power (the others' two
    runs have no company on a GPU); elsewhere the repeats spread over every case."""
    ids = [f"c{i:02d}" for i in range(49)]
    shapes = {f"c{i:02d}" for i in range(0, 49, 4)}  # 13 of them
    plan = hunt_plan(0.01, 0.999, ids, shapes)
    assert {c for c, n in plan.items() if n} == shapes and set(plan.values()) == {0, 51}
    assert 13 * (51 + 2) >= 688 > 13 * (50 + 2)
    assert plan_line("k", plan, shapes) == (
        "k: 51 repeats on each of its 13 cases at production shapes, the two guarded runs alone on the other 36")
    spread = hunt_plan(0.01, 0.999, ids, set())
    assert set(spread.values()) == {13} and plan_line("k", spread, set()) == "k: 13 repeats on each of its 49 cases"
    none_here = hunt_plan(0.01, 0.999, ids, {"elsewhere"})
    assert none_here == spread
    assert plan_line("k", none_here, {"elsewhere"}) == (
        "k: 13 repeats on each of its 49 cases (none at production shapes)")
    # a case at T = 0 writes no output for a race to spoil: no repeats, and the others make the power
    empty = {"c01", "c02", "c03", "c05", "c06"}
    live = hunt_plan(0.01, 0.999, ids, set(), empty)
    assert {c for c, n in live.items() if not n} == empty and set(live.values()) == {0, 14}
    assert 44 * (14 + 2) >= 688 > 44 * (13 + 2)
    assert plan_line("k", live, set(), empty) == (
        "k: 14 repeats on each of its 44 cases, the two guarded runs alone on the other 5, at T = 0: their calls "
        "write no output for a race to spoil")  # fmt: skip
    at_shapes = hunt_plan(0.01, 0.999, ids, shapes, {"c00"})  # an empty case among the shapes is not hunted
    assert at_shapes["c00"] == 0 and {n for c, n in at_shapes.items() if c in shapes - {"c00"}} == {56}
    assert plan_line("k", at_shapes, shapes, {"c00"}).endswith(
        "the two guarded runs alone on the other 37 (1 of them at T = 0, whose calls write no output for a race to "
        "spoil)")  # fmt: skip
    assert plan_line("k", hunt_plan(0.01, 0.999, ["c01"], set(), {"c01"}), set(), {"c01"}) == (
        "k: no case here writes output")
    many = hunt_plan(0.01, 0.999, [f"c{i}" for i in range(4000)], set())
    assert set(many.values()) == {1}  # always a repeat: its calls have company, and count
    assert hunt_plan(0.01, 0.999, [], set()) == {}


def test_a_hunt_states_what_it_saw_and_the_power_of_calls_that_agreed():
    assert hunt_line("k", "sm90", [(10, 0), (10, 0)], 0.01) == (
        "k (sm90): 20 calls over 2 cases; none differed: no race at rate >= 0.01 with confidence 18.2093%")
    assert hunt_line("k", "sm90", [(10, 0), (10, 2)], 0.01) == (
        "k (sm90): 20 calls over 2 cases; 2 differed from their case's first run, in 1 cases: a race "
        "(about 10.00% of calls)")  # fmt: skip
    assert hunt_line("k", "sm90", [(10, 0)], 0.01, company="a copy loop").startswith(
        "k (sm90): 10 calls over 1 cases, beside a copy loop; none differed")
    assert hunt_line("k", "sm90", [(10, 3)], 0.01, deterministic=False).endswith(
        "3 differed from their case's first run (declared non-deterministic: judged against the bound): no wrong run "
        "at rate >= 0.01 with confidence 9.5618%")  # fmt: skip


def test_the_sign_off_hunts_the_production_kernels_its_policy_names(tmp_path):
    from mxmoe.harness.cli.signoff import race_hunt_args

    assert race_hunt_args(["triton", "marlin"], None) == [
        "--race-power", "0.01,0.999", "--contention", "copy", "--hunt", "triton", "--hunt", "marlin"]  # fmt: skip
    policy = tmp_path / "policy.toml"
    policy.write_text('[races]\nbackends = ["tri*"]\nrate = 0.02\nconfidence = 0.99\ncontention = "matmul"\n')
    assert race_hunt_args(["triton", "marlin"], str(policy)) == [
        "--race-power", "0.02,0.99", "--contention", "matmul", "--hunt", "triton"]  # fmt: skip
    assert race_hunt_args([], None) == []  # a CPU: no production kernel runs, none hunted


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--repeat", "-1"], "--repeat: expected an integer >= 0, got '-1'"),
     (["--repeat", "two"], "--repeat: expected an integer >= 0, got 'two'"),
     (["--race-power", "1,0.999"], "--race-power: RATE,CONFIDENCE, each a number strictly between 0 and 1"),
     (["--race-power", "0.01"], "--race-power: RATE,CONFIDENCE"),
     (["--repeat", "3", "--race-power", "0.01,0.999"], "not allowed with argument"),
     (["--repeat", "3", "--contention", "loud"], "--contention: invalid choice: 'loud'")],
)  # fmt: skip
def test_bad_hunt_arguments_are_refused_naming_them(args, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--backend", "emulation", *args])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_a_bad_races_table_is_refused_naming_the_key(tmp_path):
    from mxmoe.reports.policy import PolicyError, load_policy

    bad = tmp_path / "bad.toml"
    bad.write_text("[races]\nrate = 1.5\n")
    with pytest.raises(PolicyError, match=r"races.rate must be a number in \(0, 1\), got 1.5"):
        load_policy(bad)
    bad.write_text("[races]\npower = 0.9\n")
    with pytest.raises(PolicyError, match=r"unknown key races.power; accepted in \[races\]: backends, rate"):
        load_policy(bad)
    bad.write_text('[races]\ncontention = "loud"\n')
    with pytest.raises(PolicyError, match=r"races.contention must be one of copy, matmul, none, got 'loud'"):
        load_policy(bad)


def _records(folder: Path) -> list[dict]:
    from mxmoe.harness.run.results import read_results

    return read_results(folder)


@pytest.mark.long(120)
def test_a_race_in_1_of_100_calls_is_caught_by_the_sign_offs_hunt_over_the_pr_profile(tmp_path):
    """``rare_race.RareTileRace`` spoils a tile in about 1 call of 100, unseeded. The sign-off's
    kernel check (the pr profile, ``--race-power 0.01,0.999``) makes 704 calls of it that write
    output (16 in each of 44 cases; the 5 at T = 0 get no repeats), and so misses it with
    probability 0.99^704 = 8.5e-4: it FAILs, naming the run and the tile. This test fails wrongly
    that often, by the very arithmetic it checks (the price of a hunt that stops at 99.9%). Without
    the hunt the same check makes 88 calls that write output (two a case) and misses it about 41
    times in 100 (0.99^88)."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "harness", "check", "--profile", "pr", "--backend-file", f"{RARE}:RareTileRace",
           "--backend", "rare-tile-race", "--race-power", "0.01,0.999", "--results", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert ("race hunt: rare-tile-race: 14 repeats on each of its 44 cases, the two guarded runs alone on the other 5, "
            "at T = 0" in run.stdout), run.stdout[-3000:]  # fmt: skip
    fails = [r for r in _records(out) if r["outcome"] == "FAIL"]
    assert fails and all("elements differ between run 1 and run " in r["reason"] for r in fails), fails[:1]
    m = fails[0]["metrics"]
    assert m["runs"] == 16 and m["runs_differing"] >= 1 and "column tile(s) of 128" in m["differs_where"]
    line = next(ln for ln in run.stdout.splitlines() if ln.strip().startswith("rare-tile-race ("))
    assert "differed from their case's first run" in line and "a race" in line, line


def test_the_hunts_power_counts_only_calls_that_wrote_output(tmp_path, capsys):
    """A check's closing line states the power of the calls that could show a race: the T = 0
    case's two calls write nothing, get no repeats, and are not among the calls counted."""
    out = tmp_path / "results"
    assert main(["check", "--profile", "pr", "--backend", "emulation", "-k", "tiny-interleaved-t",
                 "--race-power", "0.01,0.999", "--results", str(out)]) == 0  # fmt: skip
    said = capsys.readouterr().out
    assert ("emulation: 170 repeats on each of its 4 cases, the two guarded runs alone on the other 1, at T = 0"
            in said), said  # fmt: skip
    import torch

    gpu = torch.cuda.is_available()  # there the calls run beside the default companion, and say so
    line = next(ln.strip() for ln in said.splitlines() if ln.strip().startswith("emulation ("))
    assert line.startswith("emulation (cpu)") is not gpu, line
    assert "688 calls over 4 cases" in line, line
    assert line.endswith("none differed: no race at rate >= 0.01 with confidence 99.9007%"), line
    runs = {r["case_id"]: (r["metrics"]["runs"], r["contention"]) for r in _records(out)}
    company = "copy" if gpu else "none"
    assert runs.pop("tiny-interleaved-t0") == (2, "") and set(runs.values()) == {(172, company)}, runs


def test_honest_layers_stay_clean_under_the_same_repeats(tmp_path):
    """The honest variants and the emulation, 14 repeats a case (as the sign-off's hunt makes them
    over the pr profile's cases that write output) on the small cases: every run is run 1 again."""
    out = tmp_path / "results"
    assert main(["check", "--profile", "pr", "--backend", "honest-*", "--backend", "emulation", "-k", "tiny",
                 "-k", "t7", "--repeat", "14", "--results", str(out)]) == 0  # fmt: skip
    records = _records(out)
    ran = [r for r in records if r["outcome"] != "SKIP"]
    assert len({r["backend"] for r in ran}) >= 6, json.dumps([r["backend"] for r in ran])
    assert all(r["outcome"] == "PASS" and r["metrics"]["runs"] == 16 and r["metrics"]["runs_differing"] == 0
               for r in ran), [(r["test_id"], r["outcome"], r["reason"]) for r in ran]  # fmt: skip
    # each record says what its calls ran beside: on a GPU the default companion's copy loop; with
    # no GPU, nothing (rather than claiming a companion's company)
    import torch

    assert {r["contention"] for r in ran} == ({"copy"} if torch.cuda.is_available() else {"none"})
