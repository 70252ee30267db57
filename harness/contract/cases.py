"""Cases: one MoE layer call to check, as a frozen record whose id names it and seeds its inputs.

A case is host-independent data: the model's shape and routing, the token count, the input
distribution, the routing skew and the shard (TP rank of the intermediate dimension, EP rank of
the experts). Its id is made of tokens ``[a-z0-9]+`` joined by ``-`` (docs/cases.md); the test id puts
the backend and the architecture in front: ``triton-sm90-gptoss20b-interleaved-t128``. Every
tensor a case uses derives from its id (``harness.contract.inputs``), so any case reruns alone, anywhere,
with the same bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace

from mxmoe.reference.activation import ACTIVATIONS, GPT_OSS_ALPHA, GPT_OSS_BETA, GPT_OSS_LIMIT, LAYOUTS
from mxmoe.reference.mxfp4 import BLOCK
from mxmoe.reference.routing import ROUTING_METHODS

INPUT_DISTRIBUTIONS = ("normal", "wide", "trained")
"""``normal``: trained-like weights (scale bytes 118..124) and activations, biases of unit size;
``wide``: scale exponents over a wide range (per row and per block) and token magnitudes spread
over 2^-8..2^8; ``trained``: as normal, with biases the size of the products they are added to
(``harness.contract.inputs``), where a dropped or misassigned bias is far above rounding."""
SKEWS = ("uniform", "hot", "sparse", "negative", "neartie", "balanced")
"""``uniform``: tie-free random routing; ``hot``: every token's first choice is one expert;
``sparse``: the odd-numbered experts get no tokens; ``negative``: every logit below zero (a
kernel that starts its max at 0, not -inf, routes elsewhere: FlashInfer #2822, vLLM #37605);
``neartie``: every token's logits one bfloat16 ulp apart (a bf16 top-k or softmax reorders
them); ``balanced``: every expert gets exactly T * k / E tokens (a count one over a tile size
is where a kernel's last, padded tile breaks: AITER #3538)."""
NEARTIE_MAX_EXPERTS = 128
"""``neartie`` puts the E logits in one binade, spaced by its bfloat16 ulp: at most 2^7 of them."""

_LAYOUT_TOKEN = {
    "interleaved": "interleaved",
    "pair_swapped": "pairswapped",
    "chunked_gate_up": "chunked",
    "chunked_up_gate": "chunkedupgate",
}
_TOKEN_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Model:
    """A MoE layer's shape and math, as a checkpoint defines it."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    routing: str = "Renormalize"
    activation: str = "swigluoai"
    layout: str = "interleaved"
    """Row layout of w13 in the checkpoint (canonical weights are in this layout)."""
    bias: bool = True
    alpha: float = GPT_OSS_ALPHA
    beta: float = GPT_OSS_BETA
    limit: float | None = GPT_OSS_LIMIT
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False


def _gptoss(name: str, experts: int) -> Model:
    return Model(name, 2880, 2880, experts, 4)


def _deepseek(name: str, hidden: int, inter: int, experts: int, top_k: int, groups: int, keep: int) -> Model:
    return Model(
        name,
        hidden,
        inter,
        experts,
        top_k,
        routing="DeepSeekV3",
        activation="silu",
        layout="chunked_gate_up",
        bias=False,
        limit=None,
        n_group=groups,
        topk_group=keep,
        routed_scaling_factor=2.5,
        correction_bias=True,
    )


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        _gptoss("gptoss20b", 32),  # 24 layers, E=32, top-4, H=I=2880 (H/32 = 90: not a multiple of 4)
        _gptoss("gptoss120b", 128),
        _deepseek("dsv3", 7168, 2048, 256, 8, 8, 4),  # DeepSeek-V3-style MXFP4, chunked [gate; up]
        _deepseek("dsmini", 256, 128, 16, 4, 4, 2),  # the same structure at CI size
        Model("tiny", 64, 64, 8, 2),  # GPT-OSS structure at CI size
        Model("gptosstiny", 256, 256, 8, 2),  # the tiny trained GPT-OSS fixture's layer (harness.e2e.tiny)
        Model("small", 128, 96, 16, 4),
        Model("odd", 96, 160, 6, 2),  # H/32 = 3, I/32 = 5: off every padding multiple
        Model("tpsmall", 64, 224, 8, 2),  # I/32 = 7: uneven TP shards (TP2: 128 + 96, TP4: 64 x3 + 32)
        Model("manyexperts", 4096, 256, 256, 6),  # many small groups: where a grouped GEMM races
    )
}


def tp_shard(intermediate: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, stop) of TP rank ``rank``'s slice of the intermediate dimension: every rank but the
    last gets ceil((I/32)/tp) blocks of 32, the last the rest (gpt-oss TP4: 736 x3 + 672)."""
    per = math.ceil(intermediate // BLOCK / tp) * BLOCK
    start = min(rank * per, intermediate)
    return start, min(start + per, intermediate)


def _number_token(v: float) -> str:
    """A number as an id token: 1.0 -> 1, 0.5 -> 0p5, -2.25 -> m2p25."""
    text = f"{float(v):g}"
    return text.replace("-", "m").replace(".", "p").replace("+", "")


@dataclass(frozen=True)
class Case:
    """One layer call. Build with ``make_case``; fields left out take the model's values."""

    model: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    routing: str
    activation: str
    layout: str
    bias: bool
    alpha: float
    beta: float
    limit: float | None
    n_group: int | None
    topk_group: int | None
    routed_scaling_factor: float
    correction_bias: bool
    tokens: int
    inputs: str = "normal"
    skew: str = "uniform"
    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    replica: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, accepted: str) -> ValueError:
            return ValueError(f"Case.{name} must be {accepted}; got {getattr(self, name)!r}")

        if self.model not in MODELS:
            raise bad("model", f"one of {', '.join(MODELS)}")
        for name in ("hidden", "intermediate"):
            v = getattr(self, name)
            if v <= 0 or v % BLOCK:
                raise bad(name, f"a positive multiple of {BLOCK}")
        if self.experts < 1:
            raise bad("experts", "at least 1")
        if not 1 <= self.top_k <= self.experts:
            raise bad("top_k", f"in 1..experts={self.experts}")
        if self.routing not in ROUTING_METHODS:
            raise bad("routing", f"one of {', '.join(ROUTING_METHODS)}")
        if self.activation not in ACTIVATIONS:
            raise bad("activation", f"one of {', '.join(ACTIVATIONS)}")
        if self.layout not in LAYOUTS:
            raise bad("layout", f"one of {', '.join(LAYOUTS)}")
        if self.tokens < 0:
            raise bad("tokens", "a non-negative int")
        if self.inputs not in INPUT_DISTRIBUTIONS:
            raise bad("inputs", f"one of {', '.join(INPUT_DISTRIBUTIONS)}")
        if self.skew not in SKEWS:
            raise bad("skew", f"one of {', '.join(SKEWS)}")
        if self.skew == "sparse" and self.top_k > (self.experts + 1) // 2:
            raise bad(
                "skew", f"not 'sparse' when top_k={self.top_k} exceeds the {(self.experts + 1) // 2} even experts"
            )
        if self.skew == "neartie" and self.experts > NEARTIE_MAX_EXPERTS:
            raise bad("skew", f"not 'neartie' with more than {NEARTIE_MAX_EXPERTS} experts ({self.experts})")
        if self.skew == "balanced":
            if (self.tokens * self.top_k) % self.experts:
                raise bad("skew", f"'balanced' only where tokens x top_k ({self.tokens} x {self.top_k}) is a multiple "
                                  f"of experts={self.experts}")  # fmt: skip
            if self.n_group is not None or self.correction_bias:
                raise bad("skew", "'balanced' only with an ungrouped selection on the logits (no groups or correction "
                                  "bias)")  # fmt: skip
        if not 0 <= self.tp_rank < self.tp:
            raise bad("tp_rank", f"in 0..tp-1={self.tp - 1}")
        lo, hi = tp_shard(self.intermediate, self.tp, self.tp_rank)
        if hi <= lo:
            raise bad("tp", f"small enough that TP rank {self.tp_rank} holds part of I={self.intermediate}")
        if self.ep < 1 or self.experts % self.ep:
            raise bad("ep", f"a divisor of experts={self.experts}")
        if not 0 <= self.ep_rank < self.ep:
            raise bad("ep_rank", f"in 0..ep-1={self.ep - 1}")
        if self.replica < 0:
            raise bad("replica", "a non-negative int")

    @property
    def id(self) -> str:
        """``model-layout-t{T}`` plus a token for each way the case departs from the model's
        defaults: routing method, activation, input distribution, skew, shard, replica."""
        m = MODELS[self.model]
        parts = [self.model, _LAYOUT_TOKEN[self.layout]]
        if self.activation != m.activation:
            parts.append(self.activation)
        if self.activation == "swigluoai":  # its parameters, where they depart from the model's
            for name, tok in (("alpha", "alpha"), ("beta", "beta"), ("limit", "lim")):
                v = getattr(self, name)
                if v != getattr(m, name):
                    parts.append(tok + ("none" if v is None else _number_token(v)))
        if self.routing != m.routing:
            parts.append(self.routing.lower())
        if (self.hidden, self.intermediate, self.experts, self.top_k) != (m.hidden, m.intermediate, m.experts, m.top_k):
            parts.append(f"h{self.hidden}i{self.intermediate}e{self.experts}k{self.top_k}")
        if not self.bias and m.bias:
            parts.append("nobias")
        parts.append(f"t{self.tokens}")
        if self.inputs != "normal":
            parts.append(self.inputs)
        if self.skew != "uniform":
            parts.append(self.skew)
        if self.tp > 1:
            parts.append(f"tp{self.tp}r{self.tp_rank}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}r{self.ep_rank}")
        if self.replica:
            parts.append(f"s{self.replica}")
        out = "-".join(parts)
        assert _TOKEN_RE.match(out), out
        return out

    @property
    def conversion_key(self) -> Case:
        """The case without what only its tokens and router logits derive from (``tokens``,
        ``skew``): every case of one layer, shard, routing and activation has the same, and a
        backend that ``converts_per_layer`` converts the same weights for all of them."""
        return replace(self, tokens=0, skew="uniform")

    @property
    def layer_key(self) -> str:
        """What the layer's weights derive from: the same for every token count, skew and shard of
        one layer, so that TP and EP shards of a case are slices of one full layer."""
        shape = f"h{self.hidden}i{self.intermediate}e{self.experts}"
        return f"{self.model}-{_LAYOUT_TOKEN[self.layout]}-{self.inputs}-{shape}-s{self.replica}"

    @property
    def weight_elements(self) -> int:
        """Weight elements of the full layer: each expert's w13 [2I, H] and w2 [H, I]."""
        return self.experts * 3 * self.hidden * self.intermediate

    @property
    def tokens_key(self) -> str:
        """What the tokens and router logits derive from: the id without the shard."""
        return replace(self, tp=1, tp_rank=0, ep=1, ep_rank=0).id

    @property
    def intermediate_shard(self) -> tuple[int, int]:
        """This TP rank's [start, stop) of the intermediate dimension."""
        return tp_shard(self.intermediate, self.tp, self.tp_rank)

    @property
    def local_experts(self) -> tuple[int, int]:
        """This EP rank's [start, stop) of the experts."""
        per = self.experts // self.ep
        return self.ep_rank * per, (self.ep_rank + 1) * per

    def to_dict(self) -> dict[str, object]:
        """Plain data (JSON-ready); ``Case.from_dict`` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Case:
        """Rebuild a case; unknown keys are an error (a record from another version must say so)."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown Case fields {sorted(unknown)}; accepted: {sorted(names)}")
        return cls(**data)


def make_case(model: str, tokens: int, **overrides: object) -> Case:
    """A case of zoo model ``model`` with ``tokens`` tokens; ``overrides`` replace Case fields."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {model!r}")
    m = MODELS[model]
    base = {f.name: getattr(m, f.name) for f in fields(Model) if f.name != "name"}
    base.update(overrides)
    return Case(model=model, tokens=tokens, **base)
