"""Hypothesis strategies for the STRUCTURE of cases (never tensor values: those derive from the case
id): token counts 0, 1, odd and large; all tokens to one expert (hot); empty experts (sparse);
shapes off the padding multiples; TP and EP shards. Also a per-process cache of case inputs, so
that tests looking at one case through several backends build its tensors once."""

from __future__ import annotations

import functools

from hypothesis import assume
from hypothesis import strategies as st

from mxmoe.harness.contract.cases import MODELS, Case, make_case, tp_shard
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs
from mxmoe.harness.contract.platforms import device_for, host_arch
from mxmoe.harness.run.profiles import SMALL_MODELS

TOKENS = st.one_of(
    st.just(0),
    st.just(1),
    st.integers(1, 40).map(lambda n: 2 * n + 1),  # odd: never a multiple of a tile
    st.integers(64, 160),  # large for these shapes: several tokens per expert
)
"""Token counts the kernels treat differently: none, one (decode), odd, and many."""

OFF_PADDING = st.sampled_from(((96, 160), (160, 96), (224, 32), (32, 224)))
"""(hidden, intermediate) multiples of 32 that are odd multiples: off every padding alignment (64,
128, 256) a kernel may use."""


@st.composite
def shards(draw: st.DrawFn, case: Case) -> Case:
    """``case`` as one TP rank (of the intermediate dimension) or one EP rank (of the experts), or
    whole."""
    kind = draw(st.sampled_from(("whole", "tp", "ep")))
    if kind == "tp":
        blocks = case.intermediate // 32
        tp = draw(st.sampled_from([t for t in (2, 4, 8) if t <= blocks] or [1]))
        rank = draw(st.integers(0, tp - 1))
        lo, hi = tp_shard(case.intermediate, tp, rank)
        assume(hi > lo)  # more ranks than blocks: a rank with nothing is not a valid shard
        return make_case(case.model, case.tokens, **{**_overrides(case), "tp": tp, "tp_rank": rank})
    if kind == "ep":
        ep = draw(st.sampled_from([d for d in (2, 3, 4, 8) if case.experts % d == 0] or [1]))
        rank = draw(st.integers(0, ep - 1))
        return make_case(case.model, case.tokens, **{**_overrides(case), "ep": ep, "ep_rank": rank})
    return case


def _overrides(case: Case) -> dict[str, object]:
    return {k: v for k, v in case.to_dict().items() if k not in ("model", "tokens")}


@st.composite
def cases(
    draw: st.DrawFn,
    tokens: st.SearchStrategy[int] = TOKENS,
    sharded: bool = True,
    skews: tuple[str, ...] = ("uniform", "hot", "sparse", "negative", "neartie"),
) -> Case:
    """A small case: a CI-size zoo model (possibly with a shape off the padding multiples), a token
    count, an input distribution, a routing skew (of ``skews``), a replica, and (``sharded``) a TP
    or EP shard."""
    model = draw(st.sampled_from(SMALL_MODELS))
    m = MODELS[model]
    over: dict[str, object] = {}
    if draw(st.booleans()) and model != "dsmini":
        over["hidden"], over["intermediate"] = draw(OFF_PADDING)
    over["inputs"] = draw(st.sampled_from(("normal", "wide", "trained")))
    skew = draw(st.sampled_from(skews))
    if skew == "sparse" and m.top_k > (m.experts + 1) // 2:
        skew = "uniform"
    if skew == "neartie" and m.routing != "Renormalize":  # sigmoid scores of neighbours a bf16 ulp apart tie
        skew = "uniform"
    over["skew"] = skew
    over["replica"] = draw(st.integers(0, 3))
    case = make_case(model, draw(tokens), **over)
    return draw(shards(case)) if sharded else case


def cached_inputs(case: Case) -> CaseInputs:
    """``make_inputs(case)`` on this host's device (the one its arch runs on), once per process (a
    pure function of the id). Callers must not modify the tensors; the engine's checksums would
    catch a backend that does."""
    return _cached_inputs(case, device_for(host_arch()))


@functools.lru_cache(maxsize=8)
def _cached_inputs(case: Case, device: str) -> CaseInputs:
    return make_inputs(case, device)
