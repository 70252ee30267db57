"""MXFP4 and MXFP8 (OCP Microscaling v1.0): decode, pack, exact dequantization and quantization.

Everything here is exact: decoded values, dequantized weights and quantized codes are computed in
float64, where every E2M1, E4M3 and E8M0 value and every product of an element with its scale is
representable, so no result depends on the order of operations or on the device.

Readings this oracle commits to (docs/oracle.md; peers differ, and the harness tests backends on
these bytes explicitly rather than inheriting a peer's choice):

* E2M1 code ``c``: bit 3 is the sign, codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.
* Packing: two codes per uint8 along the reduction axis; element ``2i`` is the LOW nibble.
* E8M0 byte ``b``: ``2 ** (b - 127)``; byte 0 is ``2 ** -127`` (not 0, as triton_kernels reads it);
  byte 255 is NaN (not +inf as in triton_kernels, not ``2 ** 128`` as in gpt-oss).

Quantizer policy (the oracle consumes already-quantized weights; quantizers generate inputs and
emulate activation quantization):

* Scale rules, per block of 32 along the last axis, with ``amax`` the block's largest magnitude
  and ``emax`` the element format's largest exponent (2 for E2M1, 8 for E4M3):
  ``floor`` (the spec): ``e = floor(log2(amax)) - emax``; elements may saturate.
  ``rceil`` (NVIDIA hardware): ``e = ceil(log2(amax / max_normal))``; never saturates.
  ``even`` (torchao's EVEN): ``amax`` is first rounded to the element's mantissa width
  (half away from zero), then as ``floor``.
  The shared exponent is clamped to [-127, 127].
* Elements: ``x / 2**e`` rounded to nearest, ties to even, onto the element grid, saturating at
  the largest finite magnitude (6 for E2M1, 448 for E4M3). Signed zeros keep their sign.
* An all-zero block gets scale byte 0 (``2 ** -127``) and zero elements (signs kept).
* A block holding any NaN or infinity gets scale byte 255 (NaN) and zero elements, so the whole
  block dequantizes to NaN: E2M1 cannot encode a non-finite value, and silently turning one into
  a finite number would hide an upstream overflow.
"""

from __future__ import annotations

import math

import torch

BLOCK = 32
"""Elements that share one E8M0 scale, along the reduction axis."""

SCALE_RULES = ("floor", "rceil", "even")
E8M0_NAN = 255
E8M0_BIAS = 127

# (mantissa bits, exponent of the smallest normal, largest exponent, largest finite magnitude)
_E2M1 = (1, 0, 2, 6.0)
_E4M3 = (3, -6, 8, 448.0)

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float64,
)
"""The value of each E2M1 code 0..15, in float64."""


def _check_uint8(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a torch.uint8 tensor, got {got}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a floating-point tensor (float64, float32, bfloat16, ...), got {got}")


def _check_rule(rule: str) -> None:
    if rule not in SCALE_RULES:
        raise ValueError(f"rule must be one of {', '.join(SCALE_RULES)}; got {rule!r}")


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Value of each E2M1 code (uint8 in 0..15), as float64."""
    _check_uint8("codes", codes)
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes must be E2M1 codes in 0..15, got a maximum of {int(codes.max())}")
    return E2M1_VALUES.to(codes.device)[codes.long()]


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Value of each E8M0 byte: ``2 ** (byte - 127)`` as float64; byte 255 is NaN."""
    _check_uint8("scales", scales)
    val = torch.exp2(scales.to(torch.float64) - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, torch.full_like(val, math.nan), val)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes [..., K] into bytes [..., K/2]: element 2i in the low nibble, 2i+1 the high."""
    _check_uint8("codes", codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"codes' last dimension must be even to pack two per byte, got {codes.shape[-1]}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes must be E2M1 codes in 0..15, got a maximum of {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] into E2M1 codes [..., K] (low nibble first)."""
    _check_uint8("packed", packed)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _pair_table(device: torch.device) -> torch.Tensor:
    """complex128 [256 * 256]: entry ``s * 256 + b`` holds both elements of packed byte ``b``
    times scale byte ``s`` (the low nibble's value as the real part, the high's as the imaginary).
    One gather then dequantizes a byte, scale included, in one exact pass. The pair is stored as one
    16-byte complex number because gathering 16-byte elements is about 75 times faster on an H200
    than gathering rows of two float64 (0.07 ms against 5 ms for one gpt-oss expert's w13), and
    this step bounds the oracle's speed at gpt-oss-120b shapes."""
    key = device.type if device.index is None else f"{device.type}:{device.index}"
    table = _PAIR_TABLES.get(key)
    if table is None:
        byte = torch.arange(256, dtype=torch.uint8)
        pair = decode_e2m1(unpack_fp4(byte.unsqueeze(-1)))  # [256, 2]
        scale = decode_e8m0(byte)  # [256]
        table = torch.view_as_complex((scale[:, None, None] * pair[None]).reshape(256 * 256, 2)).to(device)
        _PAIR_TABLES[key] = table
    return table


_PAIR_TABLES: dict[str, torch.Tensor] = {}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact float64 value of MXFP4 data: ``blocks`` uint8 [..., K/2] (two codes a byte) and
    ``scales`` uint8 [..., K/32]; returns [..., K]. A NaN scale byte makes its block NaN."""
    _check_uint8("blocks", blocks)
    _check_uint8("scales", scales)
    half = blocks.shape[-1]
    if blocks.shape[:-1] != scales.shape[:-1] or half * 2 != scales.shape[-1] * BLOCK:
        raise ValueError(
            f"blocks [..., K/2] and scales [..., K/32] disagree: blocks {tuple(blocks.shape)}, "
            f"scales {tuple(scales.shape)} (K must be a multiple of {BLOCK})"
        )
    if scales.device != blocks.device:
        raise ValueError(f"blocks and scales must be on one device, got {blocks.device} and {scales.device}")
    lead = blocks.shape[:-1]
    nblk = scales.shape[-1]
    # uint8 + int32 promotes to int32 in the one kernel that builds the index.
    idx = blocks.reshape(*lead, nblk, BLOCK // 2) + (scales.to(torch.int32) << 8).unsqueeze(-1)
    out = torch.view_as_real(_pair_table(blocks.device).index_select(0, idx.reshape(-1)))
    return out.reshape(*lead, half * 2)


def _round_minifloat(y: torch.Tensor, fmt: tuple[int, int, int, float]) -> torch.Tensor:
    """Round float64 ``y`` to nearest, ties to even, onto a sign-magnitude float grid with
    ``mbits`` mantissa bits, smallest normal exponent ``emin`` (subnormals below it) and largest
    finite magnitude ``vmax``, saturating there. Exact: the quantum is a power of two, so the
    division, ``torch.round`` (half to even) and the product are all exact in float64."""
    mbits, emin, _, vmax = fmt
    mag = y.abs()
    _, exp = torch.frexp(mag)  # mag = m * 2**exp with m in [0.5, 1): floor(log2(mag)) = exp - 1
    e = torch.clamp(exp.to(torch.float64) - 1, min=emin)
    quantum = torch.exp2(e - mbits)
    q = torch.round(mag / quantum) * quantum
    q = torch.clamp(q, max=vmax)
    return torch.copysign(q, y)


_IEEE = {  # (mantissa bits, exponent of the smallest normal, largest finite magnitude)
    torch.bfloat16: (7, -126, float(torch.finfo(torch.bfloat16).max)),
    torch.float16: (10, -14, float(torch.finfo(torch.float16).max)),
    torch.float32: (23, -126, float(torch.finfo(torch.float32).max)),
}


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded ONCE to nearest-even in ``dtype`` (bfloat16, float16, float32), as float64;
    magnitudes that round past the largest finite value become infinities, as in IEEE arithmetic.

    ``tensor.to(torch.bfloat16)`` from float64 goes through float32 and so rounds twice: a value
    just above a bf16 midpoint can land on the midpoint in float32 and then round to even, the
    wrong way. A kernel that rounds its float32 accumulator to bf16 rounds once, and so does this.
    """
    if dtype not in _IEEE:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _IEEE))}; got {dtype}")
    mbits, emin, vmax = _IEEE[dtype]
    y = x.to(torch.float64)
    q = _round_minifloat(y, (mbits, emin, 0, math.inf))
    return torch.where(q.abs() > vmax, torch.copysign(torch.full_like(q, math.inf), y), q)


def _shared_exponent(amax: torch.Tensor, rule: str, fmt: tuple[int, int, int, float]) -> torch.Tensor:
    """Unbiased shared exponent of each block under ``rule`` (float64, in [-127, 127])."""
    mbits, _, emax, vmax = fmt
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if rule == "floor":
        _, exp = torch.frexp(safe)
        e = exp.to(torch.float64) - 1 - emax
    elif rule == "even":
        # amax rounded to mbits mantissa bits, half away from zero, moves up an exponent exactly
        # when its mantissa rounds up to 2. Decided on frexp's mantissa, not by rounding amax
        # itself, which overflows or underflows at the ends of float64.
        m, exp = torch.frexp(safe)  # m in [0.5, 1)
        top = 2.0 ** (mbits + 1)
        bump = (torch.floor(m * top + 0.5) >= top).to(torch.float64)
        e = exp.to(torch.float64) - 1 - emax + bump
    else:  # rceil
        # Smallest e with amax / 2**e <= vmax. Computed on the exponent and mantissa separately so
        # that no rounding of amax / vmax can move it: amax <= vmax * 2**e  <=>  e >= log2(amax/vmax).
        # The floor rule's exponent leaves amax / 2**e in [2**emax, 2**(emax + 1)), and vmax lies in
        # that range, so one step up is the most it can take; vmax * 2**e is exact in float64.
        _, exp = torch.frexp(safe)
        e = exp.to(torch.float64) - 1 - emax
        e = torch.where(safe > vmax * torch.exp2(e), e + 1, e)
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS))
    return torch.clamp(e, -E8M0_BIAS, E8M0_BIAS)


def shared_exponent(amax: torch.Tensor, rule: str, element: str) -> torch.Tensor:
    """The unbiased shared exponent (float64, in [-127, 127]) that ``rule`` gives a block whose
    largest magnitude is ``amax``, for ``element`` ``e2m1`` (MXFP4) or ``e4m3`` (MXFP8)."""
    _check_rule(rule)
    fmts = {"e2m1": _E2M1, "e4m3": _E4M3}
    if element not in fmts:
        raise ValueError(f"element must be one of {', '.join(fmts)}; got {element!r}")
    return _shared_exponent(amax.to(torch.float64), rule, fmts[element])


def _quantize_blocks(x: torch.Tensor, rule: str, fmt: tuple[int, int, int, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent and rounded element values (float64, not yet encoded) of each block."""
    _check_float("x", x)
    _check_rule(rule)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"x's last dimension (K) must be a multiple of {BLOCK}, got {x.shape[-1]}")
    xb = x.to(torch.float64).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    finite = torch.isfinite(xb).all(dim=-1)
    amax = torch.where(torch.isfinite(xb), xb.abs(), torch.zeros_like(xb)).amax(dim=-1)
    e = _shared_exponent(amax, rule, fmt)
    elems = _round_minifloat(xb / torch.exp2(e).unsqueeze(-1), fmt)
    elems = torch.where(finite.unsqueeze(-1), elems, torch.zeros_like(elems))
    scale = torch.where(finite, e + E8M0_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)
    return elems, scale


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 code of each float64 value that is exactly on the E2M1 grid (sign of zero kept)."""
    mag = values.abs()
    grid = E2M1_VALUES[:8].to(values.device)
    code = torch.searchsorted(grid, mag.contiguous())
    if bool((code > 7).any()) or not torch.equal(grid[code.clamp(max=7)], mag):
        raise ValueError("values must lie exactly on the E2M1 grid (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives)")
    return (code | (torch.signbit(values).long() << 3)).to(torch.uint8)


def quantize_mxfp4(x: torch.Tensor, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] along its last axis to MXFP4: returns (blocks uint8 [..., K/2],
    scales uint8 [..., K/32]). ``rule`` is one of ``floor`` (the spec), ``rceil``, ``even``."""
    elems, scale = _quantize_blocks(x, rule, _E2M1)
    codes = encode_e2m1(elems.flatten(-2))
    return pack_fp4(codes), scale


def quantize_mxfp8(x: torch.Tensor, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] along its last axis to MXFP8: returns (elements
    torch.float8_e4m3fn [..., K], scales uint8 [..., K/32])."""
    elems, scale = _quantize_blocks(x, rule, _E4M3)
    # The values are already on the E4M3 grid, so this cast is exact.
    return elems.flatten(-2).to(torch.float8_e4m3fn), scale


def dequantize_mxfp8(elements: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact float64 value of MXFP8 data: ``elements`` float8_e4m3fn [..., K], ``scales`` uint8
    [..., K/32]; returns [..., K]."""
    if not isinstance(elements, torch.Tensor) or elements.dtype != torch.float8_e4m3fn:
        got = elements.dtype if isinstance(elements, torch.Tensor) else type(elements).__name__
        raise ValueError(f"elements must be a torch.float8_e4m3fn tensor, got {got}")
    _check_uint8("scales", scales)
    k = elements.shape[-1]
    if elements.shape[:-1] != scales.shape[:-1] or k != scales.shape[-1] * BLOCK:
        raise ValueError(
            f"elements [..., K] and scales [..., K/32] disagree: elements {tuple(elements.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    vals = elements.to(torch.float64).reshape(*elements.shape[:-1], k // BLOCK, BLOCK)
    return (vals * decode_e8m0(scales).unsqueeze(-1)).reshape(elements.shape)


def fake_quantize(x: torch.Tensor, fmt: str, rule: str = "floor") -> torch.Tensor:
    """``x`` after a round trip through ``fmt`` (``mxfp4`` or ``mxfp8``), as float64: what a kernel
    that quantizes its activations along the last axis actually multiplies."""
    if fmt == "mxfp4":
        return dequantize_mxfp4(*quantize_mxfp4(x, rule))
    if fmt == "mxfp8":
        return dequantize_mxfp8(*quantize_mxfp8(x, rule))
    raise ValueError(f"fmt must be one of mxfp4, mxfp8; got {fmt!r}")
