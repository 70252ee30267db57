"""Every backend's weight conversion: bit-exact inverse, zero padding, inputs untouched, and the
oracle on the converted weights (under the backend's declared row layout) equal to the oracle on
the canonical ones. Pure torch: these run on any host. Test ids carry every architecture the
backend is declared for, so ``pytest -k gfx942`` selects the conversions of gfx942's backends."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.convert import ROLES
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.run.registry import discover
from mxmoe.kernels import flashinfer_cutlass_mxfp4_bf16 as fcm
from mxmoe.kernels.flashinfer_common import SM90_LAYOUTS

BACKENDS = [item.backend for item in discover() if item.backend.declaration.kind == "backend"]
CASES = [
    make_case("tiny", 7),
    make_case("tiny", 5, layout="chunked_gate_up"),
    make_case("tiny", 5, bias=False),
    make_case("odd", 7),
    make_case("dsmini", 7),
    make_case("tpsmall", 9, tp=4, tp_rank=3),
    make_case("small", 9, ep=4, ep_rank=2),
    make_case("gptoss20b", 1, tp=8, tp_rank=7),
]


def _bid(b) -> str:
    return f"{b.declaration.id}-{'-'.join(b.declaration.archs)}"


@functools.cache
def _inputs(case):
    return make_inputs(case, "cpu")


def _nonzero_units(t: torch.Tensor) -> int:
    """Set bits of a byte tensor, non-zero elements otherwise. Storage steps move bytes, nibbles
    or single bits (FlashInfer 0.6.16 and later repack SM90 weights bit by bit, so a nibble count
    changes there) and add zeros: any of these keeps the count of set bits."""
    if t.dtype in (torch.uint8, torch.float8_e4m3fn):
        u = t.view(torch.uint8)
        return sum(int(((u >> b) & 1).count_nonzero()) for b in range(8))
    return int(t.count_nonzero())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS, ids=_bid)
def test_convert_round_trip_zero_padding_inputs_untouched(backend, case):
    _round_trip(backend, case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("generation", sorted(SM90_LAYOUTS),
                         ids=lambda g: f"{_bid(fcm.FlashInferCutlassMxfp4Bf16)}-layout-{g}")  # fmt: skip
def test_each_flashinfer_sm90_layout_generation_round_trips_with_zero_padding(generation, case, monkeypatch):
    """FlashInfer's CUTLASS adapter stores weights in the layout of the installed release's
    generation; the test above sees only the one installed here (0.6.14's on CI). With 0.7.4
    installed on an H100 it failed 8 cases that this host never ran: every generation, whatever is
    installed."""
    monkeypatch.setattr(fcm, "installed_version", lambda: generation)  # each key is its first release
    _round_trip(fcm.FlashInferCutlassMxfp4Bf16(), case)


def _round_trip(backend, case) -> None:
    """Conversion and back bit for bit, padding zero in the padded and the stored layout, the
    declared layout and alignment, fp32 biases where declared, the caller's inputs untouched."""
    inputs = _inputs(case)
    before = {n: t.clone() for n, t in inputs.tensors().items()}
    conv = backend.convert_weights(inputs)
    d = backend.declaration
    logical = conv.logical()
    assert logical.w13_layout == d.w13_layout
    assert logical.hidden_size % d.hidden_align == 0 and logical.intermediate_size % d.intermediate_align == 0
    assert logical.hidden_size >= case.hidden and logical.intermediate_size >= inputs.weights.intermediate_size
    back = conv.canonical()
    for role in ROLES:
        src = getattr(inputs.weights, role)
        if src is None:
            assert role not in conv.tensors and getattr(back, role) is None
            continue
        got = getattr(back, role)
        assert got.dtype == src.dtype and torch.equal(got, src), f"{role} does not convert back bit for bit"
        # Padding adds only zeros, storage steps only move bits and add zeros: with the bit-exact
        # inverse above, equal counts of non-zero units mean every padded unit is zero.
        n_src = _nonzero_units(src)
        assert _nonzero_units(getattr(logical, role)) == n_src, f"{role}: non-zero padding in the padded layout"
        assert _nonzero_units(conv.tensors[role]) == n_src, f"{role}: non-zero padding in the stored layout"
    if d.bias_dtype == "fp32" and inputs.weights.w13_bias is not None:
        assert conv.tensors["w13_bias"].dtype == torch.float32
    for name, t in inputs.tensors().items():
        assert torch.equal(t, before[name]), f"convert modified the caller's {name}"


def _oracle(inputs, weights, precision):
    return inputs.reference(dataclasses.replace(precision, output=torch.float64), weights=weights)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS, ids=_bid)
def test_oracle_on_converted_weights_equals_canonical(backend, case):
    """Exactly equal, at the backend's declared precision: with bf16 (or MXFP8) GEMM inputs and
    MXFP4 weights of these (normal) cases every product is exact and every float64 sum is exact,
    so the extra zero terms of the padding cannot change a bit; padded hidden outputs are 0."""
    inputs = _inputs(case)
    precision = backend.declaration.arithmetic.precision
    logical = backend.convert_weights(inputs).logical()
    ref = _oracle(inputs, inputs.weights, precision)
    got = _oracle(inputs, logical, precision)
    h = case.hidden
    assert torch.equal(got[:, :h], ref), f"max difference {(got[:, :h] - ref).abs().max():.3e}"
    assert torch.equal(got[:, h:], torch.zeros_like(got[:, h:]))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.declaration.w13_layout != "interleaved"], ids=_bid)
def test_a_layout_declared_wrong_is_caught(backend):
    """The check above can fail: the converted rows read under the checkpoint's layout (a backend
    that declares one layout and converts to another) give a different layer."""
    inputs = _inputs(make_case("tiny", 7))
    precision = backend.declaration.arithmetic.precision
    logical = backend.convert_weights(inputs).logical()
    wrong = dataclasses.replace(logical, w13_layout="interleaved")
    ref = _oracle(inputs, inputs.weights, precision)
    assert not torch.equal(_oracle(inputs, wrong, precision)[:, : inputs.case.hidden], ref)
