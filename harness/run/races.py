"""The race hunt's arithmetic: how many calls see a race of a given rate, and what calls that saw
none say.

A race corrupts some calls of a kernel and not others. The same inputs and weights go through the
kernel many times (``engine.run_case``'s ``repeat``), and every run is compared bit for bit with the
first. If a race corrupts each call independently with probability ``rate``, then ``n`` calls all
agree with probability ``(1 - rate)**n + rate**n``. The second term counts the case where every call
is corrupted alike, and it is negligible for any rate worth hunting. So a hunt that saw no
difference in ``n`` calls rules out a race of rate ``rate`` or more with confidence
``1 - (1 - rate)**n``. Seeing one at ``rate`` with probability ``confidence`` takes
``log(1 - confidence) / log(1 - rate)`` calls: 688 at 1% and 99.9%.

Where the calls go (``hunt_plan``). Every case's kernel runs twice anyway (the guarded runs,
compared bit for bit). The hunt's repeats go to the quarter of a kernel's cases with the most
routed rows (tokens x top-k), evenly, as many as make those cases' calls alone reach the number
above. A grouped GEMM races on its
group switches, and a call with more routed rows makes more of them and runs longer beside the
hunt's company. Measured in a sign-off on an H100, FlashInfer 0.6.14's SM90 kernel (direct and
through vLLM's layer) beside the copy companion, with the repeats spread evenly over its cases: 4
of the 204 calls at T >= 4095 differed from their case's first run, and none of the 1,348 calls at
smaller T. The power stated is over the hunted cases' calls: it rules out a race that corrupts ``rate``
of the calls at the shapes with the most routed rows. The other cases' two runs still catch a
race they show, but are not counted towards the power (on a GPU they have no company).

What this cannot see: a race that needs conditions the hunt does not make (other work on the GPU
at the same moment, another shape, another clock), a race of small calls alone that their two
guarded runs miss, and a corruption that is the same in every call, which is not a race and is
judged against the bound instead. The independence it assumes across calls is the hunt's
premise, not a measured fact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

GUARDED_RUNS = 2
"""The runs every check makes (``engine.guarded_call``) before the hunt's repeats."""


def check_rate_confidence(rate: float, confidence: float) -> None:
    """Both must lie strictly between 0 and 1."""
    for name, value in (("rate", rate), ("confidence", confidence)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise ValueError(f"{name}: a number strictly between 0 and 1, not {value!r}")


def calls_needed(rate: float, confidence: float) -> int:
    """The fewest calls that see a race of ``rate`` with probability ``confidence``."""
    check_rate_confidence(rate, confidence)
    return math.ceil(math.log1p(-confidence) / math.log1p(-rate))


HEAVY_SHARE = 0.25
"""The share of a hunted kernel's cases, those with the most routed rows, that take its repeats."""


def hunt_plan(rate: float, confidence: float, rows: Mapping[str, int]) -> dict[str, int]:
    """The repeats (beyond the two guarded runs) of each case id of ``rows`` (its routed rows:
    tokens x top-k): the same number, at least one, on each of the ``HEAVY_SHARE`` of the cases
    with the most routed rows (ties in id order, so that a plan depends on the cases alone), so
    that their calls alone reach ``calls_needed``; none on the others. Only calls with repeats
    run beside the hunt's company on a GPU, and the report counts those there."""
    plan = dict.fromkeys(rows, 0)
    if not rows:
        return plan
    heavy = sorted(rows, key=lambda c: (-rows[c], c))[: math.ceil(len(rows) * HEAVY_SHARE)]
    each = max(1, math.ceil(calls_needed(rate, confidence) / len(heavy)) - GUARDED_RUNS)
    plan.update(dict.fromkeys(heavy, each))
    return plan


def plan_line(backend: str, plan: Mapping[str, int], rows: Mapping[str, int]) -> str:
    """How ``hunt_plan`` placed a backend's calls, in words: the repeats on each heavy case, how
    many there are and from how many routed rows, and the guarded runs alone on the rest."""
    heavy = [c for c, n in plan.items() if n]
    if not heavy:
        return f"{backend}: no case here"
    least = min(rows[c] for c in heavy)
    rest = len(plan) - len(heavy)
    return (f"{backend}: {plan[heavy[0]]} repeats on each of its {len(heavy)} cases with the most routed rows "
            f"(tokens x top-k >= {least})" + (f", the two guarded runs alone on the other {rest}" if rest else ""))


def confidence_from(calls: int, rate: float) -> float:
    """How sure ``calls`` calls that all agreed make us that no race has rate ``rate`` or more."""
    return 1.0 - (1.0 - rate) ** calls


def company_of(contentions: Iterable[str]) -> str | None:
    """What a backend's hunted calls ran beside, in words, from its cases' record ``contention``
    (``harness.run.contention``); None where no case says (results made before it was recorded)."""
    from mxmoe.harness.run.contention import CONTENTIONS

    said = list(contentions)
    kinds = sorted({c for c in said if c})
    if not kinds:
        return None
    words = "; ".join(CONTENTIONS.get(k, k) for k in kinds)
    return words if len(kinds) == 1 and all(said) else f"{words} ({sum(map(bool, said))} of {len(said)} cases said)"


def hunt_line(
    backend: str,
    arch: str,
    runs: Iterable[tuple[int, int]],
    rate: float | None = None,
    deterministic: bool = True,
    company: str | None = None,
) -> str:
    """One backend's hunt on one arch, from each case's (calls, calls that differed from its first):
    what was seen, beside what (``company``: ``company_of``), and, given ``rate``, the power that
    calls which all agreed give under that company. A backend declared non-deterministic differs by
    design; its worst differing run of each case was judged against the bound (a wrong one is its
    case's FAIL), so what the calls rule out is a wrong run."""
    runs = list(runs)
    calls, differing = sum(c for c, _ in runs), sum(d for _, d in runs)
    head = f"{backend} ({arch}): {calls} calls over {len(runs)} cases" + (f", beside {company}" if company else "")
    if not deterministic:
        head += (f"; {differing} differed from their case's first run (declared non-deterministic: judged "
                 "against the bound)")
        if rate is None:
            return head
        return f"{head}: no wrong run at rate >= {rate:g} with confidence {confidence_from(calls, rate):.4%}"
    if differing:
        cases = sum(1 for _, d in runs if d)
        return (f"{head}; {differing} differed from their case's first run, in {cases} cases: a race "
                f"(about {differing / calls:.2%} of calls)")  # fmt: skip
    if rate is None:
        return f"{head}; none differed"
    return f"{head}; none differed: no race at rate >= {rate:g} with confidence {confidence_from(calls, rate):.4%}"
