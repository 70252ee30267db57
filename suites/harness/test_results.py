"""Recorded results and reproducers: every verdict reaches disk as one parseable line, parallel
writers never share a file, and a reproducer gives back the very bytes the backend was fed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.judge.engine import bitwise_differences, run_case
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.results import SCHEMA, Recorder, load_repro, read_results, save_repro

ROOT = Path(__file__).resolve().parents[2]
FAULTY = Path(__file__).with_name("faulty_backends.py")
ARCH = host_arch()
FIELDS = {
    "schema", "test_id", "backend", "backend_spec", "arch", "outcome", "reason", "findings", "case_id", "case",
    "metrics", "traceback", "seconds", "timestamp", "host", "declaration", "repro", "build", "device_peak_gib",
    "device_peak_parts",
}  # fmt: skip


@pytest.fixture(scope="module")
def honest():
    return load_spec("mxmoe.harness.instruments.honest:HonestFp32")


@pytest.fixture(scope="module")
def wrong():
    return load_spec(f"{FAULTY}:WrongSignFp32")


def test_records_are_appended_as_they_happen(tmp_path, honest):
    rec = Recorder(tmp_path)
    for n, tokens in enumerate((1, 3), start=1):
        result, _ = run_case(honest.backend, make_case("tiny", tokens), ARCH)
        rec.record(result, honest)
        # on disk, complete, before the next case starts
        assert len(rec.path.read_text().splitlines()) == n
    records = read_results(tmp_path)
    assert [r["test_id"] for r in records] == [
        f"honest-fp32-{ARCH}-tiny-interleaved-t1",
        f"honest-fp32-{ARCH}-tiny-interleaved-t3",
    ]
    r = records[0]
    assert FIELDS <= set(r)
    assert r["schema"] == SCHEMA and r["outcome"] == "PASS" and r["backend_spec"] == honest.spec
    assert r["case"]["tokens"] == 1 and r["case_id"] == "tiny-interleaved-t1"
    assert r["metrics"]["elements"] == 64 and 0 < r["metrics"]["worst_ratio"] <= 1
    assert r["host"]["arch"] == ARCH and "torch" in r["host"]
    assert r["declaration"]["arithmetic"]["precision"]["intermediate"] == "bf16"
    assert r["declaration"]["arithmetic"]["precision"]["output"] == "bfloat16"
    assert r["timestamp"].endswith("+00:00")


def test_a_batch_is_written_as_single_records_are(tmp_path, honest, wrong):
    """``record_many`` (a sweep's SKIPs decided without a worker) writes each line as ``record``
    does, and the declaration and case it makes plain once per object stay each record's own."""
    done = [run_case(loaded.backend, make_case("tiny", t), ARCH)[0] for loaded in (honest, wrong) for t in (1, 3)]
    loaded = [honest, honest, wrong, wrong]
    one, many = Recorder(tmp_path / "one"), Recorder(tmp_path / "many")
    for result, item in zip(done, loaded):
        one.record(result, item)
    many.record_many([(result, item, None) for result, item in zip(done, loaded)])
    assert len(many.path.read_text().splitlines()) == 4

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k != "timestamp"}

    a, b = read_results(tmp_path / "one"), read_results(tmp_path / "many")
    assert [strip(r) for r in a] == [strip(r) for r in b]
    assert [r["case"]["tokens"] for r in b] == [1, 3, 1, 3]
    ids = [honest.backend.declaration.id, wrong.backend.declaration.id]
    assert [r["declaration"]["id"] for r in b] == [ids[0], ids[0], ids[1], ids[1]] and ids[0] != ids[1]


_WRITER = """
import sys
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.judge.engine import Result
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.results import Recorder
loaded = load_spec("mxmoe.harness.instruments.honest:HonestFp32")
rec = Recorder(sys.argv[1])
case = make_case("tiny", 1)
for i in range(200):
    rec.record(Result(f"w{sys.argv[2]}-{i}", "honest-fp32", "cpu", case, "PASS", reason="x" * 2000), loaded)
"""


def test_two_processes_never_share_a_file(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(w)], cwd=ROOT) for w in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    files = sorted(tmp_path.glob("results-*.jsonl"))
    assert len(files) == 2
    for f in files:
        ids = [json.loads(line)["test_id"] for line in f.read_text().splitlines()]
        writer = ids[0].split("-")[0]
        assert ids == [f"{writer}-{i}" for i in range(200)]
    assert len(read_results(tmp_path)) == 400


@pytest.mark.parametrize(
    "case",
    [make_case("tiny", 5), make_case("dsmini", 9, ep=2, ep_rank=1), make_case("tpsmall", 9, tp=2, tp_rank=1)],
    ids=lambda c: c.id,
)
def test_repro_round_trips_bitwise(tmp_path, wrong, case):
    result, inputs = run_case(wrong.backend, case, ARCH)
    assert result.outcome == "FAIL"
    path = save_repro(tmp_path, result, inputs, wrong.spec)
    assert path == (tmp_path / "repro" / f"{result.test_id}.json").resolve()
    info = json.loads(path.read_text())
    assert info["replay"] == f"python -m harness replay {path}"
    assert info["outcome"] == "FAIL" and info["backend_spec"] == wrong.spec
    loaded, got_case, arch, got = load_repro(path)
    assert (loaded.backend.declaration.id, got_case, arch) == ("wrongsign-fp32", case, ARCH)
    ref_t, got_t = inputs.tensors(), got.tensors()
    assert set(ref_t) == set(got_t)
    for name, t in ref_t.items():
        assert got_t[name].dtype == t.dtype and got_t[name].shape == t.shape, name
        assert bitwise_differences(got_t[name], t) == 0, name
    assert got.weights.w13_layout == inputs.weights.w13_layout


def test_replay_reruns_with_the_same_outcome(tmp_path, wrong, honest, capsys):
    case = make_case("small", 7)
    for loaded, outcome, status in ((wrong, "FAIL", 1), (honest, "PASS", 0)):
        result, inputs = run_case(loaded.backend, case, ARCH)
        assert result.outcome == outcome
        path = save_repro(tmp_path, result, inputs, loaded.spec)
        assert main(["replay", str(path)]) == status
        out = capsys.readouterr().out
        assert f"{outcome} {result.test_id}: {result.reason}" in out


def test_reproducer_tensors_are_not_pickles(tmp_path, wrong):
    result, inputs = run_case(wrong.backend, make_case("tiny", 2), ARCH)
    path = save_repro(tmp_path, result, inputs, wrong.spec)
    blob = path.with_suffix(".safetensors").read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])  # safetensors: a JSON header, then raw bytes
    assert set(header) - {"__metadata__"} == set(inputs.tensors())
    assert not blob.startswith(b"\x80")  # no pickle protocol marker


def test_reproducers_over_the_size_cap_regenerate_their_inputs(tmp_path, wrong, monkeypatch, capsys):
    """Over MXMOE_REPRO_MAX_MB, the case's own inputs are kept as checksums and regenerated on
    replay; inputs that are not the case's own are always written; 0 is the opt-out."""
    case = make_case("small", 7)
    result, inputs = run_case(wrong.backend, case, ARCH)
    monkeypatch.setenv("MXMOE_REPRO_MAX_MB", "0.01")  # 10 KB: under the small case's inputs
    path = save_repro(tmp_path / "capped", result, inputs, wrong.spec)
    info = json.loads(path.read_text())
    assert info["tensors"] is None and not path.with_suffix(".safetensors").exists()
    assert info["input_bytes"] > 0.01 * 2**20 and info["inputs"].startswith("regenerated from the case id")
    _, _, _, got = load_repro(path)
    for name, t in inputs.tensors().items():
        assert bitwise_differences(got.tensors()[name], t) == 0, name
    assert main(["replay", str(path)]) == 1 and f"FAIL {result.test_id}" in capsys.readouterr().out
    info["checksums"]["x"] = "0" * 64  # another harness's inputs: refused, saying how to keep tensors
    path.write_text(json.dumps(info))
    with pytest.raises(ValueError, match="differ from the recorded checksums.*MXMOE_REPRO_MAX_MB=0"):
        load_repro(path)
    inputs.x.mul_(2)  # not the case's own any more: written whatever the cap
    assert json.loads(save_repro(tmp_path / "own", result, inputs, wrong.spec).read_text())["tensors"]
    monkeypatch.setenv("MXMOE_REPRO_MAX_MB", "0")
    inputs.x.div_(2)
    assert json.loads(save_repro(tmp_path / "full", result, inputs, wrong.spec).read_text())["inputs"] == "saved"
    monkeypatch.setenv("MXMOE_REPRO_MAX_MB", "lots")
    with pytest.raises(ValueError, match="MXMOE_REPRO_MAX_MB must be a non-negative number"):
        save_repro(tmp_path / "bad", result, inputs, wrong.spec)
