"""The bias hypotheses and the energy test: sub-bound bias faults are named by the bias
projections, an undeclared rounding point shows in the error's energy (reported as an effective
precision), the declared arithmetic stays under both at the stated false-alarm rate, and a bf16
combine that is declared is judged by its own arithmetic. (The honest variants, emulation and
portable Triton run both tests on every pr case in ``suites/engine`` and ``suites/harness``.)"""

from __future__ import annotations

import math

import pytest
import torch

from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.instruments.faults import CombineBf16, busiest_expert
from mxmoe.harness.instruments.honest import HonestBf16Combine, HonestFp32, Oracle
from mxmoe.harness.judge.bounds import reference_and_bound
from mxmoe.harness.judge.engine import run_case
from mxmoe.harness.judge.systematic import _bias_directions, energy_test, systematic_test


@pytest.mark.parametrize("family", ["bias2", "bias13"])
def test_a_bias_fault_below_the_bound_is_named_by_its_bias_projection(family, host_device):
    """One expert's output moved along its bias direction (b2, or b13 through the activation's
    derivative) by a quarter of the smallest bound it touches: no element leaves the bound, and
    the projection on that expert's bias finds it and names it."""
    case = make_case("small", 256, skew="hot")
    inputs = make_inputs(case, host_device)
    bounded = reference_and_bound(inputs, HonestFp32.declaration.arithmetic)
    terms = bounded.terms
    e = busiest_expert(inputs)
    v = _bias_directions(inputs.weights, terms, bounded.ref.device)[family].double()
    mine = (terms.ids == e).unsqueeze(-1)
    shift = torch.where(mine, v, torch.zeros_like(v)).sum(1)  # [T, H]
    touched = shift != 0
    scale = 0.25 * float((bounded.bound[touched] / shift[touched].abs()).min())
    got = (bounded.ref + scale * shift).to(torch.bfloat16)
    assert float(((got.double() - bounded.ref).abs() / bounded.bound).max()) < 1
    found = systematic_test(inputs.weights, bounded, got)
    assert found.fired and found.family == family, found.finding()
    assert found.where.startswith(f"expert {e}'s w"), found.where
    honest = systematic_test(inputs.weights, bounded, bounded.ref.to(torch.bfloat16))
    assert not honest.fired, honest.finding()


def test_energy_of_honest_rounding_is_its_prediction_and_stays_under_the_threshold(host_arch, host_device):
    """The oracle rounded once to bf16 is exactly the uniform-rounding model: its energy is the
    prediction to within a few percent (effective precision 8 bits of bf16's 8); honest kernels
    stay under the threshold."""
    case = make_case("small", 256)
    inputs = make_inputs(case, host_device)
    result, _ = run_case(Oracle(), case, host_arch, inputs=inputs)
    m = result.metrics
    assert result.outcome == "PASS" and 0.9 < m.energy_ratio < 1.05 < m.energy_threshold, m.energy
    assert abs(m.effective_bits - 8) < 0.1
    for backend in (HonestFp32(), HonestBf16Combine()):
        result, _ = run_case(backend, case, host_arch, inputs=inputs)
        assert result.outcome == "PASS" and result.metrics.energy_ratio < result.metrics.energy_threshold, (
            result.metrics.energy
        )


def test_an_undeclared_bf16_combine_shows_in_the_energy_alone(host_arch, host_device):
    """The same arithmetic as ``honest-bf16-combine``, declared fp32: every element within the
    bound, no projection fires, the energy test does and reports the precision lost; declared,
    it passes."""
    case = make_case("small", 1024, inputs="trained")
    inputs = make_inputs(case, host_device)
    result, _ = run_case(CombineBf16(), case, host_arch, inputs=inputs)
    m = result.metrics
    assert result.outcome == "FAIL" and m.energy_fired and not m.systematic_fired, result.reason
    assert "energy: error energy exceeds the declared arithmetic's" in result.reason
    assert m.effective_bits < 7.8
    declared, _ = run_case(HonestBf16Combine(), case, host_arch, inputs=inputs)
    assert declared.outcome == "PASS", declared.reason


def test_the_energy_threshold_is_the_quadratic_form_tail_at_the_stated_rate(host_device):
    """With the error exactly at the threshold's energy, the test is at its edge; an output with
    no error has ratio 0 and infinite effective precision."""
    case = make_case("tiny", 33)
    inputs = make_inputs(case, host_device)
    bounded = reference_and_bound(inputs, HonestFp32.declaration.arithmetic)
    exact = energy_test(inputs.weights, bounded, bounded.ref.to(torch.float64))
    assert exact.ratio == 0 and math.isinf(exact.effective_bits) and not exact.fired
    trace = float(bounded.terms.variance.sum()) / 3
    direction = torch.ones_like(bounded.ref) / math.sqrt(bounded.ref.numel())
    for factor, fired in ((0.99, False), (1.01, True)):
        got = bounded.ref + direction * math.sqrt(factor * exact.threshold * trace)
        assert energy_test(inputs.weights, bounded, got).fired is fired
