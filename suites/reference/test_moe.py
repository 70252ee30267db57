"""reference.moe, the batched float64 MoE oracle, against per-token Python-float definitions.

``brute.moe_token_loop`` is the plain restatement of the layer (docs/formats.md). ``_token_loop``
below is the same literal loop written here from brute's primitives, with hooks that round the
precision points in plain Python, so that ``Precision`` can be checked too; it also returns, per
output element, the sum of the magnitudes of the terms that make it up, which is what float64
rounding errors are proportional to.

Hypothesis draws the structure of the cases; tensor values come from generators seeded with drawn
integers. Random weights come from the ``make_weights`` fixture (suites/reference/conftest.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mxmoe.reference import brute
from mxmoe.reference.activation import ACTIVATIONS, LAYOUTS, convert_layout
from mxmoe.reference.moe import MoEWeights, Precision, dequantize_weights, moe, moe_routed, round_to
from mxmoe.reference.routing import ROUTING_METHODS, Routing, route, topk_margin

REL = 1e-12
SIZES = st.sampled_from([32, 64, 96])
SEEDS = st.integers(0, 2**32 - 1)
# Llama4 needs router_weight_on_input, tested on its own.
METHODS = tuple(m for m in ROUTING_METHODS if m != "Llama4")
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA_ONLY = [pytest.param("cuda", marks=NO_CUDA)]


def _fewer(n: int) -> settings:
    """The active profile's example count divided by ``n``, for tests whose examples are slow."""
    return settings(max_examples=max(1, settings().max_examples // n))


# ---------------------------------------------------------------------------------------------
# Inputs


def _inputs(t: int, e: int, hidden: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, H] and tie-free float32 logits [T, E]: per token a random permutation of a grid of
    step 0.5 plus jitter below the step, so no two experts of a token are within ~0.2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    grid = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]) if t else torch.empty(0, e)
    logits = (grid.float() - e / 2) * 0.5 + torch.rand(t, e, generator=g) * 0.3
    return x.to(device), logits.to(device)


@st.composite
def routing_setups(draw: st.DrawFn, methods: tuple[str, ...] = METHODS, max_e: int = 8) -> dict:
    """A routing method with its options, E and top_k."""
    method = draw(st.sampled_from(methods))
    kw: dict = {}
    if method == "DeepSeekV3" and draw(st.booleans()):
        n_group, size = draw(st.integers(1, 3)), draw(st.integers(2, max(2, max_e // 3)))
        e = n_group * size
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, topk_group * size))
        kw.update(n_group=n_group, topk_group=topk_group)
    else:
        e = draw(st.integers(1, max_e))
        top_k = draw(st.integers(1, e))
    if method in ("DeepSeekV3", "MiniMax2"):
        if draw(st.booleans()):
            kw["correction_bias"] = draw(SEEDS)  # materialized by _route_kw
        kw["routed_scaling_factor"] = draw(st.sampled_from([1.0, 2.5]))
    return dict(routing_method=method, top_k=top_k, e=e, kw=kw)


def _route_kw(setup: dict, device: str = "cpu") -> dict:
    kw = dict(setup["kw"])
    if "correction_bias" in kw:
        g = torch.Generator().manual_seed(kw["correction_bias"])
        kw["correction_bias"] = (torch.rand(setup["e"], generator=g) * 0.2).to(device)
    return dict(routing_method=setup["routing_method"], top_k=setup["top_k"], **kw)


def _tie_free(logits: torch.Tensor, kw: dict) -> bool:
    """Random correction biases can bring two selection scores close; such cases are discarded."""
    opts = {k: v for k, v in kw.items() if k in ("correction_bias", "n_group", "topk_group")}
    margin = topk_margin(logits, kw["top_k"], kw["routing_method"], **opts)
    return bool((margin > 1e-6).all())


def _with_layout(w: MoEWeights, layout: str) -> MoEWeights:
    """The same experts with w13's rows (blocks, scales and bias together) in ``layout``."""
    conv = convert_layout
    bias = None if w.w13_bias is None else conv(w.w13_bias, w.w13_layout, layout, -1)
    return dataclasses.replace(
        w,
        w13_blocks=conv(w.w13_blocks, w.w13_layout, layout, -2),
        w13_scales=conv(w.w13_scales, w.w13_layout, layout, -2),
        w13_bias=bias,
        w13_layout=layout,
    )


def _select_experts(w: MoEWeights, idx: torch.Tensor) -> MoEWeights:
    """The experts ``idx`` (in that order) of ``w``."""
    idx = idx.to(w.w13_blocks.device)
    pick = {
        f.name: getattr(w, f.name).index_select(0, idx)
        for f in dataclasses.fields(w)
        if isinstance(getattr(w, f.name), torch.Tensor)
    }
    return dataclasses.replace(w, **pick)


# ---------------------------------------------------------------------------------------------
# The plain loop with precision hooks, and the comparison


def _round_bits(v: float, bits: int) -> float:
    """``v`` rounded to ``bits`` significant bits, to nearest, ties to even (Python's round):
    bf16 is 8 bits, fp32 24; exact for normal values, which is all these tests produce."""
    if v == 0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)
    return math.ldexp(round(m * 2**bits), e - bits)


def _rounder(point: str) -> Callable[[list[float]], list[float]]:
    bits = {"bf16": 8, "fp32": 24}[point]
    return lambda vs: [_round_bits(v, bits) for v in vs]


def _token_loop(
    x: torch.Tensor,
    logits: torch.Tensor,
    w: MoEWeights,
    *,
    top_k: int,
    routing_method: str,
    activation: str = "swigluoai",
    router_weight_on_input: bool = False,
    rounding: dict[str, str] | None = None,
    **route_kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer one token and one expert at a time, with the precision points in ``rounding``
    rounded in plain Python; returns (output, magnitude), both float64 [T, H], where magnitude is
    per element sum_k |w_k| * (sum_j |a_j * W2[i, j]| + |b2[i]|), the scale of its rounding errors."""
    rnd = {p: _rounder(v) for p, v in (rounding or {}).items()}
    ident = list

    def r(point: str) -> Callable[[list[float]], list[float]]:
        return rnd.get(point, ident)

    bias = route_kw.get("correction_bias")
    bias = None if bias is None else bias.double().cpu().tolist()
    b13 = None if w.w13_bias is None else w.w13_bias.double().cpu().tolist()
    b2 = None if w.w2_bias is None else w.w2_bias.double().cpu().tolist()
    blocks = {k: getattr(w, k).cpu().tolist() for k in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales")}
    rows: dict[tuple[str, int], list[list[float]]] = {}

    def mat(kind: str, e: int) -> list[list[float]]:
        if (kind, e) not in rows:
            pairs = zip(blocks[f"{kind}_blocks"][e], blocks[f"{kind}_scales"][e])
            rows[kind, e] = [brute.dequantize_row(b, s) for b, s in pairs]
        return rows[kind, e]

    hidden = w.hidden_size
    out, mag = [], []
    for xt, lt in zip(x.double().cpu().tolist(), logits.double().cpu().tolist()):
        acc: list[list[float]] = [[] for _ in range(hidden)]
        size: list[list[float]] = [[] for _ in range(hidden)]
        chosen = brute.route_token(
            lt,
            top_k,
            routing_method,
            bias,
            route_kw.get("n_group"),
            route_kw.get("topk_group"),
            route_kw.get("routed_scaling_factor", 1.0),
        )
        for e, wt in chosen:
            wt = r("routing_weights")([wt])[0]
            xin = r("activation_input")([wt * v for v in xt] if router_weight_on_input else xt)
            h = [math.fsum(a * b for a, b in zip(xin, row)) for row in mat("w13", e)]
            if b13 is not None:
                h = [v + b for v, b in zip(h, b13[e])]
            h = r("gemm1_output")(h)
            a = r("intermediate")(brute.activate(h, activation, w.w13_layout, 1.702, 1.0, 7.0))
            y = [math.fsum(p * q for p, q in zip(a, row)) for row in mat("w2", e)]
            ymag = [math.fsum(abs(p * q) for p, q in zip(a, row)) for row in mat("w2", e)]
            if b2 is not None:
                y = [v + b for v, b in zip(y, b2[e])]
                ymag = [v + abs(b) for v, b in zip(ymag, b2[e])]
            y = r("expert_output")(y)
            scale = 1.0 if router_weight_on_input else wt
            for i in range(hidden):
                acc[i].append(scale * y[i])
                size[i].append(abs(scale) * ymag[i])
        out.append([math.fsum(terms) for terms in acc])
        mag.append([math.fsum(terms) for terms in size])
    shape = (len(out), hidden)
    return (
        torch.tensor(out, dtype=torch.float64).reshape(shape),
        torch.tensor(mag, dtype=torch.float64).reshape(shape),
    )


def _assert_close(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float, what: str = "") -> None:
    """|got - ref| <= REL * (|ref| + scale) elementwise, with a message in assert_close's format.

    ``scale`` is the per-element sum of |terms| from ``_token_loop`` where the test has it: float64
    sums of a few hundred products carry errors of ~1e-14 of that sum, so 1e-12 leaves headroom
    yet catches any real mistake (a wrong row, expert, weight or bias is of the order of |ref|).
    Where only two batched results are compared (no loop), ``scale`` is the case's largest |ref|:
    random signed terms make outputs of the order of sum |terms| / sqrt(terms), so it is honest
    for these small cases."""
    got, ref = got.cpu().to(torch.float64), ref.cpu().to(torch.float64)
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    scale = torch.as_tensor(scale, dtype=torch.float64)
    allowed = REL * (ref.abs() + scale) + 1e-300
    diff = (got - ref).abs()
    bad = ~(diff <= allowed)
    if bool(bad.any()):
        worst = int(torch.argmax(torch.where(bad, diff / allowed, torch.zeros_like(diff))))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ref.shape))
        raise AssertionError(
            f"{what}: Mismatched elements: {int(bad.sum())} / {ref.numel()}\n"
            f"Greatest excess at index {idx}: got {got[idx].item()!r}, ref {ref[idx].item()!r}, "
            f"difference {diff[idx].item():.3e} (up to {allowed[idx].item():.3e} allowed)"
        )


def _case_scale(ref: torch.Tensor) -> float:
    return float(ref.abs().max()) if ref.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# Equality with the per-token definitions


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@_fewer(5)
@given(
    setup=routing_setups(),
    t=st.integers(0, 6),
    hidden=SIZES,
    inter=SIZES,
    biases=st.booleans(),
    seed=SEEDS,
)
def test_moe_matches_brute(layout, activation, setup, t, hidden, inter, biases, seed, make_weights, device):
    kw = _route_kw(setup, device)
    x, logits = _inputs(t, setup["e"], hidden, seed, device)
    assume(_tie_free(logits, kw))
    w = dataclasses.replace(make_weights(setup["e"], hidden, inter, seed, bias=biases, device=device),
                            w13_layout=layout)
    got = moe(x, logits, w, activation=activation, **kw)
    assert got.dtype == torch.float64 and got.device.type == device and tuple(got.shape) == (t, hidden)
    ref = brute.moe_token_loop(x.cpu(), logits.cpu(), _to_cpu(w), activation=activation, **_cpu_kw(kw))
    _, scale = _token_loop(x, logits, w, activation=activation, **kw)
    _assert_close(got, ref, scale, f"{setup} t={t} H={hidden} I={inter} bias={biases}")


def _to_cpu(w: MoEWeights) -> MoEWeights:
    return dataclasses.replace(
        w, **{f.name: getattr(w, f.name).cpu() for f in dataclasses.fields(w)
              if isinstance(getattr(w, f.name), torch.Tensor)}
    )


def _cpu_kw(kw: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@_fewer(3)
@given(e=st.integers(1, 8), t=st.integers(0, 6), hidden=SIZES, inter=SIZES, seed=SEEDS,
       activation=st.sampled_from(ACTIVATIONS))
def test_router_weight_on_input_matches_brute(e, t, hidden, inter, seed, activation, make_weights):
    x, logits = _inputs(t, e, hidden, seed)
    w = make_weights(e, hidden, inter, seed)
    kw = dict(top_k=1, routing_method="Llama4", activation=activation)
    got = moe(x, logits, w, router_weight_on_input=True, **kw)
    ref = brute.moe_token_loop(x, logits, w, router_weight_on_input=True, **kw)
    _, scale = _token_loop(x, logits, w, router_weight_on_input=True, **kw)
    _assert_close(got, ref, scale, "router weight on the input")
    if t:
        # the activation is not linear: scaling the input is not scaling the output
        on_output = moe(x, logits, w, **kw)
        assert not torch.allclose(got, on_output, rtol=1e-6, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_top_k_equals_e(method, make_weights):
    e, hidden, inter = 4, 64, 32
    x, logits = _inputs(5, e, hidden, seed=21)
    w = make_weights(e, hidden, inter, seed=21)
    got = moe(x, logits, w, top_k=e, routing_method=method)
    ref = brute.moe_token_loop(x, logits, w, top_k=e, routing_method=method)
    _, scale = _token_loop(x, logits, w, top_k=e, routing_method=method)
    _assert_close(got, ref, scale, f"{method} top_k=E")


@pytest.mark.parametrize("top_k", [1, 2])
def test_experts_without_tokens(top_k, make_weights, device):
    # Every token's logits put experts 5 (and 2) far ahead: the other six experts get no token.
    e, hidden, inter = 8, 32, 64
    x, logits = _inputs(7, e, hidden, seed=4, device=device)
    logits[:, 5] += 20.0
    logits[:, 2] += 10.0
    w = make_weights(e, hidden, inter, seed=4, device=device)
    assert set(route(logits, top_k, "Renormalize").ids.flatten().tolist()) == ({5} if top_k == 1 else {5, 2})
    got = moe(x, logits, w, top_k=top_k)
    ref = brute.moe_token_loop(x.cpu(), logits.cpu(), _to_cpu(w), top_k=top_k)
    _, scale = _token_loop(x, logits, w, top_k=top_k, routing_method="Renormalize")
    _assert_close(got, ref, scale, f"top_k={top_k}, all tokens on one expert")


@pytest.mark.parametrize("output", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_empty_batch(output, make_weights):
    w = make_weights(4, 96, 32, seed=0)
    x, logits = _inputs(0, 4, 96, seed=0)
    got = moe(x, logits, w, top_k=2, precision=Precision(output=output))
    assert tuple(got.shape) == (0, 96) and got.dtype == output
    emap = torch.tensor([1, -1, 0, -1])
    got = moe(x, logits, _select_experts(w, torch.tensor([2, 0])), top_k=2, expert_map=emap)
    assert tuple(got.shape) == (0, 96)


@pytest.mark.parametrize("method", ROUTING_METHODS)
def test_empty_batch_every_routing_method(method, make_weights):
    w = make_weights(4, 32, 32, seed=0)
    x, logits = _inputs(0, 4, 32, seed=0)
    k = 1 if method == "Llama4" else 2
    got = moe(x, logits, w, top_k=k, routing_method=method, router_weight_on_input=method == "Llama4")
    assert tuple(got.shape) == (0, 32) and got.dtype == torch.float64


def test_dequantized_weights_give_the_same_layer(make_weights):
    # documented: dequantizing is exact, so the layer from DequantizedWeights is equal bit for bit
    e, hidden, inter = 6, 64, 96
    x, logits = _inputs(9, e, hidden, seed=41)
    w = make_weights(e, hidden, inter, seed=41)
    got = moe(x, logits, dequantize_weights(w), top_k=2)
    ref = moe(x, logits, w, top_k=2)
    assert torch.equal(got, ref)
    _assert_close(got, brute.moe_token_loop(x, logits, w, top_k=2), _case_scale(ref), "dequantized")


# ---------------------------------------------------------------------------------------------
# Invariances


@given(setup=routing_setups(max_e=12), t=st.integers(0, 10), ranks=st.integers(1, 4), hidden=SIZES,
       inter=SIZES, seed=SEEDS)
def test_expert_parallel_ranks_sum_to_the_full_layer(
    setup, t, ranks, hidden, inter, seed, make_weights, device
):
    kw = _route_kw(setup, device)
    e = setup["e"]
    x, logits = _inputs(t, e, hidden, seed, device)
    assume(_tie_free(logits, kw))
    w = make_weights(e, hidden, inter, seed, device=device)
    full = moe(x, logits, w, **kw)
    routing = route(logits, setup["top_k"], setup["routing_method"],
                    **{k: v for k, v in kw.items() if k not in ("top_k", "routing_method")})

    g = torch.Generator().manual_seed(seed + 3)
    owner = torch.randint(0, ranks, (e,), generator=g)
    total = torch.zeros_like(full)
    for rank in range(ranks):
        mine = (owner == rank).nonzero().flatten()
        mine = mine[torch.randperm(mine.numel(), generator=g)]  # local order need not follow global
        emap = torch.full((e,), -1, dtype=torch.int32 if rank % 2 else torch.int64)
        emap[mine] = torch.arange(mine.numel(), dtype=emap.dtype)
        got = moe(x, logits, _select_experts(w, mine), expert_map=emap.to(device), **kw)
        # The rank's share is the full layer with every other expert's routing weight set to 0.
        local = torch.isin(routing.ids, mine.to(device))
        masked = Routing(weights=torch.where(local, routing.weights, 0.0), ids=routing.ids)
        ref = moe_routed(x, masked, w)
        _assert_close(got, ref, _case_scale(full), f"rank {rank} of {ranks}, experts {mine.tolist()}")
        if mine.numel() == 0:
            assert torch.equal(got, torch.zeros_like(got))
        total += got
    _assert_close(total, full, _case_scale(full), "sum over ranks")


def test_non_local_experts_contribute_nothing(make_weights, device):
    # One rank holds the whole weight tensor, but the map says only experts 1 and 4 are local; the
    # others are poisoned with NaN scales, so any contribution of theirs would show.
    e, hidden, inter = 6, 64, 32
    x, logits = _inputs(8, e, hidden, seed=9, device=device)
    w = make_weights(e, hidden, inter, seed=9, device=device)
    remote = torch.tensor([0, 2, 3, 5], device=device)
    poisoned = dataclasses.replace(
        w,
        w13_scales=w.w13_scales.index_fill(0, remote, 255),
        w2_scales=w.w2_scales.index_fill(0, remote, 255),
    )
    emap = torch.tensor([-1, 1, -1, -1, 4, -1], device=device)
    got = moe(x, logits, poisoned, top_k=3, expert_map=emap)
    assert bool(torch.isfinite(got).all())
    routing = route(logits, 3, "Renormalize")
    local = (routing.ids == 1) | (routing.ids == 4)
    assert bool(local.any()) and not bool(local.all())
    ref = brute.moe_token_loop(x.cpu(), logits.cpu(), _to_cpu(w), top_k=3, expert_map=emap.cpu())
    _, scale = _token_loop(x, logits, w, top_k=3, routing_method="Renormalize")
    _assert_close(got, ref, scale, "local experts 1 and 4")


@given(setup=routing_setups(methods=tuple(m for m in METHODS if m != "DeepSeekV3") + ("DeepSeekV3",)),
       t=st.integers(0, 10), hidden=SIZES, inter=SIZES, seed=SEEDS)
def test_permuting_experts_with_router_columns_changes_nothing(setup, t, hidden, inter, seed, make_weights):
    assume("n_group" not in setup["kw"])  # a permutation across groups changes the groups
    kw = _route_kw(setup)
    e = setup["e"]
    x, logits = _inputs(t, e, hidden, seed)
    assume(_tie_free(logits, kw))
    w = make_weights(e, hidden, inter, seed)
    perm = torch.randperm(e, generator=torch.Generator().manual_seed(seed + 5))
    kw_p = dict(kw)
    if "correction_bias" in kw:
        kw_p["correction_bias"] = kw["correction_bias"][perm]
    got = moe(x, logits[:, perm], _select_experts(w, perm), **kw_p)
    ref = moe(x, logits, w, **kw)
    _assert_close(got, ref, _case_scale(ref), f"permutation {perm.tolist()}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_converted_w13_layout_gives_the_same_layer(layout, activation, make_weights):
    e, hidden, inter = 5, 96, 64
    x, logits = _inputs(9, e, hidden, seed=13)
    w = make_weights(e, hidden, inter, seed=13)
    converted = _with_layout(w, layout)
    if layout != "interleaved":
        assert not torch.equal(converted.w13_blocks, w.w13_blocks)
    got = moe(x, logits, converted, top_k=3, activation=activation)
    ref = moe(x, logits, w, top_k=3, activation=activation)
    # The same products summed in the same order, only stored in other rows: equal bit for bit.
    assert torch.equal(got, ref), f"max |diff| {(got - ref).abs().max().item():.3e}"
    # and not by accident: reading the converted rows as interleaved is a different layer
    if layout not in ("interleaved",):
        wrong = moe(x, logits, dataclasses.replace(converted, w13_layout="interleaved"), top_k=3,
                    activation=activation)
        assert not torch.allclose(wrong, ref, rtol=1e-3, atol=0)


# ---------------------------------------------------------------------------------------------
# Precision points


@pytest.mark.parametrize("output", [torch.bfloat16, torch.float32])
def test_output_dtype_is_the_exact_sum_rounded_once(output, make_weights):
    e, hidden, inter = 6, 64, 64
    x, logits = _inputs(10, e, hidden, seed=17)
    w = make_weights(e, hidden, inter, seed=17)
    got = moe(x, logits, w, top_k=2, precision=Precision(output=output))
    assert got.dtype == output
    # brute's float64 result rounded once, in plain Python. (A brute result within 1e-12 of a
    # rounding midpoint could round the other way; these fixed inputs have none.)
    bits = {torch.bfloat16: 8, torch.float32: 24}[output]
    exact = brute.moe_token_loop(x, logits, w, top_k=2)
    ref = torch.tensor([[_round_bits(v, bits) for v in row] for row in exact.tolist()], dtype=torch.float64)
    assert torch.equal(got.double(), ref), f"{int((got.double() != ref).sum())} elements differ"
    assert not torch.equal(got.double(), exact), "rounding to a narrower dtype must change something"


# Values a hair above or below a rounding midpoint of bf16 (8 significant bits) and float16 (11): a
# conversion through float32 first loses the hair and then rounds the midpoint to even, the wrong way.
HAIR = 2.0**-30
NEAR_MIDPOINTS = {
    8: [1 + 2**-8 + HAIR, 1 + 2**-8 - HAIR, 1 + 3 * 2**-8 - HAIR, -(1 + 2**-8 + HAIR), 3 + 2**-7 + HAIR],
    11: [1 + 2**-11 + HAIR, 1 + 2**-11 - HAIR, 1 + 3 * 2**-11 - HAIR, -(1 + 2**-11 + HAIR)],
}


def _constant_layer(values: list[float]) -> tuple[torch.Tensor, torch.Tensor, MoEWeights]:
    """One expert with all-zero weights and a float64 down-projection bias: the layer's exact
    output is that bias, times a routing weight of exactly 1 (top-1 Renormalize)."""
    hidden = 32
    b2 = torch.zeros(1, hidden, dtype=torch.float64)
    b2[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    raw = _raw(e=1, hidden=hidden, inter=32)
    return torch.zeros(1, hidden), torch.zeros(1, 1), MoEWeights(**raw, w2_bias=b2)


@pytest.mark.parametrize("output,bits", [(torch.bfloat16, 8), (torch.float16, 11)], ids=["bf16", "fp16"])
def test_output_is_rounded_once_near_a_midpoint(output, bits):
    values = NEAR_MIDPOINTS[bits]
    x, logits, w = _constant_layer(values)
    exact = moe(x, logits, w, top_k=1)
    assert exact[0, : len(values)].tolist() == values
    got = moe(x, logits, w, top_k=1, precision=Precision(output=output))[0, : len(values)].tolist()
    ref = [_round_bits(v, bits) for v in values]
    assert got == ref, f"exact {values} rounded to {got}, expected {ref} (rounded once)"


@pytest.mark.parametrize("point,bits", [("bf16", 8), ("fp32", 24)])
def test_round_to_rounds_once(point, bits):
    values = NEAR_MIDPOINTS[8] + NEAR_MIDPOINTS[11] + [1 + 2**-24 + 2**-50, math.pi, -1e-3]
    got = round_to(torch.tensor(values, dtype=torch.float64), point).tolist()
    ref = [_round_bits(v, bits) for v in values]
    assert got == ref, [(v, a, b) for v, a, b in zip(values, got, ref) if a != b]


POINTS = [
    ("intermediate", "bf16"),
    ("intermediate", "fp32"),
    ("routing_weights", "bf16"),
    ("routing_weights", "fp32"),
    ("gemm1_output", "bf16"),
    ("expert_output", "bf16"),
    ("activation_input", "bf16"),
]


@pytest.mark.parametrize("point,to", POINTS, ids=[f"{p}-{t}".replace("_", "") for p, t in POINTS])
@pytest.mark.parametrize("on_input", [False, True], ids=["combine", "oninput"])
def test_precision_point_matches_the_rounded_loop(point, to, on_input, make_weights):
    e, hidden, inter = 6, 64, 64
    # x is bf16 already: to make activation_input's rounding visible, feed x in float64.
    x, logits = _inputs(8, e, hidden, seed=23)
    x = x.double() * (1 + 2**-12)
    w = make_weights(e, hidden, inter, seed=23)
    kw = dict(top_k=1, routing_method="Llama4", router_weight_on_input=True) if on_input else dict(
        top_k=3, routing_method="Renormalize")
    got = moe(x, logits, w, precision=Precision(**{point: to}), **kw)
    ref, scale = _token_loop(x, logits, w, rounding={point: to}, **kw)
    _assert_close(got, ref, scale, f"{point}={to}")
    exact, _ = _token_loop(x, logits, w, **kw)
    assert bool(((got - exact).abs() > REL * scale).any()), f"{point}={to} changed nothing"
    if point == "routing_weights" and not on_input:
        # |w - round(w)| <= 2**-(bits) |w|: the output moves by at most that much of sum |w_k y_k|
        bits = {"bf16": 8, "fp32": 24}[to]
        bound = 2.0**-bits * scale * (1 + 1e-9)
        assert bool(((got - exact).abs() <= bound).all())


PRECISION_ERRORS = [
    ("activation_input", "fp32"),
    ("gemm1_output", "mxfp8"),
    ("intermediate", "fp8"),
    ("expert_output", "mxfp8"),
    ("routing_weights", "fp16"),
    ("output", torch.int32),
    ("output", "bfloat16"),
    ("mx_rule", "nearest"),
]


@pytest.mark.parametrize("field,value", PRECISION_ERRORS, ids=[f"{f}-{v}".replace("_", "").replace(".", "")
                                                               for f, v in PRECISION_ERRORS])
def test_precision_rejects_unknown_values(field, value):
    with pytest.raises(ValueError, match=f"Precision.{field}"):
        Precision(**{field: value})


# ---------------------------------------------------------------------------------------------
# Inputs are never modified


MUTATION_CASES = {
    "default": dict(top_k=2),
    "llama4-on-input-rounded": dict(
        top_k=1, routing_method="Llama4", router_weight_on_input=True, activation="silu",
        precision=Precision(activation_input="mxfp8", gemm1_output="bf16", intermediate="bf16",
                            expert_output="fp32", routing_weights="bf16", output=torch.bfloat16),
    ),
    "deepseek-groups-expert-map": dict(
        top_k=3, routing_method="DeepSeekV3", n_group=4, topk_group=2, routed_scaling_factor=2.5,
        correction_bias="bias", expert_map="map", precision=Precision(intermediate="mxfp8"),
    ),
}


def _bits(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.device, t.contiguous().view(torch.uint8).cpu().flatten().tolist()


@pytest.mark.parametrize("name", list(MUTATION_CASES))
def test_inputs_are_not_mutated(name, make_weights, device):
    e, hidden, inter = 8, 64, 32
    x, logits = _inputs(6, e, hidden, seed=31, device=device)
    w = make_weights(e, hidden, inter, seed=31, device=device)
    kw = dict(MUTATION_CASES[name])
    if kw.get("expert_map") == "map":
        kw["expert_map"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], device=device)
    if kw.get("correction_bias") == "bias":
        kw["correction_bias"] = torch.linspace(-0.1, 0.1, e, device=device)
    watched = {"x": x, "logits": logits, **{f"w.{i}": t for i, t in enumerate(w.tensors())}}
    watched |= {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}
    before = {k: _bits(v) for k, v in watched.items()}
    out = moe(x, logits, w, **kw)
    out.zero_()  # the result shares no storage with an input
    for k, v in watched.items():
        assert _bits(v) == before[k], f"{k} was modified"


# ---------------------------------------------------------------------------------------------
# Devices


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_cpu_and_device_agree(device, make_weights):
    e, hidden, inter = 8, 96, 64
    kw = dict(top_k=3, routing_method="DeepSeekV3", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    x, logits = _inputs(12, e, hidden, seed=37)
    w = make_weights(e, hidden, inter, seed=37)
    bias = torch.linspace(-0.1, 0.1, e)
    ref = moe(x, logits, w, correction_bias=bias, **kw)
    got = moe(x.to(device), logits.to(device), _to_device(w, device), correction_bias=bias.to(device), **kw)
    assert got.device.type == device
    _assert_close(got, ref, _case_scale(ref), "cpu vs device")


def _to_device(w: MoEWeights, device: str) -> MoEWeights:
    return dataclasses.replace(
        w, **{f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)
              if isinstance(getattr(w, f.name), torch.Tensor)}
    )


# ---------------------------------------------------------------------------------------------
# Bad input


def _raw(e: int = 2, hidden: int = 64, inter: int = 32) -> dict:
    return dict(
        w13_blocks=torch.zeros(e, 2 * inter, hidden // 2, dtype=torch.uint8),
        w13_scales=torch.zeros(e, 2 * inter, max(1, hidden // 32), dtype=torch.uint8),
        w2_blocks=torch.zeros(e, hidden, inter // 2, dtype=torch.uint8),
        w2_scales=torch.zeros(e, hidden, max(1, inter // 32), dtype=torch.uint8),
    )


WEIGHT_ERRORS = {
    "hidden-48": (_raw(hidden=48), r"H=48 .*multiples of 32"),
    "inter-48": (_raw(inter=48), r"I=48 .*multiples of 32"),
    "w13-blocks-int8": (_raw() | {"w13_blocks": torch.zeros(2, 64, 32, dtype=torch.int8)}, "w13_blocks"),
    "w2-scales-float": (_raw() | {"w2_scales": torch.zeros(2, 64, 1)}, "w2_scales"),
    "w2-blocks-shape": (_raw() | {"w2_blocks": torch.zeros(2, 64, 17, dtype=torch.uint8)}, "w2_blocks"),
    "w2-blocks-experts": (_raw() | {"w2_blocks": torch.zeros(3, 64, 16, dtype=torch.uint8)}, "w2_blocks"),
    "w13-scales-shape": (_raw() | {"w13_scales": torch.zeros(2, 64, 3, dtype=torch.uint8)}, "w13_scales"),
    "w13-bias-shape": (_raw() | {"w13_bias": torch.zeros(2, 32)}, "w13_bias"),
    "w2-bias-int": (_raw() | {"w2_bias": torch.zeros(2, 64, dtype=torch.int32)}, "w2_bias"),
    "w13-layout": (_raw() | {"w13_layout": "gate_up"}, "w13_layout"),
}


@pytest.mark.parametrize("name", list(WEIGHT_ERRORS))
def test_bad_weights_name_the_argument(name):
    fields, match = WEIGHT_ERRORS[name]
    with pytest.raises(ValueError, match=match):
        MoEWeights(**fields)


def _call(**over: object) -> torch.Tensor:
    w = MoEWeights(**_raw())
    x, logits = _inputs(3, 2, 64, seed=0)
    args = dict(x=x, router_logits=logits, weights=w, top_k=1) | over
    return moe(args.pop("x"), args.pop("router_logits"), args.pop("weights"), **args)


CALL_ERRORS = {
    "x-width": (dict(x=torch.zeros(3, 32)), r"x must be \[T, H=64\]"),
    "x-1d": (dict(x=torch.zeros(64)), "x must be"),
    "top-k-above-e": (dict(top_k=3), "top_k"),
    "top-k-zero": (dict(top_k=0), "top_k"),
    "unknown-method": (dict(routing_method="Unspecified"), "method must be one of Default, Renormalize"),
    "unknown-activation": (dict(activation="gelu"), "activation must be one of silu, swigluoai"),
    "expert-map-length": (dict(expert_map=torch.tensor([0, 1, -1])), "expert_map"),
    "expert-map-float": (dict(expert_map=torch.tensor([0.0, 1.0])), "expert_map"),
    "expert-map-duplicate": (dict(expert_map=torch.tensor([1, 1])), "expert_map"),
    "expert-map-out-of-range": (dict(expert_map=torch.tensor([0, 2])), "expert_map"),
    "router-has-more-experts": (dict(router_logits=torch.zeros(3, 4)), "expert_map"),
    "logits-tokens": (dict(router_logits=torch.zeros(2, 2)), "router_logits"),
    "on-input-top-k-2": (dict(top_k=2, router_weight_on_input=True), "router_weight_on_input"),
    "precision-not-precision": (dict(precision="bf16"), "precision"),
}


@pytest.mark.parametrize("name", list(CALL_ERRORS))
def test_bad_call_names_the_argument(name):
    over, match = CALL_ERRORS[name]
    with pytest.raises(ValueError, match=match):
        _call(**over)
