"""The fault catalogue's matrix (``python -m harness mutants --profile pr``), checked point by point:
by ``test_mutants.py`` on its own run, and on a CPU by the installed sign-off's test on that
sign-off's run of the same command (one run of two minutes instead of two)."""

from __future__ import annotations

import json
from pathlib import Path

from mxmoe.harness.instruments.faults import MUTANTS, ON_BF16_GEMM1
from mxmoe.harness.instruments.honest import HONEST
from mxmoe.harness.run.profiles import profile_cases

RAISES = {"mutant-nameerror-at-call", "mutant-import-nameerror"}


def check_matrix(path: Path, rc: int) -> None:
    """Every fault caught, every honest variant and the control clean on every case, the peers'
    rules compared; ``rc`` is the command's exit status."""
    rows = {r["id"]: r for r in json.loads(path.read_text())["rows"]}
    n = len(profile_cases("pr"))

    # every fault of the catalogue the PR profile reaches is caught by it, FAIL or ERROR as fits; a
    # token bucket's fault at production shapes is reached by no PR case, run on none, and says so
    faults = [r for r in rows.values() if r["kind"] == "mutant"]
    # the control is not a fault; the import failure is one; the sub-bound faults run on both families
    assert len(faults) == len(MUTANTS) - 1 + 1 + len(ON_BF16_GEMM1)
    assert {c.declaration.id for c in ON_BF16_GEMM1} <= {r["id"] for r in faults}
    unreached = [r for r in faults if r["verdict"] == "not reached"]
    assert [r["id"] for r in unreached] == ["mutant-bucket-3-4"], [r["id"] for r in unreached]
    assert unreached[0]["runs"] == 0 and unreached[0]["unreached"] == n
    faults = [r for r in faults if r not in unreached]
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
    assert all(set(r["peer_catches"]) == {"vllm_80pct_0p3", "triton_kernels"} for r in rows.values() if r["runs"])
    let_through = [r["id"] for r in faults if r["peer_catches"]["vllm_80pct_0p3"] == 0]
    assert len(let_through) >= 5, let_through
    assert rows["mutant-nameerror-at-call"]["peer_catches"]["vllm_80pct_0p3"] == 1  # an exception fails any test

    assert rc == 0, [r["id"] for r in rows.values() if r["verdict"] in ("MISSED", "FALSE ALARM")]
