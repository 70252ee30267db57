"""Shrinking keeps a failure while cutting its inputs: tokens, experts, intermediate and hidden."""

from __future__ import annotations

import json

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.diagnosis.shrink import shrink
from mxmoe.harness.instruments.faults import NibbleOrderSwapped, OneScaleByteOff
from mxmoe.harness.judge.engine import run_case
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.results import save_repro


def _bytes(inputs: object) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.tensors().values())


@pytest.mark.parametrize("fault", [NibbleOrderSwapped, OneScaleByteOff])
def test_a_failing_case_shrinks_to_one_token_and_the_smallest_shape_and_still_fails(fault, host_arch, host_device):
    inputs = make_inputs(make_case("small", 16), host_device)
    found = shrink(fault(), inputs, host_arch)
    assert found.result.outcome == "FAIL"
    assert (found.case.tokens, found.case.hidden, found.case.intermediate) == (1, 32, 32)
    assert found.case.experts == found.case.top_k == 4
    assert found.steps[0] == "tokens 16 -> 1" and _bytes(found.inputs) < _bytes(inputs) / 40
    again, _ = run_case(fault(), found.case, host_arch, inputs=found.inputs)  # checked from scratch
    assert again.outcome == "FAIL"


def test_a_passing_case_is_not_shrunk(host_arch, host_device):
    with pytest.raises(ValueError, match="does not fail here"):
        shrink(load_spec("mxmoe.kernels.emulation:Emulation").backend, make_inputs(make_case("small", 4), host_device),
               host_arch)  # fmt: skip


def test_a_gpt_oss_20b_failure_shrinks_to_a_reproducer_under_a_megabyte(tmp_path, profile, capsys, host_arch):
    if profile == "pr":
        pytest.skip("nightly profile: gpt-oss-20b's float64 oracle takes minutes on a CPU (the pr profile shrinks "
                    "the small model's failures above)")  # fmt: skip
    loaded = load_spec("mxmoe.harness.instruments.faults:NibbleOrderSwapped")
    case = make_case("gptoss20b", 7)
    result, inputs = run_case(loaded.backend, case, host_arch)
    repro = save_repro(tmp_path / "big", result, inputs, loaded.spec)
    assert main(["shrink", str(repro), "--out", str(tmp_path / "small")]) == 0
    (small,) = (tmp_path / "small" / "repro").glob("*.json")
    info = json.loads(small.read_text())
    size = small.stat().st_size + (small.parent / info["tensors"]).stat().st_size
    assert info["outcome"] == "FAIL" and size < 2**20, size
    assert main(["replay", str(small)]) == 1  # it still fails when replayed
    assert "FAIL" in capsys.readouterr().out
