"""The drift check of vLLM's own MXFP4 oracle against the declarations: that it sees a difference
of each kind (on facts edited from a real probe), that known differences must keep occurring, that
each vLLM release has its own known differences, and, where vLLM's sources are fetched (./dev does
it on GPU-less hosts), that vLLM 0.34.0 (NEWEST_VLLM, which the declarations follow), 0.33.0
(PREVIOUS_VLLM) and 0.26.0 (DEFAULT_VLLM), each run under every fake platform, differ from the
declarations only as that release's KNOWN explains."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mxmoe.harness.run.registry import discover
from mxmoe.harness.upstream import vllm_drift as vd
from mxmoe.harness.upstream.fetch import DEFAULT_VLLM, NEWEST_VLLM, PREVIOUS_VLLM

DECLARATIONS = [item.backend.declaration for item in discover()]
ROOT = Path(__file__).resolve().parents[2]
CHECKED_VLLM = (NEWEST_VLLM, PREVIOUS_VLLM, DEFAULT_VLLM)
"""The releases the drift check runs against: the one the declarations follow, the one before it, and
the one whose vendored triton_kernels the Triton backends run."""


def _fetched(version: str) -> bool:
    return vd.vllm_fetched(version)


def _not_fetched(version: str) -> str:
    return (
        f"vLLM {version}'s sources are not fetched (python -m harness fetch vllm --vllm-version {version}; "
        "./dev does it without a GPU)"
    )


def _facts() -> dict:
    """sm90 facts as vLLM reports them where they agree with the declarations."""
    ours = {d.vllm_backend: d for d in DECLARATIONS if d.vllm_backend}
    from mxmoe.harness.upstream.selection import GPT_OSS_PRIORITY

    return {
        "arch": "sm90",
        "backends": sorted(ours),
        "gpt_oss_priority": list(GPT_OSS_PRIORITY),
        "moe_backend_strings": {"triton": ["TRITON"], "triton_unfused": ["TRITON_UNFUSED"]},
        "round_up": {"TRITON": {"2880x360": [2880, 384]}},
        "routing_method_names": ["Renormalize", "RenormalizeNaive"],
        "supports": {"TRITON": {"activations": ["SWIGLUOAI"], "routing_methods": ["Renormalize", "RenormalizeNaive"]}},
        "w13_layout": {"TRITON": "interleaved"},
        "needs_biases": {"TRITON": "optional", "FLASHINFER_CUTLASS_MXFP4_BF16": "required"},
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
        (lambda f: f["needs_biases"].update({"TRITON": "required"}), ("needs_biases", "TRITON")),
        (
            lambda f: f["needs_biases"].update({"FLASHINFER_CUTLASS_MXFP4_BF16": "optional"}),
            ("needs_biases", "FLASHINFER_CUTLASS_MXFP4_BF16"),
        ),
    ],
    ids=[
        "round-up",
        "selection",
        "layout",
        "activations",
        "routing",
        "backend-gone",
        "biases-asserted",
        "biases-no-longer-asserted",
    ],
)
def test_each_kind_of_drift_is_seen(edit, expected):
    facts = copy.deepcopy(_facts())
    edit(facts)
    assert expected in _kinds(facts)


def test_sm12x_has_its_own_auto_order():
    """vLLM 0.33.0 and 0.34.0 put TRITON after MARLIN on SM12x (0.34.0 on SM110 too, which no declaration
    names): its order there is no drift, 0.26.0's one
    order is, in a row of that arch."""
    from mxmoe.harness.upstream.selection import GPT_OSS_PRIORITY, gpt_oss_priority

    facts = {**copy.deepcopy(_facts()), "arch": "sm120", "gpt_oss_priority": list(gpt_oss_priority("sm120"))}
    assert not [d for d in vd.compare(facts, DECLARATIONS) if d.kind == "gpt_oss_priority"]
    facts["gpt_oss_priority"] = list(GPT_OSS_PRIORITY)
    rows = [d for d in vd.compare(facts, DECLARATIONS) if d.kind == "gpt_oss_priority"]
    assert [(d.subject, d.arch) for d in rows] == [("auto", "sm120")]


def test_known_drift_is_marked_and_a_vanished_one_is_stale():
    absent = vd.Drift("backends", "AITER_TRITON_MXFP4_BF16", "*", "declared", "absent", vllm_version=DEFAULT_VLLM)
    drifts = vd.mark_known([absent])
    assert drifts[0].known and "50622" in drifts[0].known
    stale = vd.stale_known(drifts)
    assert ("backends", "AITER_TRITON_MXFP4_BF16", "*") not in stale and ("round_up", "TRITON", "gfx942") in stale


def test_each_release_has_its_own_known_differences():
    """PR #50622 is in the newest release: its absence there is not explained, and 0.26.0's reasons for it
    do not count as stale there; a release with no list of its own takes the last one before it. The
    default release is the one the declarations follow."""
    absent = vd.Drift("backends", "AITER_TRITON_MXFP4_BF16", "*", "declared", "absent", vllm_version=NEWEST_VLLM)
    assert vd.mark_known([absent])[0].known is None
    assert ("backends", "AITER_TRITON_MXFP4_BF16", "*") not in vd.stale_known([absent])
    assert ("round_up", "TRITON", "gfx942") in vd.stale_known([absent])
    assert not any(vd._PR50622 in reason for reason in vd.known_for(NEWEST_VLLM).values())
    assert vd.known_for(NEWEST_VLLM) is vd.KNOWN is vd.KNOWN_V34 and vd.known_for() is vd.KNOWN
    assert vd.known_for(DEFAULT_VLLM) is vd.KNOWN_V26 and vd.known_for(NEWEST_VLLM + "+cu130") is vd.KNOWN_V34
    assert vd.known_for(PREVIOUS_VLLM) is vd.KNOWN_V33 and vd.known_for("0.33.5") is vd.KNOWN_V33
    assert vd.known_for("0.35.0") is vd.KNOWN_V34  # a newer release is checked against the last reasons
    assert vd.Drift("backends", "X", "*", "", "").vllm_version == NEWEST_VLLM
    assert set(vd.probe_deps(DEFAULT_VLLM)) < set(vd.probe_deps(PREVIOUS_VLLM)) == set(vd.probe_deps(NEWEST_VLLM))


def test_the_two_newest_releases_have_the_same_limitations_each_naming_its_own():
    """0.33.0's oracle answers as 0.34.0's in everything compared: the same keys, and every reason that
    names a release names its own (0.34.0's TRT-LLM reason counts its third kernel class)."""
    assert set(vd.KNOWN_V34) == set(vd.KNOWN_V33)
    for key, reason in vd.KNOWN_V34.items():
        if reason != vd.KNOWN_V33[key]:
            assert "0.34.0" in reason and "0.33.0" not in reason, key
            assert "0.33.0" in vd.KNOWN_V33[key] and "0.34.0" not in vd.KNOWN_V33[key], key
    assert "TrtLlmMxfp4Mxfp8ExpertsModular" in vd.KNOWN_V34[("routing_methods", "FLASHINFER_TRTLLM_MXFP4_BF16", "*")]


def test_triton_on_sm12x_is_known_only_where_vllm_does_not_run_it():
    """The TRITON and TRITON_UNFUSED adapters apply vLLM 0.34.0's SM12x settings (0.33.0's) and declare
    sm120: no difference is left there in 0.34.0 or 0.33.0, and 0.26.0, which does not run them on SM12x
    (_triton_kernel_moe_supports_current_device below capability 11.0), differs in exactly these."""
    strings = [f"{s}/{q}" for s in ("triton", "triton_unfused") for q in ("none", "mxfp8", "fp8")]
    assert not [k for k in {**vd.KNOWN_V34, **vd.KNOWN_V33} if k[2] == "sm120" and k[1].startswith("triton")]
    assert [k for k in vd.KNOWN_V26 if k[2] == "sm120" and k[1].startswith("triton")] == [
        ("selection", s, "sm120") for s in strings
    ]
    ours = {d.vllm_backend: d for d in DECLARATIONS if d.vllm_backend}
    assert "sm120" in ours["TRITON"].archs and "sm120" in ours["TRITON_UNFUSED"].archs
    facts = {**copy.deepcopy(_facts()), "arch": "sm120"}
    facts["gpt_oss_priority"] = list(vd.gpt_oss_priority("sm120"))
    facts["selection"] = {"triton": {"none": "TRITON"}, "triton_unfused": {"none": "TRITON_UNFUSED"}}
    assert not [d for d in vd.compare(facts, DECLARATIONS) if d.kind == "selection"]
    facts["selection"] = {"triton": {"none": "error: not supported"}}  # as 0.26.0 answers there
    for version, explained in ((NEWEST_VLLM, False), (PREVIOUS_VLLM, False), (DEFAULT_VLLM, True)):
        rows = vd.mark_known(
            [d for d in vd.compare({**facts, "vllm_version": version}, DECLARATIONS) if d.kind == "selection"]
        )
        assert [(d.subject, d.arch) for d in rows] == [("triton/none", "sm120")]
        assert bool(rows[0].known) == explained and (not explained or "11.0" in rows[0].known)


@pytest.mark.parametrize(
    "version",
    [pytest.param(v, marks=pytest.mark.skipif(not _fetched(v), reason=_not_fetched(v))) for v in CHECKED_VLLM],
)
@pytest.mark.long(110)
def test_vllm_oracle_differs_from_the_declarations_only_as_known(tmp_path, version):
    """vLLM itself, under sm80 ... gfx950 and cpu: no unexplained difference, no stale one."""
    out = tmp_path / "drift.json"
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "vllm-drift", "--vllm-version", version, "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"vLLM {version} " in proc.stdout
    data = json.loads(out.read_text())
    assert data["vllm_version"] == version
    assert set(data["facts"]) == set(vd.PROBE_ARCHS)
    for arch, facts in data["facts"].items():
        errors = [k for k, v in facts.items() if isinstance(v, str) and v.startswith("error")]
        assert not errors, f"probe sections failed on {arch}: {errors}"
    assert data["drift"] and all(d["known"] for d in data["drift"]) and not data["stale_known"]
