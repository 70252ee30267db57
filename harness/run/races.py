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

What this cannot see: a race that needs conditions the hunt does not make (other work on the GPU
at the same moment, another shape, another clock), and a corruption that is the same in every
call, which is not a race and is judged against the bound instead. The independence it assumes
across calls is the hunt's premise, not a measured fact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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


def repeats_for(rate: float, confidence: float, cases: int) -> int:
    """The repeats per case (beyond the two guarded runs) that give ``cases`` cases together
    ``calls_needed`` calls; 0 where the guarded runs already do."""
    if cases < 1:
        return 0
    return max(0, math.ceil(calls_needed(rate, confidence) / cases) - GUARDED_RUNS)


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
