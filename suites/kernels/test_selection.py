"""The selection oracle: the backend vLLM's MXFP4 oracle picks per architecture, the reasons it
gives for the others, and its errors. Test ids carry the architecture (``pytest -k gfx942``)."""

from __future__ import annotations

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.run.registry import discover
from mxmoe.harness.upstream.selection import MOE_BACKENDS, Deployment, NoBackend, select_backend

DECLS = [item.backend.declaration for item in discover()]


def _pick(**kw):
    return select_backend(Deployment(**kw), DECLS)


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("gfx942", "AITER_TRITON_MXFP4_BF16"),
        ("gfx950", "AITER_MXFP4_BF16"),
        ("sm90", "TRITON"),
        ("sm100", "FLASHINFER_TRTLLM_MXFP4_BF16"),
        ("sm80", "MARLIN"),
        ("cpu", "EMULATION"),
    ],
)
def test_auto_choice_per_arch(arch, expected):
    sel = _pick(arch=arch)
    assert sel.chosen.vllm_backend == expected
    assert sel.candidates[-1] == (expected, None)
    assert all(reason for _, reason in sel.candidates[:-1]), "every earlier candidate has a reason"


def test_gfx942_ck_declines_the_scheme():
    reasons = dict(_pick(arch="gfx942").candidates)
    assert "declines the quantization scheme" in reasons["AITER_MXFP4_BF16"]
    assert "device gfx942 not supported" in reasons["FLASHINFER_TRTLLM_MXFP4_BF16"]


def test_gfx950_ck_wins_over_aiter_triton():
    sel = _pick(arch="gfx950")
    assert [name for name, _ in sel.candidates][-1] == "AITER_MXFP4_BF16"


def test_mxfp8_activations_when_asked_sm100():
    assert _pick(arch="sm100", activation_quant="mxfp8").chosen.vllm_backend == "FLASHINFER_TRTLLM_MXFP4_MXFP8"
    assert _pick(arch="sm100", moe_backend="flashinfer_cutlass", activation_quant="mxfp8").chosen.id == (
        "flashinfer-cutlass-mxfp4-mxfp8"
    )


def test_explicit_moe_backend_sm90():
    assert _pick(arch="sm90", moe_backend="flashinfer_cutlass").chosen.vllm_backend == "FLASHINFER_CUTLASS_MXFP4_BF16"
    assert _pick(arch="sm90", moe_backend="marlin").chosen.vllm_backend == "MARLIN"


def test_explicit_aiter_on_gfx942_falls_to_triton():
    sel = _pick(arch="gfx942", moe_backend="aiter")
    assert sel.chosen.vllm_backend == "AITER_TRITON_MXFP4_BF16"
    assert "declines" in dict(sel.candidates)["AITER_MXFP4_BF16"]


def test_no_backend_error_lists_every_candidate_gfx942():
    with pytest.raises(NoBackend) as err:
        _pick(arch="gfx942", moe_backend="aiter", routing="DeepSeekV3")
    msg = str(err.value)
    for name in MOE_BACKENDS["aiter"]:
        assert f"  {name}: " in msg
    assert "routing method DeepSeekV3 not supported" in msg
    assert "device gfx942 not supported" in msg


def test_no_backend_expert_parallel_gfx942():
    with pytest.raises(NoBackend, match="expert parallelism not supported"):
        _pick(arch="gfx942", moe_backend="aiter_triton_mxfp4_bf16", ep=2)


def test_unknown_strings_are_rejected_with_the_accepted_ones():
    with pytest.raises(ValueError, match="accepted: auto, flashinfer_trtllm"):
        Deployment(arch="sm90", moe_backend="flashinfer")
    with pytest.raises(ValueError, match="arch must be one of"):
        Deployment(arch="mi300")
    with pytest.raises(ValueError, match="activation_quant must be one of bf16, mxfp8, fp8"):
        Deployment(arch="sm90", activation_quant="int8")


def test_cli_select_gfx942(capsys):
    assert main(["select", "--arch", "gfx942"]) == 0
    out = capsys.readouterr().out
    assert "chosen: AITER_TRITON_MXFP4_BF16 (aiter-triton-mxfp4-bf16)" in out
    assert "rejected: declines the quantization scheme MXFP4 w4a16 on gfx942" in out


def test_cli_select_no_backend_exits_1_gfx942(capsys):
    assert main(["select", "--arch", "gfx942", "--moe-backend", "triton", "--routing", "DeepSeekV3"]) == 1
    assert "TRITON: routing method DeepSeekV3 not supported" in capsys.readouterr().out


def test_cli_select_unknown_moe_backend(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["select", "--arch", "sm90", "--moe-backend", "cutlass"])
    assert exc.value.code == 2
    assert "invalid choice: 'cutlass'" in capsys.readouterr().err
