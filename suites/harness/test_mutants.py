"""Detection power: ``python -m harness mutants`` over the PR profile catches every fault of the
catalogue, and the honest variants and the control raise no alarm in the same run."""

from __future__ import annotations

import json

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.instruments.faults import MUTANTS, Mutant
from mxmoe.harness.instruments.honest import HONEST
from mxmoe.harness.run.profiles import profile_cases

ISSUE_LIST = {
    "interleaved-as-chunked", "gate-up-swapped", "pair-swapped", "nibble-order", "scales-wrong-axis",
    "e8m0-bias-128", "one-scale-byte", "expert-skipped", "routing-hardcoded", "not-renormalized",
    "bias-in-weights", "weight-twice", "weight-on-input", "ties-other-way", "missing-plus-one", "no-clamp",
    "clamp-wrong-side", "clamp-after-sigmoid", "alpha-one", "b13-dropped", "b2-dropped", "b2-dropped-one-expert",
    "capacity-drop", "rows-unwritten", "input-mutated", "garbage-padding", "intermediate-mxfp8",
    "routing-weights-bf16", "nameerror-at-call", "import-nameerror",
}  # fmt: skip
RAISES = {"mutant-nameerror-at-call", "mutant-import-nameerror"}


def test_the_catalogue_has_every_fault_of_the_issue():
    slugs = {cls.slug for cls in MUTANTS} | {"import-nameerror"}
    assert ISSUE_LIST <= slugs, ISSUE_LIST - slugs
    for cls in MUTANTS:
        assert issubclass(cls, Mutant) and cls.fault and cls.declaration.kind == "instrument"
        assert cls.declaration.id == f"mutant-{cls.slug}"



@pytest.mark.long(230)
def test_the_matrix(tmp_path):
    """One run of ``python -m harness mutants`` (about two minutes on a 2-core CPU; one test, so
    that xdist does not run it once per worker), checked point by point."""
    path = tmp_path / "mutants.json"
    rc = main(["mutants", "--profile", "pr", "--json", str(path)])
    rows = {r["id"]: r for r in json.loads(path.read_text())["rows"]}
    n = len(profile_cases("pr"))

    # every fault of the catalogue is caught by the PR profile, FAIL or ERROR as fits
    faults = [r for r in rows.values() if r["kind"] == "mutant"]
    assert len(faults) == len(MUTANTS) - 1 + 1  # the control is not a fault; the import failure is one
    for r in faults:
        assert r["caught"], f"{r['id']} was not caught: {r['fault']}"
        first = [o for o in r["outcomes"].values() if o != "PASS"][0]
        assert first == ("ERROR" if r["id"] in RAISES else "FAIL"), (r["id"], first)

    # no false alarm from the honest variants or the control, in the same run, on every case
    clean = [r for r in rows.values() if r["kind"] in ("honest", "control")]
    assert len(clean) == len(HONEST) + 1  # every honest variant, and the control
    for r in clean:
        assert r["runs"] + r["skips"] == n, r["id"]
        assert r["fails"] == r["errors"] == 0, f"false alarm: {r['id']} {r['outcomes']}"
        assert 0 < r["worst_ratio"] < 1

    # the hard one is run on every case and reported with its rate
    r = rows["mutant-routing-weights-bf16"]
    assert r["runs"] + r["skips"] == n
    assert 0 < r["fails"] < r["runs"]

    # vLLM's 80%-within-0.3 rule lets several of these through (docs/peers.md); all are caught here
    assert all(set(r["peer_catches"]) == {"vllm_80pct_0p3", "triton_kernels"} for r in rows.values())
    let_through = [r["id"] for r in faults if r["peer_catches"]["vllm_80pct_0p3"] == 0]
    assert len(let_through) >= 5, let_through
    assert rows["mutant-nameerror-at-call"]["peer_catches"]["vllm_80pct_0p3"] == 1  # an exception fails any test

    assert rc == 0, [r["id"] for r in rows.values() if r["verdict"] in ("MISSED", "FALSE ALARM")]


def test_a_row_that_ran_nothing_or_met_a_harness_error_shows_nothing():
    """No runs is not clean (nor MISSED); a harness-side ERROR is not a catch."""
    from mxmoe.harness.audits.catalogue import BAD_VERDICTS, Row

    assert Row("honest-fp32", "honest", None, "honest").verdict == "NOT RUN"
    assert Row("mutant-x", "a fault", None, "mutant").verdict == "NOT RUN"
    errored = Row("mutant-x", "a fault", None, "mutant", runs=2, harness_errors=1)
    assert errored.verdict == "HARNESS ERROR" and not errored.caught
    assert Row("mutant-x", "a fault", None, "mutant", runs=2, fails=1).verdict == "caught"
    assert {"NOT RUN", "HARNESS ERROR", "MISSED", "FALSE ALARM"} == set(BAD_VERDICTS)
