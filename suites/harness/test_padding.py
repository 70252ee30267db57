"""Padding canonical weights to a backend's alignment: reversible, zero-filled, and the padded
layer equals the canonical one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxmoe.harness.contract.inputs import generator_for, random_mxfp4_weights, tie_free_logits
from mxmoe.harness.contract.padding import pad_weights, padded_bytes, round_up, unpad_weights
from mxmoe.reference.activation import LAYOUTS
from mxmoe.reference.moe import moe

NAMES = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias")


def _weights(layout: str, bias: bool = True):
    gen = generator_for(f"padding-{layout}-{bias}")
    return random_mxfp4_weights(gen, 4, 96, 160, bias=bias, w13_layout=layout), gen


def test_round_up():
    assert [round_up(n, 64) for n in (0, 1, 64, 65, 360)] == [0, 64, 64, 128, 384]
    assert round_up(360, 256) == 512  # the ROCm TP8 gpt-oss shard (docs/formats.md)
    with pytest.raises(ValueError, match="multiple"):
        round_up(10, 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_pad_unpad_round_trip_and_zero_fill(layout, bias):
    w, _ = _weights(layout, bias)
    before = {n: getattr(w, n).clone() for n in NAMES if getattr(w, n) is not None}
    p = pad_weights(w, 256, 256)
    assert (p.hidden_size, p.intermediate_size, p.w13_layout) == (256, 256, layout)
    back = unpad_weights(p, 96, 160)
    for name, t in before.items():
        assert torch.equal(getattr(back, name), t), name
        assert torch.equal(getattr(w, name), t), f"{name} was modified"
        # unpad recovers every original value and nothing non-zero was added: the padding is zero
        assert getattr(p, name).count_nonzero() == t.count_nonzero(), name
    assert padded_bytes(p) > padded_bytes(w)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_padded_layer_equals_the_canonical_one(layout, activation):
    w, gen = _weights(layout)
    x = torch.randn(6, 96, generator=gen).to(torch.bfloat16)
    logits = tie_free_logits(gen, 6, 4)
    limit = 7.0 if activation == "swigluoai" else None
    ref = moe(x, logits, w, top_k=2, activation=activation, limit=limit)
    p = pad_weights(w, 128, 192)
    got = moe(torch.nn.functional.pad(x, (0, 32)), logits, p, top_k=2, activation=activation, limit=limit)
    assert torch.equal(got[:, 96:], torch.zeros_like(got[:, 96:])), "padded hidden channels are not zero"
    scale = ref.abs().max()
    assert (got[:, :96] - ref).abs().max() <= 1e-12 * scale


def test_padding_keeps_gate_and_up_apart():
    """Interleaved rows padded per half: reading the padded weights as interleaved still pairs
    gate j with up j (a pad appended at the end of the 2I rows would shift every pair)."""
    w, _ = _weights("interleaved")
    p = pad_weights(w, 96, 192)
    assert torch.equal(p.w13_blocks[:, : 2 * 160], w.w13_blocks)
    assert p.w13_blocks[:, 2 * 160 :].count_nonzero() == 0


@pytest.mark.parametrize(
    ("hidden", "intermediate", "match"),
    [(64, 160, "hidden must be"), (100, 160, "hidden must be"), (96, 150, "intermediate must be")],
)
def test_bad_targets_name_the_argument(hidden, intermediate, match):
    w, _ = _weights("interleaved")
    with pytest.raises(ValueError, match=match):
        pad_weights(w, hidden, intermediate)


def test_unpad_to_larger_is_an_error():
    w, _ = _weights("interleaved")
    with pytest.raises(ValueError, match="cannot unpad"):
        unpad_weights(dataclasses.replace(w), 128, 160)
