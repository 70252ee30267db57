"""The error bound: never exceeded by an honest kernel, tight enough to matter, and small enough to
catch a single E8M0 scale byte off by one.

(a) every honest variant passes every pr case that runs on the CPU; (b) the worst error/bound
ratio of the honest variants is at least 0.25 (a bound 100x too loose would pass everything);
(c) an honest kernel with ONE scale byte of w2 off by one, in the block that matters most, FAILs;
(d) the oracle itself, run as a backend, never exceeds the bound.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from case_strategies import cached_inputs

from mxmoe.harness.contract.backend import Arithmetic, Backend, Declaration
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.harness.instruments.honest import HONEST, HonestFp32
from mxmoe.harness.instruments.torch_moe import Prepared
from mxmoe.harness.judge.bounds import reference_and_bound
from mxmoe.harness.judge.engine import compare, run_case
from mxmoe.harness.run.profiles import SMALL_MODELS, profile_cases
from mxmoe.kernels.emulation import Emulation
from mxmoe.reference.moe import Precision
from mxmoe.reference.mxfp4 import BLOCK, dequantize_mxfp4
from mxmoe.reference.routing import route

VARIANTS = (*HONEST, Emulation)
PR = profile_cases("pr")
HEAVY = "gptoss20b-interleaved-t1"
"""The one pr case whose convert (float64 dequantization of 32 full gpt-oss experts) costs ~20 s on
a CPU: in the pr profile it runs for honest-fp32 here (and for emulation in test_differential)."""


SMALL = [c for c in PR if c.model in SMALL_MODELS]
PRODUCTION = [c for c in PR if c.model not in SMALL_MODELS]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.declaration.id for v in VARIANTS])
def test_honest_variant_never_fails_and_the_bound_is_tight(variant, host_arch):
    """(a) and (b) over the pr profile's CI-size cases. Tightness is asserted per variant (stronger
    than over all of them): each variant gets within 4x of the bound somewhere."""
    ratios = {}
    for c in SMALL:
        result, _ = run_case(variant(), c, host_arch, inputs=cached_inputs(c))
        assert result.outcome == "PASS", f"{result.test_id}: {result.outcome} {result.reason}"
        ratios[c.id] = result.metrics.worst_ratio
    case_id = max(ratios, key=ratios.get)
    print(f"worst error/bound {variant.declaration.id}: {ratios[case_id]:.3f} ({case_id})")
    assert ratios[case_id] >= 0.25, ratios


@pytest.mark.parametrize(
    "variant, case",
    [pytest.param(v, c, id=f"{v.declaration.id}-{c.id}") for v in VARIANTS for c in PRODUCTION],
)
def test_honest_variant_never_fails_at_production_shape(variant, case, profile, host_arch):
    if case.id == HEAVY and variant is not HonestFp32 and profile == "pr":
        pytest.skip(f"{HEAVY} converts 32 full experts (~20 s on a CPU): honest-fp32 only, all under --profile nightly")
    result, _ = run_case(variant(), case, host_arch, inputs=cached_inputs(case))
    assert result.outcome == "PASS", f"{result.test_id}: {result.outcome} {result.reason}"
    print(f"worst error/bound {result.test_id}: {result.metrics.worst_ratio:.3f}")


# -- (c) one E8M0 byte off by one ------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _honest_prepared(case_id: str, inputs: CaseInputs) -> Prepared:
    return HonestFp32().convert(inputs)


class ScaleByteOff(HonestFp32):
    """HonestFp32, except that w2's scale byte at (expert, row, block) is off by ``delta``."""

    def __init__(self, expert: int, row: int, block: int, delta: int) -> None:
        self.where = (expert, row, block, delta)
        self.declaration = dataclasses.replace(HonestFp32.declaration, id=f"scale{'plus' if delta > 0 else 'minus'}")

    def convert(self, inputs: CaseInputs) -> Prepared:
        e, row, blk, delta = self.where
        w = inputs.weights
        scales = w.w2_scales[e].clone()
        scales[row, blk] = int(scales[row, blk]) + delta
        honest = _honest_prepared(inputs.case.id, inputs)
        w2 = honest.w2.clone()
        d = dequantize_mxfp4(w.w2_blocks[e], scales).to(w2.dtype)
        w2[e, : d.shape[0], : d.shape[1]] = d  # the rest is the backend's zero padding
        return dataclasses.replace(honest, w2=w2)


def _expert_weight(inputs: CaseInputs) -> torch.Tensor:
    """Total routing weight each local expert receives."""
    c = inputs.case
    r = route(inputs.router_logits, c.top_k, c.routing, **inputs.routing_kwargs)
    ids = r.ids if inputs.expert_map is None else inputs.expert_map.long()[r.ids]
    total = torch.zeros(inputs.weights.num_experts, dtype=torch.float64, device=ids.device)
    keep = ids >= 0
    return total.index_add_(0, ids[keep], r.weights[keep].abs())


def _largest_block(inputs: CaseInputs, e: int) -> tuple[int, int]:
    """(row, block) of expert ``e``'s w2 with the largest sum of |dequantized values|."""
    w2 = dequantize_mxfp4(inputs.weights.w2_blocks[e], inputs.weights.w2_scales[e])
    mags = w2.abs().reshape(w2.shape[0], -1, BLOCK).sum(-1)
    return divmod(int(mags.argmax()), mags.shape[1])


_DETECT = [c for c in PR if c.tokens > 0 and c.inputs == "normal"]


@pytest.mark.parametrize("delta", [1, -1], ids=["plus1", "minus1"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id)
        for c in _DETECT
    ],
)
def test_one_scale_byte_off_by_one_fails(case, delta, profile, host_arch):
    inputs = cached_inputs(case)
    e = int(_expert_weight(inputs).argmax())
    row, blk = _largest_block(inputs, e)
    result, _ = run_case(ScaleByteOff(e, row, blk, delta), case, host_arch, inputs=inputs)
    assert result.outcome == "FAIL", f"{case.id} expert {e} w2[{row}, block {blk}] {delta:+d}: {result.reason}"


def test_dsv3_scale_byte_minus_one_at_t7_is_caught_by_the_systematic_test(profile):
    """The bound's measured limit (0.77x at DeepSeek-V3, T=7, one byte -1 on the busiest expert's
    largest w2 block) is caught by the block projections and named (H200: z = 33 over a threshold
    of 7.9). DeepSeek-V3's weights dequantized take ~45 GB: nightly, on a GPU."""
    if profile == "pr":
        pytest.skip("DeepSeek-V3 weights dequantized take ~45 GB: under --profile nightly, on a GPU")
    if not torch.cuda.is_available():
        pytest.skip("DeepSeek-V3 weights dequantized take ~45 GB: needs a GPU")
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.contract.inputs import make_inputs
    from mxmoe.harness.contract.platforms import device_for, host_arch

    case = make_case("dsv3", 7)
    inputs = make_inputs(case, device_for(host_arch()))
    e = int(_expert_weight(inputs).argmax())
    row, blk = _largest_block(inputs, e)
    result, _ = run_case(ScaleByteOff(e, row, blk, -1), case, host_arch(), inputs=inputs)
    m = result.metrics
    print(f"{case.id} expert {e} w2[{row}, block {blk}] -1: worst {m.worst_ratio:.3g}x, z {m.systematic_z:.3g}")
    assert result.outcome == "FAIL" and result.reason.startswith("systematic:"), result.reason
    assert f"expert {e}'s w2 block (row {row}, block {blk}:" in m.systematic


def test_scale_byte_catch_rate_over_every_expert(profile):
    """Measured, not asserted: every local expert that receives a token, its largest w2 block,
    byte +1 and -1, over normal and wide inputs (~600 runs: under --profile nightly only)."""
    if profile == "pr":
        pytest.skip("a measurement (~600 mutant runs), printed under --profile nightly")
    caught, misses = 0, []
    for c in PR:
        if c.tokens == 0 or c.id == HEAVY:  # HEAVY: covered by test_one_scale_byte_off_by_one_fails
            continue
        inputs = cached_inputs(c)
        bounded = reference_and_bound(inputs, HonestFp32.declaration.arithmetic)
        for e in torch.nonzero(_expert_weight(inputs) > 0).flatten().tolist():
            row, blk = _largest_block(inputs, e)
            for delta in (1, -1):
                b = ScaleByteOff(e, row, blk, delta)
                out = torch.full((c.tokens, c.hidden), float("nan"), dtype=torch.bfloat16, device=inputs.x.device)
                b.run(b.convert(inputs), inputs, out)
                m = compare(out, bounded.ref, bounded.bound, torch.isnan(out))
                if m.over_bound or m.nonfinite:
                    caught += 1
                else:
                    misses.append(f"{c.id} expert {e} {delta:+d}: worst {m.worst_ratio:.3f}")
    total = caught + len(misses)
    print(f"one w2 scale byte +-1 (largest block, every routed expert): caught {caught} / {total}")
    for miss in misses:
        print("  missed", miss)


# -- (d) the oracle as a backend -------------------------------------------------------------------


class Oracle(Backend):
    """reference.moe.moe at float64, rounded once to the declared output dtype."""

    declaration = Declaration(
        id="oracle-bf16",
        archs=ARCHS,
        description="the exact layer rounded once to bf16",
        arithmetic=Arithmetic(precision=Precision(output=torch.bfloat16), accumulate="fp64"),
        kind="instrument",
    )

    def convert(self, inputs: CaseInputs) -> None:
        return None

    def run(self, prepared: None, inputs: CaseInputs, out: torch.Tensor) -> None:
        got = inputs.reference(Precision(output=out.dtype))
        out.copy_(got)


class OracleFp32(Oracle):
    declaration = dataclasses.replace(
        Oracle.declaration,
        id="oracle-fp32",
        arithmetic=Arithmetic(precision=Precision(output=torch.float32), accumulate="fp64"),
    )


@pytest.mark.parametrize("backend", [Oracle, OracleFp32], ids=["bf16", "fp32"])
def test_oracle_as_a_backend_is_within_the_bound(backend, host_arch):
    worst = 0.0
    for c in SMALL:
        result, _ = run_case(backend(), c, host_arch, inputs=cached_inputs(c))
        assert result.outcome == "PASS", f"{result.test_id}: {result.reason}"
        worst = max(worst, result.metrics.worst_ratio)
    print(f"{backend.declaration.id}: worst error/bound {worst:.3f}")


@pytest.mark.parametrize("case", PRODUCTION, ids=[c.id for c in PRODUCTION])
def test_oracle_as_a_backend_is_within_the_bound_at_production_shape(case, host_arch):
    for backend in (Oracle, OracleFp32):
        result, _ = run_case(backend(), case, host_arch, inputs=cached_inputs(case))
        assert result.outcome == "PASS", f"{result.test_id}: {result.reason}"


# -- a hole in the bound ---------------------------------------------------------------------------


class Bf16WeightsFp32Out(HonestFp32):
    """Honest: fp32 everywhere but the routing weights, rounded to bf16 as declared; fp32 output,
    so that nothing else hides the routing weights' rounding."""

    declaration = dataclasses.replace(
        HonestFp32.declaration,
        id="honest-bf16weights-fp32out",
        arithmetic=Arithmetic(precision=Precision(routing_weights="bf16", output=torch.float32)),
    )


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id) for c in PR if c.id in ("tiny-interleaved-t7", "tiny-interleaved-default-t8")]
    + [pytest.param(c, id=c.id) for c in PR if c.routing == "Llama4"],  # once a bound hole: fixed
)
def test_declared_routing_weight_rounding_is_in_the_bound(case, host_arch):
    result, _ = run_case(Bf16WeightsFp32Out(), case, host_arch, inputs=cached_inputs(case))
    assert result.outcome == "PASS", f"{result.test_id}: {result.reason}"
