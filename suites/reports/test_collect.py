"""Reading and reconciling result folders of many jobs and hosts (``reports.collect``)."""

import json
import shutil

import pytest

from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.judge.engine import Result
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.results import Recorder
from mxmoe.reports.collect import ResultFileError, collect

LOADED = load_spec("mxmoe.harness.instruments.honest:HonestFp32")


def record(folder, outcome, tokens, host=None):
    rec = Recorder(folder)
    if host is not None:  # another machine's file: its own name and fingerprint
        rec.path = rec.path.with_name(f"results-{host}-1.jsonl")
    case = make_case("tiny", tokens)
    out = rec.record(Result(f"honest-fp32-cpu-{case.id}", "honest-fp32", "cpu", case, outcome), LOADED)
    if host is not None:
        lines = rec.path.read_text().splitlines()
        last = json.loads(lines[-1])
        last["host"] = {**last["host"], "hostname": host}
        rec.path.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    return out


def test_two_hosts_merge_without_loss_or_double_counting(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for t in (1, 2, 3):
        record(a, "PASS", t, host="gpu-node-1")
    for t in (4, 5):
        record(b, "PASS", t, host="cpu-runner")
    got = collect([a, b])
    assert len(got.cases) == 5 and got.duplicates == 0 and not got.flaky
    # the same folder copied into two artifacts counts once
    shutil.copytree(a, tmp_path / "copy-of-a")
    again = collect([a, b, tmp_path / "copy-of-a"])
    assert len(again.cases) == 5 and again.duplicates == 3


def test_the_failing_run_is_the_verdict_and_a_disagreeing_history_is_flaky(tmp_path):
    """No run's clock decides: a FAIL and a later PASS of one test keep the FAIL (the kernel is
    sometimes wrong) and the test is flaky; agreeing runs are history."""
    record(tmp_path, "FAIL", 7)
    record(tmp_path, "PASS", 7)
    record(tmp_path, "PASS", 9)
    record(tmp_path, "PASS", 9, host="gpu-node-2")  # the same test again on another machine
    got = collect([tmp_path])
    by_id = {r["test_id"]: r for r in got.cases}
    assert by_id["honest-fp32-cpu-tiny-interleaved-t7"]["outcome"] == "FAIL"
    assert got.flaky == [("honest-fp32-cpu-tiny-interleaved-t7", "cpu")]
    assert [r["outcome"] for r in got.history[("honest-fp32-cpu-tiny-interleaved-t7", "cpu")]] == ["PASS"]
    reversed_order = collect([tmp_path])  # the same files read in any order give the same verdict
    assert {r["test_id"]: r["outcome"] for r in reversed_order.cases} == {k: v["outcome"] for k, v in by_id.items()}
    assert len(got.history[("honest-fp32-cpu-tiny-interleaved-t9", "cpu")]) == 1  # kept, and agreeing: not flaky


def test_a_truncated_file_is_an_error_naming_it(tmp_path):
    record(tmp_path, "PASS", 1)
    record(tmp_path, "PASS", 2)
    path = next(tmp_path.glob("results-*.jsonl"))
    path.write_text(path.read_text()[:-40])
    with pytest.raises(ResultFileError, match=rf"{path.name}:2: truncated \(the file ends mid-line\)"):
        collect([tmp_path])


def test_a_foreign_file_is_an_error_naming_it(tmp_path):
    foreign = tmp_path / "results-other-tool.jsonl"
    foreign.write_text(json.dumps({"name": "test_foo", "status": "passed"}) + "\n")
    with pytest.raises(ResultFileError, match=r"results-other-tool.jsonl:1: no schema, test_id.*not a result record"):
        collect([tmp_path])
    foreign.write_text(json.dumps({"schema": 99, "test_id": "x", "backend": "b", "arch": "cpu", "outcome": "PASS",
                                   "timestamp": "t", "host": {}}) + "\n")  # fmt: skip
    with pytest.raises(ResultFileError, match="record schema 99"):
        collect([tmp_path])
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    with pytest.raises(ResultFileError, match="not a result file"):
        collect([notes])
    with pytest.raises(ResultFileError, match="no such file or folder"):
        collect([tmp_path / "missing"])


def test_gpqa_summaries_are_collected_and_lm_eval_files_left_alone(tmp_path):
    from mxmoe.harness.gpqa import run

    spec = run.Spec("gpqa_diamond_mc", tmp_path / "data.csv")
    spec.data.write_text("x")
    recs = [{"question_id": "q0", "repeat": 0, "permutation": [0, 1, 2, 3], "answer": "A", "extracted": "A",
             "correct": True}]  # fmt: skip
    summary = run.summarize(spec, "triton", recs, model="tiny", bar=None, baseline=None, seconds=1.0)
    run.write(tmp_path, spec, "triton", summary, {"results": {}}, recs)
    got = collect([tmp_path])
    assert [g["backend"] for g in got.gpqa] == ["triton"] and got.cases == []
    assert len(got.sources) == 1
