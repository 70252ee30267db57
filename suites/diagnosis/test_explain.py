"""Diagnosis names the planted cause: each catalogue fault, run as the kernel under test, is
explained by itself (and, on this case, by nothing else but its one look-alike), a fault outside
the catalogue by none, and ``diagnose`` does it from a reproducer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mxmoe.harness.cli.app import main
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.diagnosis.explain import explain, summarize
from mxmoe.harness.instruments.faults import MUTANTS
from mxmoe.harness.judge.engine import poisoned, run_case
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.results import Recorder, save_repro

CASE = make_case("small", 16)
BY_SLUG = {cls.slug: cls for cls in MUTANTS}
ALIKE = {"gate-up-swapped": {"pair-swapped"}, "pair-swapped": {"gate-up-swapped"}}
"""Faults with the same output on this case (gate and up swapped, globally or within each pair,
give one matrix of rows up to order: the layer cannot tell them apart)."""
NAMED = ("interleaved-as-chunked", "gate-up-swapped", "pair-swapped", "nibble-order", "scales-wrong-axis",
         "e8m0-bias-128", "one-scale-byte", "expert-skipped", "not-renormalized", "weight-twice", "weight-on-input",
         "weights-misassigned", "missing-plus-one", "no-clamp", "clamp-wrong-side", "alpha-one", "b13-dropped",
         "b2-dropped", "b2-dropped-one-expert", "intermediate-mxfp8")  # fmt: skip
PR = NAMED[::2] + ("nibble-order", "e8m0-bias-128")
"""The pr profile's share (12 of the 20, every kind of fault); nightly checks all 20."""


def _output(backend: object, inputs: object) -> object:
    out = poisoned((CASE.tokens, CASE.hidden), backend.declaration.arithmetic.precision.output, inputs.x.device)
    backend.run(backend.convert(inputs), inputs, out)
    return out


@pytest.mark.parametrize("slug", NAMED)
def test_the_planted_fault_is_named_and_only_it(slug, profile, host_arch, host_device):
    if profile == "pr" and slug not in PR:
        pytest.skip("checked in the nightly profile (the pr profile diagnoses 12 of these 20 faults)")
    fault = BY_SLUG[slug]()
    result, _ = run_case(fault, CASE, host_arch)
    assert result.outcome == "FAIL"  # the check fails first; the diagnosis says why
    inputs = make_inputs(CASE, host_device)
    found = explain(inputs, _output(fault, inputs), fault.declaration.arithmetic)
    named = {c.slug for c in found.explained_by}
    assert named == {slug} | ALIKE.get(slug, set()), found.summary()
    assert found.summary().startswith("explained by: ")
    assert found.tokens and found.blocks  # where the error concentrates


def test_a_fault_outside_the_catalogue_is_not_explained_and_says_the_nearest(host_device):
    wrong = load_spec(f"{Path(__file__).parents[1] / 'harness' / 'faulty_backends.py'}:WrongSignFp32").backend
    inputs = make_inputs(CASE, host_device)
    found = explain(inputs, _output(wrong, inputs), wrong.declaration.arithmetic)
    assert found.explained_by == ()
    assert found.summary().startswith("no catalogue fault explains it; the nearest: ")


def test_diagnose_reads_a_reproducer(tmp_path, capsys, host_arch):
    loaded = load_spec("mxmoe.harness.instruments.faults:NibbleOrderSwapped")
    result, inputs = run_case(loaded.backend, CASE, host_arch)
    repro = save_repro(tmp_path, result, inputs, loaded.spec)
    Recorder(tmp_path).record(result, loaded, repro)
    assert main(["diagnose", str(repro)]) == 0
    out = capsys.readouterr().out
    assert "explained by: nibble-order" in out and "the first: FP4 nibbles unpacked high nibble first" in out


def test_a_failure_carries_its_diagnosis_to_the_message_the_record_the_reproducer_and_the_report(tmp_path, host_arch):
    import json

    from mxmoe.harness.judge.engine import failure_message
    from mxmoe.reports.build import build
    from mxmoe.reports.collect import collect
    from mxmoe.reports.policy import load_policy

    loaded = load_spec("mxmoe.harness.instruments.faults:NibbleOrderSwapped")
    result, inputs = run_case(loaded.backend, CASE, host_arch, diagnose=summarize)
    assert result.outcome == "FAIL" and result.diagnosis.startswith("explained by: nibble-order")
    assert f"Diagnosis: {result.diagnosis}" in failure_message(result)
    plain, _ = run_case(loaded.backend, CASE, host_arch)
    assert plain.diagnosis == ""  # only asked for (the catalogue plants its causes)
    repro = save_repro(tmp_path, result, inputs, loaded.spec)
    Recorder(tmp_path).record(result, loaded, repro)
    assert json.loads(repro.read_text())["diagnosis"] == result.diagnosis
    (failure,) = build(collect([tmp_path]), load_policy())["failures"]
    assert failure["diagnosis"] == result.diagnosis


class Bf16Combine(load_spec("mxmoe.harness.instruments.honest:HonestFp32").backend.__class__):
    """HonestFp32 whose top-k combine accumulates in bf16 where fp32 is declared."""

    combine = torch.bfloat16


def test_a_fault_with_no_effect_on_the_case_is_never_named(host_arch):
    """A bf16 combine on a Renormalize case without correction bias or expert map: the catalogue's
    hard-coded Renormalize, bias-in-weights and ignored expert map change nothing there (their output
    is the honest layer's), so they explain nothing, whatever the kernel did."""
    case = make_case("small", 64)
    result, _ = run_case(Bf16Combine(), case, host_arch, diagnose=summarize)
    assert result.outcome == "FAIL", result.reason
    for no_op in ("routing-hardcoded", "bias-in-weights", "expert-map-ignored"):
        assert no_op not in result.diagnosis, result.diagnosis
