"""The per-layer differential on a model's own activations, and the whole-model comparison.

A model run through backend X is teacher-forced on a batch of token sequences. At every MoE layer
the call X receives (the layer input after the post-attention norm, the router's logits, the
layer's MXFP4 weights) goes through the engine's guarded call (``engine.guarded_call``: poisoned
outputs, input snapshots, a second run compared bit for bit) and X's output is judged against the
oracle on that same input with the per-element bound of X's declared arithmetic, exactly as a
case is judged; the model then continues with X's output. So each layer is checked on the
activations X itself produced upstream, and the first layer that fails is where the fault is,
not where its effect became visible.

Real activations route on real logits, which are bf16 values and can tie exactly at the top-k
boundary; kernels may break such a tie either way (AITER keeps the higher index, the oracle and
triton_kernels the lower). A token routed at an exact tie is judged against the resolution its
output is closer to (``bounds.tie_aware_bound``, as every guarded call does); the number of such
tokens is reported.

The whole-model comparison is the oracle-MoE model against X's: the KL divergence of X's
next-token distribution from the oracle model's, and how often their top-1 tokens agree. These
see what the layers' faults do to the model; the per-layer verdicts see faults that the model's
output hides (one wrong scale byte moves KL by little and top-1 by nothing).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.e2e.model import BackendMoE, MoEModel
from mxmoe.harness.judge.bounds import tied_tokens
from mxmoe.harness.judge.engine import Result, guarded_call, test_id
from mxmoe.harness.run.registry import Loaded
from mxmoe.harness.run.results import Recorder, save_repro

LAYER_TEST_ID = re.compile(r"-layer(\d+)$")
"""A layer's record in a model check has its case's test id with ``-layer<N>`` appended (its
inputs are the model's own activations, not the case's generated ones): a report tells the
model check's records from the kernel sweep's by this."""


@dataclass
class LayerVerdict:
    """One layer call, judged."""

    layer: int
    result: Result
    tied_tokens: int
    repro: Path | None = None


class LayerChecker:
    """The observer a ``MoEModel`` calls at every MoE layer during a checked forward."""

    def __init__(
        self,
        model: MoEModel,
        results: str | Path | None = None,
        progress: Callable[[LayerVerdict], None] | None = None,
    ) -> None:
        self.model = model
        self.progress = progress
        self.results = None if results is None else Path(results)
        self.recorder = None if results is None else Recorder(results)
        self.verdicts: list[LayerVerdict] = []

    def __call__(self, moe: BackendMoE, inputs: CaseInputs) -> torch.Tensor:
        """Judge this layer call; hand X's output on (or stop the forward if X raised)."""
        loaded = moe.loaded
        backend = loaded.backend
        d = backend.declaration
        tid = f"{test_id(d.id, moe.arch, inputs.case)}-layer{moe.layer}"  # LAYER_TEST_ID
        result = Result(tid, d.id, moe.arch, inputs.case, "SKIP")
        start = time.perf_counter()
        got = guarded_call(backend, inputs, result, prepared=lambda: moe.prepared_for(inputs))  # tie-aware
        result.seconds = time.perf_counter() - start
        verdict = LayerVerdict(moe.layer, result, int(tied_tokens(inputs).sum()))
        if self.results is not None and result.outcome in ("FAIL", "ERROR"):
            verdict.repro = save_repro(self.results, result, inputs, loaded.spec)
        if self.recorder is not None:
            self.recorder.record(result, loaded, verdict.repro)
        self.verdicts.append(verdict)
        if self.progress is not None:
            self.progress(verdict)
        if got is None:
            raise LayerFailed(verdict)
        return got


class LayerFailed(RuntimeError):
    """A backend raised inside a checked forward: the forward cannot go on past that layer."""

    def __init__(self, verdict: LayerVerdict) -> None:
        super().__init__(f"layer {verdict.layer}: {verdict.result.reason}")
        self.verdict = verdict


@dataclass
class ModelComparison:
    """X's model against the oracle-MoE model on the same tokens (positions under ``mask``)."""

    kl_mean: float
    kl_max: float
    top1_agreement: float
    positions: int

    def to_dict(self) -> dict[str, float]:
        """Plain data."""
        return dataclasses.asdict(self)


def compare_logits(ref: torch.Tensor, got: torch.Tensor, mask: torch.Tensor) -> ModelComparison:
    """KL(P_ref || P_got) of the next-token distributions and top-1 agreement, over ``mask``'s
    positions ([B, S] bool); computed in float64 one sequence at a time."""
    kls, agree, n = [], 0, 0
    for b in range(ref.shape[0]):
        keep = mask[b].to(ref.device)
        r = torch.log_softmax(ref[b][keep].double(), dim=-1)
        g = torch.log_softmax(got[b][keep].double(), dim=-1)
        kls.append((r.exp() * (r - g)).sum(-1))
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        n += int(keep.sum())
    kl = torch.cat(kls) if kls else torch.zeros(0, dtype=torch.float64)
    return ModelComparison(
        kl_mean=float(kl.mean()) if n else 0.0,
        kl_max=float(kl.max()) if n else 0.0,
        top1_agreement=agree / n if n else 1.0,
        positions=n,
    )


@dataclass
class ModelCheck:
    """Everything ``check_model`` found."""

    backend: str
    planted: dict[int, str]
    layers: list[LayerVerdict]
    comparison: ModelComparison | None
    forward_seconds: list[float] = field(default_factory=list)
    """Unchecked forwards of X's model (after one warm-up)."""
    oracle_forward_seconds: float = 0.0
    aborted: str = ""
    """Why the checked forward stopped early (a backend raised), else empty."""

    @property
    def first_failure(self) -> int | None:
        """The first layer whose verdict is FAIL or ERROR."""
        bad = [v.layer for v in self.layers if v.result.outcome in ("FAIL", "ERROR")]
        return min(bad) if bad else None

    @property
    def passed(self) -> bool:
        """At least one layer judged, every layer judged, and every one PASS: a check that judged no
        layer (the backend raised before the first) passed nothing."""
        return bool(self.layers) and not self.aborted and all(v.result.outcome == "PASS" for v in self.layers)

    def to_dict(self) -> dict[str, object]:
        """Plain data (the run's summary file; the layers' full records are in the results JSONL)."""
        return {
            "backend": self.backend,
            "planted": {str(k): v for k, v in self.planted.items()},
            "first_failure": self.first_failure,
            "passed": self.passed,
            "aborted": self.aborted,
            "comparison": None if self.comparison is None else self.comparison.to_dict(),
            "forward_seconds": self.forward_seconds,
            "oracle_forward_seconds": self.oracle_forward_seconds,
            "layers": [
                {
                    "layer": v.layer,
                    "test_id": v.result.test_id,
                    "backend": v.result.backend,
                    "outcome": v.result.outcome,
                    "reason": v.result.reason,
                    "worst_ratio": v.result.metrics.worst_ratio,
                    "over_bound": v.result.metrics.over_bound,
                    "over_rigorous": v.result.metrics.over_rigorous,
                    "elements": v.result.metrics.elements,
                    "tied_tokens": v.tied_tokens,
                    "seconds": v.result.seconds,
                    "repro": None if v.repro is None else str(v.repro),
                }
                for v in self.layers
            ],
        }


def check_model(
    model: MoEModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    backend: Loaded,
    oracle: Loaded,
    plants: dict[int, Loaded] | None = None,
    results: str | Path | None = None,
    timing_repeats: int = 0,
    progress: Callable[[LayerVerdict], None] | None = None,
) -> ModelCheck:
    """Teacher-force ``ids`` [B, S] through the oracle-MoE model, then through ``backend``'s
    (``plants``: other backends at some layers) with every layer judged; compare the two models'
    next-token distributions over ``mask``; time ``timing_repeats`` unchecked forwards."""
    model.use(oracle)
    ref_logits, oracle_seconds = model.timed_logits(ids)
    model.use(backend, plants)
    checker = LayerChecker(model, results, progress)
    model.set_observer(checker)
    aborted = ""
    got_logits = None
    try:
        got_logits = model.logits(ids)
    except LayerFailed as exc:
        aborted = str(exc)
    except Exception as exc:  # outside the judged calls (the model's own code, say): still this check's verdict
        aborted = f"raised outside the checked layers: {type(exc).__name__}: {exc}"
    finally:
        model.set_observer(None)
    comparison = None if got_logits is None else compare_logits(ref_logits, got_logits, mask)
    seconds = []
    if timing_repeats and not aborted:
        try:
            model.logits(ids)  # warm-up: compilation, autotuning, caches
            seconds = [model.timed_logits(ids)[1] for _ in range(timing_repeats)]
        except Exception as exc:  # an unchecked forward that raises: the kernel is not fit to ship either
            aborted = f"an unchecked (timed) forward raised: {type(exc).__name__}: {exc}"
    return ModelCheck(
        backend=backend.backend.declaration.id,
        planted={i: p.backend.declaration.id for i, p in (plants or {}).items()},
        layers=checker.verdicts,
        comparison=comparison,
        forward_seconds=seconds,
        oracle_forward_seconds=oracle_seconds,
        aborted=aborted,
    )
