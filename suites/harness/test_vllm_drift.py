"""The drift check of vLLM's own MXFP4 oracle against the declarations: that it sees a difference
of each kind (on facts edited from a real probe), that known differences must keep occurring,
and, where vLLM's sources are fetched (./dev does it on GPU-less hosts), that vLLM 0.26.0 run
under every fake platform differs from the declarations only as ``KNOWN`` explains."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mxmoe.harness import vllm_drift as vd
from mxmoe.harness.registry import discover
from mxmoe.harness.vendor import DEFAULT_VLLM

DECLARATIONS = [item.backend.declaration for item in discover()]
ROOT = Path(__file__).resolve().parents[2]
FETCHED = (vd.vllm_root(DEFAULT_VLLM) / "vllm" / "__init__.py").is_file()
NOT_FETCHED = (
    f"vLLM {DEFAULT_VLLM}'s sources are not fetched (python -m harness fetch vllm; ./dev does it without a GPU)"
)


def _facts() -> dict:
    """sm90 facts as vLLM 0.26.0 reports them where they agree with the declarations."""
    ours = {d.vllm_backend: d for d in DECLARATIONS if d.vllm_backend}
    from mxmoe.harness.selection import GPT_OSS_PRIORITY

    return {
        "arch": "sm90",
        "backends": sorted(ours),
        "gpt_oss_priority": list(GPT_OSS_PRIORITY),
        "moe_backend_strings": {"triton": ["TRITON"], "triton_unfused": ["TRITON_UNFUSED"]},
        "round_up": {"TRITON": {"2880x360": [2880, 384]}},
        "routing_method_names": ["Renormalize", "RenormalizeNaive"],
        "supports": {"TRITON": {"activations": ["SWIGLUOAI"], "routing_methods": ["Renormalize", "RenormalizeNaive"]}},
        "w13_layout": {"TRITON": "interleaved"},
        "selection": {"triton": {"none": "TRITON"}},
    }


def _kinds(facts: dict) -> set[tuple[str, str]]:
    return {(d.kind, d.subject) for d in vd.compare(facts, DECLARATIONS) if d.kind != "moe_backend_strings"}


def test_agreeing_facts_give_no_drift():
    assert _kinds(_facts()) == set()


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda f: f["round_up"]["TRITON"].update({"2880x360": [2880, 512]}), ("round_up", "TRITON")),
        (lambda f: f["selection"]["triton"].update({"none": "error: not supported"}), ("selection", "triton/none")),
        (lambda f: f["w13_layout"].update({"TRITON": "chunked_gate_up"}), ("w13_layout", "TRITON")),
        (lambda f: f["supports"]["TRITON"].update({"activations": ["SILU"]}), ("activations", "TRITON")),
        (lambda f: f["supports"]["TRITON"].update({"routing_methods": ["Renormalize"]}), ("routing_methods", "TRITON")),
        (lambda f: f["backends"].remove("MARLIN"), ("backends", "MARLIN")),
    ],
    ids=["round-up", "selection", "layout", "activations", "routing", "backend-gone"],
)
def test_each_kind_of_drift_is_seen(edit, expected):
    facts = copy.deepcopy(_facts())
    edit(facts)
    assert expected in _kinds(facts)


def test_known_drift_is_marked_and_a_vanished_one_is_stale():
    drifts = vd.mark_known([vd.Drift("backends", "AITER_TRITON_MXFP4_BF16", "*", "declared", "absent")])
    assert drifts[0].known and "50622" in drifts[0].known
    stale = vd.stale_known(drifts)
    assert ("backends", "AITER_TRITON_MXFP4_BF16", "*") not in stale and ("round_up", "TRITON", "gfx942") in stale


@pytest.mark.skipif(not FETCHED, reason=NOT_FETCHED)
def test_vllm_oracle_differs_from_the_declarations_only_as_known(tmp_path):
    """vLLM 0.26.0 itself, under sm80 ... gfx950 and cpu: no unexplained difference, no stale one."""
    out = tmp_path / "drift.json"
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "vllm-drift", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["vllm_version"] == DEFAULT_VLLM
    assert set(data["facts"]) == set(vd.PROBE_ARCHS)
    for arch, facts in data["facts"].items():
        errors = [k for k, v in facts.items() if isinstance(v, str) and v.startswith("error")]
        assert not errors, f"probe sections failed on {arch}: {errors}"
    assert data["drift"] and all(d["known"] for d in data["drift"]) and not data["stale_known"]
