"""Statistics of a GPQA run that a release manager can trust, and the verdict rule.

**Accuracy and its interval.** GPQA is scored on (question, repeat) samples, and the repeats of one
question are not independent: a question the model cannot answer is wrong in every repeat. The
variance of the accuracy is therefore the cluster-robust one, questions as clusters (Miller, "Adding
Error Bars to Evals", 2024, eq. 4): with k_q correct of n_q samples of question q, N = sum n_q and
p = sum k_q / N, Var(p) = Q / (Q - 1) * sum_q (k_q - p n_q)^2 / N^2. Its ratio to the binomial
variance p (1 - p) / N is the design effect d; the 95% interval is Wilson's score interval at the
effective sample size N / max(d, 1) (statsmodels' ``proportion_confint``), which stays inside
[0, 1] and is not degenerate at 0% or 100% as a normal interval is. With one repeat d = 1 and it is
the plain Wilson interval.

**Paired comparison with a baseline** (the oracle's MoE, or a previous run's per-sample file) on
the same samples, same choice orders: per-sample agreement of the extracted answers; the exact
McNemar test on the discordant pairs (b: baseline right and the backend wrong, c: the reverse;
statsmodels' ``mcnemar(exact=True)``, a two-sided binomial test of b against b + c at 1/2); and
the accuracy difference with a cluster-robust 95% interval (per-question sums of the paired
differences, Student's t with Q - 1 degrees of freedom, scipy). The McNemar test takes the pairs as
independent, which repeats of one question are not; the interval of the difference does not, and
both are reported.

**Thresholds** (docs/gpqa.md): the published GPQA-diamond accuracies of gpt-oss at each
reasoning effort, in the chain-of-thought form, less vLLM's margin of 0.05 (vLLM's CI passes
gpt-oss-20b at low effort at 0.568 - 0.05); for the tiny fixture on its own task, the accuracy the
oracle's MoE reached when it was trained (``fixture.json``) less the same margin. A bar holds for
the whole question set it was set on: a run of a sample (``--limit``) is judged by its baseline only.

**The verdict rule**, per backend:

* ERROR: the run did not finish (the backend raised, the server died, was unreachable or answered
  with something that is not a chat completion); there is no accuracy.
* SKIP: the backend declined to run here (its own gate, as a kernel check's SKIP: vLLM's oracle
  refusing the deployment on this host, for instance); there is no accuracy, and it is never a pass.
* FAIL: the accuracy is below the threshold of its (model, data, form, effort), as vLLM's CI
  judges (the point estimate, not the interval); or the exact McNemar test against the baseline
  rejects equal accuracy at alpha = 0.05, two-sided (a kernel that changes which questions the
  model gets right, in either direction, is not the model the baseline is).
* PASS: at least one of those checks applied, none failed, and the run had the power to see the
  smallest drop it guards against (``MIN_DROP`` at ``POWER``; ``power_to_see``): a run of a few
  questions that "passes" because it cannot fail is UNJUDGED, with its power.
* UNJUDGED: neither a threshold nor a baseline applies, or the run was too small to see a drop of
  ``MIN_DROP``; the numbers are reported, nothing is concluded.

**Power.** Against a baseline, the exact McNemar test of the paired samples (normal approximation,
Connor 1987): with n samples and a discordant share psi, a true drop of delta is rejected at alpha
with power Phi((delta sqrt(n) - z_{1-alpha/2} sqrt(psi)) / sqrt(psi - delta^2)), psi taken as the
run's own discordant share but never below delta (a drop of delta needs that many discordant
samples at least). Against a threshold alone, the point estimate's spread at its effective sample
size: power Phi(delta / SE - z_{1-alpha}). The larger of the checks that apply is the run's power.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

ALPHA = 0.05
MIN_DROP = 0.05
"""The smallest accuracy drop a GPQA PASS must have been able to see (5 points) ..."""
POWER = 0.8
"""... with this power; the policy's ``gpqa.min_drop`` and ``gpqa.power`` default to these."""
MARGIN = 0.05
"""vLLM's allowance below the published accuracy."""

PUBLISHED = {
    ("gpt-oss-20b", "low"): 0.568,
    ("gpt-oss-20b", "medium"): 0.660,
    ("gpt-oss-20b", "high"): 0.715,
    ("gpt-oss-120b", "low"): 0.671,
    ("gpt-oss-120b", "medium"): 0.731,
    ("gpt-oss-120b", "high"): 0.801,
}
"""GPQA-diamond accuracy of gpt-oss by reasoning effort (OpenAI's model card; docs/gpqa.md)."""


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """Accuracy over N samples of Q questions, with its 95% interval."""

    correct: int
    samples: int
    questions: int
    accuracy: float
    low: float
    high: float
    design_effect: float


@dataclasses.dataclass(frozen=True)
class Paired:
    """A backend against its baseline on the same samples."""

    samples: int
    agreement: float
    baseline_only: int  # b: the baseline right, the backend wrong
    backend_only: int  # c: the backend right, the baseline wrong
    mcnemar_p: float
    difference: float  # backend accuracy - baseline accuracy
    low: float
    high: float

    @property
    def differs(self) -> bool:
        return self.mcnemar_p < ALPHA


def _clusters(records: Sequence[dict], value: str) -> dict[str, list[float]]:
    by_q: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_q[r["question_id"]].append(float(r[value]))
    return by_q


def accuracy(records: Sequence[dict]) -> Accuracy:
    """Accuracy of per-sample records (``question_id``, ``correct``) with the cluster-robust
    Wilson interval of the module docstring."""
    from statsmodels.stats.proportion import proportion_confint

    if not records:
        raise ValueError("no samples to score")
    by_q = _clusters(records, "correct")
    n = len(records)
    k = sum(sum(v) for v in by_q.values())
    p = k / n
    q = len(by_q)
    d = 1.0
    binomial = p * (1 - p) / n
    if q > 1 and binomial > 0:
        clustered = q / (q - 1) * sum((sum(v) - p * len(v)) ** 2 for v in by_q.values()) / n**2
        d = clustered / binomial
    n_eff = n / max(d, 1.0)
    low, high = proportion_confint(p * n_eff, n_eff, alpha=ALPHA, method="wilson")
    return Accuracy(int(k), n, q, p, float(low), float(high), d)


def paired(baseline: Sequence[dict], backend: Sequence[dict]) -> Paired:
    """The paired comparison of the module docstring. Samples are matched by (question id,
    repeat); both runs must hold the same samples with the same choice orders."""
    from scipy.stats import t as student_t
    from statsmodels.stats.contingency_tables import mcnemar

    base = {(r["question_id"], r["repeat"]): r for r in baseline}
    mine = {(r["question_id"], r["repeat"]): r for r in backend}
    if set(base) != set(mine):
        raise ValueError(f"the baseline holds {len(base)} samples and the backend {len(mine)}, "
                         f"{len(set(base) ^ set(mine))} not in both: not the same questions and repeats")  # fmt: skip
    moved = [key for key in base if list(base[key]["permutation"]) != list(mine[key]["permutation"])]
    if moved:
        raise ValueError(f"{len(moved)} samples have other choice orders in the baseline: not the same prompts")
    b = sum(1 for key in base if base[key]["correct"] and not mine[key]["correct"])
    c = sum(1 for key in base if mine[key]["correct"] and not base[key]["correct"])
    both = sum(1 for key in base if base[key]["correct"] and mine[key]["correct"])
    agree = sum(1 for key in base if base[key]["extracted"] == mine[key]["extracted"])
    n = len(base)
    p = mcnemar([[both, b], [c, n - both - b - c]], exact=True).pvalue if b + c else 1.0
    diffs: dict[str, float] = defaultdict(float)
    sizes: dict[str, int] = defaultdict(int)
    for (qid, _), r in base.items():
        diffs[qid] += float(mine[(qid, _)]["correct"]) - float(r["correct"])
        sizes[qid] += 1
    delta = sum(diffs.values()) / n
    q = len(diffs)
    low = high = delta
    if q > 1:
        var = q / (q - 1) * sum((diffs[k] - delta * sizes[k]) ** 2 for k in diffs) / n**2
        half = float(student_t.ppf(1 - ALPHA / 2, q - 1)) * math.sqrt(var)
        low, high = delta - half, delta + half
    return Paired(n, agree / n, b, c, float(p), delta, low, high)


def threshold(model: str | None, variant: str, form: str, effort: str) -> tuple[float, str] | None:
    """(threshold, where it comes from) for a published configuration, else None."""
    published = PUBLISHED.get((model or "", effort))
    if published is None or variant != "diamond" or form != "cot":
        return None
    return published - MARGIN, f"published {model} GPQA-diamond at {effort} effort {published:.3f} - {MARGIN}"


def power_to_see(drop: float, acc: dict | Accuracy, pair: dict | Paired | None, thresholded: bool) -> float:
    """The power (module docstring) of a run with accuracy ``acc`` (and its paired comparison
    ``pair``, where there is a baseline; ``thresholded`` where a threshold applies) to see a true
    accuracy drop of ``drop``. 0 where no check applies."""
    from scipy.stats import norm

    a = acc if isinstance(acc, dict) else dataclasses.asdict(acc)
    p = pair if isinstance(pair, dict) or pair is None else dataclasses.asdict(pair)
    best = 0.0
    if p is not None and p.get("samples"):
        n = int(p["samples"])
        psi = max((int(p["baseline_only"]) + int(p["backend_only"])) / n, drop)
        z = (drop * math.sqrt(n) - float(norm.ppf(1 - ALPHA / 2)) * math.sqrt(psi)) / math.sqrt(psi - drop**2)
        best = max(best, float(norm.cdf(z)))
    if thresholded and a.get("samples"):
        n_eff = int(a["samples"]) / max(float(a.get("design_effect") or 1.0), 1.0)
        q = min(max(float(a["accuracy"]), 1 / (n_eff + 1)), 1 - 1 / (n_eff + 1))  # a spread even at 0% or 100%
        se = math.sqrt(q * (1 - q) / n_eff)
        best = max(best, float(norm.cdf(drop / se - float(norm.ppf(1 - ALPHA)))))
    return best


def verdict(acc: Accuracy | None, bar: tuple[float, str] | None, pair: Paired | None, error: str | None = None,
            drop: float = MIN_DROP, power: float = POWER, declined: str | None = None) -> tuple[str, str]:  # fmt: skip
    """(outcome, reason) by the rule of the module docstring."""
    if error is not None:
        return "ERROR", error
    if declined is not None:
        return "SKIP", declined
    if acc is None:
        raise ValueError("a finished run has an accuracy")
    fails, checks = [], []
    if bar is not None:
        checks.append("threshold")
        if acc.accuracy < bar[0]:
            fails.append(f"accuracy {acc.accuracy:.4f} < threshold {bar[0]:.3f} ({bar[1]})")
    if pair is not None:
        checks.append("baseline")
        if pair.differs:
            fails.append(f"differs from the baseline: exact McNemar p = {pair.mcnemar_p:.2g} < {ALPHA} "
                         f"({pair.baseline_only} samples only the baseline got right, {pair.backend_only} only this "
                         f"backend), accuracy difference {pair.difference:+.4f}")  # fmt: skip
    if fails:
        return "FAIL", "; ".join(fails)
    if not checks:
        return "UNJUDGED", "no threshold for this model, data and form, and no baseline"
    seen = power_to_see(drop, acc, pair, bar is not None)
    if seen < power:
        return "UNJUDGED", underpowered(acc.samples, drop, seen, power)
    return "PASS", "within " + " and ".join(checks) + f" (power {seen:.2f} to see a drop of {drop:.2f})"


def underpowered(samples: int, drop: float, seen: float, power: float) -> str:
    """The reason of a run too small to judge (one wording for the run and the report)."""
    return (f"too few samples to judge: {samples} samples would see a drop of {drop:.2f} with power {seen:.2f} "
            f"(< {power}); nothing is concluded")
