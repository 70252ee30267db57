"""The AITER adapters' parts that run without aiter or an AMD GPU: how they refuse a host, the
argument mapping (enum members by name, CK pads, the EP mask, static FP8 scales), the weight
forms they hand the kernels, and the CK storage steps against a verbatim transcription of
aiter's pure-torch shuffles. Ids carry the architecture they concern (``pytest -k gfx950``)."""

from __future__ import annotations

import enum
import sys

import pytest
import torch

from mxmoe.harness.contract import platforms
from mxmoe.harness.contract.backend import BackendUnavailable
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.kernels import storage
from mxmoe.kernels.aiter_common import (
    AITER_ACTIVATIONS,
    activation_member,
    enum_member,
    import_first,
    k_major,
    require_arch,
)
from mxmoe.kernels.aiter_mxfp4_bf16 import (
    FP8_FROM_TOKENS,
    AiterMxfp4Bf16,
    AiterMxfp4Bf16Prefill,
    aiter_expert_mask,
    ck_pads,
)
from mxmoe.kernels.aiter_mxfp4_fp8 import E4M3_MAX, AiterMxfp4Fp8, static_fp8_scales
from mxmoe.kernels.aiter_triton_mxfp4_bf16 import AiterTritonMxfp4Bf16

ADAPTERS = [AiterMxfp4Bf16, AiterMxfp4Bf16Prefill, AiterTritonMxfp4Bf16, AiterMxfp4Fp8]


def _id(cls: type) -> str:
    d = cls.declaration
    return f"{d.id}-{'-'.join(d.archs)}"


def _on(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    monkeypatch.setattr(platforms, "host_arch", lambda: arch)


# --- refusing a host -------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ADAPTERS, ids=_id)
def test_without_aiter_the_skip_names_the_package(cls, monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter -> ImportError
    with pytest.raises(BackendUnavailable, match=rf"{cls.declaration.id} needs the package 'aiter'"):
        cls().load()


@pytest.mark.parametrize("cls", ADAPTERS, ids=_id)
def test_with_aiter_on_a_cpu_host_the_skip_names_the_arch(cls, monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", type(sys)("aiter"))
    _on(monkeypatch, "cpu")
    with pytest.raises(BackendUnavailable, match=r"runs on .*\(ROCm\); this host is cpu"):
        cls().load()


def test_ck_refuses_gfx942_where_it_declines_mxfp4(monkeypatch):
    _on(monkeypatch, "gfx942")
    with pytest.raises(BackendUnavailable, match="aiter-mxfp4-bf16 runs on gfx950"):
        require_arch("aiter-mxfp4-bf16", AiterMxfp4Bf16.declaration.archs)


def test_ck_refuses_a_moved_fp8_bound_gfx950(monkeypatch):
    _on(monkeypatch, "gfx950")
    monkeypatch.setenv("AITER_BF16_FP8_MOE_BOUND", "0")
    with pytest.raises(BackendUnavailable, match="AITER_BF16_FP8_MOE_BOUND=0 moves"):
        AiterMxfp4Bf16().check_call()


def _fake_aiter(monkeypatch: pytest.MonkeyPatch, **missing: str) -> None:
    """Stand-ins for the aiter modules the Triton adapters import (HEAD paths), each with the
    names the adapters look up, less ``missing`` (module suffix -> name)."""
    names = {
        "moe.moe_op_gemm_a16w4": ("moe_gemm_a16w4", "swizzle_scales_gfx950"),
        "moe.moe_op_gemm_a8w4": ("moe_gemm_a8w4",),
        "moe.moe_routing.routing": ("routing",),
        "moe.quant_moe": ("downcast_to_static_fp8",),
    }
    monkeypatch.setitem(sys.modules, "aiter", type(sys)("aiter"))
    for suffix, attrs in names.items():
        mod = type(sys)(f"aiter.ops.triton.{suffix}")
        for a in attrs:
            if missing.get(suffix) != a:
                setattr(mod, a, lambda *args, _a=a, **kw: _a)
        monkeypatch.setitem(sys.modules, mod.__name__, mod)


def test_a8w4_takes_the_cdna4_scale_swizzle_from_aiters_a16w4_module_gfx950(monkeypatch):
    _on(monkeypatch, "gfx950")
    _fake_aiter(monkeypatch)
    b = AiterMxfp4Fp8()
    b.load()
    assert b._mods.swizzle() == "swizzle_scales_gfx950" and b._mods.gemm.moe_gemm_a8w4() == "moe_gemm_a8w4"


def test_an_aiter_without_the_scale_swizzle_is_a_skip_gfx950(monkeypatch):
    _on(monkeypatch, "gfx950")
    _fake_aiter(monkeypatch, **{"moe.moe_op_gemm_a16w4": "swizzle_scales_gfx950"})
    with pytest.raises(BackendUnavailable, match="moe_op_gemm_a16w4 has no swizzle_scales_gfx950"):
        AiterTritonMxfp4Bf16().load()


def test_import_first_takes_the_first_that_imports_and_names_all_it_tried():
    assert import_first(("mxmoe_no_such_module.a", "json"), "x").__name__ == "json"
    with pytest.raises(BackendUnavailable, match=r"x: .*mxmoe_no_such_a.*mxmoe_no_such_b"):
        import_first(("mxmoe_no_such_a", "mxmoe_no_such_b"), "x")


# --- supports: the cases each adapter takes ----------------------------------------------------


def test_ck_splits_cases_at_aiter_fp8_bound_gfx950():
    below, at = make_case("small", FP8_FROM_TOKENS - 1), make_case("small", FP8_FROM_TOKENS)
    main, prefill = AiterMxfp4Bf16(), AiterMxfp4Bf16Prefill()
    assert main.supports(below, "gfx950") is None and prefill.supports(at, "gfx950") is None
    assert "aiter-mxfp4-bf16-prefill checks those" in main.supports(at, "gfx950")
    assert "aiter-mxfp4-bf16 checks those" in prefill.supports(below, "gfx950")


def test_ck_prefill_declares_mxfp8_rceil_activations_gfx950():
    p = AiterMxfp4Bf16Prefill.declaration.arithmetic.precision
    assert (p.activation_input, p.intermediate, p.mx_rule) == ("mxfp8", "mxfp8", "rceil")
    a, b = AiterMxfp4Bf16.declaration, AiterMxfp4Bf16Prefill.declaration
    same = ("archs", "w13_layout", "hidden_align", "intermediate_align", "bias_dtype", "activations")
    assert all(getattr(a, f) == getattr(b, f) for f in same)
    assert b.vllm_backend is None, "one vLLM backend, one declaration that selection sees"


def test_ck_takes_swigluoai_only_at_gpt_oss_constants_gfx950():
    reason = AiterMxfp4Bf16().supports(make_case("small", 4, limit=2.5), "gfx950")
    assert "built in" in reason and "limit 2.5" in reason


def test_triton_a16w4_declines_silu_on_gfx1250_and_beta_not_1():
    b = AiterTritonMxfp4Bf16()
    assert "a8w4 kernel" in b.supports(make_case("small", 4, activation="silu"), "gfx1250")
    assert b.supports(make_case("small", 4, activation="silu"), "gfx942") is None
    assert "s * (up + 1)" in b.supports(make_case("small", 4, beta=0.5), "gfx942")


def test_a8w4_is_not_judged_without_a_static_fp8_point_gfx950():
    reason = AiterMxfp4Fp8().supports(make_case("small", 4), "gfx950")
    assert "static per-tensor scales" in reason and "Precision" in reason


# --- argument mapping --------------------------------------------------------------------------


class _ActivationType(enum.Enum):
    """Stands in for aiter's pybind ActivationType: members by name, values not ours to assume."""

    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2


def test_enum_members_are_looked_up_by_name():
    assert activation_member(_ActivationType, "swigluoai") is _ActivationType.Swiglu
    assert activation_member(_ActivationType, "silu") is _ActivationType.Silu
    assert set(AITER_ACTIVATIONS.values()) <= set(_ActivationType.__members__)


def test_unknown_names_raise_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"quant_type must be a member of aiter's _ActivationType: No, Silu"):
        enum_member(_ActivationType, "per_1x32", "quant_type")
    with pytest.raises(ValueError, match="activation must be one of silu, swigluoai; got 'gelu'"):
        activation_member(_ActivationType, "gelu")


@pytest.mark.parametrize(
    "padded, real, tp, expected",
    [
        ((3072, 2880, 3072, 2880), None, 1, (128, 384)),  # gpt-oss at TP1: 192 -> 128 and 192 -> 128 x 2
        ((3072, 2880, 512, 384), None, 8, (128, 128)),  # a TP8 shard of 384 in 512
        ((256, 128, 256, 96), None, 1, (128, 256)),
        ((256, 256, 256, 256), None, 2, (0, 0)),
    ],
)
def test_ck_pads_round_as_vllm_gfx950(padded, real, tp, expected):
    assert ck_pads(*padded, tp) == expected


def test_ck_pads_reject_padding_smaller_than_the_layer():
    with pytest.raises(ValueError, match="padded hidden size must be at least the real one"):
        ck_pads(128, 256, 256, 256, 1)


def test_aiter_expert_mask_is_vllms_gfx950():
    got = aiter_expert_mask(torch.tensor([-1, -1, 0, 1], dtype=torch.int32))
    assert got.dtype == torch.int32 and got.tolist() == [0, 0, 1, 1, 0]


def test_static_fp8_scales_fit_x_and_the_intermediate_gfx950():
    inputs = make_inputs(make_case("small", 7), "cpu")
    a1, a2 = static_fp8_scales(inputs)
    assert a1.dtype == a2.dtype == torch.float32 and a1.dim() == a2.dim() == 0
    assert float(a1) * E4M3_MAX == pytest.approx(float(inputs.x.abs().max()), rel=1e-6)
    assert float(a2) > 0
    empty = make_inputs(make_case("small", 0), "cpu")
    assert [float(s) for s in static_fp8_scales(empty)] == [1.0, 1.0]


# --- weight forms ------------------------------------------------------------------------------


def test_k_major_keeps_a_transposed_view_and_relays_out_a_copy():
    nk = torch.arange(2 * 6 * 4, dtype=torch.uint8).reshape(2, 6, 4)
    view = nk.transpose(-2, -1)
    assert k_major(view) is view
    copy = k_major(view.contiguous())
    assert copy.stride(-2) == 1 and torch.equal(copy, view)


def test_triton_weights_are_k_major_padded_and_inputs_untouched_gfx942(monkeypatch):
    _on(monkeypatch, "gfx942")
    inputs = make_inputs(make_case("small", 3), "cpu")
    before = {n: t.clone() for n, t in inputs.tensors().items()}
    p = AiterTritonMxfp4Bf16().convert(inputs)
    e, h, i = 16, 256, 256  # small: H 128, I 96 -> 256 / 256
    assert p.w13.shape == (e, h // 2, 2 * i) and p.w13.stride(-2) == 1
    assert p.w2.shape == (e, i // 2, h) and p.w2.stride(-2) == 1
    assert p.w13_scales.shape == (e, h // 32, 2 * i) and p.swizzle is None
    assert p.b13.dtype == p.b2.dtype == torch.float32 and p.hidden == h
    assert all(torch.equal(before[n], t) for n, t in inputs.tensors().items())


# --- the CK shuffles against aiter's own (transcribed) ------------------------------------------


def _aiter_shuffle_weight_guinterleave(x: torch.Tensor, nlane: int, gate_up: bool) -> torch.Tensor:
    """aiter/ops/shuffle.py ``shuffle_weight(x, layout=(NLane, 16), is_guinterleave=True,
    gate_up)``, the body ``shuffle_weight_a16w4`` calls (aiter e4048607), verbatim."""
    experts_cnt, n, k_pk = x.shape
    if gate_up:
        n = n // 2
    kpack = 16
    klane = 64 // nlane
    n0 = n // nlane
    k0 = k_pk // (klane * kpack)
    if gate_up:
        x_ = x.view(experts_cnt, 2, n0, nlane, k0, klane, kpack).permute(0, 2, 1, 4, 5, 3, 6).contiguous()
    else:
        x_ = x.view(experts_cnt, n0, nlane, k0, klane, kpack).permute(0, 1, 3, 4, 2, 5).contiguous()
    return x_.view(*x.shape).contiguous()


def _aiter_shuffle_scale_guinterleave(src: torch.Tensor, experts_cnt: int, gate_up: bool) -> torch.Tensor:
    """aiter/ops/shuffle.py ``shuffle_scale(src, experts_cnt, is_guinterleave=True, gate_up)``,
    the body ``shuffle_scale_a16w4`` calls (aiter e4048607), verbatim for K/32 % 8 == 0."""
    n_experts, k_ = src.shape
    n_ = n_experts // experts_cnt
    k1, n1 = k_ // 2 // 4, n_ // 16 // 2
    if gate_up:
        s = src.view(experts_cnt, 2, n1, 16, k1, 2, 4).permute(0, 2, 4, 6, 3, 5, 1).contiguous()
    else:
        s = src.view(experts_cnt, n1, 2, 16, k1, 2, 4).permute(0, 1, 4, 6, 3, 5, 2).contiguous()
    return s.view(*src.shape).contiguous()


@pytest.mark.parametrize("role", ["w13", "w2"])
def test_ck_storage_matches_aiter_shuffles_gfx950(role):
    gen = torch.Generator().manual_seed(7)
    e, n, k = 3, 64, 512  # rows (2I for w13), reduction length: Kb = 256 bytes, K/32 = 16 scales
    blocks = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, (e, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    gate_up = role == "w13"
    w_step, s_step = storage.aiter_a16w4_weight_shuffle(), storage.aiter_a16w4_scale_shuffle()
    ours_w = w_step.forward(blocks, f"{role}_blocks")
    ours_s = s_step.forward(scales, f"{role}_scales")
    assert torch.equal(ours_w, _aiter_shuffle_weight_guinterleave(blocks, 16, gate_up))
    # vLLM hands aiter the scales 2-D, [E * N, K/32]: the same bytes as the adapter's 3-D form
    theirs_s = _aiter_shuffle_scale_guinterleave(scales.reshape(-1, k // 32), e, gate_up)
    assert torch.equal(ours_s.reshape(-1, k // 32), theirs_s)
