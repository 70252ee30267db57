"""The statistics and the verdict rule of ``harness.gpqa.stats`` on records built by hand."""

import math

import pytest

from mxmoe.harness.gpqa import stats


def recs(pattern, repeats=1, extracted=None):
    """Records of questions q0.. with ``pattern[q]`` correct repeats out of ``repeats``."""
    out = []
    for q, k in enumerate(pattern):
        for r in range(repeats):
            ok = r < k
            out.append({"question_id": f"q{q}", "repeat": r, "permutation": [0, 1, 2, 3], "correct": ok,
                        "extracted": "A" if ok else (extracted or "B")})  # fmt: skip
    return out


def test_one_repeat_is_wilson():
    from statsmodels.stats.proportion import proportion_confint

    a = stats.accuracy(recs([1] * 30 + [0] * 10))
    assert (a.correct, a.samples, a.questions) == (30, 40, 40)
    low, high = proportion_confint(30, 40, method="wilson")
    assert a.low == pytest.approx(low, abs=0.01) and a.high == pytest.approx(high, abs=0.01)


def test_repeats_of_one_question_are_not_independent_samples():
    # every question right in all 4 repeats or in none: 4x the samples, no more information
    a1 = stats.accuracy(recs([1] * 30 + [0] * 10))
    a4 = stats.accuracy(recs([4] * 30 + [0] * 10, repeats=4))
    assert a4.accuracy == a1.accuracy
    assert a4.design_effect == pytest.approx(4 * 40 / 39)  # Q / (Q - 1) times the repeats
    assert a4.high - a4.low == pytest.approx(a1.high - a1.low, rel=0.05)
    # independent-looking repeats (each question right in 2 of 4) narrow it
    a_mixed = stats.accuracy(recs([2] * 40, repeats=4))
    assert a_mixed.high - a_mixed.low < a4.high - a4.low


def test_interval_at_the_edges_is_not_degenerate():
    a = stats.accuracy(recs([1] * 40))
    assert a.accuracy == 1.0 and a.high == pytest.approx(1.0) and 0.85 < a.low < 0.95


def test_paired_mcnemar_exact():
    base = recs([1] * 40)
    mine = recs([1] * 35 + [0] * 5)
    p = stats.paired(base, mine)
    assert (p.baseline_only, p.backend_only) == (5, 0)
    assert p.mcnemar_p == pytest.approx(2 * 0.5**5)  # two-sided exact binomial, 5 of 5
    assert p.difference == pytest.approx(-5 / 40) and p.high < 0
    assert p.agreement == pytest.approx(35 / 40)
    assert not p.differs  # 0.0625: five discordant pairs are too few
    p8 = stats.paired(recs([1] * 40), recs([1] * 32 + [0] * 8))
    assert p8.differs and p8.mcnemar_p == pytest.approx(2 * 0.5**8)


def test_paired_counts_answers_not_just_correctness():
    base = recs([0] * 10, extracted="B")
    mine = recs([0] * 10, extracted="C")
    p = stats.paired(base, mine)
    assert p.agreement == 0 and p.mcnemar_p == 1 and p.difference == 0


def test_paired_refuses_other_samples_or_orders():
    with pytest.raises(ValueError, match="not the same questions"):
        stats.paired(recs([1] * 10), recs([1] * 9))
    moved = recs([1] * 10)
    moved[3] = {**moved[3], "permutation": [1, 0, 2, 3]}
    with pytest.raises(ValueError, match="other choice orders"):
        stats.paired(recs([1] * 10), moved)


def test_thresholds():
    t = stats.threshold("gpt-oss-20b", "diamond", "cot", "low")
    assert t is not None and math.isclose(t[0], 0.518)
    assert math.isclose(stats.threshold("gpt-oss-120b", "diamond", "cot", "high")[0], 0.751)
    assert stats.threshold("gpt-oss-20b", "main", "cot", "low") is None  # published numbers are diamond
    assert stats.threshold("gpt-oss-20b", "diamond", "mc", "low") is None
    assert stats.threshold(None, "diamond", "cot", "low") is None


def test_verdict_rule():
    good = stats.accuracy(recs([1] * 30 + [0] * 10))
    bar = (0.7, "test")
    outcome, reason = stats.verdict(good, bar, None)  # 40 samples cannot see a 5-point drop
    assert outcome == "UNJUDGED" and reason.startswith("too few samples to judge: 40 samples")
    assert stats.verdict(good, bar, None, drop=0.3)[0] == "PASS"  # they can see a 30-point one
    assert stats.verdict(good, (0.8, "test"), None)[0] == "FAIL"
    assert stats.verdict(good, None, None)[0] == "UNJUDGED"
    differs = stats.paired(recs([1] * 40), recs([1] * 30 + [0] * 10))
    outcome, reason = stats.verdict(good, bar, differs)
    assert outcome == "FAIL" and "McNemar" in reason
    better = stats.paired(recs([1] * 30 + [0] * 10), recs([1] * 40))  # either direction is a difference
    assert stats.verdict(good, None, better)[0] == "FAIL"
    many = stats.accuracy(recs([1] * 180 + [0] * 20))  # 200 samples, the baseline's answers: power enough
    same = stats.paired(recs([1] * 180 + [0] * 20), recs([1] * 180 + [0] * 20))
    outcome, reason = stats.verdict(many, None, same)
    assert outcome == "PASS" and "power 0.89 to see a drop of 0.05" in reason
    assert stats.verdict(None, bar, None, error="server died") == ("ERROR", "server died")
