"""The selection oracle: the backend vLLM 0.34.0's MXFP4 oracle picks per architecture, the reasons
it gives for the others, its bf16 fallback, and its errors. Test ids carry the architecture
(``pytest -k gfx942``)."""

from __future__ import annotations

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.run.registry import discover
from mxmoe.harness.upstream.fetch import NEWEST_VLLM
from mxmoe.harness.upstream.selection import (
    GPT_OSS_PRIORITY,
    MOE_BACKENDS,
    Deployment,
    NoBackend,
    gpt_oss_priority,
    select_backend,
)

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
        ("sm120", "MARLIN"),
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


def test_sm12x_tries_triton_after_marlin_sm120():
    """vLLM 0.34.0's _get_priority_backends_for_gpt_oss: on SM12x TRITON comes after MARLIN; elsewhere
    the one order."""
    order = gpt_oss_priority("sm120")
    assert order.index("TRITON") == order.index("MARLIN") + 1 and sorted(order) == sorted(GPT_OSS_PRIORITY)
    assert all(gpt_oss_priority(a) == GPT_OSS_PRIORITY for a in ("sm80", "sm90", "sm100", "gfx942", "gfx950", "cpu"))
    assert _pick(arch="sm120", activation_quant="mxfp8").chosen.vllm_backend == "FLASHINFER_CUTLASS_MXFP4_MXFP8"


@pytest.mark.parametrize("moe_backend, expected", [("triton", "TRITON"), ("triton_unfused", "TRITON_UNFUSED")])
@pytest.mark.parametrize("quant", [None, "mxfp8", "fp8"])
def test_explicit_triton_runs_on_sm12x_sm120(moe_backend, expected, quant):
    """vLLM 0.34.0 runs the OpenAI Triton kernels on SM12x (_triton_kernel_moe_supports_current_device:
    9.0 <= capability < 13.0), asked for by name; `auto` still prefers MARLIN there. 0.26.0 did not
    (its window ends at 11.0: a KNOWN_V26 difference). Not run on an SM12x GPU."""
    sel = _pick(arch="sm120", moe_backend=moe_backend, activation_quant=quant)
    assert sel.chosen.vllm_backend == expected and sel.bf16_fallback == (quant is not None)
    assert _pick(arch="sm120").chosen.vllm_backend == "MARLIN"


@pytest.mark.parametrize(
    "arch, moe_backend, quant, expected",
    [
        ("sm90", "marlin", "fp8", "MARLIN"),
        ("sm120", "marlin", "mxfp8", "MARLIN"),
        ("sm90", "flashinfer_cutlass", "mxfp8", "FLASHINFER_CUTLASS_MXFP4_BF16"),
        ("sm100", "flashinfer_trtllm", "fp8", "FLASHINFER_TRTLLM_MXFP4_BF16"),
        ("sm100", "triton", "mxfp8", "TRITON"),
        ("gfx942", "aiter", "fp8", "AITER_TRITON_MXFP4_BF16"),
        ("gfx950", "aiter", "mxfp8", "AITER_MXFP4_BF16"),
    ],
    ids=lambda v: str(v),
)
def test_bf16_fallback_when_no_variant_takes_the_asked_activations(arch, moe_backend, quant, expected):
    """vLLM 0.34.0's _filter_by_activation: the asked-for scheme's variants first, then the family's
    bf16 ones (with a warning); vLLM 0.26.0 refused these."""
    sel = _pick(arch=arch, moe_backend=moe_backend, activation_quant=quant)
    assert sel.chosen.vllm_backend == expected and sel.bf16_fallback


def test_asked_activations_come_before_the_fallback_sm100():
    sel = _pick(arch="sm100", moe_backend="flashinfer_trtllm", activation_quant="mxfp8")
    assert sel.chosen.vllm_backend == "FLASHINFER_TRTLLM_MXFP4_MXFP8" and not sel.bf16_fallback
    assert [name for name, _ in sel.candidates] == ["FLASHINFER_TRTLLM_MXFP4_MXFP8"]
    assert _pick(arch="gfx950", moe_backend="aiter", activation_quant="fp8").chosen.vllm_backend == "AITER_MXFP4_FP8"
    assert not _pick(arch="sm90", activation_quant="fp8").bf16_fallback  # EMULATION takes any scheme


def test_no_fallback_without_a_bf16_variant_gfx950():
    """A family with neither the asked-for scheme nor a bf16 variant still fails, and another scheme's
    variant is never tried."""
    with pytest.raises(NoBackend, match="AITER_MXFP4_FP8: activation quantization w4a8-fp8 was not asked for"):
        _pick(arch="gfx950", moe_backend="aiter_mxfp4_fp8", activation_quant="mxfp8")
    with pytest.raises(NoBackend, match="was not asked for"):
        _pick(arch="sm100", moe_backend="flashinfer_trtllm_afp8", activation_quant="fp8")


def test_explicit_aiter_on_gfx942_falls_to_triton():
    sel = _pick(arch="gfx942", moe_backend="aiter")
    assert sel.chosen.vllm_backend == "AITER_TRITON_MXFP4_BF16"
    assert "declines" in dict(sel.candidates)["AITER_MXFP4_BF16"]


def test_no_backend_error_lists_every_candidate_gfx942():
    with pytest.raises(NoBackend) as err:
        _pick(arch="gfx942", moe_backend="aiter", routing="Default")  # vLLM 0.34.0 refuses it too
    msg = str(err.value)
    for name in MOE_BACKENDS["aiter"]:
        assert f"  {name}: " in msg
    assert "routing method Default not supported" in msg
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
    assert f"follows vLLM {NEWEST_VLLM}'s MXFP4 oracle" in out
    assert "chosen: AITER_TRITON_MXFP4_BF16 (aiter-triton-mxfp4-bf16)" in out
    assert "rejected: declines the quantization scheme MXFP4 w4a16 on gfx942" in out


def test_cli_select_warns_of_the_bf16_fallback_sm90(capsys):
    assert main(["select", "--arch", "sm90", "--moe-backend", "marlin", "--activation-quant", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "chosen: MARLIN (marlin)" in out and "MARLIN runs with bf16 activations" in out


def test_cli_select_no_backend_exits_1_gfx942(capsys):
    assert main(["select", "--arch", "gfx942", "--moe-backend", "triton", "--routing", "DeepSeekV3"]) == 1
    assert "TRITON: routing method DeepSeekV3 not supported" in capsys.readouterr().out


def test_cli_select_unknown_moe_backend(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["select", "--arch", "sm90", "--moe-backend", "cutlass"])
    assert exc.value.code == 2
    assert "invalid choice: 'cutlass'" in capsys.readouterr().err
