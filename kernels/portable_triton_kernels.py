"""The Triton kernels of the project's portable fused MoE (the backend is ``portable_triton``).

Imported only by ``PortableTriton.load``, after it has decided between compiled kernels (a GPU)
and Triton's interpreter (``TRITON_INTERPRET=1``, read by ``triton.jit`` when this module is
imported): the same source runs on a CPU in CI and compiled on NVIDIA and AMD GPUs.

The MXFP4 weights are dequantized inside the kernels, tile by tile, into bfloat16 (exact: an
E2M1 value times a power of two has at most two significant bits), and multiplied with
``tl.dot`` (bfloat16 inputs, float32 accumulation). ``tl.dot_scaled`` is not used: the CPU
interpreter has it only from Triton 3.8, and one code path for every host keeps what CI checks
the same as what runs on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant_tile(w_ptr, s_ptr, rows, offs_k, mask, K):
    """The [BLOCK_K, BLOCK_N] bfloat16 tile of MXFP4 rows ``rows`` (output channels) at reduction
    indices ``offs_k``: nibble ``k % 2`` of byte ``k // 2`` (low nibble first), times 2^(s - 127)
    of the row's scale byte ``k // 32``."""
    byte = tl.load(w_ptr + rows[None, :] * (K // 2) + offs_k[:, None] // 2, mask=mask, other=0).to(tl.int32)
    nib = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF
    mag = nib & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    # E2M1: e == 0 is the subnormal m * 0.5; otherwise (1 + m/2) * 2^(e-1) = (2 + m) * 2^e / 4.
    val = tl.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
    val = tl.where(nib >= 8, -val, val)
    s = tl.load(s_ptr + rows[None, :] * (K // 32) + offs_k[:, None] // 32, mask=mask, other=127).to(tl.int32)
    # E8M0 as float32 bits: byte s is 2^(s-127); byte 0 (2^-127) is the float32 subnormal 0x00400000;
    # byte 255 is NaN.
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    scale = bits.to(tl.float32, bitcast=True)
    return (val * scale).to(tl.bfloat16)


@triton.jit
def _dot(a, w, INTERPRETED: tl.constexpr):
    """a @ w with float32 accumulation. Interpreted, the (bfloat16-valued) operands are multiplied
    as float32 with IEEE products, which gives the same exact products: Triton 3.9's interpreter
    returns garbage for tl.dot on bfloat16 operands (it multiplies the raw bits)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a, w)


@triton.jit
def _to_bf16(x, INTERPRETED: tl.constexpr):
    """float32 -> bfloat16, rounding to nearest even. Interpreted, the rounding is done on the
    bits: Triton 3.9's interpreter truncates in ``.to(tl.bfloat16)`` (even with
    fp_downcast_rounding="rtne"), which the harness caught as errors beyond the rigorous bound."""
    if INTERPRETED:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        y = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
        return y.to(tl.bfloat16)
    return x.to(tl.bfloat16)


@triton.jit
def gemm1_activation_kernel(
    a_ptr,
    a_row_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_end_ptr,
    K,
    N_INTER,
    alpha,
    beta,
    limit,
    HAS_BIAS: tl.constexpr,
    SWIGLUOAI: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of the activation output of one expert: rows are sorted
    (token, slot) positions in [blk_start, blk_end), columns are intermediate channels. GEMM1 for
    the gate and the up rows of those channels, plus bias, in float32; then the activation in
    float32; stored as bfloat16."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
    start = tl.load(blk_start_ptr + pid_m)
    end = tl.load(blk_end_ptr + pid_m)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    a_rows = tl.load(a_row_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N_INTER
    if INTERLEAVED:
        gate_rows = 2 * offs_n
        up_rows = 2 * offs_n + 1
    else:
        gate_rows = offs_n
        up_rows = N_INTER + offs_n
    w_e = w_ptr + expert * (2 * N_INTER) * (K // 2)
    s_e = s_ptr + expert * (2 * N_INTER) * (K // 32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_k[:, None] & mask_n[None, :]
        acc_g += _dot(a, _dequant_tile(w_e, s_e, gate_rows, offs_k, wmask, K), INTERPRETED)
        acc_u += _dot(a, _dequant_tile(w_e, s_e, up_rows, offs_k, wmask, K), INTERPRETED)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + expert * (2 * N_INTER) + gate_rows, mask=mask_n, other=0.0)[None, :]
        acc_u += tl.load(b_ptr + expert * (2 * N_INTER) + up_rows, mask=mask_n, other=0.0)[None, :]
    if SWIGLUOAI:
        g = acc_g
        u = acc_u
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        act = g * (1.0 / (1.0 + tl.exp(-alpha * g))) * (u + beta)
    else:
        act = acc_g * (1.0 / (1.0 + tl.exp(-acc_g))) * acc_u
    out = out_ptr + offs_m.to(tl.int64)[:, None] * N_INTER + offs_n[None, :]
    tl.store(out, _to_bf16(act, INTERPRETED), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def gemm2_combine_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    pair_ptr,
    weight_ptr,
    out_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_end_ptr,
    K,
    H,
    HAS_BIAS: tl.constexpr,
    APPLY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of GEMM2 (K = intermediate, N = hidden) for one expert, plus
    bias, times the routing weight of each (token, slot), in float32, stored at the pair's own row
    of ``out`` [T * top_k, H]: no two programs write one element, so no atomics and no
    run-to-run differences."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
    start = tl.load(blk_start_ptr + pid_m)
    end = tl.load(blk_end_ptr + pid_m)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    w_e = w_ptr + expert * H * (K // 2)
    s_e = s_ptr + expert * H * (K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc += _dot(a, _dequant_tile(w_e, s_e, offs_n, offs_k, mask_k[:, None] & mask_n[None, :], K), INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * H + offs_n, mask=mask_n, other=0.0)[None, :]
    pairs = tl.load(pair_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    if APPLY_WEIGHT:
        acc = acc * tl.load(weight_ptr + pairs, mask=mask_m, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * H + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])
