"""Speed work must not move a verdict: the pr profile's CPU cases, judged by the harness's own honest
backends and one faulty one, give the outcomes and metrics recorded in ``recorded/verdicts-pr-cpu.json``.

The record was made by the tree before the judging was vectorized (the systematic test's per-expert
sums, its search for the largest z). Outcomes, counts and the finding's words must be the same;
numbers may move by the last bits of a changed summation order, far below anything a threshold
could notice (relative 1e-6; a CPU's thread count alone moves the last bits of a sum). A backend
that rounds a float32 sum to bf16 (GEMM1's output, the intermediate, an expert's output) is held
to 2^-8 instead: its own sums, torch's CPU kernels, run in another order on another processor
(an AMD EPYC's against the recording host's), and one rounding that flips there moves its output,
hence its energy ratio and effective bits, by about 1e-4 of themselves; the judging is still held
to 1e-6 by the backends that keep float32. Where the
systematic test fired, its finding names the same place (expert, row, block); where it did not,
the largest of many nearly equal z (one row's blocks can agree to 1e-15) may be another of them,
and only the words are compared. To record
again after a change that is meant to move numbers: ``MXMOE_RECORD_VERDICTS=1 pytest`` this file,
and say why in the commit."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("recorded") / "verdicts-pr-cpu.json"
BACKENDS = ("emulation", "honest-*", "oracle", "wrongsign-fp32")
FAULTY = str(Path(__file__).with_name("faulty_backends.py")) + ":WrongSignFp32"
NUMBERS = ("worst_ratio", "systematic_z", "systematic_threshold", "energy_ratio", "energy_threshold", "effective_bits")
COUNTS = ("elements", "over_bound", "over_rigorous", "nonfinite", "unwritten", "nondeterministic")
_NUMBER = re.compile(r"[-+]?\d+\.?\d*(?:e[-+]?\d+)?")
_FRACTION = re.compile(r"[-+]?\d+(?:\.\d+(?:e[-+]?\d+)?|e[-+]?\d+)")


def _check(results: Path) -> list[dict]:
    """The pr profile's non-gpt-oss cases through BACKENDS on the CPU (any GPU hidden: the record is
    of CPU arithmetic, and the inputs a CPU draws are the same on every host), one worker per core
    (``--workers auto``: 2 on CI, where it takes a few minutes; 16 on a GPU host)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "MXMOE_CACHE": str(results / "cache")}
    argv = [sys.executable, "-m", "harness", "check", "--profile", "pr", "-x", "gptoss", "--workers", "auto",
            "--results", str(results), "--backend-file", FAULTY,
            *(a for b in BACKENDS for a in ("--backend", b))]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    records = [json.loads(line) for p in sorted(results.glob("results-*.jsonl")) for line in p.open()]
    return sorted(
        ({"test_id": r["test_id"], "outcome": r["outcome"], "reason": _words(r["reason"]),
          "systematic": _where(r["metrics"].get("systematic", "")),
          "rounds": any(r["declaration"]["arithmetic"]["precision"].get(k) == "bf16" for k in ROUNDED),
          **{k: r["metrics"].get(k) for k in (*NUMBERS, *COUNTS)}} for r in records),
        key=lambda r: r["test_id"],
    )  # fmt: skip


def _words(text: str) -> str:
    """A finding without its numbers (compared apart, with a tolerance)."""
    return _NUMBER.sub("#", text or "")


def _where(finding: str) -> str:
    """The systematic test's finding: where it fired, with the place's numbers (only the measured
    ones dropped); where it did not, its words."""
    return _FRACTION.sub("#", finding) if finding.startswith("error correlates") else _words(finding)


ROUNDED = ("gemm1_output", "intermediate", "expert_output")
"""The declared stages whose bf16 rounding of a host-ordered float32 sum moves a backend's output
from one processor to another (held to 2^-8, not 1e-6)."""


def _close(a: float | None, b: float | None, rel: float = 1e-6) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-12


def test_the_verdicts_and_metrics_are_those_recorded(tmp_path):
    got = _check(tmp_path)
    if os.environ.get("MXMOE_RECORD_VERDICTS") == "1":
        for g in got:
            g.pop("rounds")
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n", encoding="utf-8")
        pytest.skip(f"recorded {len(got)} verdicts into {RECORD}; nothing compared")
    want = json.loads(RECORD.read_text(encoding="utf-8"))
    assert [r["test_id"] for r in got] == [r["test_id"] for r in want]
    assert {r["outcome"] for r in want} >= {"PASS", "FAIL"} and len(want) >= 300  # the record judges both ways
    moved = []
    for g, w in zip(got, want, strict=True):
        same = all(g[k] == w[k] for k in ("outcome", "reason", "systematic", *COUNTS))
        rel = 2.0**-8 if g.pop("rounds") else 1e-6
        if not same or not all(_close(g[k], w[k], rel) for k in NUMBERS):
            moved.append({k: (w[k], g[k]) for k in w if g[k] != w[k]} | {"test_id": w["test_id"]})
    assert not moved, f"{len(moved)} verdicts moved; first: {moved[:3]}"
