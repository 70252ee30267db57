"""reference.routing against brute.route_token, the plain per-token restatement of docs/formats.md.

Hypothesis draws the structure (tokens, E, top_k, method, groups, whether there is a correction
bias, a scaling factor, a seed); the logits come from a generator seeded with the drawn seed.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from mxmoe.reference import brute
from mxmoe.reference.routing import ROUTING_METHODS, has_boundary_ties, route, topk_margin

BIASED = ("DeepSeekV3", "MiniMax2")
ON_SIGMOID = ("Sigmoid", "SigmoidRenorm", "DeepSeekV3", "MiniMax2")
REL = 1e-12


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _logits(t: int, e: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Distinct logits per row: a random permutation of a grid of step 0.5, plus jitter below the
    step, so no two experts of a token are closer than ~0.2 (well clear of any rounding)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]) if t else torch.empty(0, e)
    jitter = torch.rand(t, e, generator=g, dtype=torch.float64) * 0.3
    return ((grid.to(torch.float64) - e / 2) * 0.5 + jitter).to(dtype)


def _plain_margin(
    row: list[float],
    k: int,
    method: str,
    bias: list[float] | None,
    n_group: int | None,
    topk_group: int | None,
) -> float:
    """The gap at the selection boundary, in plain Python (the documented convention: selection on
    the logits, or on sigmoid + bias for the biased methods; for groups also the group gap)."""
    n = len(row)
    if method in BIASED:
        b = bias or [0.0] * n
        scores = [_sigmoid(v) + c for v, c in zip(row, b)]
    else:
        scores = list(row)
    margin = math.inf
    allowed = list(range(n))
    if n_group is not None:
        size = n // n_group
        gs = [sum(sorted(scores[i * size : (i + 1) * size], reverse=True)[:2]) for i in range(n_group)]
        order = sorted(range(n_group), key=lambda i: (-gs[i], i))
        if topk_group < n_group:
            margin = gs[order[topk_group - 1]] - gs[order[topk_group]]
        kept = set(order[:topk_group])
        allowed = [e for e in range(n) if e // size in kept]
    ordered = sorted((scores[e] for e in allowed), reverse=True)
    if k < len(ordered):
        margin = min(margin, ordered[k - 1] - ordered[k])
    return margin


@st.composite
def routing_cases(draw: st.DrawFn, methods: tuple[str, ...] = ROUTING_METHODS) -> dict:
    method = draw(st.sampled_from(methods))
    t = draw(st.integers(0, 8))
    kw: dict = {}
    if method == "DeepSeekV3" and draw(st.booleans()):
        n_group = draw(st.integers(1, 4))
        size = draw(st.integers(2, 4))
        e = n_group * size
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, topk_group * size))
        kw.update(n_group=n_group, topk_group=topk_group)
    else:
        e = draw(st.integers(1, 16))
        top_k = 1 if method == "Llama4" else draw(st.integers(1, e))
    if method in BIASED:
        if draw(st.booleans()):
            kw["correction_bias"] = "random"
        kw["routed_scaling_factor"] = draw(st.sampled_from([1.0, 2.5, 0.75]))
    return dict(method=method, t=t, e=e, top_k=top_k, seed=draw(st.integers(0, 2**32 - 1)), kw=kw)


def _materialize(case: dict, device: str = "cpu") -> tuple[torch.Tensor, dict]:
    logits = _logits(case["t"], case["e"], case["seed"])
    kw = dict(case["kw"])
    if kw.get("correction_bias") == "random":
        g = torch.Generator().manual_seed(case["seed"] + 1)
        kw["correction_bias"] = torch.rand(case["e"], generator=g, dtype=torch.float64) * 0.2
    if "correction_bias" in kw:
        kw["correction_bias"] = kw["correction_bias"].to(device)
    return logits.to(device), kw


def _brute_rows(logits: torch.Tensor, top_k: int, method: str, kw: dict) -> list[list[tuple[int, float]]]:
    bias = kw.get("correction_bias")
    return [
        brute.route_token(
            row,
            top_k,
            method,
            None if bias is None else bias.cpu().tolist(),
            kw.get("n_group"),
            kw.get("topk_group"),
            kw.get("routed_scaling_factor", 1.0),
        )
        for row in logits.cpu().tolist()
    ]


def _assert_matches_brute(logits: torch.Tensor, top_k: int, method: str, kw: dict) -> None:
    got = route(logits, top_k, method, **kw)
    assert got.ids.dtype == torch.int64 and got.weights.dtype == torch.float64
    assert tuple(got.ids.shape) == tuple(got.weights.shape) == (logits.shape[0], top_k)
    ref = _brute_rows(logits, top_k, method, kw)
    got_ids, got_w = got.ids.cpu().tolist(), got.weights.cpu().tolist()
    for t, ref_row in enumerate(ref):
        assert got_ids[t] == [e for e, _ in ref_row], f"token {t}: ids {got_ids[t]} != brute {ref_row}"
        for j, (_, ref_w) in enumerate(ref_row):
            assert math.isclose(got_w[t][j], ref_w, rel_tol=REL, abs_tol=1e-300), (
                f"token {t} slot {j}: weight {got_w[t][j]!r} != brute {ref_w!r}"
            )


@given(case=routing_cases())
def test_route_matches_brute(case, device):
    logits, kw = _materialize(case, device)
    bias = kw.get("correction_bias")
    # Random biases and group sums can come close to a tie; such a case says nothing about the
    # selection, so it is discarded (the margin is computed in plain Python, not by topk_margin).
    for row in logits.cpu().tolist():
        b = None if bias is None else bias.cpu().tolist()
        margin = _plain_margin(row, case["top_k"], case["method"], b, kw.get("n_group"), kw.get("topk_group"))
        assume(margin > 1e-9)
    _assert_matches_brute(logits, case["top_k"], case["method"], kw)


EMPTY_CASES = [(m, False) for m in ROUTING_METHODS] + [(m, True) for m in BIASED]


@pytest.mark.parametrize("method,bias", EMPTY_CASES, ids=[m.lower() + ("-bias" * b) for m, b in EMPTY_CASES])
def test_empty_batch(method, bias):
    kw = {"correction_bias": torch.zeros(4, dtype=torch.float64)} if bias else {}
    k = 1 if method == "Llama4" else 2
    logits = torch.zeros(0, 4, dtype=torch.float64)
    got = route(logits, k, method, **kw)
    assert tuple(got.ids.shape) == tuple(got.weights.shape) == (0, k)
    assert tuple(topk_margin(logits, k, method, **kw).shape) == (0,)
    assert not has_boundary_ties(logits, k, method, **kw)


@pytest.mark.parametrize(
    "method,kw",
    [
        ("DeepSeekV3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, correction_bias=True)),
        ("DeepSeekV3", dict(n_group=8, topk_group=3, routed_scaling_factor=1.0, correction_bias=True)),
        ("MiniMax2", dict(routed_scaling_factor=1.5, correction_bias=True)),
    ],
    ids=["deepseekv3-g4-k2", "deepseekv3-g8-k3", "minimax2"],
)
def test_biased_methods_match_brute(method, kw):
    # Fixed cases next to the drawn ones, so groups, bias and scaling are always exercised.
    logits = _logits(6, 16, seed=7)
    kw = dict(kw)
    if kw.pop("correction_bias"):
        kw["correction_bias"] = torch.linspace(0.3, -0.3, 16, dtype=torch.float64)
    _assert_matches_brute(logits, 4, method, kw)
    # The bias decides the choice but never enters the weights: they are the unbiased sigmoid.
    got = route(logits, 4, method, **kw)
    s = torch.tensor([[_sigmoid(v) for v in row] for row in logits.tolist()], dtype=torch.float64)
    chosen = s.gather(1, got.ids)
    expect = chosen / chosen.sum(-1, keepdim=True) * kw["routed_scaling_factor"]
    torch.testing.assert_close(got.weights, expect, rtol=REL, atol=0)


def test_llama4_top1_sigmoid():
    logits = _logits(5, 8, seed=3)
    got = route(logits, 1, "Llama4")
    rows = logits.tolist()
    assert got.ids[:, 0].tolist() == [max(range(8), key=row.__getitem__) for row in rows]
    for t, row in enumerate(rows):
        assert math.isclose(got.weights[t, 0].item(), _sigmoid(max(row)), rel_tol=REL)


@pytest.mark.parametrize("method", ROUTING_METHODS)
def test_top_k_equals_e(method):
    e = 1 if method == "Llama4" else 6
    logits = _logits(4, e, seed=11)
    _assert_matches_brute(logits, e, method, {})
    got = route(logits, e, method)
    for row_ids in got.ids.tolist():
        assert sorted(row_ids) == list(range(e))
    assert torch.isinf(topk_margin(logits, e, method)).all()


@given(t=st.integers(0, 8), e=st.integers(1, 16), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_renormalize_and_naive_agree(t, e, data, seed):
    top_k = data.draw(st.integers(1, e))
    logits = _logits(t, e, seed)
    a = route(logits, top_k, "Renormalize")
    b = route(logits, top_k, "RenormalizeNaive")
    assert torch.equal(a.ids, b.ids)
    torch.testing.assert_close(a.weights, b.weights, rtol=REL, atol=0)
    if t:
        torch.testing.assert_close(a.weights.sum(-1), torch.ones(t, dtype=torch.float64), rtol=1e-14, atol=0)


@given(case=routing_cases())
def test_margin_is_the_plain_gap(case):
    logits, kw = _materialize(case)
    kw.pop("routed_scaling_factor", None)
    bias = kw.get("correction_bias")
    got = topk_margin(logits, case["top_k"], case["method"], **kw)
    assert got.dtype == torch.float64 and tuple(got.shape) == (case["t"],)
    refs = []
    for t, row in enumerate(logits.tolist()):
        ref = _plain_margin(
            row, case["top_k"], case["method"], None if bias is None else bias.tolist(),
            kw.get("n_group"), kw.get("topk_group"),
        )
        refs.append(ref)
        if math.isinf(ref):
            assert math.isinf(got[t].item()) and got[t].item() > 0
        else:
            # sigmoid here and in torch may differ by an ulp or two of values below 2
            assert math.isclose(got[t].item(), ref, rel_tol=1e-9, abs_tol=1e-15), (t, got[t].item(), ref)
    assert has_boundary_ties(logits, case["top_k"], case["method"], **kw) == any(r <= 0 for r in refs)


def _tied_logits(method: str, e: int, k: int, t: int = 3) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Distinct logits except that, per token, the k-th and (k+1)-th best are exactly equal, placed
    at a lower index ``lo`` and a higher index ``hi``."""
    logits = _logits(t, e, seed=5)
    pairs = []
    for row in range(t):
        order = sorted(range(e), key=lambda j: -logits[row, j].item())
        a, b = order[k - 1], order[k]
        lo, hi = min(a, b), max(a, b)
        logits[row, lo] = logits[row, hi] = logits[row, a]
        pairs.append((lo, hi))
    return logits, pairs


@pytest.mark.parametrize("method", [m for m in ROUTING_METHODS if m != "Llama4"] + ["Llama4"])
def test_boundary_tie_is_detected_and_lower_index_wins(method):
    e, k = 8, (1 if method == "Llama4" else 3)
    logits, pairs = _tied_logits(method, e, k)
    kw = {"correction_bias": torch.zeros(e, dtype=torch.float64)} if method in BIASED else {}
    margin = topk_margin(logits, k, method, **kw)
    assert (margin == 0).all(), margin
    assert has_boundary_ties(logits, k, method, **kw)
    got = route(logits, k, method, **kw)
    for row, (lo, hi) in enumerate(pairs):
        ids = got.ids[row].tolist()
        assert lo in ids and hi not in ids, (row, ids, lo, hi)
    _assert_matches_brute(logits, k, method, kw)


def test_no_tie_near_tie_and_tolerance():
    logits = torch.tensor([[0.0, 1.0, 1.0 + 2**-30, 3.0]], dtype=torch.float64)
    assert topk_margin(logits, 2, "Renormalize").item() == 2**-30
    assert not has_boundary_ties(logits, 2, "Renormalize")
    assert has_boundary_ties(logits, 2, "Renormalize", tol=1e-6)
    assert not has_boundary_ties(logits, 1, "Renormalize", tol=1e-6)


def test_group_tie_keeps_the_lower_group():
    # Groups 1 and 2 hold the same values (the best), so with topk_group=1 they tie as groups.
    row = [0.1, -0.2, 2.0, 1.5, 2.0, 1.5, -1.0, 0.3]
    logits = torch.tensor([row], dtype=torch.float64)
    kw = dict(n_group=4, topk_group=1)
    assert topk_margin(logits, 2, "DeepSeekV3", **kw).item() == 0.0
    assert has_boundary_ties(logits, 2, "DeepSeekV3", **kw)
    got = route(logits, 2, "DeepSeekV3", **kw)
    assert got.ids.tolist() == [[2, 3]]
    _assert_matches_brute(logits, 2, "DeepSeekV3", kw)


@pytest.mark.parametrize("method", ["Sigmoid", "SigmoidRenorm", "Default", "RenormalizeNaive"])
def test_selection_on_logits_where_the_transform_saturates(method):
    # sigmoid(40) == sigmoid(41) == 1.0 and softmax underflows alike in float64; the documented
    # convention selects on the logits, so expert 1 wins, and there is no tie to report.
    logits = torch.tensor([[40.0, 41.0, -800.0, -801.0]], dtype=torch.float64)
    assert route(logits, 1, method).ids.tolist() == [[1]]
    assert route(logits, 3, method).ids.tolist() == [[1, 0, 2]]
    assert not has_boundary_ties(logits, 3, method)


def test_unknown_method_lists_accepted_names():
    with pytest.raises(ValueError, match="method") as err:
        route(_logits(2, 4, 0), 2, "Unspecified")
    for name in ROUTING_METHODS:
        assert name in str(err.value)


BAD_INPUTS = [
    ("top-k-above-e", dict(top_k=5), "top_k"),
    ("top-k-zero", dict(top_k=0), "top_k"),
    ("llama4-top-k-2", dict(top_k=2, method="Llama4"), "top_k"),
    ("bias-with-renormalize", dict(correction_bias=torch.zeros(4, dtype=torch.float64)), "correction_bias"),
    ("bias-wrong-length", dict(method="DeepSeekV3", correction_bias=torch.zeros(3)), "correction_bias"),
    ("scaling-with-default", dict(method="Default", routed_scaling_factor=2.0), "routed_scaling_factor"),
    ("group-not-dividing", dict(method="DeepSeekV3", n_group=3, topk_group=1), "n_group"),
    ("group-without-topk-group", dict(method="DeepSeekV3", n_group=2), "n_group"),
    ("topk-group-too-large", dict(method="DeepSeekV3", n_group=2, topk_group=3), "topk_group"),
    ("groups-with-renormalize", dict(n_group=2, topk_group=1), "n_group"),
    ("logits-1d", dict(logits=torch.zeros(4, dtype=torch.float64)), "logits"),
    ("logits-3d", dict(logits=torch.zeros(1, 2, 4, dtype=torch.float64)), "logits"),
    ("logits-int", dict(logits=torch.zeros(2, 4, dtype=torch.int64)), "logits"),
]


@pytest.mark.parametrize("kw,match", [(kw, m) for _, kw, m in BAD_INPUTS], ids=[i for i, _, _ in BAD_INPUTS])
def test_bad_input_names_the_argument(kw, match):
    args = dict(logits=_logits(2, 4, 0), top_k=2, method="Renormalize") | kw
    with pytest.raises(ValueError, match=match):
        route(args.pop("logits"), args.pop("top_k"), args.pop("method"), **args)
