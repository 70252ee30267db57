"""Detection power: ``python -m harness mutants`` over the PR profile catches every fault of the
catalogue, and the honest variants and the control raise no alarm in the same run."""

from __future__ import annotations

import pytest
from catalogue_matrix import check_matrix

from mxmoe.harness.cli.app import main
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.instruments.faults import MUTANTS, Mutant

ISSUE_LIST = {
    "interleaved-as-chunked", "gate-up-swapped", "pair-swapped", "nibble-order", "scales-wrong-axis",
    "e8m0-bias-128", "one-scale-byte", "expert-skipped", "routing-hardcoded", "not-renormalized",
    "bias-in-weights", "weight-twice", "weight-on-input", "ties-other-way", "missing-plus-one", "no-clamp",
    "clamp-wrong-side", "clamp-after-sigmoid", "alpha-one", "b13-dropped", "b2-dropped", "b2-dropped-one-expert",
    "capacity-drop", "rows-unwritten", "input-mutated", "garbage-padding", "intermediate-mxfp8",
    "routing-weights-bf16", "nameerror-at-call", "import-nameerror",
}  # fmt: skip


def test_the_catalogue_has_every_fault_of_the_issue():
    slugs = {cls.slug for cls in MUTANTS} | {"import-nameerror"}
    assert ISSUE_LIST <= slugs, ISSUE_LIST - slugs
    for cls in MUTANTS:
        assert issubclass(cls, Mutant) and cls.fault and cls.declaration.kind == "instrument"
        assert cls.declaration.id == f"mutant-{cls.slug}"



@pytest.mark.long(230)
def test_the_matrix(tmp_path, host_arch, profile):
    """One run of ``python -m harness mutants`` (about two minutes on a 2-core CPU; one test, so
    that xdist does not run it once per worker), checked point by point. On a CPU, the pr profile
    checks the same matrix on the installed sign-off's run of the same command instead
    (``suites/packaging/test_install.py``), rather than making it twice."""
    if host_arch == "cpu" and profile == "pr":
        pytest.skip("checked on the installed sign-off's own run of `mutants --profile pr` "
                    "(suites/packaging/test_install.py), not on a second run of it")  # fmt: skip
    path = tmp_path / "mutants.json"
    rc = main(["mutants", "--profile", "pr", "--json", str(path)])
    check_matrix(path, rc)


def test_a_row_that_ran_nothing_or_met_a_harness_error_shows_nothing():
    """No runs is not clean (nor MISSED); a harness-side ERROR is not a catch."""
    from mxmoe.harness.audits.catalogue import BAD_VERDICTS, Row

    assert Row("honest-fp32", "honest", None, "honest").verdict == "NOT RUN"
    assert Row("mutant-x", "a fault", None, "mutant").verdict == "NOT RUN"
    errored = Row("mutant-x", "a fault", None, "mutant", runs=2, harness_errors=1)
    assert errored.verdict == "HARNESS ERROR" and not errored.caught
    assert Row("mutant-x", "a fault", None, "mutant", runs=2, fails=1).verdict == "caught"
    assert {"NOT RUN", "HARNESS ERROR", "MISSED", "FALSE ALARM", "FAILS UNPATCHED"} == set(BAD_VERDICTS)
    unreached = Row("mutant-x", "a fault", None, "mutant", unreached=3)
    assert unreached.verdict == "not reached" and unreached.verdict not in BAD_VERDICTS
    # a case it reached but could not run (a SKIP) still shows nothing
    assert Row("mutant-x", "a fault", None, "mutant", unreached=3, skips=1).verdict == "NOT RUN"


@pytest.mark.long(90)
@pytest.mark.device_case(make_case("gptoss20b", 128, tp=4, tp_rank=3))
def test_a_token_bucket_fault_is_caught_by_the_nightly_and_missed_by_the_pr_profile(host_arch):
    """The class of a kernel wrong for one bucket of token counts at one model's shape (3 or 4
    tokens at a production hidden size, as AITER's was): no case of the pr profile can change under
    it, so that profile passes it everywhere; the nightly's decode cases at gpt-oss's shapes take
    the bucket and FAIL. Run on gpt-oss-20b's TP shards (H = 2880, a fraction of the weights: about
    a minute on a 2-core CPU), where both profiles have cases. On this host's hardware: a GPU host
    runs the fault there, as the nightly would."""
    from mxmoe.harness.instruments.faults import DecodeBucketWrong
    from mxmoe.harness.judge.engine import run_case
    from mxmoe.harness.run.profiles import profile_cases

    fault = DecodeBucketWrong()
    pr, nightly = profile_cases("pr"), profile_cases("nightly")
    assert not [c.id for c in pr if fault.reaches(c)]
    reached = {c.id for c in nightly if fault.reaches(c)}
    assert {f"{m}-interleaved-t{t}" for m in ("gptoss20b", "gptoss120b") for t in (3, 4)} <= reached
    by_id = {c.id: c for c in pr + nightly}
    for case_id, outcome in (
        ("gptoss20b-interleaved-t4-tp4r3", "FAIL"),  # the nightly's decode batch on a shard: caught
        ("gptoss20b-interleaved-t128-tp4r3", "PASS"),  # the same shard in another bucket: exact
        ("gptoss20b-interleaved-t1-tp8r7", "PASS"),  # the pr profile's production shape: missed
        ("small-interleaved-t3", "PASS"),  # the pr profile's decode bucket, at a small shape: missed
    ):
        result, _ = run_case(fault, by_id[case_id], host_arch)
        assert result.outcome == outcome, (case_id, result.outcome, result.reason)
