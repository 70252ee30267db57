"""reference.activation: the w13 row layouts and the gated activations (docs/formats.md).

Expected row orders are written out per layout in plain Python (``_row_labels``); expected
activation values come from brute.activate or from scalar arithmetic in the test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mxmoe.reference import brute
from mxmoe.reference.activation import (
    ACTIVATIONS,
    GPT_OSS_ALPHA,
    GPT_OSS_BETA,
    GPT_OSS_LIMIT,
    LAYOUTS,
    convert_layout,
    gated_activation,
    split_gate_up,
)

PAIRS = list(itertools.product(LAYOUTS, LAYOUTS))


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _row_labels(layout: str, inter: int) -> list[tuple[str, int]]:
    """What each of the 2I rows holds under ``layout``, as docs/formats.md lists them."""
    gate = [("g", j) for j in range(inter)]
    up = [("u", j) for j in range(inter)]
    if layout == "interleaved":
        return [r for j in range(inter) for r in (gate[j], up[j])]
    if layout == "pair_swapped":
        return [r for j in range(inter) for r in (up[j], gate[j])]
    if layout == "chunked_gate_up":
        return gate + up
    assert layout == "chunked_up_gate"
    return up + gate


def _w13(e: int, inter: int, hidden: int, seed: int) -> dict[str, tuple[torch.Tensor, int]]:
    """Packed weights, scales and a bias, each with the dim that holds the 2I rows."""
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks": (torch.randint(0, 256, (e, 2 * inter, hidden // 2), generator=g, dtype=torch.uint8), -2),
        "scales": (torch.randint(0, 256, (e, 2 * inter, hidden // 32), generator=g, dtype=torch.uint8), -2),
        "bias": (torch.randn(e, 2 * inter, generator=g).to(torch.bfloat16), -1),
    }


shapes = dict(
    e=st.integers(1, 4),
    inter=st.sampled_from([32, 64, 96]),
    hidden=st.sampled_from([32, 64, 96]),
    seed=st.integers(0, 2**32 - 1),
)


@given(src=st.sampled_from(LAYOUTS), dst=st.sampled_from(LAYOUTS), **shapes)
def test_convert_layout_moves_rows_where_the_layouts_say(src, dst, e, inter, hidden, seed):
    src_labels, dst_labels = _row_labels(src, inter), _row_labels(dst, inter)
    where = {label: row for row, label in enumerate(src_labels)}
    for name, (t, dim) in _w13(e, inter, hidden, seed).items():
        got = convert_layout(t, src, dst, dim)
        ref = t.index_select(dim, torch.tensor([where[label] for label in dst_labels]))
        assert got.dtype == t.dtype and torch.equal(got, ref), f"{name}: {src} -> {dst}"


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}-to-{b}".replace("_", "") for a, b in PAIRS])
def test_convert_layout_round_trip_is_identity(src, dst):
    for name, (t, dim) in _w13(3, 64, 96, seed=1).items():
        there = convert_layout(t, src, dst, dim)
        back = convert_layout(there, dst, src, dim)
        assert torch.equal(back, t), f"{name}: {src} -> {dst} -> {src}"
        if src != dst:
            assert not torch.equal(there, t), f"{name}: {src} -> {dst} left the rows in place"


@given(
    a=st.sampled_from(LAYOUTS), b=st.sampled_from(LAYOUTS), c=st.sampled_from(LAYOUTS), **shapes
)
def test_convert_layout_composes(a, b, c, e, inter, hidden, seed):
    for name, (t, dim) in _w13(e, inter, hidden, seed).items():
        two_steps = convert_layout(convert_layout(t, a, b, dim), b, c, dim)
        assert torch.equal(two_steps, convert_layout(t, a, c, dim)), f"{name}: {a} -> {b} -> {c}"


def _gemm1_output(t: int, inter: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    """float64 [T, 2I] spread wide enough that swigluoai's clamps at +-7 are hit on both sides."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 2 * inter, generator=g, dtype=torch.float64) * spread


@given(
    src=st.sampled_from(LAYOUTS),
    dst=st.sampled_from(LAYOUTS),
    activation=st.sampled_from(ACTIVATIONS),
    t=st.integers(0, 6),
    inter=st.sampled_from([32, 64, 96]),
    seed=st.integers(0, 2**32 - 1),
)
def test_activation_is_layout_independent_after_conversion(src, dst, activation, t, inter, seed):
    h = _gemm1_output(t, inter, seed)
    got = gated_activation(convert_layout(h, src, dst, -1), activation, dst)
    ref = gated_activation(h, activation, src)
    assert tuple(got.shape) == (t, inter)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}-to-{b}".replace("_", "") for a, b in PAIRS])
def test_activation_is_layout_independent_on_many_values(src, dst, activation):
    # Enough values (8 x 96) that an ulp-level dependence on the layout, e.g. an elementwise op that
    # takes another code path for strided views than for contiguous ones, shows.
    h = _gemm1_output(8, 96, seed=6)
    got = gated_activation(convert_layout(h, src, dst, -1), activation, dst)
    ref = gated_activation(h, activation, src)
    assert torch.equal(got, ref), f"{int((got != ref).sum())} of {ref.numel()} values differ"


@given(
    layout=st.sampled_from(LAYOUTS),
    activation=st.sampled_from(ACTIVATIONS),
    limit=st.sampled_from([GPT_OSS_LIMIT, 3.0, None, 0.0]),
    t=st.integers(0, 6),
    inter=st.sampled_from([32, 64, 96]),
    seed=st.integers(0, 2**32 - 1),
)
def test_activation_matches_brute(layout, activation, limit, t, inter, seed):
    h = _gemm1_output(t, inter, seed)
    got = gated_activation(h, activation, layout, GPT_OSS_ALPHA, GPT_OSS_BETA, limit)
    assert got.dtype == torch.float64 and tuple(got.shape) == (t, inter)
    for row, got_row in zip(h.tolist(), got.tolist()):
        ref_row = brute.activate(row, activation, layout, GPT_OSS_ALPHA, GPT_OSS_BETA, limit)
        for j, (a, b) in enumerate(zip(got_row, ref_row)):
            # torch's and math's exp differ by an ulp or so; nothing here cancels
            assert math.isclose(a, b, rel_tol=1e-14, abs_tol=1e-300), (j, a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_silu_is_silu_of_gate_times_up(layout):
    h = _gemm1_output(5, 64, seed=2)
    labels = _row_labels(layout, 64)

    def pick(which: str) -> torch.Tensor:
        rows = [[v for (kind, _), v in zip(labels, row) if kind == which] for row in h.tolist()]
        return torch.tensor(rows, dtype=torch.float64)

    ref = torch.nn.functional.silu(pick("g")) * pick("u")
    got = gated_activation(h, "silu", layout)
    torch.testing.assert_close(got, ref, rtol=1e-14, atol=0)
    # silu takes no clamp: values far beyond the swiglu limit pass through
    assert got.abs().max() > GPT_OSS_LIMIT * 2


def _one_pair(g: float, u: float, layout: str = "interleaved") -> torch.Tensor:
    gate_first = layout in ("interleaved", "chunked_gate_up")
    return torch.tensor([[g, u] if gate_first else [u, g]], dtype=torch.float64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("limit", [GPT_OSS_LIMIT, 1.0], ids=["limit7", "limit1"])
def test_swigluoai_clamps_before_the_sigmoid(layout, limit):
    def act(g: float, u: float) -> float:
        return gated_activation(_one_pair(g, u, layout), "swigluoai", layout, limit=limit).item()

    def sig(v: float) -> float:
        return _sigmoid(GPT_OSS_ALPHA * v)

    # g above the limit: clamp-first feeds the clamped g to the sigmoid; a "swiglustep" that clamps
    # g * sigmoid(alpha * g) afterwards is a different function (far apart at limit 1).
    g, u = 2.0 * limit, 0.5
    got = act(g, u)
    clamp_first = limit * sig(limit) * (u + GPT_OSS_BETA)
    clamp_after = min(g * sig(g), limit) * (u + GPT_OSS_BETA)
    assert math.isclose(got, clamp_first, rel_tol=1e-14), (got, clamp_first)
    assert abs(got - clamp_after) > (0.1 if limit == 1.0 else 1e-6) * abs(clamp_after)
    assert abs(got - g * sig(g) * (u + GPT_OSS_BETA)) > 0.1 * abs(got)
    # the gate is clamped from above only; the up projection on both sides
    ref_low = -2.0 * limit * sig(-2.0 * limit) * (u + GPT_OSS_BETA)
    assert math.isclose(act(-2.0 * limit, u), ref_low, rel_tol=1e-14)
    for u_far, u_clamped in ((3.0 * limit, limit), (-3.0 * limit, -limit)):
        ref = 0.5 * sig(0.5) * (u_clamped + GPT_OSS_BETA)
        assert math.isclose(act(0.5, u_far), ref, rel_tol=1e-14), (u_far, act(0.5, u_far), ref)


@pytest.mark.parametrize("limit", [None, 0, 0.0])
def test_swigluoai_limit_none_or_zero_means_no_clamp(limit):
    g, u = 10.0, -9.0
    got = gated_activation(_one_pair(g, u), "swigluoai", "interleaved", limit=limit).item()
    assert math.isclose(got, g * _sigmoid(GPT_OSS_ALPHA * g) * (u + GPT_OSS_BETA), rel_tol=1e-15)


def test_swigluoai_alpha_and_beta_are_used():
    g, u = 0.75, 0.5
    got = gated_activation(_one_pair(g, u), "swigluoai", "interleaved", alpha=2.0, beta=0.25).item()
    assert math.isclose(got, g * _sigmoid(2.0 * g) * (u + 0.25), rel_tol=1e-15)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_gate_up(layout):
    h = torch.arange(2 * 64, dtype=torch.float64).reshape(1, -1).repeat(2, 1)
    gate, up = split_gate_up(h, layout)
    labels = _row_labels(layout, 64)
    assert gate[0].tolist() == [float(r) for r, (kind, _) in enumerate(labels) if kind == "g"]
    assert up[0].tolist() == [float(r) for r, (kind, _) in enumerate(labels) if kind == "u"]


def test_inputs_are_not_mutated_and_outputs_are_new():
    h = _gemm1_output(4, 32, seed=3)  # hits both clamps
    keep = h.clone()
    for activation, layout in itertools.product(ACTIVATIONS, LAYOUTS):
        gated_activation(h, activation, layout)
        assert torch.equal(h, keep), (activation, layout)
    for src, dst in PAIRS:
        for name, (t, dim) in _w13(2, 32, 64, seed=4).items():
            before = t.clone()
            out = convert_layout(t, src, dst, dim)
            out.zero_()
            assert torch.equal(t, before), (name, src, dst)


@pytest.mark.parametrize("arg", ["src", "dst"])
def test_unknown_layout_names_the_argument(arg):
    t = torch.zeros(2, 64)
    src, dst = ("blocked", "interleaved") if arg == "src" else ("interleaved", "blocked")
    with pytest.raises(ValueError, match=arg) as err:
        convert_layout(t, src, dst, -1)
    assert all(name in str(err.value) for name in LAYOUTS)


def test_unknown_activation_or_layout_in_gated_activation():
    h = torch.zeros(2, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="activation") as err:
        gated_activation(h, "gelu", "interleaved")
    assert all(name in str(err.value) for name in ACTIVATIONS)
    with pytest.raises(ValueError, match="layout") as err:
        gated_activation(h, "silu", "gate_up")
    assert all(name in str(err.value) for name in LAYOUTS)


def test_odd_row_count_is_rejected():
    with pytest.raises(ValueError, match="even"):
        gated_activation(torch.zeros(2, 63, dtype=torch.float64), "silu", "interleaved")
