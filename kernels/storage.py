"""Storage steps of the vendor layouts (``harness.contract.convert.Storage``), written from the vendors'
published layout code and checked here only for what they must be: pure permutations of bytes
(or nibbles) plus zero padding, inverted bit for bit. Each docstring names the vendor function
whose layout it reproduces; agreement with the vendor's own function, where that function is pure
torch and the package is installed, is checked by the adapters' tests.

All steps act per expert: dimension 0 is the expert, a weight is [E, rows, cols], a bias
[E, rows].
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from mxmoe.harness.contract.convert import Storage
from mxmoe.harness.contract.padding import round_up

W = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales")
SCALES = ("w13_scales", "w2_scales")
BLOCKS = ("w13_blocks", "w2_blocks")
BIASES = ("w13_bias", "w2_bias")


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


@functools.lru_cache(maxsize=64)
def epilogue_tile_rows(rows: int) -> torch.Tensor:
    """FlashInfer's ``get_shuffle_matrix_a_row_indices`` at epilogue_tile_m = 128 (block of 32
    rows): new row 32b + j is old row 32b + 4 (j % 8) + j // 8. TRT-LLM-gen MoE GEMMs read w13, w2,
    their scales (before the 128x4 swizzle) and biases in this order."""
    if rows % 32:
        raise ValueError(f"the epilogue row shuffle needs rows % 32 == 0, got {rows}")
    j = torch.arange(rows)
    return (j // 32) * 32 + 4 * (j % 8) + (j % 32) // 8


def row_shuffle(roles: tuple[str, ...] = W + BIASES) -> Storage:
    """``epilogue_tile_rows`` applied to dimension 1 of every tensor of ``roles``."""

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        return t.index_select(1, epilogue_tile_rows(t.shape[1]).to(t.device))

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        return t.index_select(1, _inverse(epilogue_tile_rows(t.shape[1])).to(t.device))

    return Storage("epilogue-row-shuffle", roles, fwd, inv, "rows permuted for the transposed-MMA epilogue (tile 128)")


def swizzle_128x4(view_fp8: bool = True) -> Storage:
    """FlashInfer's ``block_scale_interleave`` (alias ``nvfp4_block_scale_interleave``): each
    expert's [R, C] scale bytes zero-padded to [ceil128(R), ceil4(C)] and stored in 512-byte tiles
    of 128 rows x 4 columns, byte (m, k) at ((m // 128) * C/4 + k // 4) * 512 + (m % 32) * 16 +
    ((m % 128) // 32) * 4 + k % 4. Kept as [E, R', C'] and, as vLLM does for TRT-LLM, viewed as
    float8_e4m3fn (the bytes stay E8M0)."""

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        e, r, c = t.shape
        rp, cp = round_up(r, 128), round_up(c, 4)
        p = torch.zeros(e, rp, cp, dtype=t.dtype, device=t.device)
        p[:, :r, :c] = t
        out = p.reshape(e, rp // 128, 4, 32, cp // 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(e, rp, cp)
        return out.contiguous().view(torch.float8_e4m3fn) if view_fp8 else out.contiguous()

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        e, rp, cp = t.shape
        p = t.view(torch.uint8).reshape(e, rp // 128, cp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)
        return p.reshape(e, rp, cp)[:, : shape[1], : shape[2]].contiguous()

    return Storage("scale-swizzle-128x4", SCALES, fwd, inv, "scales in 128x4 tiles (block_scale_interleave)")


def sm90_scale_interleave() -> Storage:
    """The scale layout of FlashInfer's SM90 mixed-input CUTLASS MoE from 0.6.10 to 0.6.15 (and
    of vLLM's converter): groups of 4 consecutive scale bytes (128 elements of K) of each row
    kept together, rows inner: [E, R, K/32] -> [E, K/128, R * 4], out[e, kb, 4r + g] =
    s[e, r, 4kb + g]. Needs K/32 % 4 == 0 (hidden and intermediate padded to 128)."""

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        e, r, c = t.shape
        if c % 4:
            raise ValueError(f"the SM90 scale interleave needs K/32 % 4 == 0, got {c}")
        return t.reshape(e, r, c // 4, 4).permute(0, 2, 1, 3).reshape(e, c // 4, r * 4).contiguous()

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        e, r, c = shape
        return t.reshape(e, c // 4, r, 4).permute(0, 2, 1, 3).reshape(e, r, c).contiguous()

    return Storage("sm90-scale-interleave", SCALES, fwd, inv, "scales [E, K/128, 4R] (FlashInfer 0.6.10-0.6.15)")


@functools.lru_cache(maxsize=16)
def sm90_nibble_source(rows: int, k: int) -> torch.Tensor:
    """For FlashInfer's SM90 mixed-GEMM weight interleave (0.6.10-0.6.15, CUDA kernel
    ``moe_gemm_mixed_utils.cu``): the flat source index (row * k + element) of every output
    nibble. Rows pair up as r and r + 8 within each 16-row group; within 64-element partitions
    the elements of the pair are interleaved. Needs rows % 16 == 0 and k % 64 == 0."""
    if rows % 16 or k % 64:
        raise ValueError(f"the SM90 weight interleave needs rows % 16 == 0 and K % 64 == 0, got {rows} x {k}")
    r_out = torch.arange(rows).reshape(-1, 1)
    t = torch.arange(k).reshape(1, -1)
    p, tt = t // 64, t % 64
    j = tt // 2
    h = (r_out // 8) % 2
    r_base = 16 * (r_out // 16) + r_out % 8
    src_row = r_base + 8 * (tt % 2)
    src_el = 64 * p + 32 * (j // 16) + 16 * h + 8 * ((j // 2) % 2) + 2 * ((j % 16) // 4) + j % 2
    return (src_row * k + src_el).reshape(-1)


def _nibbles(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t & 0xF, t >> 4], dim=-1).reshape(t.shape[0], -1)


def _pack(n: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    pairs = n.reshape(*shape, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def sm90_weight_interleave() -> Storage:
    """``sm90_nibble_source`` applied to each expert's packed weights (whole nibbles move; every
    nibble's bits stay as they are)."""

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        e, r, kb = t.shape
        src = sm90_nibble_source(r, 2 * kb).to(t.device)
        return _pack(_nibbles(t)[:, src], t.shape)

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        e, r, kb = t.shape
        src = sm90_nibble_source(r, 2 * kb).to(t.device)
        return _pack(_nibbles(t)[:, _inverse(src)], t.shape)

    return Storage("sm90-weight-interleave", BLOCKS, fwd, inv, "nibbles of row pairs (r, r+8) interleaved per 64")


def sm90_scale_fold() -> Storage:
    """The "folded" scale layout of FlashInfer's SM90 mixed-input CUTLASS MoE from 0.6.16
    (``interleave_moe_scales_for_sm90_mixed_gemm`` in ``fused_moe/prepare.py``, PR #3738): per
    64 rows, 4 slices of 16 rows folded side by side, each holding the 4 scale bytes of 128
    elements of K: [E, R, K/32] -> [E, R/64, K/128, 16, 16], out[e, rb, kb, fm, 4 ms + g] =
    s[e, 64 rb + 16 ms + fm, 4 kb + g]. Needs R % 64 == 0 and K/32 % 4 == 0."""

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        e, r, c = t.shape
        if r % 64 or c % 4:
            raise ValueError(
                f"the SM90 scale fold (FlashInfer >= 0.6.16) needs R % 64 == 0 and K/32 % 4 == 0, got {r} x {c}"
            )
        return (
            t.reshape(e, r // 64, 4, 16, c // 4, 4)
            .permute(0, 1, 4, 3, 2, 5)
            .reshape(e, r // 64, c // 4, 16, 16)
            .contiguous()
        )

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        e, r, c = shape
        return t.reshape(e, r // 64, c // 4, 16, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(e, r, c).contiguous()

    return Storage("sm90-scale-fold", SCALES, fwd, inv, "scales [E, R/64, K/128, 16, 16] (FlashInfer >= 0.6.16)")


SM90_REPACK_MASKS = (
    (0x80, 24), (0x70, 18), (0x08, 12), (0x07, 6), (0x8000, 13), (0x7000, 7), (0x0800, 1), (0x0700, -5),
    (0x800000, 2), (0x700000, -4), (0x080000, -10), (0x070000, -16), (0x80000000, -1), (0x10000000, 1),
    (0x60000000, -3), (0x08000000, -13), (0x01000000, -11), (0x06000000, -15),
)  # fmt: skip
"""(source mask, left shift) of FlashInfer 0.6.16's SM90 weight repack kernel
(``moe_gemm_mixed_utils.cu``): where each bit of a 32-bit word of four source bytes goes."""


@functools.lru_cache(maxsize=1)
def sm90_repack_bits() -> tuple[int, ...]:
    """Destination bit of each source bit 0..31 of the 0.6.16 repack; a permutation of 0..31
    (checked here: the masks cover every bit once and land on distinct bits)."""
    dst = [-1] * 32
    for mask, shift in SM90_REPACK_MASKS:
        for b in range(32):
            if mask >> b & 1:
                if dst[b] != -1:
                    raise AssertionError(f"bit {b} appears in two repack masks")
                dst[b] = b + shift
    if sorted(dst) != list(range(32)):
        raise AssertionError(f"the SM90 repack masks are not a permutation of 32 bits: {dst}")
    return tuple(dst)


WIDENED_SLICE_BYTES = 1 << 24
"""The most bytes of weights a step that widens them works on at once (``by_experts``). The SM90
repack widens each byte to int64 and keeps several such copies, about 30 times its input: on a
whole gpt-oss-120b w13 (1.06 GB) FlashInfer's conversion raised an H100's allocated peak by 29.9
GiB, the most of any stage of any backend at a decode shape, and memory decides how many cases
share a GPU. Slices of 16 MiB keep those copies near half a GiB."""


def by_experts(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(t)`` for a step that acts per expert and keeps the shape and dtype, computed over
    slices of whole experts of at most ``WIDENED_SLICE_BYTES`` (one expert where one is larger)
    into one output: the same bytes, without ``fn``'s widened copies of every expert at once."""
    expert_bytes = math.prod(t.shape[1:]) * t.element_size()
    per = max(1, WIDENED_SLICE_BYTES // max(1, expert_bytes))
    if per >= t.shape[0]:
        return fn(t)
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    for start in range(0, t.shape[0], per):
        out[start : start + per] = fn(t[start : start + per])
    return out


def _permute_bits(raw: torch.Tensor, dst: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros_like(raw)
    for b, d in enumerate(dst):
        out |= ((raw >> b) & 1) << d
    return out


def sm90_weight_repack() -> Storage:
    """FlashInfer 0.6.16's SM90 mixed-input weight layout (``interleave_moe_weights_for_sm90_mixed_gemm``
    with "fp4", a CUDA kernel there): within each 16-row group rows r and r + 8, and within each
    32-byte partition of a row the bytes c and c + 4 of each 8-byte MMA slice, form a 32-bit word
    (r[c], r+8[c], r[c+4], r+8[c+4], little endian) whose bits are permuted
    (``SM90_REPACK_MASKS``); the word of MMA slice m lands in row r + 8 (m % 2), at byte 16 (m // 2)
    + 4 j of the partition. Needs rows % 16 == 0 and K % 64 == 0."""
    dst = sm90_repack_bits()
    inv_dst = tuple(dst.index(b) for b in range(32))

    def dims(t: torch.Tensor) -> tuple[int, int, int]:
        e, n, kb = t.shape
        if n % 16 or kb % 32:
            raise ValueError(
                f"the SM90 weight repack (FlashInfer >= 0.6.16) needs rows % 16 == 0 and K % 64 == 0, got {n}x{2 * kb}"
            )
        return e, n, kb

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        dims(t)
        return by_experts(t, fwd_slice)

    def fwd_slice(t: torch.Tensor) -> torch.Tensor:
        e, n, kb = t.shape
        x = t.reshape(e, n // 16, 2, 8, kb // 32, 4, 2, 4).to(torch.int64)  # [E, g, half, r, p, mma, hi4, j]
        lo, hi = x[:, :, 0], x[:, :, 1]
        raw = lo[..., 0, :] | (hi[..., 0, :] << 8) | (lo[..., 1, :] << 16) | (hi[..., 1, :] << 24)
        v = _permute_bits(raw, dst)  # [E, g, r, p, mma, j]
        by = torch.stack([(v >> (8 * i)) & 0xFF for i in range(4)], -1)
        by = by.reshape(e, n // 16, 8, kb // 32, 2, 2, 4, 4)  # mma -> (mma // 2, mma % 2)
        return by.permute(0, 1, 5, 2, 3, 4, 6, 7).reshape(e, n, kb).to(torch.uint8).contiguous()

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        dims(t)
        return by_experts(t, inv_slice)

    def inv_slice(t: torch.Tensor) -> torch.Tensor:
        e, n, kb = t.shape
        by = t.reshape(e, n // 16, 2, 8, kb // 32, 2, 4, 4).to(torch.int64)  # [E, g, m%2, r, p, m//2, j, byte]
        by = by.permute(0, 1, 3, 4, 5, 2, 6, 7).reshape(e, n // 16, 8, kb // 32, 4, 4, 4)
        v = sum(by[..., i] << (8 * i) for i in range(4))
        raw = _permute_bits(v, inv_dst)
        parts = [(raw >> (8 * i)) & 0xFF for i in range(4)]  # lo[c], hi[c], lo[c+4], hi[c+4]
        lo = torch.stack([parts[0], parts[2]], dim=-2)  # [E, g, r, p, mma, hi4, j]
        hi = torch.stack([parts[1], parts[3]], dim=-2)
        x = torch.stack([lo, hi], dim=2)  # [E, g, half, r, p, mma, hi4, j]
        return x.reshape(e, n, kb).to(torch.uint8).contiguous()

    return Storage("sm90-weight-repack", BLOCKS, fwd, inv, "bit-level repack of row pairs (FlashInfer >= 0.6.16)")


def transpose() -> Storage:
    """[E, N, K] -> [E, K, N] for blocks and scales, as a VIEW of the [E, N, K] memory: how OpenAI
    triton_kernels takes MXFP4 weights (vLLM's ``w.transpose(-2, -1)`` before the layout
    conversion). The packed reduction dimension must stay the contiguous one: triton_kernels'
    ``wrap_torch_tensor`` doubles the stride-1 dimension of an FP4 tensor, so a contiguous
    [E, K/2, N] copy would be read as N doubled."""
    return Storage(
        "transpose",
        W,
        lambda t, role: t.transpose(-2, -1),
        lambda t, role, shape: t.transpose(-2, -1),
        "blocks and scales [E, K, N] (reduction dimension first), K contiguous",
    )


def aiter_a16w4_weight_shuffle() -> Storage:
    """AITER's ``shuffle_weight_a16w4(w, 16, gate_up)`` for the CK a16w4 MoE: [E, N, Kb] bytes in
    16-row x 16-byte tiles, K split in groups of 4 tiles; for w13 (gate_up) the gate and up
    halves are interleaved at 16-row granularity. Needs N % 16 == 0 (per half) and Kb % 64 == 0."""

    def dims(t: torch.Tensor, role: str) -> tuple[int, ...]:
        e, n, kb = t.shape
        halves = 2 if role == "w13_blocks" else 1
        if (n // halves) % 16 or kb % 64:
            raise ValueError(f"AITER a16w4 weight shuffle needs N % 16 == 0 and Kb % 64 == 0, got {n} x {kb}")
        return e, halves, n // halves // 16, kb // 64

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        e, g, n0, k0 = dims(t, role)
        v = t.reshape(e, g, n0, 16, k0, 4, 16).permute(0, 2, 1, 4, 5, 3, 6)
        return v.reshape(t.shape).contiguous()

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        e, g, n0, k0 = dims(t, role)
        v = t.reshape(e, n0, g, k0, 4, 16, 16).permute(0, 2, 1, 5, 3, 4, 6)
        return v.reshape(shape).contiguous()

    return Storage("aiter-a16w4-weight-shuffle", BLOCKS, fwd, inv, "16x16-byte tiles, gate/up interleaved per 16 rows")


def aiter_a16w4_scale_shuffle() -> Storage:
    """AITER's ``shuffle_scale_a16w4(s, E, gate_up)``: [E, n, k] scale bytes ordered
    [E, n/32, k/8, 4 (k lane), 16 (n lane), 2 (k pack), 2 (n pack)], the n pack being the gate/up
    half for w13. AITER pads k to a multiple of 8 with 0x7F; the declared padding (hidden and
    intermediate to 256) makes k a multiple of 8, so nothing is padded here (checked)."""

    def dims(t: torch.Tensor) -> tuple[int, int, int]:
        e, n, k = t.shape
        if n % 32 or k % 8:
            raise ValueError(f"AITER a16w4 scale shuffle needs n % 32 == 0 and k % 8 == 0, got {n} x {k}")
        return e, n // 32, k // 8

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        e, n1, k1 = dims(t)
        if role == "w13_scales":
            v = t.reshape(e, 2, n1, 16, k1, 2, 4).permute(0, 2, 4, 6, 3, 5, 1)
        else:
            v = t.reshape(e, n1, 2, 16, k1, 2, 4).permute(0, 1, 4, 6, 3, 5, 2)
        return v.reshape(t.shape).contiguous()

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        e, n1, k1 = dims(t)
        v = t.reshape(e, n1, k1, 4, 16, 2, 2)
        v = v.permute(0, 6, 1, 4, 2, 5, 3) if role == "w13_scales" else v.permute(0, 1, 6, 4, 2, 5, 3)
        return v.reshape(shape).contiguous()

    return Storage("aiter-a16w4-scale-shuffle", SCALES, fwd, inv, "scales [E, n/32, k/8, 4, 16, 2, 2]")


_MARLIN_SCALE_PERM = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])
_MARLIN_SCALE_PERM_SINGLE = torch.tensor([2 * i + d for i in range(4) for d in (0, 1, 8, 9, 16, 17, 24, 25)])
_MXFP4_MARLIN_SWAP = torch.tensor([0, 2, 1, 3])


def marlin_scales() -> Storage:
    """vLLM's Marlin MXFP4 scale preparation (pure torch): each expert's scales transposed to
    [K/32, N], ``marlin_permute_scales`` (rows of 64 permuted by scale_perm), then
    ``mxfp4_marlin_process_scales`` for 16-bit activations (groups of 4 bytes reordered
    0, 2, 1, 3). The weights' tile repack is a CUDA op (``gptq_marlin_repack``) run by the adapter."""

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        e, n, g = t.shape
        s = t.transpose(1, 2).reshape(e, -1, 64)[:, :, _MARLIN_SCALE_PERM.to(t.device)]
        s = s.reshape(e, -1, 4)[:, :, _MXFP4_MARLIN_SWAP.to(t.device)]
        return s.reshape(e, g, n).contiguous()

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        e, n, g = shape
        s = t.reshape(e, -1, 4)[:, :, _inverse(_MXFP4_MARLIN_SWAP).to(t.device)]
        s = s.reshape(e, -1, 64)[:, :, _inverse(_MARLIN_SCALE_PERM).to(t.device)]
        return s.reshape(e, g, n).transpose(1, 2).contiguous()

    return Storage("marlin-scales", SCALES, fwd, inv, "scales [K/32, N], Marlin-permuted, pairs swapped")


def marlin_bias() -> Storage:
    """vLLM's ``marlin_permute_bias``: each expert's bias in runs of 32 permuted by
    scale_perm_single."""

    def fwd(t: torch.Tensor, role: str) -> torch.Tensor:
        return t.reshape(t.shape[0], -1, 32)[:, :, _MARLIN_SCALE_PERM_SINGLE.to(t.device)].reshape(t.shape).contiguous()

    def inv(t: torch.Tensor, role: str, shape: torch.Size) -> torch.Tensor:
        perm = _inverse(_MARLIN_SCALE_PERM_SINGLE).to(t.device)
        return t.reshape(t.shape[0], -1, 32)[:, :, perm].reshape(shape).contiguous()

    return Storage("marlin-bias", BIASES, fwd, inv, "biases in runs of 32 permuted (marlin_permute_bias)")
