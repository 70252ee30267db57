"""The engine's guards, each shown catching what it is for, with small faulty backends defined here;
and the pytest plugin end to end (replay line, recorded results)."""

from __future__ import annotations

import dataclasses
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxmoe.harness.contract.backend import XFail
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.diagnosis.explain import summarize
from mxmoe.harness.instruments.honest import HonestFp32
from mxmoe.harness.judge.engine import Metrics, Result, failure_message, judge, poisoned, run_case
from mxmoe.kernels.emulation import Emulation

CASE = make_case("tiny", 7)
ROOT = Path(__file__).resolve().parents[2]


def _declare(ident: str, **changes: object):
    return dataclasses.replace(Emulation.declaration, id=ident, kind="instrument", **changes)


class UnwrittenRow(Emulation):
    """Leaves the last output row unwritten (a tile that is never stored)."""

    declaration = _declare("unwritten-row")

    def run(self, prepared, inputs, out):
        tmp = torch.empty_like(out)
        super().run(prepared, inputs, tmp)
        out[:-1].copy_(tmp[:-1])


class WritesX(Emulation):
    """Scales x in place after using it (a fused kernel that reuses its input buffer)."""

    declaration = _declare("writes-x")

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        inputs.x.mul_(2)


class Flaky(Emulation):
    """The second call differs from the first in one element by one bf16 ulp (atomics)."""

    declaration = _declare("flaky")
    calls = 0

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        self.calls += 1
        if self.calls % 2 == 0:
            self.spoil(out)

    def spoil(self, out):
        out.view(torch.int16)[0, 0] += 1


class WrongSecondRun(Flaky):
    """The second call writes garbage into one row (a race that sometimes loses)."""

    declaration = _declare("wrong-second-run")

    def spoil(self, out):
        out[0] *= 64


class FlakyDeclared(Flaky):
    declaration = _declare("flaky-declared", deterministic=False)


class WrongSecondRunDeclared(WrongSecondRun):
    """Declared non-deterministic (as vLLM's Marlin MoE is: rows placed by atomics), and its
    second run is wrong: being non-deterministic by design must not let a wrong run pass."""

    declaration = _declare("wrong-second-run-declared", deterministic=False)


class UnwrittenSecondRun(Flaky):
    """The second call leaves the last row unwritten (a tile lost to a race)."""

    declaration = _declare("unwritten-second-run", deterministic=False)

    def spoil(self, out):
        out[-1] = poisoned(out[-1].shape, out.dtype, out.device)


class Raises(Emulation):
    declaration = _declare("raises")

    def run(self, prepared, inputs, out):
        raise RuntimeError("illegal memory access in the test's kernel")


class MakesNaN(Emulation):
    declaration = _declare("makes-nan")

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        out[1, 3] = math.nan


class MakesInf(Emulation):
    declaration = _declare("makes-inf")

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        out[2, 5] = math.inf


_XF = XFail(when={"model": "tiny"}, reason="known upstream bug", link="https://example.org/issue/1")


class UnwrittenKnown(UnwrittenRow):
    declaration = _declare("unwritten-known", xfails=(_XF,))


class HonestKnown(Emulation):
    declaration = _declare("honest-known", xfails=(_XF,))


def test_unwritten_row_fails_with_its_count(host_arch):
    result, _ = run_case(UnwrittenRow(), CASE, host_arch)
    assert result.outcome == "FAIL"
    assert result.metrics.unwritten == CASE.hidden
    assert f"{CASE.hidden} output elements never written" in result.reason


def test_input_written_in_place_fails_naming_it(host_arch):
    result, _ = run_case(WritesX(), CASE, host_arch)
    assert result.outcome == "FAIL"
    assert result.reason.startswith("inputs modified by the backend: x")


def test_nondeterminism_fails_a_backend_declared_deterministic(host_arch):
    result, _ = run_case(Flaky(), CASE, host_arch)
    assert result.outcome == "FAIL"
    m = result.metrics
    assert m.nondeterministic == 1 and m.second_worst_ratio is not None and m.second_over_bound == 0
    assert result.reason == (
        f"1 elements differ between two runs on the same inputs at {m.differs_where} (declared deterministic; "
        f"each run judged on its own: worst error/bound {m.worst_ratio:.3g}x and {m.second_worst_ratio:.3g}x)"
    )
    assert m.differs_where.startswith("1 token row(s) ") and m.differing_run == 2 and m.runs == 2
    # and a wrong second run says so beside the non-determinism
    result, _ = run_case(WrongSecondRun(), CASE, host_arch)
    assert result.outcome == "FAIL" and result.metrics.over_bound == 0 and result.metrics.second_over_bound > 0
    assert "(declared deterministic; each run judged on its own" in result.reason
    assert "; the second of two runs on the same inputs: " in result.reason


def test_identical_runs_judge_no_second_run(host_arch):
    """Where the runs are the same bits the second is the first: nothing more is computed or said."""
    result, _ = run_case(Emulation(), CASE, host_arch)
    m = result.metrics
    assert result.outcome == "PASS" and m.nondeterministic == 0 and result.findings == []
    assert (m.second_worst_ratio, m.second_over_bound, m.second_nonfinite, m.second_unwritten) == (None, 0, 0, 0)


def test_a_nondeterministic_failure_is_diagnosed_on_the_run_that_is_wrong(host_arch):
    result, _ = run_case(Flaky(), CASE, host_arch, diagnose=summarize)
    assert result.diagnosis.startswith("none needed: both runs are within the bound"), result.diagnosis
    result, _ = run_case(WrongSecondRun(), CASE, host_arch, diagnose=summarize)
    assert result.outcome == "FAIL" and result.metrics.over_bound == 0
    assert result.diagnosis.startswith("of the second run (the first is within the bound"), result.diagnosis


def test_declared_nondeterminism_passes_with_a_finding_naming_both_runs(host_arch):
    result, _ = run_case(FlakyDeclared(), CASE, host_arch)
    assert result.outcome == "PASS", result.reason
    m = result.metrics
    assert m.second_worst_ratio is not None and m.second_over_bound == 0
    assert result.findings == [
        f"1 elements differ between two runs on the same inputs at {m.differs_where} (declared non-deterministic; "
        f"each run judged on its own: worst error/bound {m.worst_ratio:.3g}x and {m.second_worst_ratio:.3g}x)"
    ]


def test_declared_nondeterminism_fails_where_the_second_run_exceeds_the_bound(host_arch):
    result, _ = run_case(WrongSecondRunDeclared(), CASE, host_arch, diagnose=summarize)
    m = result.metrics
    assert result.outcome == "FAIL" and m.over_bound == 0 and m.second_over_bound > 0 and m.second_worst_ratio > 1
    assert result.reason == (
        f"the second of two runs on the same inputs: {m.second_over_bound} of {m.elements} elements exceed the "
        f"error bound (worst {m.second_worst_ratio:.3g}x; {m.second_over_rigorous} beyond the rigorous bound, the "
        "rest beyond the probabilistic one, which honest arithmetic exceeds with probability < 3e-14 per element)"
    )
    assert result.findings[0].endswith(f"{m.worst_ratio:.3g}x and {m.second_worst_ratio:.3g}x)")
    assert result.diagnosis.startswith("of the second run (the first is within the bound"), result.diagnosis


def test_declared_nondeterminism_fails_where_the_second_run_leaves_elements_unwritten(host_arch):
    result, _ = run_case(UnwrittenSecondRun(), CASE, host_arch)
    assert result.outcome == "FAIL" and result.metrics.unwritten == 0
    assert result.metrics.second_unwritten == CASE.hidden
    assert result.reason.startswith(f"the second of two runs on the same inputs: {CASE.hidden} output elements never "
                                    "written, "), result.reason  # fmt: skip


def test_records_without_the_second_run_fields_still_read_and_judge_as_before():
    """Results written before the second run was judged lack its fields: they read into Metrics and
    judge as they did (a declared non-determinism a finding, no second-run problem)."""
    old = {k: v for k, v in Metrics(elements=8, worst_ratio=0.5, nondeterministic=2).to_dict().items()
           if not k.startswith("second_")}  # fmt: skip
    result = Result("t", "flaky-declared", "cpu", CASE, "PASS", metrics=Metrics(**old))
    judge(FlakyDeclared(), result)
    assert (result.outcome, result.reason) == ("PASS", "worst error/bound 0.5")
    assert result.findings == ["2 elements differ between two runs on the same inputs (declared non-deterministic)"]


def test_exception_is_an_error_with_the_traceback(host_arch):
    result, _ = run_case(Raises(), CASE, host_arch)
    assert result.outcome == "ERROR"
    assert result.reason == "the backend raised"
    assert "RuntimeError: illegal memory access in the test's kernel" in result.traceback
    assert "in run" in result.traceback


def test_nan_where_the_oracle_is_finite_fails(host_arch):
    result, _ = run_case(MakesNaN(), CASE, host_arch)
    assert result.outcome == "FAIL"
    # a NaN the kernel wrote carries no poison payload: non-finite, but not "unwritten"
    assert (result.metrics.nonfinite, result.metrics.unwritten) == (1, 0)
    assert "1 non-finite output elements where the oracle is finite" in result.reason


def test_inf_where_the_oracle_is_finite_fails(host_arch):
    result, _ = run_case(MakesInf(), CASE, host_arch)
    assert result.outcome == "FAIL"
    assert (result.metrics.nonfinite, result.metrics.unwritten) == (1, 0)
    assert "1 non-finite output elements where the oracle is finite" in result.reason
    assert math.isinf(result.metrics.worst_ratio)


def test_strict_xfail_turns_fail_into_xfail_and_pass_into_fail(host_arch):
    known, _ = run_case(UnwrittenKnown(), CASE, host_arch)
    assert known.outcome == "XFAIL"
    assert known.reason.startswith("known upstream bug (https://example.org/issue/1): ")
    honest, _ = run_case(HonestKnown(), CASE, host_arch)
    assert honest.outcome == "FAIL"
    assert honest.reason.startswith("unexpected pass of a strict xfail")
    other, _ = run_case(UnwrittenKnown(), make_case("small", 7), host_arch)
    assert other.outcome == "FAIL"  # the xfail names tiny only


class SwigluOnly(Emulation):
    declaration = _declare("swiglu-only", activations=("swigluoai",), routing_methods=("Renormalize",), archs=("cpu",))


@pytest.mark.parametrize(
    "case, arch, reason",
    [
        (make_case("small", 8, activation="silu", limit=None), "cpu", "swiglu-only does not implement activation silu"),
        (make_case("tiny", 8, routing="Default"), "cpu", "swiglu-only does not implement routing method Default"),
        (CASE, "sm90", "swiglu-only does not run on sm90 (declared: cpu)"),
    ],
    ids=["activation", "routing", "arch"],
)
def test_unsupported_is_a_skip_with_the_reason(case, arch, reason):
    result, inputs = run_case(SwigluOnly(), case, arch)
    assert (result.outcome, result.reason, inputs) == ("SKIP", reason, None)


def test_an_arch_this_host_lacks_is_a_skip(host_arch):
    lacking = "gfx942" if host_arch != "gfx942" else "sm90"
    result, _ = run_case(HonestFp32(), CASE, lacking)
    assert (result.outcome, result.reason) == ("SKIP", f"needs {lacking} hardware; this host is {host_arch}")


def test_failure_message_is_assert_close_style_and_ends_with_the_replay(host_arch):
    result, _ = run_case(UnwrittenRow(), CASE, host_arch)
    lines = failure_message(result, "python -m harness replay r.json").splitlines()
    assert lines[0].startswith(f"unwritten-row-{host_arch}-tiny-interleaved-t7: 64 output elements never written")
    assert lines[1] == "Mismatched elements: 64 / 448 (14.3%) exceed the error bound"
    assert lines[2].startswith("Greatest error/bound: inf at index (6, ")
    assert lines[3].startswith("Max abs diff inf, max rel diff inf, RMS rel inf, cosine nan")
    assert lines[3].endswith("non-finite 64, unwritten 64")
    assert lines[-1] == "Replay: python -m harness replay r.json"
    error, _ = run_case(Raises(), CASE, host_arch)
    text = failure_message(error, "X")
    assert "Traceback (most recent call last)" in text and text.endswith("\nReplay: X")


_FAULTY_FILE = """
import dataclasses
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.kernels.emulation import Emulation

# this host's arch and one it lacks: one test of each kind wherever the suite runs
OTHER = "gfx942" if host_arch() != "gfx942" else "sm90"

class Negated(Emulation):
    declaration = dataclasses.replace(Emulation.declaration, id="negated", archs=(host_arch(), OTHER))

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        out.neg_()
"""


def _pytest(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_plugin_reports_a_fail_with_a_replay_that_reruns_just_it(tmp_path, host_arch):
    backend = tmp_path / "negated.py"
    backend.write_text(_FAULTY_FILE)
    spec = f"{backend}:Negated"
    sel = ("--backend-file", spec, "--backend", "negated", "-k", "tiny-interleaved-t1")
    run = _pytest("suites/engine/test_differential.py", *sel)
    assert run.returncode == 1, run.stdout
    # t1 and t16-wide of tiny on this host's arch fail; the other arch's skip here
    assert "2 failed, 2 skipped" in run.stdout, run.stdout
    # set: with CI set, pytest repeats each failure's full message in the short summary
    replays = sorted({ln.removeprefix("Replay: ") for ln in run.stdout.splitlines() if ln.startswith("Replay: ")})
    assert len(replays) == 2, run.stdout
    replay = next(r for r in replays if "t16" not in r)
    assert replay == shlex.join(
        [
            "python",
            "-m",
            "pytest",
            f"suites/engine/test_differential.py::test_differential[negated-{host_arch}-tiny-interleaved-t1]",
            "--backend",
            "negated",
            "--backend-file",
            str(backend.resolve()) + ":Negated",
        ]
    )
    again = _pytest(*shlex.split(replay)[3:])
    assert again.returncode == 1 and "1 failed in" in again.stdout, again.stdout


def test_plugin_records_results_and_reproducers(tmp_path, host_arch):
    backend = tmp_path / "negated.py"
    backend.write_text(_FAULTY_FILE)
    results = tmp_path / "results"
    sel = ("--backend-file", f"{backend}:Negated", "--backend", "negated", "--backend", "emulation")
    run = _pytest("suites/engine/test_differential.py", *sel, "-k", f"{host_arch}-tiny-interleaved-t",
                  "--results", str(results))
    assert run.returncode == 1, run.stdout
    from mxmoe.harness.run.results import read_results

    records = read_results(results)
    outcomes = {(r["backend"], r["outcome"]) for r in records}
    # negated fails wherever T > 0 (T = 0 has nothing to negate); emulation passes everywhere
    assert outcomes == {("negated", "FAIL"), ("negated", "PASS"), ("emulation", "PASS")}, outcomes
    failing = [r for r in records if r["outcome"] == "FAIL"]
    assert all(r["repro"] and Path(r["repro"]).is_file() for r in failing)
    assert f"Replay: python -m harness replay {failing[0]['repro']}" in run.stdout


def test_plugin_results_under_xdist_keep_every_worker(tmp_path, host_arch):
    """Under ``-n 2`` each worker records into its own file, and together they hold every test."""
    results = tmp_path / "results"
    run = _pytest(
        "suites/engine/test_differential.py", "-n", "2", "-k", f"emulation-{host_arch}-tiny and not vllm",
        "--results", str(results),
    )
    assert run.returncode == 0, run.stdout
    from mxmoe.harness.run.results import read_results

    files = sorted(results.glob("results-*.jsonl"))
    records = read_results(results)
    ran = int(run.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert len(records) == ran > 0, (len(records), run.stdout)
    assert len({r["test_id"] for r in records}) == len(records)
    assert 1 <= len(files) <= 2, files  # one file per process that ran tests, never a shared one


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_bound_that_is_not_finite_is_an_error_never_a_pass(bad, host_arch, host_device):
    """A NaN compares False with everything: a NaN (or infinite) bound would pass any output at
    that element. The harness's own failure is an ERROR, and never counted as a catch."""
    from mxmoe.harness.contract.inputs import make_inputs
    from mxmoe.harness.judge.bounds import reference_and_bound
    from mxmoe.harness.judge.engine import harness_error

    inputs = make_inputs(CASE, host_device)
    bounded = reference_and_bound(inputs, HonestFp32.declaration.arithmetic)
    rigorous, probabilistic = bounded.rigorous.clone(), bounded.probabilistic.clone()
    rigorous[2, 3] = probabilistic[2, 3] = bad
    bounded = dataclasses.replace(bounded, rigorous=rigorous, probabilistic=probabilistic)
    result, _ = run_case(HonestFp32(), CASE, host_arch, inputs=inputs, bounded=bounded)
    assert result.outcome == "ERROR" and harness_error(result), result.reason
    assert result.reason.startswith("1 of 448 elements have no finite error bound or error/bound ratio")
    wrong, _ = run_case(Raises(), CASE, host_arch)
    assert wrong.outcome == "ERROR" and not harness_error(wrong)  # the backend's own failure is one


class DeclinesOnSight(Emulation):
    """Sees the case only in ``convert`` and declines it there (as vLLM's oracle re-routing a
    deployment does): the engine's SKIP, naming why."""

    declaration = _declare("declines-on-sight")

    def convert(self, inputs):
        from mxmoe.harness.contract.backend import BackendUnavailable

        raise BackendUnavailable(f"vLLM selects MARLIN for T={inputs.case.tokens}, not this backend")


class ConvertRaises(Emulation):
    declaration = _declare("convert-raises")

    def convert(self, inputs):
        raise RuntimeError("the weight conversion broke")


def test_a_backend_declining_the_case_in_convert_is_a_skip_naming_why_and_a_crash_there_an_error(host_arch):
    declined, inputs = run_case(DeclinesOnSight(), CASE, host_arch)
    assert declined.outcome == "SKIP"
    assert declined.reason == "declines-on-sight cannot run this case: vLLM selects MARLIN for T=7, not this backend"
    assert declined.metrics.elements == 0 and inputs is not None  # the inputs were made; nothing was judged
    assert not declined.traceback
    crashed, _ = run_case(ConvertRaises(), CASE, host_arch)
    assert (crashed.outcome, crashed.reason) == ("ERROR", "the backend raised")
    assert crashed.metrics.elements == 0
    assert "RuntimeError: the weight conversion broke" in crashed.traceback and "in convert" in crashed.traceback


# -- the race hunt: run_case's repeats ----------------------------------------------------------


class RacesOnCall(Emulation):
    """Right on every call but those numbered in ``bad`` (1-based), where one tile (rows 2-3,
    columns 0-7) comes out wrong by ``by`` ulps: a race that a pair of runs rarely meets."""

    declaration = _declare("races-on-call")
    bad: tuple[int, ...] = (5,)
    by = 1

    def __init__(self) -> None:
        self.calls = self.converts = 0

    def convert(self, inputs):
        self.converts += 1
        return super().convert(inputs)

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        self.calls += 1
        if self.calls in self.bad:
            out[2:4, 0:8].view(torch.int16).add_(self.by)


class RacesDeclared(RacesOnCall):
    """Declared non-deterministic: its differing runs are judged against the bound; call 4 is
    far off, calls 3 and 6 by an ulp."""

    declaration = _declare("races-declared", deterministic=False)
    bad = (3, 4, 6)

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        if self.calls == 4:
            out[2:4, 0:8] = 1000.0


class RaisesOnCall(RacesOnCall):
    declaration = _declare("raises-on-call")

    def run(self, prepared, inputs, out):
        if self.calls == 3:
            raise RuntimeError("illegal memory access on the fourth call")
        super().run(prepared, inputs, out)


def test_a_race_on_the_fifth_call_passes_two_runs_and_fails_the_hunt_naming_the_run_and_where(host_arch):
    backend = RacesOnCall()
    result, _ = run_case(backend, CASE, host_arch)
    assert result.outcome == "PASS" and result.metrics.runs == 2 and backend.calls == 2
    backend = RacesOnCall()
    result, _ = run_case(backend, CASE, host_arch, repeat=6)
    m = result.metrics
    assert result.outcome == "FAIL" and backend.calls == 8 and backend.converts == 1  # one conversion for all
    assert (m.runs, m.runs_differing, m.differing_run, m.nondeterministic) == (8, 1, 5, 16)
    assert m.differs_where.startswith("2 token row(s) 2-3; 1 column tile(s) of 128 0; experts most routed to")
    assert result.reason.startswith(
        f"16 elements differ between run 1 and run 5 of 8 on the same inputs (1 of the 7 runs after the first "
        f"differ from it) at {m.differs_where} (declared deterministic"
    ), result.reason


def test_every_differing_run_is_counted(host_arch):
    backend = RacesOnCall()
    backend.bad = (2, 4, 9)
    result, _ = run_case(backend, CASE, host_arch, repeat=8)
    m = result.metrics
    assert (m.runs, m.runs_differing, m.differing_run) == (10, 3, 2)


def test_a_declared_nondeterministic_backend_is_judged_by_its_worst_differing_run(host_arch):
    result, _ = run_case(RacesDeclared(), CASE, host_arch, repeat=4)
    m = result.metrics
    assert (m.runs, m.runs_differing, m.differing_run) == (6, 3, 4)
    assert result.outcome == "FAIL" and m.over_bound == 0 and m.second_over_bound == 16, result.reason
    assert result.reason.startswith("run 4 of 6 on the same inputs: 16 of "), result.reason
    honest, _ = run_case(RacesOnCall.__mro__[1](), CASE, host_arch, repeat=4)  # Emulation: no run differs
    assert honest.outcome == "PASS" and (honest.metrics.runs, honest.metrics.runs_differing) == (6, 0)


def test_a_backend_that_raises_on_a_repeat_is_an_error_naming_the_run(host_arch):
    result, _ = run_case(RaisesOnCall(), CASE, host_arch, repeat=3)
    assert result.outcome == "ERROR" and result.reason == "the backend raised on run 4 of 5 (the race hunt's)"
    assert "illegal memory access on the fourth call" in result.traceback


@pytest.mark.parametrize("bad", [-1, 1.5, "3"])
def test_repeat_must_be_a_whole_number_of_runs(bad, host_arch):
    with pytest.raises(ValueError, match="repeat: a whole number of runs >= 0"):
        run_case(Emulation(), CASE, host_arch, repeat=bad)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bitwise_differences_counts_by_slices_what_one_count_would(monkeypatch, device):
    """The guards' count of differing elements, taken ``COUNT_SLICE`` elements at a time (a whole
    count widens to 9 bytes an element on CUDA): the same number as one count over the whole tensor,
    for every shape and dtype the guards compare, a NaN's payload included."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the CUDA count is the one that widens; this host has no GPU")
    from mxmoe.harness.judge import engine

    monkeypatch.setattr(engine, "COUNT_SLICE", 7)
    gen = torch.Generator().manual_seed(11)
    for shape, dtype in [((), torch.float32), ((5,), torch.uint8), ((13, 3), torch.bfloat16),
                         ((4, 6, 5), torch.uint8), ((2, 40), torch.float64)]:  # fmt: skip
        a = torch.randint(0, 200, shape, generator=gen).to(dtype)
        b = a.clone()
        flat = b.view(-1)
        hit = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 3)]
        flat[hit] = flat[hit] + 1
        if dtype == torch.float32:  # a NaN whose payload alone differs
            a.fill_(float("nan"))
            b.view(torch.int32).copy_(a.view(torch.int32) + 1)
        a, b = a.to(device), b.to(device)
        it = engine._SAME_SIZE_INT[a.element_size()]
        whole = int((a.view(it) != b.view(it)).sum())
        assert engine.bitwise_differences(a, b) == whole == (1 if dtype == torch.float32 else len(hit)), (shape, dtype)
        assert engine.bitwise_differences(a, a) == 0
        t = a.mT if a.dim() >= 2 else a  # a view that is not contiguous
        assert engine.bitwise_differences(t, b.mT if b.dim() >= 2 else b) == whole
