"""Detection power: ``python -m harness mutants`` over the PR profile catches every fault of the
catalogue, and the honest variants and the control raise no alarm in the same run."""

from __future__ import annotations

import json

import pytest

from mxmoe.harness.cli import main
from mxmoe.harness.mutants import MUTANTS, Mutant
from mxmoe.harness.zoo import profile_cases

ISSUE_LIST = {
    "interleaved-as-chunked", "gate-up-swapped", "pair-swapped", "nibble-order", "scales-wrong-axis",
    "e8m0-bias-128", "one-scale-byte", "expert-skipped", "routing-hardcoded", "not-renormalized",
    "bias-in-weights", "weight-twice", "weight-on-input", "ties-other-way", "missing-plus-one", "no-clamp",
    "clamp-wrong-side", "clamp-after-sigmoid", "alpha-one", "b13-dropped", "b2-dropped", "b2-dropped-one-expert",
    "capacity-drop", "rows-unwritten", "input-mutated", "garbage-padding", "intermediate-mxfp8",
    "routing-weights-bf16", "nameerror-at-call", "import-nameerror",
}  # fmt: skip
RAISES = {"mutant-nameerror-at-call", "mutant-import-nameerror"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    path = tmp_path_factory.mktemp("mutants") / "mutants.json"
    rc = main(["mutants", "--profile", "pr", "--json", str(path)])
    return rc, {r["id"]: r for r in json.loads(path.read_text())["rows"]}


def test_the_catalogue_has_every_fault_of_the_issue():
    slugs = {cls.slug for cls in MUTANTS} | {"import-nameerror"}
    assert ISSUE_LIST <= slugs, ISSUE_LIST - slugs
    for cls in MUTANTS:
        assert issubclass(cls, Mutant) and cls.fault and cls.declaration.kind == "instrument"
        assert cls.declaration.id == f"mutant-{cls.slug}"


def test_exit_status_says_all_as_expected(matrix):
    rc, rows = matrix
    assert rc == 0, [r["id"] for r in rows.values() if r["verdict"] in ("MISSED", "FALSE ALARM")]


def test_every_fault_is_caught_by_the_pr_profile(matrix):
    _, rows = matrix
    faults = [r for r in rows.values() if r["kind"] == "mutant"]
    assert len(faults) == len(ISSUE_LIST) - 1 + len({c.slug for c in MUTANTS} - ISSUE_LIST)
    for r in faults:
        assert r["caught"], f"{r['id']} was not caught: {r['fault']}"
        first = [o for o in r["outcomes"].values() if o != "PASS"][0]
        assert first == ("ERROR" if r["id"] in RAISES else "FAIL"), (r["id"], first)


def test_no_false_alarm_from_honest_variants_or_the_control(matrix):
    _, rows = matrix
    clean = [r for r in rows.values() if r["kind"] in ("honest", "control")]
    assert len(clean) == 6
    n = len(profile_cases("pr"))
    for r in clean:
        assert r["runs"] + r["skips"] == n, r["id"]
        assert r["fails"] == r["errors"] == 0, f"false alarm: {r['id']} {r['outcomes']}"
        assert 0 < r["worst_ratio"] < 1


def test_routing_weights_bf16_is_reported_with_its_rate(matrix):
    _, rows = matrix
    r = rows["mutant-routing-weights-bf16"]
    assert r["runs"] + r["skips"] == len(profile_cases("pr")), "run on every case, for its rate"
    assert 0 < r["fails"] < r["runs"]  # the hard one: caught on some cases only, and said so
