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
compared bit for bit). In a check that runs the production shapes (``check --production-shapes``,
the sign-off's on a GPU; ``profiles.production_cases``: gpt-oss's layers from decode to long
prefill, and the shapes where races live), the hunt's repeats go evenly to those cases, as many as
make their calls alone reach the number above: a race is a hazard of the shapes a kernel serves,
and the power the policy asks for is over calls at those shapes. Any other check, and a kernel
that runs none of them, spreads its repeats over every case. Measured in a sign-off on an H100,
FlashInfer 0.6.14's SM90 kernel (direct and through vLLM's layer) beside the copy companion, with
the repeats spread over every case: 4 of the 204 calls at T >= 4095 differed from their case's
first run, and none of the 1,348 calls at smaller T, the pr profile's small cases among them.
Putting every repeat on the heaviest quarter of the cases would meet such a race more often, at
twice the kernel time (396 s of test time against 184, estimated from that sign-off's records);
the production shapes alone cost what the even spread did (192 s). The other cases' two runs
still catch a race they show, but are not counted towards the power (on a GPU they have no
company). Nor are a case's calls at T = 0, where the kernel writes no output for a race to spoil:
such a case gets no repeats, and the power is over the calls that wrote something (the pr
profile's 5 empty cases once took 75 of its 735 hunted calls, which overstated the power).

What this cannot see: a race that needs conditions the hunt does not make (other work on the GPU
at the same moment, another shape, another clock), a race of the small cases alone that their two
guarded runs miss, and a corruption that is the same in every call, which is not a race and is
judged against the bound instead. The independence it assumes across calls is the hunt's
premise, not a measured fact.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

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


def hunt_plan(
    rate: float, confidence: float, cases: Iterable[str], hunt_in: Collection[str], empty: Collection[str] = ()
) -> dict[str, int]:
    """The repeats (beyond the two guarded runs) of each case id of ``cases``: the same number, at
    least one, on each of those in ``hunt_in`` (the production shapes' ids), so that their calls
    alone reach ``calls_needed``, and none on the others; on every case where none is in
    ``hunt_in``. ``empty``: the cases whose calls write no output (T = 0). No race can spoil what a
    call does not write, so they get no repeats and their calls do not count towards the power.
    Only calls with repeats run beside the hunt's company on a GPU, and the report counts those
    there."""
    plan = dict.fromkeys(cases, 0)
    live = [c for c in plan if c not in empty]
    hunted = [c for c in live if c in hunt_in] or live
    if hunted:
        each = max(1, math.ceil(calls_needed(rate, confidence) / len(hunted)) - GUARDED_RUNS)
        plan.update(dict.fromkeys(hunted, each))
    return plan


def plan_line(backend: str, plan: Mapping[str, int], hunt_in: Collection[str], empty: Collection[str] = ()) -> str:
    """Where ``hunt_plan`` put a backend's calls, in words."""
    hunted = [c for c, n in plan.items() if n]
    if not hunted:
        return f"{backend}: no case here" if not plan else f"{backend}: no case here writes output"
    where = " at production shapes" if hunted[0] in hunt_in else " (none at production shapes)" if hunt_in else ""
    rest = len(plan) - len(hunted)
    nothing = sum(1 for c in plan if c in empty and not plan[c])
    why = ("" if not nothing else ", at T = 0: their calls write no output for a race to spoil" if nothing == rest
           else f" ({nothing} of them at T = 0, whose calls write no output for a race to spoil)")  # fmt: skip
    return (f"{backend}: {plan[hunted[0]]} repeats on each of its {len(hunted)} cases{where}"
            + (f", the two guarded runs alone on the other {rest}{why}" if rest else ""))


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
