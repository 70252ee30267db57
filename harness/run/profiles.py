"""The built-in case lists of each profile. A list is data, the same on every host: which cases
run where is decided by the backends' declarations and the host, never by the list.

* ``pr``: small shapes that run in seconds on a CPU (under the Triton interpreter too), covering
  every structure once: token counts 0, 1, odd and larger, each zoo model, wide inputs, hot and
  sparse routing, uneven TP shards, EP ranks, other routing methods and layouts, one decode
  bucket (T=3), one long prefill (T=8192), every expert one over a block (17 tokens each), and
  gpt-oss-20b itself at T=1 (H/32 = 90, whole and as an uneven TP8 shard).
* ``nightly``: a grid over the same structures with many more token counts, distributions and
  seeds (replicas), plus the production shapes (gpt-oss-20b and -120b, DeepSeek-V3) at
  T = 1, 7, 128, 4096 (gpt-oss under both Renormalize and RenormalizeNaive), gpt-oss TP and EP
  shards, and the serving regime at gpt-oss's shapes: every decode bucket boundary
  (``DECODE_TOKENS``), long prefill (``PREFILL_TOKENS``), where tiles break (T = 127, 129, 255,
  257, 4095, 4097, and every expert one over each block size, ``BLOCK_SIZES``), hot, sparse
  (experts with no tokens), all-negative and near-tied logits, and trained-size biases; meant
  for GPUs.

Kernel libraries pick their kernel by buckets of the token count (FlashInfer's autotuner by powers
of two, AITER by ranges that start at 1-2, 3-4, 5-8, ...) or of the tokens per expert
(triton_kernels' block_m, vLLM's Marlin block size), and a kernel wrong in one bucket is right in
every other: so the production shapes take each side of each boundary. A TP or EP shard does not
move either count (a shard sees all T tokens, and each local expert the same share of them), so
the shards stay at T=128 and at one decode count.
"""

from __future__ import annotations

import itertools

from mxmoe.harness.contract.cases import MODELS, Case, make_case

PROFILES = ("pr", "nightly")
SMALL_MODELS = ("tiny", "small", "odd", "dsmini", "tpsmall")
BIG_MODELS = ("gptoss20b", "gptoss120b", "dsv3")
_OTHER_ROUTINGS = ("Default", "RenormalizeNaive", "TopK", "Sigmoid", "SigmoidRenorm", "TopKSigmoid", "MiniMax2")
DECODE_TOKENS = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65)
"""Each side of every power-of-two bucket boundary a decode batch meets (FlashInfer's autotuner
buckets by powers of two; AITER's kernel table has a bucket of 3 and 4 tokens)."""
PREFILL_TOKENS = (8192, 16384)
"""Chunked prefill: vLLM sends up to its max batched tokens in one call (8192 by default on large
GPUs, more where raised)."""
BLOCK_SIZES = (8, 16, 32, 48, 64, 128)
"""The M block sizes the adapters' kernels pick by tokens per expert: vLLM's Marlin 8, 16, 32, 48
or 64; triton_kernels' block_m 16 to 128. Balanced cases put one token over each on every expert."""


def _pr() -> list[Case]:
    cases = [make_case(m, t) for m in SMALL_MODELS for t in (0, 1, 7, 33)]
    cases += [
        make_case("tiny", 16, inputs="wide"),
        make_case("small", 16, inputs="wide"),
        make_case("dsmini", 16, inputs="wide"),
        make_case("small", 16, skew="hot"),
        make_case("small", 16, skew="sparse"),
        make_case("dsmini", 16, skew="sparse"),
        make_case("small", 16, skew="negative"),
        make_case("small", 16, skew="neartie"),
        make_case("small", 20, skew="balanced"),  # 5 tokens per expert
        make_case("small", 68, skew="balanced"),  # 17 per expert: one over a block of 16
        make_case("small", 3),  # a decode bucket of its own in several kernel libraries
        make_case("odd", 8192),  # a long prefill
        make_case("small", 16, inputs="trained"),
        make_case("tpsmall", 9, tp=2, tp_rank=0),
        make_case("tpsmall", 9, tp=2, tp_rank=1),
        make_case("tpsmall", 9, tp=4, tp_rank=3),
        make_case("dsmini", 9, ep=2, ep_rank=1),
        make_case("small", 9, ep=4, ep_rank=2),
        make_case("tiny", 8, routing="Llama4", top_k=1, activation="silu", limit=None),
        make_case("tiny", 8, routing="Default"),
        make_case("tiny", 8, routing="RenormalizeNaive"),
        make_case("small", 8, routing="Sigmoid"),
        make_case("small", 8, routing="MiniMax2", correction_bias=True, routed_scaling_factor=1.5),
        make_case("small", 8, activation="silu", limit=None),
        make_case("small", 8, limit=1.0),  # a clamp that binds often: where clamp faults are material
        make_case("tiny", 8, layout="chunked_gate_up"),
        make_case("tiny", 8, bias=False),
        make_case("gptoss20b", 1),
        make_case("gptoss20b", 1, tp=8, tp_rank=7),
    ]
    return cases


def _nightly() -> list[Case]:
    cases = []
    tokens = (0, 1, 2, 3, 5, 7, 8, 16, 31, 33, 64, 128)
    for m, t, inputs, skew, rep in itertools.product(
        SMALL_MODELS, tokens, ("normal", "wide"), ("uniform", "hot", "sparse"), range(4)
    ):
        cases.append(make_case(m, t, inputs=inputs, skew=skew, replica=rep))
    for m, routing, t, rep in itertools.product(("tiny", "small"), _OTHER_ROUTINGS, (1, 7, 33, 100), range(4)):
        extra = {"correction_bias": True, "routed_scaling_factor": 1.5} if routing == "MiniMax2" else {}
        cases.append(make_case(m, t, routing=routing, replica=rep, **extra))
    for m, act, layout, t, rep in itertools.product(
        ("tiny", "small", "odd"), ("silu", "swigluoai"), ("interleaved", "chunked_gate_up"), (1, 17, 64), range(4)
    ):
        cases.append(make_case(m, t, activation=act, limit=None if act == "silu" else 7.0, layout=layout, replica=rep))
    for t, rep in itertools.product((1, 9, 40), range(4)):
        cases += [make_case("tpsmall", t, tp=tp, tp_rank=r, replica=rep) for tp in (2, 4) for r in range(tp)]
        cases += [make_case("dsmini", t, ep=ep, ep_rank=r, replica=rep) for ep in (2, 4) for r in range(ep)]
        cases.append(make_case("tiny", t, routing="Llama4", top_k=1, activation="silu", limit=None, replica=rep))
    for m, t in itertools.product(BIG_MODELS, (1, 7, 128, 4096)):
        cases.append(make_case(m, t))
    for m, t in itertools.product(BIG_MODELS[:2], (1, 7, 128, 4096)):  # vLLM's other GPT-OSS routing path
        cases.append(make_case(m, t, routing="RenormalizeNaive"))
    # the serving regime at production shapes: each side of every decode bucket boundary, long
    # prefill, token counts around the block sizes, every expert one over each block size (T x 4 /
    # E tokens each), the adversarial routings, trained-size biases
    for m in BIG_MODELS[:2]:
        cases += [make_case(m, t) for t in (*DECODE_TOKENS, 127, 129, 255, 257, 4095, 4097, *PREFILL_TOKENS)]
        per = MODELS[m].experts // MODELS[m].top_k
        cases += [make_case(m, per * (b + 1), skew="balanced") for b in BLOCK_SIZES]
        cases += [make_case(m, 128, skew=s) for s in ("hot", "sparse", "negative", "neartie")]
        cases += [make_case(m, 128, inputs="trained"), make_case(m, 4096, inputs="trained")]
    for t in (4, 128):  # a decode batch and a prefill tile on the shards
        cases += [make_case("gptoss120b", t, tp=8, tp_rank=r) for r in (0, 7)]
        cases += [make_case("gptoss120b", t, ep=4, ep_rank=r) for r in (0, 3)]
        cases += [make_case("gptoss20b", t, tp=4, tp_rank=r) for r in (0, 3)]
    # where grouped GEMMs race: a group switch per few tiles, at many tokens a call
    cases += [make_case("manyexperts", t) for t in (128, 4096, 8192)]
    return cases


def profile_cases(profile: str) -> list[Case]:
    """The cases of ``profile`` (``pr`` or ``nightly``), each id once."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}; got {profile!r}")
    cases = _pr() if profile == "pr" else _nightly()
    unique: dict[str, Case] = {}
    for c in cases:  # grids overlap; one id must always mean one case
        if unique.setdefault(c.id, c) != c:
            raise AssertionError(f"two different cases share the id {c.id} in profile {profile}")
    return list(unique.values())


RACE_CASES = ("manyexperts-interleaved-t8192",)
"""Cases where grouped GEMMs race, judged beside the production shapes: 256 experts of 4096 x 256
at 8192 tokens, so that a persistent CTA switches expert every few tiles (FlashInfer #5438's
reproducer; its SM90 kernel corrupted 56,881 elements of one call there, on an H100)."""


def production_cases() -> list[Case]:
    """The production shapes: the nightly profile's gpt-oss cases (gpt-oss-20b and -120b from
    decode batches to long prefill, both GPT-OSS routing paths, tile breaks, adversarial routings,
    trained-size biases, TP and EP shards), and the cases where races live (``RACE_CASES``). A GPU
    sign-off judges every production kernel on them (``check --production-shapes``), and hunts
    races in them."""
    return [c for c in profile_cases("nightly") if c.model.startswith("gptoss") or c.id in RACE_CASES]
