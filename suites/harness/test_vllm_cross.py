"""``harness.audits.vllm_cross``: the same case through "vLLM's layer" and through "the direct
adapter", each side one of the project's own instruments under the ids the command pairs
(``vllm-x`` and ``x``), so that each verdict is shown on a side whose fault is known: identical,
rounding (naming the side farther from the oracle), vllm, adapter, both, not compared; and the
command's refusal of a backend it cannot pair."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxmoe.harness.audits.vllm_cross import BLAMING, PREFIX, CrossRow, cross, pairs
from mxmoe.harness.contract.backend import BackendUnavailable
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.instruments.honest import HonestBf16Gemm, HonestFp32

HOST = host_arch()
OTHER = "gfx950" if HOST != "gfx950" else "sm90"
"""An architecture this host is not (a side declared only for it does not run here)."""
CASE = make_case("tiny", 7)


def side(cls: type, ident: str, **changes: object):
    """An instance of ``cls`` declared as ``ident`` (``changes`` replace declaration fields)."""
    declaration = dataclasses.replace(cls.declaration, id=ident, **changes)
    return type(f"{cls.__name__}As{ident.title().replace('-', '')}", (cls,), {"declaration": declaration})()


class Negated(HonestFp32):
    """Every nonzero element of the output has the wrong sign: far beyond any bound."""

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        out.neg_()


class Doubled(HonestFp32):
    """The output twice what it should be (a scale applied twice)."""

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        out.mul_(2)


class DeclinesInConvert(HonestFp32):
    """Declines the case once it sees it (vLLM's oracle choosing another backend)."""

    def convert(self, inputs):
        raise BackendUnavailable("vLLM selects MARLIN here")


class SecondRunDiffers(HonestFp32):
    """The first run is honest; the second differs in one element by one bf16 ulp (declared
    deterministic, so the engine fails it)."""

    calls = 0

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        self.calls += 1
        if self.calls % 2 == 0:
            out.view(torch.int16)[0, 0] += 1


def test_the_same_honest_backend_on_both_sides_is_identical():
    row = cross(side(HonestFp32, "vllm-x"), side(HonestFp32, "x"), CASE)
    assert isinstance(row, CrossRow)
    assert (row.case, row.vllm, row.adapter) == (CASE.id, "vllm-x", "x")
    assert (row.vllm_outcome, row.adapter_outcome, row.differing, row.verdict) == ("PASS", "PASS", 0, "identical")
    assert row.vllm_worst == row.adapter_worst and 0 < row.vllm_worst <= 1
    assert row.verdict not in BLAMING
    assert row.to_dict()["verdict"] == "identical"


@pytest.mark.parametrize(
    "vllm_cls, adapter_cls, verdict, outcomes",
    [
        (Negated, HonestFp32, "vllm", ("FAIL", "PASS")),
        (HonestFp32, Negated, "adapter", ("PASS", "FAIL")),
        (Negated, Doubled, "both", ("FAIL", "FAIL")),
        (Doubled, Doubled, "both", ("FAIL", "FAIL")),
    ],
    ids=["vllm", "adapter", "both", "both-identical"],
)
def test_the_side_beyond_the_bound_is_the_one_blamed(vllm_cls, adapter_cls, verdict, outcomes):
    row = cross(side(vllm_cls, "vllm-x"), side(adapter_cls, "x"), CASE)
    assert (row.verdict, (row.vllm_outcome, row.adapter_outcome)) == (verdict, outcomes), row.detail
    assert row.verdict in BLAMING
    if verdict == "vllm":
        assert row.detail.startswith("vLLM's conversion or call: ") and "exceed the error bound" in row.detail
        assert f"the adapter passes, worst {row.adapter_worst:.3g}x" in row.detail
    elif verdict == "adapter":
        assert row.detail.startswith("the adapter's conversion or call: ") and "exceed the error bound" in row.detail
        assert f"vLLM's layer passes, worst {row.vllm_worst:.3g}x" in row.detail
    if vllm_cls is adapter_cls:
        assert row.differing == 0 and row.detail.startswith("identical outputs, both FAIL")
    else:
        assert row.differing > 0


@pytest.mark.parametrize("bf16_side", ["vllm", "adapter"])
def test_both_within_the_bound_but_different_is_rounding_naming_the_side_farther_from_the_oracle(bf16_side):
    """bf16 GEMMs (HonestBf16Gemm) and float32 GEMMs (HonestFp32) are both honest and declared;
    their outputs differ in rounding. Each way round, the row names the side with the larger
    worst error/bound."""
    bf16, fp32 = side(HonestBf16Gemm, "x"), side(HonestFp32, "x")
    vllm, adapter = (bf16, fp32) if bf16_side == "vllm" else (fp32, bf16)
    vllm.declaration = dataclasses.replace(vllm.declaration, id="vllm-x")
    row = cross(vllm, adapter, CASE)
    assert (row.vllm_outcome, row.adapter_outcome, row.verdict) == ("PASS", "PASS", "rounding"), row.detail
    assert row.differing > 0 and row.verdict not in BLAMING
    assert row.vllm_worst != row.adapter_worst
    farther = "vLLM's layer" if row.vllm_worst > row.adapter_worst else "the adapter"
    nearer = "the adapter" if farther == "vLLM's layer" else "vLLM's layer"
    assert f"{farther} is farther from the oracle" in row.detail, row.detail
    assert f"{nearer} is farther" not in row.detail
    assert f"{row.differing} elements differ in rounding" in row.detail


def test_a_side_that_does_not_run_the_case_is_not_compared_with_the_reason():
    skipped = cross(side(HonestFp32, "vllm-x", archs=(OTHER,)), side(HonestFp32, "x"), CASE, HOST)
    assert (skipped.verdict, skipped.vllm_outcome, skipped.adapter_outcome) == ("not compared", "SKIP", "PASS")
    assert skipped.differing is None
    assert skipped.detail == f"vllm-x SKIP: vllm-x does not run on {HOST} (declared: {OTHER})"
    declined = cross(side(HonestFp32, "vllm-x"), side(DeclinesInConvert, "x"), CASE, HOST)
    assert (declined.verdict, declined.adapter_outcome, declined.differing) == ("not compared", "SKIP", None)
    assert declined.detail == "x SKIP: x cannot run this case: vLLM selects MARLIN here"
    assert declined.verdict not in BLAMING


def test_identical_outputs_where_only_one_side_fails_blame_that_side():
    row = cross(side(HonestFp32, "vllm-x"), side(SecondRunDiffers, "x"), CASE)
    assert (row.vllm_outcome, row.adapter_outcome, row.differing) == ("PASS", "FAIL", 0)
    assert row.verdict == "adapter", row.detail


def test_a_side_that_did_not_run_has_no_worst_ratio():
    row = cross(side(HonestFp32, "vllm-x", archs=(OTHER,)), side(HonestFp32, "x"), CASE, HOST)
    assert row.vllm_worst is None


def test_pairs_match_each_vllm_driver_with_its_adapter_only():
    backends = [side(HonestFp32, i) for i in ("vllm-a", "a", "b", "vllm-c", "vllm-b", "vllm-a-b", "xvllm-b")]
    got = [(v.declaration.id, a.declaration.id) for v, a in pairs(backends)]
    assert got == [("vllm-a", "a"), ("vllm-b", "b")]
    assert PREFIX == "vllm-"
    assert pairs([side(HonestFp32, "vllm-a")]) == [] and pairs([]) == []


def test_the_command_refuses_a_backend_without_a_vllm_driver_listing_those_it_accepts(capsys):
    from mxmoe.harness.cli.app import main

    with pytest.raises(SystemExit) as exited:
        main(["vllm-cross", "--backend", "nonexistent"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    err = err.strip().splitlines()[-1]
    assert "--backend: one of " in err and "got ['nonexistent']" in err, err
    accepted = err.split("--backend: one of ", 1)[1].split(" (a backend with a vLLM driver)")[0].split(", ")
    assert "triton" in accepted and "triton-unfused" in accepted, accepted
    assert not any(a.startswith(PREFIX) for a in accepted), accepted
