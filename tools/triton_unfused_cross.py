"""Where vLLM's TRITON_UNFUSED MoE and the project's direct adapter of it (kernels/oai_triton_unfused.py)
differ on the same inputs (standalone: vLLM and torch only, on a CUDA GPU).

What it showed (NVIDIA H200, vLLM 0.33.0's carried runtime and ops, E=32, T=4096, H=I=2880): both
sides run the same triton_kernels v3.5.1 GEMMs on the same routing data (R and A: 0 positions, 0 of
94,371,840 GEMM1 elements) and sum each token's top-k rows alike (D: 0); the one difference was
the activation between the GEMMs. vLLM's ``_C::swigluoai_and_mul`` (csrc/activation_kernels.cu)
computes ``(u + 1) * g / (1 + expf(-g * alpha))``, and that expression in torch matches it bit for
bit (0 of 47,185,920); the oracle's order ``g * sigmoid(alpha * g) * (u + 1)``, which the adapter
used before, differed on 269 (249 with |a| < 0.01), moving 142 GEMM2 row elements and 27 of
11,796,480 outputs (15 tokens); with vLLM's activation, 0. The adapter now computes vLLM's order.

Steps, each on the same inputs (random MXFP4 weights, trained-like scale bytes 118..124):
  R. routing data from vLLM's ``make_routing_data`` and from the adapter's (bit matrix packed in
     torch, ``routing_from_bitmatrix``): positions where indices, gate scales, histogram differ.
  A. GEMM1 (no fused activation, float32 bias, bf16 out) on w13 rows interleaved (vLLM keeps the
     GPT-OSS checkpoint's) and chunked [gate; up] (the adapter's), columns matched: equal?
  B. the activation on ONE GEMM1 output: vLLM's op against the adapter's (0 expected: the same
     expression), and against the oracle's order (for scale: what the order alone moves).
  C. GEMM2 (n_expts_act 1, gammas, one row per (token, slot)) on vLLM's activation and on the
     oracle's order: rows differ?
  D. the top-k sum on ONE set of rows: ``masked_moe_sum`` against the adapter's torch sum (0
     expected), and other slot orders, for scale (sums of 4 bf16 terms are mostly exact in float32).
  E. end to end, each side its own routing, w13 layout, activation and sum; then the adapter's
     side with vLLM's activation op (0 expected if the activation is the whole cause).

Usage: python tools/triton_unfused_cross.py [--experts 32] [--tokens 4096] [--topk 4] [--hidden 2880]
[--intermediate 2880] [--seed 0] (vLLM installed: it aliases its vendored triton_kernels; where
only the project's carried vLLM runtime is, start it through ``python -c "from
mxmoe.harness.upstream.vllm_runtime import boot; boot(arch='sm90'); import runpy, sys; sys.argv =
['m', *ARGS]; runpy.run_path('tools/triton_unfused_cross.py', run_name='__main__')"``, which puts
the adapters' triton_kernels first, the cached copy of vLLM's v3.5.1 (``python -m harness fetch
triton-kernels``), and loads the ops build for the activation (``python -m harness build-vllm-ops``)).
Step E's first number is the finding: 0 where the adapter and vLLM's layer agree bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from mxmoe.harness.contract.cases import make_case
from mxmoe.kernels.oai_triton_unfused import OaiTritonUnfused, unfused_activation
from mxmoe.reference.activation import GPT_OSS_ALPHA as ALPHA
from mxmoe.reference.activation import GPT_OSS_BETA as BETA
from mxmoe.reference.activation import GPT_OSS_LIMIT as LIMIT
from mxmoe.reference.activation import gated_activation

GPT_OSS_CASE = make_case("gptoss20b", 1)  # only its swiglu (alpha, beta, limit) is read
VLLM_LAYOUT = "interleaved"  # w13 rows as the GPT-OSS checkpoint has them, which vLLM keeps
ADAPTER_LAYOUT = OaiTritonUnfused.declaration.w13_layout  # [gate; up], the adapter's


def differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements that differ bit for bit."""
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return int((a != b).sum())


def adapter_activation(gemm1: torch.Tensor, layout: str) -> torch.Tensor:
    """The adapter's own activation (kernels/oai_triton_unfused.py, vLLM's operation order since
    the adapter was aligned with it) at GPT-OSS's swiglu."""
    return unfused_activation(gemm1, GPT_OSS_CASE, layout)


def oracle_order(gemm1: torch.Tensor, layout: str) -> torch.Tensor:
    """The oracle's order, ``g * sigmoid(alpha * g) * (u + 1)`` (reference/activation.py), in
    float32 and rounded to bf16: what the adapter computed before, kept to show what the order moves."""
    return gated_activation(gemm1.float(), "swigluoai", layout, ALPHA, BETA, LIMIT).to(torch.bfloat16)


def in_order(terms: list[torch.Tensor]) -> torch.Tensor:
    """((0 + t0) + t1) + ...: the slots summed one after the other, as ``masked_moe_sum`` does."""
    acc = torch.zeros_like(terms[0])
    for t in terms:
        acc = acc + t
    return acc


def pack_topk_bits(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """kernels/oai_triton.py's ``pack_topk_bits``: the uint32 [T, ceil(E / 32)] bit matrix, in torch."""
    valid = ids >= 0
    idx = ids.to(torch.int64).clamp(min=0)
    bit = torch.where(valid, torch.ones_like(idx) << (idx % 32), torch.zeros_like(idx))
    packed = torch.zeros(ids.shape[0], -(-experts // 32), dtype=torch.int64, device=ids.device)
    packed.scatter_add_(1, idx // 32, bit)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).view(torch.uint32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--topk", type=int, default=4, help="a power of two (v3.5.1's routing)")
    p.add_argument("--hidden", type=int, default=2880, help="a multiple of 32, above 128 on Hopper")
    p.add_argument("--intermediate", type=int, default=2880, help="a multiple of 64 (vLLM's round-up)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.hidden % 32 or a.intermediate % 64 or a.hidden <= 128 or a.topk & (a.topk - 1):
        p.error("--hidden must be a multiple of 32 above 128, --intermediate of 64, --topk a power of two")

    import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops where installed)
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as vg
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _swizzle_mxfp4

    if vg.triton_kernels_version != "3.5.1":  # imported after vLLM: vLLM's own alias, and its patches
        raise SystemExit(f"triton_kernels {vg.triton_kernels_version}: the adapter is written against v3.5.1")
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig, matmul_ogs
    from triton_kernels.routing import routing_from_bitmatrix
    from triton_kernels.tensor import Bitmatrix

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    E, T, K, H, N = a.experts, a.tokens, a.topk, a.hidden, a.intermediate
    bf16 = torch.bfloat16

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=gen, device=dev, dtype=torch.int32).to(torch.uint8)

    w13, s13 = u8(E, 2 * N, H // 2), u8(E, 2 * N, H // 32, lo=118, hi=125)  # rows interleaved: g0, u0, g1, ...
    w2, s2 = u8(E, H, N // 2), u8(E, H, N // 32, lo=118, hi=125)
    b13, b2, x = (torch.randn(*s, generator=gen, device=dev).to(bf16) for s in ((E, 2 * N), (E, H), (T, H)))
    b13, b2 = b13.float(), b2.float()  # float32 biases from the checkpoint's bf16, as both sides keep them
    top = torch.topk(torch.randn(T, E, generator=gen, device=dev), K, dim=1)  # Renormalize
    ids, weights = top.indices.to(torch.int32), torch.softmax(top.values, dim=1)  # float32, as vLLM's router
    perm = torch.cat([torch.arange(0, 2 * N, 2), torch.arange(1, 2 * N, 2)]).to(dev)  # interleaved -> chunked

    def weight(blocks: torch.Tensor, scales: torch.Tensor) -> tuple:
        """vLLM's ``_swizzle_mxfp4`` (the adapter's ``_swizzle`` does the same: Hopper layouts,
        split_k 1, scale groups padded to 4) and its PrecisionConfig."""
        w, flex, s = _swizzle_mxfp4(blocks.contiguous(), scales.contiguous())
        return w, PrecisionConfig(weight_scale=s, flex_ctx=FlexCtx(rhs_data=flex))

    (w13_i, pc13_i), (w13_c, pc13_c) = weight(w13, s13), weight(w13[:, perm], s13[:, perm])
    w2_t, pc2 = weight(w2, s2)
    b13_c = b13[:, perm].contiguous()
    vg._constrain_sm12x_block_m(T * K, E)  # vLLM's SM12x pin (nothing elsewhere), for both sides

    def adapter_routing() -> tuple:
        packed = pack_topk_bits(ids, E)
        bm = Bitmatrix(packed, shape=[T, packed.shape[1] * 32], shape_max=[T, None], scratchpad=None)
        w = torch.where(ids >= 0, weights.to(bf16), torch.full_like(weights, -1.0, dtype=bf16))
        return routing_from_bitmatrix(bm, w, ids.to(torch.int16), E, K)

    def gemm1(route: tuple, w: object, pc: object, bias: torch.Tensor) -> torch.Tensor:
        """GEMM1 in expert order, then gathered back to (token, slot) order (both sides' step)."""
        rd, gi, _ = route
        y = torch.empty(1, T * K, 2 * N, dtype=bf16, device=dev)
        matmul_ogs(x, w, bias, rd, gather_indx=gi, precision_config=pc, y=y)
        return y.view(T * K, 2 * N)[gi.dst_indx.to(torch.int64)]

    def gemm2(route: tuple, act: torch.Tensor) -> torch.Tensor:
        """GEMM2 with one row per (token, slot) (``n_expts_act`` = 1) and the gate scales."""
        rd, gi, si = route
        rows = torch.empty(1, T * K, H, dtype=bf16, device=dev)
        matmul_ogs(act[gi.src_indx.to(torch.int64)], w2_t, b2, dataclasses.replace(rd, n_expts_act=1),
                   scatter_indx=si, precision_config=pc2, gammas=rd.gate_scal, y=rows)  # fmt: skip
        return rows.view(T, K, H)

    def vllm_act(interleaved: torch.Tensor) -> torch.Tensor:  # UnfusedOAITritonExperts.activation
        torch.ops._C.swigluoai_and_mul(out := torch.empty(T * K, N, dtype=bf16, device=dev), interleaved, ALPHA, LIMIT)
        return out

    def vllm_sum(rows: torch.Tensor) -> torch.Tensor:  # the end of UnfusedOAITritonExperts.apply
        vg.masked_moe_sum(rows, ids, out := torch.empty(T, H, dtype=bf16, device=dev))
        return out

    def adapter_sum(rows: torch.Tensor) -> torch.Tensor:
        r = rows.float()
        return torch.where((ids >= 0).view(T, K, 1), r, torch.zeros_like(r)).sum(dim=1).to(bf16)

    print(f"E={E} T={T} top-{K} H={H} I={N} seed {a.seed}; {torch.cuda.get_device_name()}")
    rv, ra = vg.make_routing_data(ids, weights, E), adapter_routing()
    fields = [(i, f) for i in (1, 2) for f in ("src_indx", "dst_indx")] + [(0, "gate_scal"), (0, "expt_hist")]
    what = ", ".join(f"{('rd', 'gather', 'scatter')[i]}.{f} {differ(getattr(rv[i], f), getattr(ra[i], f))}"
                     for i, f in fields)  # fmt: skip
    print(f"R. routing data, positions that differ: {what}")

    g1_i, g1_c = gemm1(rv, w13_i, pc13_i, b13), gemm1(ra, w13_c, pc13_c, b13_c)
    print(f"A. GEMM1 interleaved vs chunked, columns matched: {differ(g1_i[:, perm], g1_c)} of {g1_c.numel()} differ")

    act_v = vllm_act(g1_i)
    act_a, act_o = adapter_activation(g1_i, VLLM_LAYOUT), oracle_order(g1_i, VLLM_LAYOUT)
    flips = act_v.view(torch.int16) != act_o.view(torch.int16)
    mags = act_v[flips].float().abs()
    small = int((mags < 0.01).sum())
    print(f"B. activation, vLLM's op vs the adapter's: {differ(act_v, act_a)} of {flips.numel()} differ; "
          f"vs the oracle's order: {int(flips.sum())} ({small} with |a| < 0.01, largest "
          f"{mags.max().item() if mags.numel() else 0:.4g})")  # fmt: skip

    rows_v, rows_o = gemm2(rv, act_v), gemm2(rv, act_o)
    moved = (rows_v.view(torch.int16) != rows_o.view(torch.int16)).any(dim=2)
    print(f"C. GEMM2 rows on each activation: {differ(rows_v, rows_o)} of {rows_v.numel()} elements differ, "
          f"in {int(moved.sum())} (token, slot) rows")  # fmt: skip

    seq = vllm_sum(rows_v)
    slots = [rows_v[:, j].float() for j in range(K)]
    half = max(1, K // 2)
    pairwise = (in_order(slots[:half]) + in_order(slots[half:])).to(bf16) if K > 1 else seq
    backwards = in_order(slots[::-1]).to(bf16)
    print(f"D. top-k sum on one set of rows, masked_moe_sum vs torch's sum: {differ(seq, adapter_sum(rows_v))} "
          f"differ; vs slots in order in torch: {differ(seq, in_order(slots).to(bf16))}; for scale, other orders: "
          f"first half + second half {differ(seq, pairwise)}, slots reversed {differ(seq, backwards)}")  # fmt: skip

    out_v = vllm_sum(gemm2(rv, vllm_act(g1_i)))
    out_a = adapter_sum(gemm2(ra, adapter_activation(g1_c, ADAPTER_LAYOUT)))
    bad = out_v.view(torch.int16) != out_a.view(torch.int16)
    chunked_as_interleaved = torch.stack([g1_c[:, :N], g1_c[:, N:]], dim=-1).reshape(T * K, 2 * N)
    out_av = adapter_sum(gemm2(ra, vllm_act(chunked_as_interleaved)))
    print(f"E. end to end: {int(bad.sum())} of {bad.numel()} output elements differ, in {int(bad.any(1).sum())} "
          f"tokens; the adapter with vLLM's activation op: {differ(out_v, out_av)}")  # fmt: skip


if __name__ == "__main__":
    main()
