"""The systematic-error test: its threshold is the stated false-alarm rate, honest arithmetic stays
under it, and the faults the per-element bound cannot separate from rounding are caught by it,
named where they are. (Zero false alarms over the honest variants, emulation and portable Triton on
every pr case are shown by ``suites/harness/test_mutants.py`` and ``suites/engine/test_differential.py``,
which run with the test on.)"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs
from mxmoe.harness.instruments.faults import RoutingWeightsBf16, _largest_w2_block, busiest_expert
from mxmoe.harness.instruments.honest import HonestFp32, HonestMxfp8
from mxmoe.harness.judge.bounds import clipping_bound, reference_and_bound
from mxmoe.harness.judge.engine import Metrics, Result, judge, run_case
from mxmoe.harness.judge.systematic import ALPHA, systematic_test, threshold
from mxmoe.reference.moe import MoEWeights


def test_threshold_is_the_union_bound_at_the_stated_rate():
    for n in (1, 917, 1_036_808, 20_643_941):
        z = threshold(n)
        assert math.isclose(n * 2 * math.exp(-z * z / 2), ALPHA, rel_tol=1e-9)
    assert threshold(10**6) > threshold(10**3)
    with pytest.raises(ValueError, match="alpha must be in"):
        threshold(10, alpha=0.0)


def test_clipping_is_the_coherent_part_of_mxfp8_only():
    mag = torch.tensor([[1.0] * 31 + [500.0]], dtype=torch.float64)  # one element past 448 x scale
    zero = torch.zeros_like(mag)
    assert torch.equal(clipping_bound("bf16", mag, zero), zero)
    clip = clipping_bound("mxfp8", mag, zero, "floor")
    assert float(clip[0, -1]) > 0 and float(clip[0, :-1].abs().max()) == 0


def test_an_mxfp8_intermediate_rounding_the_oracles_way_leaves_no_error():
    """Block amax 300 (scale 2^0 under FLOOR, E4M3 steps of 2^-9 up to 2^-6, 2^-3 at 1): an element
    whose admissible interval lies in one cell is the oracle's rounded value exactly, error 0; one
    whose interval holds a cell's edge may land a cell away; a block whose amax may cross a power
    of two (its scale uncertain) keeps every element's error."""
    from mxmoe.harness.judge.bounds import _mx_intermediate

    a = torch.tensor([[300.0, 1.0 + 2**-5, 1.0 + 2**-4] + [2.0**-12] * 29,
                      [255.99] + [1.0] * 31], dtype=torch.float64)  # fmt: skip
    e = torch.full_like(a, 2.0**-20)
    e[1] = 0.02  # 255.99 + 0.02 crosses 256: the second block's scale is not certain
    zeros = torch.zeros_like(a)
    rounded, err, sq, lin, coh = _mx_intermediate(a, e, e**2, zeros, zeros, "floor")
    assert float(rounded[0, 1]) == 1.0 and float(rounded[0, 3]) == 0.0  # 1 + 2^-5 rounds down; 2^-12 flushes
    assert float(err[0, 0]) == 0 and float(err[0, 1]) == 0 and float(err[0, 3:].abs().max()) == 0
    assert float(err[0, 2]) > 2**-4 and float(sq[0, 2]) > 0  # on a tie: either neighbour
    assert bool((err[1] > 0).all()) and bool((sq[1] > 0).all())


def test_honest_arithmetic_stays_under_the_threshold(host_arch, host_device):
    case = make_case("small", 33)
    inputs = make_inputs(case, host_device)
    for backend in (HonestFp32(), HonestMxfp8()):
        result, _ = run_case(backend, case, host_arch, inputs=inputs)
        m = result.metrics
        assert result.outcome == "PASS", result.reason
        assert m.systematic_z is not None and m.systematic_z < m.systematic_threshold, m.systematic


@pytest.mark.parametrize("case", [make_case("gptoss20b", 1), make_case("gptoss20b", 1, tp=8, tp_rank=7)], ids=str)
def test_bf16_routing_weights_are_caught_at_gptoss_shape(case, host_arch, host_device):
    """Within the bound on every element, caught by the slot projections alone, and named. A
    detection of one draw (the fault is caught on most gpt-oss cases, not all): the inputs are
    drawn on the CPU on every host, so the same draw is judged on a CPU and on a GPU."""
    inputs = make_inputs(case, host_device, draw_on="cpu")
    result, _ = run_case(RoutingWeightsBf16(), case, host_arch, inputs=inputs)
    m = result.metrics
    assert result.outcome == "FAIL" and m.over_bound == 0, result.reason
    assert result.reason.startswith("systematic: error correlates with expert"), result.reason
    assert m.systematic_z > m.systematic_threshold


class W2ScaleByte(HonestFp32):
    """HonestFp32 with one E8M0 byte of w2 off by ``delta`` at (expert, row, block)."""

    def __init__(self, where: tuple[int, int, int], delta: int) -> None:
        self.where, self.delta = where, delta

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        e, row, blk = self.where
        s = w.w2_scales.clone()
        s[e, row, blk] += self.delta
        return dataclasses.replace(w, w2_scales=s)


def test_a_wrong_scale_byte_is_named_by_its_block(host_arch, host_device):
    case = make_case("small", 64, skew="hot")
    inputs = make_inputs(case, host_device)
    e = busiest_expert(inputs)
    row, blk = _largest_w2_block(inputs.weights, e)
    result, _ = run_case(W2ScaleByte((e, row, blk), -1), case, host_arch, inputs=inputs)
    assert result.outcome == "FAIL"
    assert f"expert {e}'s w2 block (row {row}, block {blk}:" in result.metrics.systematic, result.metrics.systematic
    # the matched filter over the expert's tokens outgrows the element's own ratio
    assert result.metrics.systematic_z / result.metrics.systematic_threshold > result.metrics.worst_ratio


def test_the_verdict_reports_it_apart_from_the_bound():
    case = make_case("tiny", 1)
    result = Result("x", "honest-fp32", "cpu", case, "PASS")
    finding = "error correlates with expert 3's output (token 0, slot 1), z = 12"
    result.metrics = Metrics(
        elements=64, worst_ratio=0.4, systematic_z=12.0, systematic_threshold=6.5, systematic=finding
    )
    judge(HonestFp32(), result)
    assert result.outcome == "FAIL"
    assert result.reason == (
        "systematic: error correlates with expert 3's output (token 0, slot 1), z = 12 "
        "(every element within the bound: worst 0.4x)"
    )


def test_it_does_not_run_where_the_bound_has_no_slot_terms(host_device):
    case = make_case("tiny", 7)
    inputs = make_inputs(case, host_device)
    bounded = reference_and_bound(inputs, HonestFp32.declaration.arithmetic)
    got = bounded.ref.to(torch.bfloat16)
    assert systematic_test(inputs.weights, bounded, got) is not None
    assert systematic_test(inputs.weights, dataclasses.replace(bounded, terms=None), got) is None
    assert systematic_test(inputs.weights, bounded, torch.full_like(got, float("nan"))) is None
