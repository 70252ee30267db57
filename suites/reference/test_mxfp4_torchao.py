"""reference.mxfp4 against torchao 0.18.0's MX quantizer (``to_mx``) and dequantizer (``to_dtype``).

Where the two agree they must agree bit for bit; every systematic disagreement is pinned below in
its own test, with the line of torchao that causes it, so that a torchao upgrade that changes one of
them shows up here as a failure to re-read rather than as silent drift.
"""

from __future__ import annotations

import warnings

import pytest
import torch

mx_tensor = pytest.importorskip(
    "torchao.prototype.mx_formats.mx_tensor", reason="torchao (0.18.0, the `test` extra) is not installed"
)
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config", reason="torchao is not installed")

from mxmoe.reference.mxfp4 import (  # noqa: E402 (after the importorskip that guards torchao)
    decode_e2m1,
    dequantize_mxfp4,
    dequantize_mxfp8,
    quantize_mxfp4,
    quantize_mxfp8,
    unpack_fp4,
)

SEED = 20240612
MODES = {"floor": "FLOOR", "rceil": "RCEIL", "even": "EVEN"}
FP4 = torch.float4_e2m1fn_x2
FP8 = torch.float8_e4m3fn


def torchao_quantize(x: torch.Tensor, elem: torch.dtype, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, scale bytes) from torchao: packed uint8 for FP4, float8_e4m3fn for FP8."""
    mode = getattr(mx_config.ScaleCalculationMode, MODES[rule])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale, data = mx_tensor.to_mx(x.contiguous(), elem, 32, mode)
    return data, scale.view(torch.uint8)


def torchao_dequantize(data: torch.Tensor, scales: torch.Tensor, elem: torch.dtype, target=torch.float32):
    return mx_tensor.to_dtype(data, scales.view(torch.float8_e8m0fnu), elem, 32, target).to(torch.float64)


def ours_quantize(x: torch.Tensor, elem: torch.dtype, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_mxfp4(x, rule) if elem is FP4 else quantize_mxfp8(x, rule)


def element_bits(data: torch.Tensor, elem: torch.dtype) -> torch.Tensor:
    """Element codes, one per element: E2M1 codes (unpacked) or E4M3 bytes; [..., K/32, 32]."""
    bits = unpack_fp4(data) if elem is FP4 else data.view(torch.uint8)
    return bits.reshape(*bits.shape[:-1], bits.shape[-1] // 32, 32)


def mixed_input(rows: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """~rows*k values in blocks of different scale ranges: ordinary (2**-30..2**30), wide (2**-120..
    2**120), tiny (2**-149..2**-118, float32 subnormals, where the scale byte is 0), rounding ties
    (multiples of 2**e/16) and exact zeros of both signs."""
    g = torch.Generator().manual_seed(seed)
    nblk = k // 32
    kind = torch.randint(0, 4, (rows, nblk, 1), generator=g)
    lo = torch.tensor([-30, -120, -149, -30])[kind]
    hi = torch.tensor([30, 120, -118, 30])[kind]
    e = (lo + (torch.rand(rows, nblk, 1, generator=g) * (hi - lo + 1)).floor()).to(torch.float64)
    spread = torch.exp2(torch.randint(-10, 1, (rows, nblk, 32), generator=g).to(torch.float64))
    x = torch.randn(rows, nblk, 32, generator=g, dtype=torch.float64) * spread * torch.exp2(e)
    ties = torch.randint(-96, 97, (rows, nblk, 32), generator=g).to(torch.float64) / 16 * torch.exp2(e)
    x = torch.where(kind == 3, ties, x)
    zero = torch.rand(rows, nblk, 32, generator=g) < 0.05
    x = torch.where(zero, torch.where(torch.rand(rows, nblk, 32, generator=g) < 0.5, 0.0, -0.0), x)
    return x.reshape(rows, k).to(dtype)


@pytest.fixture(scope="module")
def big_input() -> dict:
    return {
        torch.float32: mixed_input(1024, 1024, SEED, torch.float32),  # 1M values
        torch.bfloat16: mixed_input(256, 512, SEED + 1, torch.bfloat16),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("elem", [FP4, FP8], ids=["fp4", "fp8"])
@pytest.mark.parametrize("rule", list(MODES))
def test_quantizer_agrees_with_torchao(rule, elem, dtype, big_input, record_property):
    """Exact agreement of scale bytes and element codes on every block whose scale byte is not 0;
    on byte-0 blocks torchao's codes are those of the block scaled as the pinned tests below say."""
    x = big_input[dtype]
    got_data, got_scales = torchao_quantize(x, elem, rule)
    ref_data, ref_scales = ours_quantize(x, elem, rule)
    got_bits, ref_bits = element_bits(got_data, elem), element_bits(ref_data, elem)
    same_scale = got_scales == ref_scales
    same_block = same_scale & (got_bits == ref_bits).all(-1)
    record_property("block_agreement", same_block.float().mean().item())
    record_property("element_agreement", (got_bits == ref_bits).float().mean().item())
    byte0 = ref_scales == 0
    assert bool(same_scale.all()), f"{int((~same_scale).sum())} scale bytes differ from torchao {rule}"
    bad = ~same_block & ~byte0
    assert not bool(bad.any()), (
        f"{int(bad.sum())} / {int((~byte0).sum())} blocks with a nonzero scale byte differ from torchao {rule}; "
        f"first at block {tuple(bad.nonzero()[0].tolist())}"
    )
    if rule == "rceil":
        expected = torchao_rceil_byte0_codes(x, elem)
    else:
        expected = element_bits(ours_quantize(x.to(torch.float64) / 2, elem, rule)[0], elem)
    assert torch.equal(got_bits[byte0], expected[byte0]), f"byte-0 blocks ({rule}) differ from the pinned reading"


def torchao_rceil_byte0_codes(x: torch.Tensor, elem: torch.dtype) -> torch.Tensor:
    """Elements of x rounded with no scaling at all (x * 1.0): byte 0 blocks are below 2**-120, so
    only the sign survives."""
    neg = torch.signbit(x).to(torch.uint8)
    bits = neg << 3 if elem is FP4 else neg << 7
    return bits.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)


TINY = [6 * 2.0**-127, 2.0**-127, -1.5 * 2.0**-127, 4 * 2.0**-127, -0.5 * 2.0**-127]
"""A block both formats represent exactly at scale byte 0 (amax 6 * 2**-127 < 2**-125)."""


@pytest.mark.parametrize("elem", [FP4, FP8], ids=["fp4", "fp8"])
@pytest.mark.parametrize("rule", ["floor", "even"])
def test_torchao_floor_even_halve_byte0_blocks(rule, elem):
    """torchao 0.18.0's to_mx writes scale byte 0 (2**-127) for a block with amax < 2**-125 (FP4)
    but divides the elements by ``clamp(scale_fp32, min=F32_MIN_NORMAL)`` = 2**-126, a workaround
    for Triton's denormals: its codes are those of x / 2, and its own round trip (to_dtype reads
    byte 0 correctly as 2**-127) returns x / 2 rounded at scale 2**-127 instead of x, which is
    representable. This is the 'byte 0, factor 2' of docs/oracle.md."""
    x = torch.zeros(1, 32, dtype=torch.float32)
    x[0, : len(TINY)] = torch.tensor(TINY)
    got_data, got_scales = torchao_quantize(x, elem, rule)
    ref_data, ref_scales = ours_quantize(x, elem, rule)
    assert got_scales.item() == 0 and ref_scales.item() == 0
    halved, _ = ours_quantize(x.to(torch.float64) / 2, elem, rule)
    assert torch.equal(element_bits(got_data, elem), element_bits(halved, elem)), "torchao did not use x / 2"
    assert not torch.equal(element_bits(got_data, elem), element_bits(ref_data, elem))
    round_trip = torchao_dequantize(got_data, got_scales, elem)
    ours = (dequantize_mxfp4 if elem is FP4 else dequantize_mxfp8)(ref_data, ref_scales)
    ours_half = (dequantize_mxfp4 if elem is FP4 else dequantize_mxfp8)(*ours_quantize(x.double() / 2, elem, rule))
    assert torch.equal(round_trip, ours_half), f"torchao round trip {round_trip[0, :5].tolist()}"
    assert torch.equal(ours, x.to(torch.float64)), "ours keeps these representable values exactly"


@pytest.mark.parametrize("elem", [FP4, FP8], ids=["fp4", "fp8"])
def test_torchao_rceil_does_not_scale_byte0_blocks(elem):
    """torchao's _to_mx_rceil multiplies by ``torch.where(exponent == 0, 1.0, 2**(127 - exponent))``:
    a byte-0 block is not scaled at all, so every element (< 6 * 2**-127) rounds to a signed zero
    and the block vanishes; ours scales by 2**127 and keeps it."""
    x = torch.zeros(1, 32, dtype=torch.float32)
    x[0, : len(TINY)] = torch.tensor(TINY)
    got_data, got_scales = torchao_quantize(x, elem, "rceil")
    assert got_scales.item() == 0
    assert torch.equal(element_bits(got_data, elem), torchao_rceil_byte0_codes(x, elem))
    round_trip = torchao_dequantize(got_data, got_scales, elem)
    assert not bool(round_trip.any()), "torchao's RCEIL round trip of a byte-0 block is all zeros"
    ref_data, ref_scales = ours_quantize(x, elem, "rceil")
    ours = (dequantize_mxfp4 if elem is FP4 else dequantize_mxfp8)(ref_data, ref_scales)
    assert torch.equal(ours, x.to(torch.float64))


@pytest.mark.parametrize("elem, vmax", [(FP4, 6.0), (FP8, 448.0)], ids=["fp4", "fp8"])
@pytest.mark.parametrize("k", [5, 20, -60, 100])
def test_torchao_rceil_saturates_just_above_a_power_of_two(elem, vmax, k):
    """torchao's eager RCEIL takes ``ceil(log2(amax / vmax))`` in float32. For amax the next float32
    above vmax * 2**k, amax / vmax = 2**k * (1 + 2**-23), whose float32 log2 rounds to exactly k
    (the ulp of k exceeds 2**-23 / ln 2 for |k| >= 2): torchao picks 2**k and saturates amax, which
    RCEIL promises never to do. Ours (and exact math) pick 2**(k+1). At k = 0 the log2 is resolved."""
    amax = torch.nextafter(torch.tensor(vmax * 2.0**k), torch.tensor(float("inf")))
    x = torch.zeros(1, 32, dtype=torch.float32)
    x[0, 0], x[0, 1] = amax, 2.0**k
    got_data, got_scales = torchao_quantize(x, elem, "rceil")
    ref_data, ref_scales = ours_quantize(x, elem, "rceil")
    assert ref_scales.item() == 128 + k, "exact RCEIL: amax > vmax * 2**k needs 2**(k+1)"
    assert got_scales.item() == 127 + k, f"torchao's float32 log2 picked byte {got_scales.item()}"
    assert torchao_dequantize(got_data, got_scales, elem)[0, 0].item() == vmax * 2.0**k < amax.item()
    x[0, 0] = torch.nextafter(torch.tensor(vmax), torch.tensor(float("inf")))
    x[0, 1] = 1.0
    assert torchao_quantize(x, elem, "rceil")[1].item() == 128 == ours_quantize(x, elem, "rceil")[1].item()


@pytest.mark.parametrize("elem", [FP4, FP8], ids=["fp4", "fp8"])
@pytest.mark.parametrize("rule", list(MODES))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["posinf", "neginf", "nan"])
def test_torchao_nonfinite_blocks(bad, rule, elem):
    """NaN: both write byte 255 and both dequantize the block to NaN (their codes differ, and do not
    matter). Infinity: ours writes 255 (NaN block); torchao reads the exponent field of inf (128) and
    clamps: FLOOR/EVEN give 128 - emax + 127 (253 for FP4, 247 for FP8), RCEIL gives 254; the
    infinity saturates to +-vmax and the finite neighbours (tiny at that scale) round to zero. Read
    exactly, that block is finite (+-vmax * 2**(byte - 127) and zeros): the overflow is lost; only
    torchao's own float32 dequantization turns +-vmax * 2**(byte - 127) (>= 2**128) back into +-inf."""
    x = torch.zeros(1, 64, dtype=torch.float32)
    x[0, :3] = torch.tensor([bad, 1.0, -2.0])
    x[0, 32:35] = torch.tensor([1.0, -3.0, 0.5])
    got_data, got_scales = torchao_quantize(x, elem, rule)
    ref_data, ref_scales = ours_quantize(x, elem, rule)
    assert ref_scales[0, 0].item() == 255 and got_scales[0, 1] == ref_scales[0, 1]
    got = torchao_dequantize(got_data, got_scales, elem)
    ours = (dequantize_mxfp4 if elem is FP4 else dequantize_mxfp8)(ref_data, ref_scales)
    assert torch.equal(got[0, 32:], ours[0, 32:]), "the finite neighbour block must agree"
    assert bool(ours[0, :32].isnan().all())
    if bad != bad:  # NaN
        assert got_scales[0, 0].item() == 255 and bool(got[0, :32].isnan().all())
        return
    emax, vmax = (2, 6.0) if elem is FP4 else (8, 448.0)
    ref_byte = 254 if rule == "rceil" else 128 - emax + 127
    assert got_scales[0, 0].item() == ref_byte, f"torchao scale byte {got_scales[0, 0].item()}"
    sign = 1.0 if bad > 0 else -1.0
    exact = (dequantize_mxfp4 if elem is FP4 else dequantize_mxfp8)(
        got_data if elem is FP4 else got_data.view(FP8), got_scales
    )
    assert exact[0, 0].item() == sign * vmax * 2.0 ** (ref_byte - 127), "the infinity must saturate to vmax"
    assert not bool(exact[0, 1:32].any()), "torchao's finite neighbours of an infinity round to zero"
    assert got[0, 0].item() == sign * float("inf") and not bool(got[0, 1:32].any())


def all_fp4_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed byte (16 blocks a row) under every scale byte (one row per scale byte)."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    return blocks, scales


def assert_dequant_agrees(got: torch.Tensor, ref: torch.Tensor, limit: float, what: str) -> None:
    """Bitwise agreement (sign of zero and NaN included) wherever the exact value fits the target
    dtype (|ref| < limit); beyond it torchao's float32/bf16 product overflows to +-inf."""
    nan = ref.isnan()
    fits = ~nan & (ref.abs() < limit)
    over = ~nan & ~fits
    ok = (got == ref) & (torch.signbit(got) == torch.signbit(ref))
    assert bool(got[nan].isnan().all()), f"{what}: a NaN (scale 255 or NaN element) did not stay NaN"
    bad = fits & ~ok
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} / {int(fits.sum())} in-range values differ; first at "
        f"{tuple(bad.nonzero()[0].tolist())}: torchao {got[bad][0].item()!r}, ours {ref[bad][0].item()!r}"
    )
    assert torch.equal(got[over], torch.copysign(torch.full_like(ref[over], float("inf")), ref[over])), what


@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torchao_dequantizes_every_fp4_scale_and_code_like_ours(target):
    """torchao's to_dtype (unpack_uint4 low nibble first, f4_unpacked_to_f32, get_fp_scale) agrees
    with ours on all 256 x 256 (scale byte, packed byte) pairs, byte 0 included (2**-127: on CPU
    eager the 'factor 2' of docs/oracle.md is in the quantizer, pinned above, not here), byte 255 NaN, -0 kept,
    except where the exact product reaches 2**128 and overflows float32 / bfloat16 (bytes 253, 254)."""
    blocks, scales = all_fp4_pairs()
    got = torchao_dequantize(blocks, scales, FP4, target)
    ref = dequantize_mxfp4(blocks, scales)
    assert_dequant_agrees(got, ref, 2.0**128, f"fp4 -> {target}")
    assert got[0, 2].item() == 0.5 * 2.0**-127 and got[0, 2].item() == ref[0, 2].item()


def test_torchao_dequantizes_every_fp8_scale_and_element_like_ours():
    """Every E4M3 byte (NaN encodings included) under every scale byte, into float32: equal except
    float32 overflow at 2**128."""
    elems = torch.arange(256, dtype=torch.uint8).view(FP8).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 8)
    got = torchao_dequantize(elems, scales, FP8, torch.float32)
    ref = dequantize_mxfp8(elems, scales)
    assert_dequant_agrees(got, ref, 2.0**128, "fp8 -> float32")


def test_torchao_fp4_codes_match_our_table():
    """torchao's own E2M1 decode of every code, against ours (a nibble-order or -0 slip shows here)."""
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels", reason="torchao is not installed")
    codes = torch.arange(16, dtype=torch.uint8)
    got = kernels.f4_unpacked_to_f32(codes).to(torch.float64)
    ref = decode_e2m1(codes)
    assert torch.equal(got, ref) and torch.equal(torch.signbit(got), torch.signbit(ref))
    byte = torch.tensor([0x21], dtype=torch.uint8)
    assert torch.equal(kernels.unpack_uint4(byte), unpack_fp4(byte)), "torchao and ours unpack low nibble first"
