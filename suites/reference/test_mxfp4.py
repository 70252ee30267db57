"""reference.mxfp4 against plain restatements of docs/formats.md and of the module's documented policy.

Every expected value here is computed without the code under test: E2M1, E4M3 and E8M0 values from
their bit fields with ``fractions.Fraction``, rounding to nearest-even with integer arithmetic on the
exact binary value of each float, scale exponents from exact rationals. Hypothesis draws structure
(shapes, exponent ranges, seeds); tensor values come from a generator seeded with the drawn seed.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from mxmoe.reference.mxfp4 import (
    E2M1_VALUES,
    SCALE_RULES,
    decode_e2m1,
    decode_e8m0,
    dequantize_mxfp4,
    dequantize_mxfp8,
    encode_e2m1,
    fake_quantize,
    pack_fp4,
    quantize_mxfp4,
    quantize_mxfp8,
    unpack_fp4,
)

SEED = 20240611
"""Fixed seed of every generator in this file: a run's data never depends on the clock."""


# --------------------------------------------------------------------------------------------------
# Independent restatement of the formats (bit fields -> exact values)
# --------------------------------------------------------------------------------------------------


def ref_e2m1(code: int) -> tuple[Fraction, bool]:
    """(magnitude, negative) of an E2M1 code from its bit fields: sign bit 3, exponent bits 2-1 with
    bias 1, mantissa bit 0; exponent 0 is subnormal (0.5 * m)."""
    sign, exp, man = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = Fraction(man, 2) if exp == 0 else Fraction(2) ** (exp - 1) * (1 + Fraction(man, 2))
    return mag, bool(sign)


def ref_e4m3(byte: int) -> tuple[Fraction, bool] | None:
    """(magnitude, negative) of an E4M3 (fn) byte from its bit fields; None for the NaN encodings.
    Bias 7, 3 mantissa bits, exponent 0 subnormal with quantum 2**-9, no infinities."""
    sign, exp, man = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if exp == 0xF and man == 7:
        return None
    if exp == 0:
        mag = Fraction(man, 8) * Fraction(2) ** -6
    else:
        mag = Fraction(2) ** (exp - 7) * (1 + Fraction(man, 8))
    return mag, bool(sign)


def ref_e8m0(byte: int) -> Fraction | None:
    """Scale value of an E8M0 byte; None for 255, which the spec reads as NaN."""
    return None if byte == 255 else Fraction(2) ** (byte - 127)


def signed_float(mag: Fraction, negative: bool) -> float:
    """An exact signed float64 (float(Fraction) rounds correctly; all values here are exact)."""
    return math.copysign(float(mag), -1.0 if negative else 1.0)


E2M1_POS = [ref_e2m1(c)[0] for c in range(8)]
E4M3_FINITE = [b for b in range(256) if ref_e4m3(b) is not None]


class Fmt:
    """Element format constants, restated from the OCP spec rather than imported."""

    def __init__(self, name: str, mbits: int, emin: int, emax: int, vmax: Fraction) -> None:
        self.name, self.mbits, self.emin, self.emax, self.vmax = name, mbits, emin, emax, vmax


FP4 = Fmt("fp4", mbits=1, emin=0, emax=2, vmax=Fraction(6))
FP8 = Fmt("fp8", mbits=3, emin=-6, emax=8, vmax=Fraction(448))


def floor_log2(q: Fraction) -> int:
    """floor(log2(q)) of a positive rational, exactly."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    return e if Fraction(2) ** e <= q else e - 1


def ref_shared_exponent(amax: Fraction, rule: str, fmt: Fmt) -> int:
    """Shared exponent of a block with finite, nonzero ``amax``, from the module docstring's rules."""
    if rule == "floor":
        e = floor_log2(amax) - fmt.emax
    elif rule == "rceil":
        # The smallest e with amax <= vmax * 2**e.
        e = floor_log2(amax / fmt.vmax)
        if amax > fmt.vmax * Fraction(2) ** e:
            e += 1
    elif rule == "even":
        step = Fraction(2) ** (floor_log2(amax) - fmt.mbits)
        rounded = math.floor(amax / step + Fraction(1, 2)) * step  # half away from zero (amax > 0)
        e = floor_log2(rounded) - fmt.emax
    else:
        raise AssertionError(rule)
    return max(-127, min(127, e))


def float_parts(x: float) -> tuple[int, int]:
    """(m, p) with |x| == m * 2**p exactly, m a nonnegative integer (plain bit manipulation)."""
    frac, exp = math.frexp(abs(x))
    return int(math.ldexp(frac, 53)), exp - 53


def ref_round(x: float, shift: int, fmt: Fmt) -> float:
    """``x / 2**shift`` rounded to nearest, ties to even, onto ``fmt``'s grid, saturating at vmax;
    the sign of ``x`` is kept (zeros included). Integer arithmetic on the exact binary value."""
    m, p = float_parts(x)
    p -= shift
    negative = math.copysign(1.0, x) < 0
    if m == 0:
        return signed_float(Fraction(0), negative)
    top = m.bit_length() - 1 + p  # floor(log2(|x| / 2**shift))
    qe = max(top, fmt.emin) - fmt.mbits  # quantum exponent at that binade (subnormals: emin's)
    if p >= qe:
        n = m << (p - qe)
    else:
        s = qe - p
        n, rem, half = m >> s, m & ((1 << s) - 1), 1 << (s - 1)
        if rem > half or (rem == half and n & 1):
            n += 1
    mag = Fraction(n) * Fraction(2) ** qe
    return signed_float(min(mag, fmt.vmax), negative)


def ref_quantize_block(block: list[float], rule: str, fmt: Fmt) -> tuple[int, list[float]]:
    """(scale byte, element values) of one block under the module's documented policy."""
    if not all(math.isfinite(v) for v in block):
        return 255, [0.0] * len(block)
    amax = max(Fraction(abs(v)) for v in block)
    if amax == 0:
        return 0, [math.copysign(0.0, v) for v in block]
    e = ref_shared_exponent(amax, rule, fmt)
    return e + 127, [ref_round(v, e, fmt) for v in block]


def fp4_elements(blocks: torch.Tensor) -> torch.Tensor:
    return decode_e2m1(unpack_fp4(blocks))


def same_values(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal, with the same sign bit (so -0 != +0), or both NaN."""
    both_nan = got.isnan() & ref.isnan()
    return both_nan | ((got == ref) & (torch.signbit(got) == torch.signbit(ref)))


def assert_same(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    ok = same_values(got, ref)
    if not bool(ok.all()):
        bad = (~ok).nonzero()
        idx = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} / {ok.numel()} elements differ (sign of zero and NaN included); "
            f"first at index {idx}: got {got[idx].item()!r}, expected {ref[idx].item()!r}"
        )


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


def test_e2m1_table_matches_bit_fields():
    ref = torch.tensor([signed_float(*ref_e2m1(c)) for c in range(16)], dtype=torch.float64)
    assert_same(E2M1_VALUES, ref, "E2M1_VALUES")
    assert bool(torch.signbit(decode_e2m1(torch.tensor([8], dtype=torch.uint8)))), "code 8 must decode to -0"


def test_every_byte_unpacks_low_nibble_first_and_decodes():
    byte = torch.arange(256, dtype=torch.uint8)
    codes = unpack_fp4(byte.unsqueeze(-1))
    ref_codes = torch.tensor([[b & 0xF, b >> 4] for b in range(256)], dtype=torch.uint8)
    assert torch.equal(codes, ref_codes), "unpack_fp4 must put the LOW nibble first (element 2i)"
    ref = torch.tensor(
        [[signed_float(*ref_e2m1(b & 0xF)), signed_float(*ref_e2m1(b >> 4))] for b in range(256)],
        dtype=torch.float64,
    )
    assert_same(decode_e2m1(codes), ref, "decode_e2m1 of every byte's two nibbles")
    # The same 256 bytes as one row of 16 blocks at scale 2**0.
    got = dequantize_mxfp4(byte.unsqueeze(0), torch.full((1, 16), 127, dtype=torch.uint8))
    assert_same(got, ref.reshape(1, 512), "dequantize_mxfp4 at scale byte 127")
    assert bool(torch.signbit(got[0, 16])) and got[0, 16] == 0, "byte 0x08's low nibble (code 8) is -0"


def test_every_e8m0_byte_decodes():
    got = decode_e8m0(torch.arange(256, dtype=torch.uint8))
    for b in range(256):
        ref = ref_e8m0(b)
        if ref is None:
            assert math.isnan(got[b].item()), f"E8M0 byte 255 must decode to NaN, got {got[b].item()}"
        else:
            assert Fraction(got[b].item()) == ref, f"E8M0 byte {b}: got {got[b].item()!r}, expected 2**{b - 127}"
    assert got[0].item() == 2.0**-127, "byte 0 is 2**-127, not 0"


def test_dequantize_every_scale_times_every_code():
    # Row s: all 256 packed bytes (16 blocks) under scale byte s.
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    got = dequantize_mxfp4(blocks, scales)
    assert got.dtype == torch.float64
    codes = [c for b in range(256) for c in (b & 0xF, b >> 4)]
    elems = [ref_e2m1(c) for c in codes]
    rows = []
    for s in range(255):
        scale = ref_e8m0(s)
        rows.append([signed_float(mag * scale, neg) for mag, neg in elems])
    assert_same(got[:255], torch.tensor(rows, dtype=torch.float64), "dequantize_mxfp4 scale x code")
    assert bool(got[255].isnan().all()), "scale byte 255 (NaN) must make its whole block NaN"


def test_dequantize_nan_scale_is_per_block():
    blocks = torch.full((2, 48), 0x72, dtype=torch.uint8)  # codes 2 and 7: 1.0 and 6.0
    scales = torch.tensor([[127, 255, 128], [255, 126, 255]], dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales).reshape(2, 3, 32)
    nan_block = (scales == 255).unsqueeze(-1).expand(2, 3, 32)
    assert bool(got[nan_block].isnan().all()), "every element of a byte-255 block must be NaN"
    assert not bool(got[~nan_block].isnan().any()), "a NaN scale leaked into a neighbouring block"
    assert got[0, 0, :2].tolist() == [1.0, 6.0] and got[1, 1, :2].tolist() == [0.5, 3.0]


# --------------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------------


def test_pack_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8, 0x0, 0x7]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0x8F, 0x70]], "a nibble swap is silent on symmetric data"


@given(
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    pairs=st.integers(0, 40),
    seed=st.integers(0, 2**31 - 1),
)
@example(lead=[], pairs=0, seed=0)
def test_pack_unpack_invert_each_other(lead, pairs, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, 2 * pairs), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (*lead, pairs) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed), codes), f"unpack(pack(codes)) != codes for shape {tuple(codes.shape)}"
    raw = torch.randint(0, 256, (*lead, pairs), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(raw)), raw), "pack(unpack(bytes)) != bytes"
    if not pairs or not codes.numel():
        return
    flat_codes, flat_packed = codes.reshape(-1, 2 * pairs).tolist(), packed.reshape(-1, pairs).tolist()
    for row_c, row_p in zip(flat_codes, flat_packed):
        assert row_p == [row_c[2 * i] | (row_c[2 * i + 1] << 4) for i in range(pairs)]


def test_encode_e2m1_inverts_the_table():
    values = torch.tensor([signed_float(*ref_e2m1(c)) for c in range(16)], dtype=torch.float64)
    assert encode_e2m1(values).tolist() == list(range(16)), "encode_e2m1 must keep -0 as code 8"
    for off_grid in (0.25, 2.5, 7.0, -5.0):
        with pytest.raises(ValueError, match="E2M1 grid"):
            encode_e2m1(torch.tensor([off_grid], dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# Round trips of representable data
# --------------------------------------------------------------------------------------------------


def representable_fp4(rows: int, nblk: int, lo: int, hi: int, seed: int, anchor: bool) -> tuple:
    """Random E2M1 grid values (both zero signs included) times a per-block 2**e, e in [lo, hi].
    With ``anchor`` each block holds a +-4 or +-6 (times 2**e), which makes 2**e every rule's scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, nblk, 32), generator=g, dtype=torch.uint8)
    if anchor:
        slot = torch.randint(0, 32, (rows, nblk, 1), generator=g)
        big = torch.randint(0, 4, (rows, nblk, 1), generator=g, dtype=torch.uint8)
        codes.scatter_(-1, slot, torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[big.long()])
    exps = torch.randint(lo, hi + 1, (rows, nblk), generator=g)
    vals = [[signed_float(*ref_e2m1(c)) for c in blk] for row in codes.tolist() for blk in row]
    base = torch.tensor(vals, dtype=torch.float64).reshape(rows, nblk, 32)
    x = (base * torch.exp2(exps.to(torch.float64)).unsqueeze(-1)).reshape(rows, nblk * 32)
    return x, exps, codes


@pytest.mark.parametrize("rule", SCALE_RULES)
@given(
    rows=st.integers(1, 4),
    nblk=st.integers(1, 4),
    span=st.tuples(st.integers(-127, 127), st.integers(0, 254)),
    seed=st.integers(0, 2**31 - 1),
)
@example(rows=1, nblk=2, span=(-127, 0), seed=1)
@example(rows=1, nblk=2, span=(127, 0), seed=2)
def test_representable_blocks_round_trip_exactly(rule, rows, nblk, span, seed):
    """For E2M1 every rule's exponent is at most the block's own one and leaves amax / 2**e <= 6,
    and a grid value times 2**k that stays <= 6 is again on the grid: so every representable block
    round-trips bitwise under every rule. With a +-4 or +-6 anchor all three rules pick 2**e itself."""
    lo = span[0]
    hi = min(127, lo + span[1])
    x, exps, codes = representable_fp4(rows, nblk, lo, hi, seed, anchor=True)
    blocks, scales = quantize_mxfp4(x, rule)
    assert torch.equal(scales, (exps + 127).to(torch.uint8)), "anchored block: the scale must be 2**e"
    assert torch.equal(unpack_fp4(blocks).reshape(codes.shape), codes), "codes differ from the source codes"
    assert_same(dequantize_mxfp4(blocks, scales), x, f"round trip ({rule}, anchored)")
    assert_same(fake_quantize(x, "mxfp4", rule), x, f"fake_quantize mxfp4 ({rule})")
    y, _, _ = representable_fp4(rows, nblk, lo, hi, seed + 1, anchor=False)
    assert_same(fake_quantize(y, "mxfp4", rule), y, f"round trip ({rule}, no anchor)")


def test_every_finite_e4m3_value_round_trips_exactly():
    finite = torch.tensor(E4M3_FINITE, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ref = torch.tensor([signed_float(*ref_e4m3(b)) for b in E4M3_FINITE], dtype=torch.float64)
    assert_same(finite.to(torch.float64), ref, "torch's E4M3 decode vs the bit fields")
    # 31 values a block plus a 448 anchor, so every rule picks scale 2**0 for every block.
    vals = ref.tolist()
    vals += [0.0] * (-len(vals) % 31)
    rows = [vals[i : i + 31] + [448.0] for i in range(0, len(vals), 31)]
    for shift in (-127, -3, 0, 5, 119):
        x = torch.tensor(rows, dtype=torch.float64) * 2.0**shift
        for rule in SCALE_RULES:
            elems, scales = quantize_mxfp8(x, rule)
            assert elems.dtype == torch.float8_e4m3fn
            assert scales.flatten().tolist() == [127 + shift] * len(rows), f"{rule}: scale for shift {shift}"
            assert_same(elems.to(torch.float64), torch.tensor(rows, dtype=torch.float64), f"{rule} elements")
            assert_same(dequantize_mxfp8(elems, scales), x, f"mxfp8 round trip ({rule}, shift {shift})")


def test_mxfp8_floor_saturates_where_rceil_does_not():
    """The floor rule leaves amax / 2**e in [256, 512) but E4M3 stops at 448: a representable 240
    (1.875 * 2**7) is scaled to 480 and saturates; RCEIL picks 2**0 and keeps it."""
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, 0] = 240.0
    assert fake_quantize(x, "mxfp8", "floor")[0, 0].item() == 224.0
    assert fake_quantize(x, "mxfp8", "even")[0, 0].item() == 224.0
    assert fake_quantize(x, "mxfp8", "rceil")[0, 0].item() == 240.0


# --------------------------------------------------------------------------------------------------
# The floor rule, case by case
# --------------------------------------------------------------------------------------------------


def one_block(*values: float) -> torch.Tensor:
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return x


def test_floor_amax_7_scale_1_and_saturates_to_6():
    blocks, scales = quantize_mxfp4(one_block(7.0, -7.0, 1.0))
    assert scales.tolist() == [[127]], f"floor(log2 7) - 2 = 0, got byte {scales.item()}"
    assert unpack_fp4(blocks)[0, :3].tolist() == [7, 15, 2], "7 must saturate to 6 (code 7), -7 to -6"


# (input at scale 2**0, expected value); the 4.0 in the block pins the scale at 2**0.
TIES = [
    (0.25, 0.0),
    (0.75, 1.0),
    (1.25, 1.0),
    (1.75, 2.0),
    (2.5, 2.0),
    (3.5, 4.0),
    (5.0, 4.0),
    (0.2, 0.0),
    (0.3, 0.5),
    (2.4, 2.0),
    (2.6, 3.0),
    (4.9, 4.0),
    (5.1, 6.0),
    (6.0, 6.0),
    (6.5, 6.0),
]


def token(v: float) -> str:
    return f"{v:g}".replace("-", "m").replace(".", "p").replace("+", "")


@pytest.mark.parametrize(
    "x, ref",
    TIES + [(-a, -b) for a, b in TIES],
    ids=[token(a) for a, _ in TIES] + [token(-a) for a, _ in TIES],
)
def test_floor_rounds_to_nearest_even(x, ref):
    blocks, scales = quantize_mxfp4(one_block(4.0, x))
    assert scales.item() == 127
    got = fp4_elements(blocks)[0, 1]
    assert got.item() == ref and bool(torch.signbit(got)) == (x < 0), f"{x} rounded to {got.item()}, expected {ref}"


def test_negative_zero_and_zero_blocks():
    blocks, scales = quantize_mxfp4(one_block(4.0, -0.0, -0.1, 0.0))
    assert unpack_fp4(blocks)[0, :4].tolist() == [6, 8, 8, 0], "-0 and values rounding to 0 keep the sign"
    blocks, scales = quantize_mxfp4(torch.zeros(2, 64, dtype=torch.float64))
    assert scales.tolist() == [[0, 0], [0, 0]] and not bool(blocks.any()), "all-zero block: byte 0, code 0"
    blocks, scales = quantize_mxfp4(torch.full((1, 32), -0.0))
    assert scales.item() == 0 and unpack_fp4(blocks).tolist() == [[8] * 32], "all -0 block: byte 0, code 8"


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "posinf", "neginf"])
def test_nonfinite_block_is_nan_and_isolated(rule, bad):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 96, generator=g, dtype=torch.float64) * 3
    x[0, 40] = bad  # block 1 of row 0
    blocks, scales = quantize_mxfp4(x, rule)
    assert scales[0, 1].item() == 255, f"a block holding {bad} must get scale byte 255"
    got = dequantize_mxfp4(blocks, scales)
    assert bool(got[0, 32:64].isnan().all()), "the whole non-finite block must dequantize to NaN"
    assert not bool(got[0, :32].isnan().any() or got[0, 64:].isnan().any() or got[1].isnan().any())
    clean_blocks, clean_scales = quantize_mxfp4(x[:, 64:], rule)
    assert torch.equal(blocks[:, 32:], clean_blocks) and torch.equal(scales[:, 2:], clean_scales)
    first_blocks, first_scales = quantize_mxfp4(x[:, :32], rule)
    assert torch.equal(blocks[:, :16], first_blocks) and torch.equal(scales[:, :1], first_scales)
    elems, scales8 = quantize_mxfp8(x, rule)
    assert scales8[0, 1].item() == 255 and bool(dequantize_mxfp8(elems, scales8)[0, 32:64].isnan().all())


# (amax, expected floor scale byte, expected value of the amax element after the round trip)
CLAMP_CASES = [
    (2.0**-140, 0, 0.0),  # floor gives -142, clamped to -127; 2**-13 at that scale rounds to 0
    (2.0**-126, 0, 2.0**-126),  # floor gives -128, clamped; 2 * 2**-127 is exact
    (3 * 2.0**-129, 0, 2.0**-127),  # clamped; 0.75 at scale 2**-127 is a tie, to even: 1.0
    (2.0**129, 254, 2.0**129),  # floor gives 127 exactly, no clamp
    (2.0**130, 254, 6 * 2.0**127),  # floor gives 128, clamped to 127: 8 saturates to 6
    (2.0**200, 254, 6 * 2.0**127),
]


@pytest.mark.parametrize(
    "amax, ref_scale, ref_value", CLAMP_CASES, ids=["2em140", "2em126", "3x2em129", "2e129", "2e130", "2e200"]
)
def test_floor_exponent_clamps_at_both_ends(amax, ref_scale, ref_value):
    blocks, scales = quantize_mxfp4(one_block(-amax, amax / 8))
    assert scales.item() == ref_scale, f"amax {amax}: scale byte {scales.item()}, expected {ref_scale}"
    got = dequantize_mxfp4(blocks, scales)[0, 0].item()
    assert got == -ref_value, f"amax {amax}: dequantized to {got}, expected {-ref_value}"


# --------------------------------------------------------------------------------------------------
# Every rule against the independent implementation, on random blocks
# --------------------------------------------------------------------------------------------------


def random_blocks(n: int, seed: int) -> torch.Tensor:
    """[n, 32] float64 blocks spanning exponents -150..150 (clamping at both ends included), with
    spread inside a block, exact zeros of both signs, exact E2M1/E4M3 rounding ties, and amax placed
    on the rule boundaries (6 * 2**k, 448 * 2**k, 1.75 * 2**k, 1.9375 * 2**k and their neighbours)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.exp2(torch.randint(-150, 151, (n, 1), generator=g).to(torch.float64))
    spread = torch.exp2(torch.randint(-14, 1, (n, 32), generator=g).to(torch.float64))
    x = torch.randn(n, 32, generator=g, dtype=torch.float64) * base * spread
    kind = torch.randint(0, 6, (n,), generator=g)
    # Multiples of 1/16 of a power of two: every E2M1 and E4M3 midpoint among them.
    grid = torch.randint(-160, 161, (n, 32), generator=g).to(torch.float64) / 16 * base
    x = torch.where((kind == 1).unsqueeze(-1), grid, x)
    zero = torch.rand(n, 32, generator=g) < 0.1
    x = torch.where(zero, torch.where(torch.rand(n, 32, generator=g) < 0.5, 0.0, -0.0), x)
    edges = torch.tensor([6.0, 448.0, 1.75, 1.9375, 3.5, 7.0, 480.0], dtype=torch.float64)
    pick = edges[torch.randint(0, len(edges), (n,), generator=g)] * base.squeeze(-1)
    nudge = torch.randint(-1, 2, (n,), generator=g)
    edge = torch.where(nudge == 0, pick, torch.nextafter(pick, pick * (1.0 + nudge.to(torch.float64))))
    x[:, 0] = torch.where(kind >= 4, edge, x[:, 0])
    return x


def check_against_reference(x: torch.Tensor, rule: str, fmt: Fmt):
    if fmt is FP4:
        blocks, scales = quantize_mxfp4(x, rule)
        elems = fp4_elements(blocks)
    else:
        q, scales = quantize_mxfp8(x, rule)
        elems = q.to(torch.float64)
    ref = [ref_quantize_block(row, rule, fmt) for row in x.tolist()]
    ref_scales = torch.tensor([s for s, _ in ref], dtype=torch.uint8)
    ref_elems = torch.tensor([v for _, v in ref], dtype=torch.float64)
    bad = (scales.flatten() != ref_scales).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{fmt.name} {rule}: {bad.numel()} / {len(ref)} scale bytes differ; first: block {x[bad[0]].tolist()} "
        f"got {scales.flatten()[bad[0]].item()}, expected {ref_scales[bad[0]].item()}"
    )
    assert_same(elems, ref_elems, f"{fmt.name} {rule} elements")
    return scales


@pytest.mark.parametrize("fmt", [FP4, FP8], ids=["fp4", "fp8"])
@pytest.mark.parametrize("rule", SCALE_RULES)
def test_rules_match_independent_implementation(rule, fmt, profile):
    n = {"pr": 2000 if fmt is FP4 else 1000, "nightly": 20000}[profile]
    x = random_blocks(n, SEED + SCALE_RULES.index(rule))
    scales = check_against_reference(x, rule, fmt)
    if rule == "rceil":
        # Never saturates: amax <= vmax * 2**e wherever the exponent is not clamped at the top, and
        # e is the smallest such (or clamped at the bottom).
        for row, s in zip(x.tolist(), scales.flatten().tolist()):
            amax = max(Fraction(abs(v)) for v in row)
            if amax == 0 or s == 254:
                continue
            e = Fraction(2) ** (s - 127)
            assert amax <= fmt.vmax * e, f"rceil saturated: amax {float(amax)} > {fmt.vmax} * 2**{s - 127}"
            assert s == 0 or amax > fmt.vmax * e / 2, f"rceil scale 2**{s - 127} is not the smallest for {amax}"


@pytest.mark.parametrize("fmt", [FP4, FP8], ids=["fp4", "fp8"])
@pytest.mark.parametrize("rule", SCALE_RULES)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3), nblk=st.integers(1, 3), lo=st.integers(-160, 150))
def test_rules_match_independent_implementation_shapes(rule, fmt, seed, rows, nblk, lo):
    """The same check on drawn leading shapes and a drawn exponent window, through the [..., K] path."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(lo, lo + 12, (rows, nblk, 1), generator=g).to(torch.float64)
    x = (torch.randn(rows, nblk, 32, generator=g, dtype=torch.float64) * torch.exp2(e)).reshape(rows, nblk * 32)
    if fmt is FP4:
        blocks, scales = quantize_mxfp4(x, rule)
        assert blocks.shape == (rows, nblk * 16) and scales.shape == (rows, nblk)
    else:
        q, scales = quantize_mxfp8(x, rule)
        assert q.shape == (rows, nblk * 32) and scales.shape == (rows, nblk)
    check_against_reference(x.reshape(-1, 32), rule, fmt)


EXTREME_AMAX = [
    2.0**-1074,  # the smallest float64 subnormal
    2.0**-1072,
    2.0**-1060,
    1.7e308,  # 1.89 * 2**1023: E2M1's EVEN rounding of amax goes past float64's range
    1.79e308,  # 1.99 * 2**1023: so does E4M3's
    torch.finfo(torch.float64).max,
]


@pytest.mark.parametrize("fmt", [FP4, FP8], ids=["fp4", "fp8"])
@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("amax", EXTREME_AMAX, ids=["2em1074", "2em1072", "2em1060", "1p7e308", "1p79e308", "max"])
def test_rules_at_the_ends_of_float64(amax, rule, fmt):
    """Clamping must hold for any float64 input, not only float32's range: every rule's exponent here
    is far outside [-127, 127], so the scale byte is 0 or 254 and the block is rounded at that scale."""
    x = torch.tensor([[amax, -amax / 3] + [0.0] * 30], dtype=torch.float64)
    check_against_reference(x, rule, fmt)


# --------------------------------------------------------------------------------------------------
# Errors name the argument at fault
# --------------------------------------------------------------------------------------------------

U8 = torch.zeros(2, 16, dtype=torch.uint8)
S8 = torch.zeros(2, 1, dtype=torch.uint8)

BAD_CALLS = {
    "quantize-k-not-multiple": (lambda: quantize_mxfp4(torch.zeros(2, 48)), r"x's last dimension \(K\).*32"),
    "quantize8-k-not-multiple": (lambda: quantize_mxfp8(torch.zeros(2, 33)), r"x's last dimension \(K\).*32"),
    "quantize-int-x": (lambda: quantize_mxfp4(torch.zeros(2, 32, dtype=torch.int32)), r"^x must be a floating"),
    "quantize-list-x": (lambda: quantize_mxfp4([0.0] * 32), r"^x must be a floating"),
    "quantize-unknown-rule": (lambda: quantize_mxfp4(torch.zeros(1, 32), "nearest"), r"rule.*floor, rceil, even"),
    "quantize8-unknown-rule": (lambda: quantize_mxfp8(torch.zeros(1, 32), "ceil"), r"rule.*floor, rceil, even"),
    "dequantize-float-blocks": (lambda: dequantize_mxfp4(U8.float(), S8), r"^blocks must be a torch.uint8"),
    "dequantize-int8-blocks": (lambda: dequantize_mxfp4(U8.to(torch.int8), S8), r"^blocks must be a torch.uint8"),
    "dequantize-int32-scales": (lambda: dequantize_mxfp4(U8, S8.int()), r"^scales must be a torch.uint8"),
    "dequantize-k-mismatch": (lambda: dequantize_mxfp4(U8, torch.zeros(2, 2, dtype=torch.uint8)), r"blocks.*scales"),
    "dequantize-lead-mismatch": (lambda: dequantize_mxfp4(U8, torch.zeros(3, 1, dtype=torch.uint8)), r"blocks.*scales"),
    "dequantize8-wrong-elements": (lambda: dequantize_mxfp8(torch.zeros(2, 32), S8), r"^elements must be"),
    "dequantize8-uint8-scales-wrong": (
        lambda: dequantize_mxfp8(torch.zeros(2, 32).to(torch.float8_e4m3fn), S8.float()),
        r"^scales must be",
    ),
    "dequantize8-shape-mismatch": (
        lambda: dequantize_mxfp8(torch.zeros(2, 64).to(torch.float8_e4m3fn), S8),
        r"elements.*scales",
    ),
    "decode-code-16": (lambda: decode_e2m1(torch.tensor([3, 16], dtype=torch.uint8)), r"^codes must be E2M1.*16"),
    "decode-int64-codes": (lambda: decode_e2m1(torch.tensor([3])), r"^codes must be a torch.uint8"),
    "pack-code-16": (lambda: pack_fp4(torch.tensor([1, 16], dtype=torch.uint8)), r"^codes must be E2M1.*16"),
    "pack-odd-k": (lambda: pack_fp4(torch.zeros(3, dtype=torch.uint8)), r"^codes' last dimension must be even"),
    "unpack-int-packed": (lambda: unpack_fp4(torch.zeros(3, dtype=torch.int16)), r"^packed must be a torch.uint8"),
    "decode-e8m0-float": (lambda: decode_e8m0(torch.zeros(3)), r"^scales must be a torch.uint8"),
    "fake-quantize-fmt": (lambda: fake_quantize(torch.zeros(1, 32), "nvfp4"), r"^fmt must be one of mxfp4, mxfp8"),
}


@pytest.mark.parametrize("call, pattern", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_bad_input_raises_value_error_naming_the_argument(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
