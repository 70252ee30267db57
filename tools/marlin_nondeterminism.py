"""Where vLLM's Marlin MXFP4 MoE differs from run to run on the same inputs (standalone: vLLM and
torch only, on a CUDA GPU).

Hypothesis under test: ``moe_align_block_size`` places each expert's (token, slot) rows with an
``atomicAdd`` when it does not take its small-batch path (topk_ids.numel() >= 1024 or more than 64
experts), so the order of an expert's rows differs between calls; Marlin's stripe partition of
the K dimension over thread blocks depends on the M block a row lands in (a tile summed whole by
one block, or in K slices reduced in float32), so a row that moves to another M block is summed in
another order, and a few of its bf16 outputs differ in the last bit.

Steps, each on the same inputs:
  A. moe_align_block_size twice: are the sorted row ids identical? the same rows per expert?
  B. the two Marlin GEMMs and activation (``_fused_marlin_moe``) twice on ONE sorted order: equal?
  C. the same on each call's own sorted order: how many elements differ?
  D. each order with every expert's rows sorted ascending (a canonical order): equal?
  E. ``fused_marlin_moe`` end to end twice (what vLLM's layer calls): how many elements differ?

Usage: python tools/marlin_nondeterminism.py [--experts 32] [--tokens 4096] [--topk 4] [--repeats 3]
(vLLM installed; where only the project's carried vLLM runtime is, start it through
``python -c "from mxmoe.harness.upstream.vllm_runtime import boot; boot(arch='sm90'); import runpy,
sys; sys.argv = ['m', *ARGS]; runpy.run_path('tools/marlin_nondeterminism.py', run_name='__main__')"``).
Written from vLLM 0.33.0's sources. Run on an H200 (vLLM 0.33.0's runtime, the project's ops build)
at the unpadded 2880 first, where Marlin has no tile configuration: step A there showed the
atomicAdd path placing 16,300 of 17,344 rows elsewhere from call to call (E=32, T=4096) and 309 of
1,024 (E=128, T=128), each expert's set of rows the same; the small-batch path (E=32, T=128) gave
identical orders. At the padded sizes (2026-12-03, the same H200 and runtime), E=32 T=4096: B. one
sorted order run again, 0 elements differ (three times); C. each call's own order, 754 and 625;
D. every expert's rows in ascending order, 0 and 0; E. end to end, 635 and 569 of 12,582,912. E=128
T=128: the order differs, the output does not (every expert's rows fit one block of 8); E=32 T=128:
identical order and output. So the atomicAdd order is the whole cause.
"""

from __future__ import annotations

import argparse
import types

import torch


def canonical(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, block: int, padded: int) -> torch.Tensor:
    """``sorted_ids`` with each expert's rows (its consecutive blocks) in ascending order, padding last."""
    out = sorted_ids.clone()
    n = padded // block
    experts = expert_ids[:n].tolist()
    start = 0
    for b in range(1, n + 1):
        if b == n or experts[b] != experts[start]:
            seg = out[start * block : b * block]
            out[start * block : b * block] = torch.sort(seg).values  # padding ids are the largest
            start = b
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--topk", type=int, default=4)
    # gpt-oss's 2880 padded as vLLM pads it for Marlin (hidden to 256, intermediate to 128): Marlin
    # has no tile configuration for a K or N of 2880 ("Invalid thread config").
    p.add_argument("--hidden", type=int, default=3072, help="a multiple of 256 (default 3072: gpt-oss's 2880 padded)")
    p.add_argument(
        "--intermediate", type=int, default=2944, help="a multiple of 128 (default 2944: gpt-oss's 2880 padded)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.hidden % 256 or a.intermediate % 128:
        p.error(
            f"--hidden must be a multiple of 256 and --intermediate of 128 (vLLM pads to them for Marlin); "
            f"got {a.hidden} and {a.intermediate}"
        )

    import vllm._custom_ops as ops  # noqa: F401  (registers the ops)
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import _fused_marlin_moe, fused_marlin_moe
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_moe_mxfp4_layer_for_marlin
    from vllm.scalar_type import scalar_types

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(a.seed)
    E, T, K, H, N = a.experts, a.tokens, a.topk, a.hidden, a.intermediate
    u8 = dict(dtype=torch.uint8, device=dev, generator=g)
    w13 = torch.randint(0, 256, (E, 2 * N, H // 2), **u8)
    w2 = torch.randint(0, 256, (E, H, N // 2), **u8)
    s13 = torch.randint(118, 123, (E, 2 * N, H // 32), **u8)
    s2 = torch.randint(118, 123, (E, H, N // 32), **u8)
    b13 = torch.randn(E, 2 * N, device=dev, generator=g).to(torch.bfloat16)
    b2 = torch.randn(E, H, device=dev, generator=g).to(torch.bfloat16)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, device=dev, generator=g)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    topk_w = (topk_w / topk_w.sum(-1, keepdim=True)).float()
    topk_ids = topk_ids.to(torch.int32)

    layer = types.SimpleNamespace(params_dtype=torch.bfloat16)
    mw13, mw2, ms13, ms2, mb13, mb2 = prepare_moe_mxfp4_layer_for_marlin(layer, w13, w2, s13, s2, b13, b2)
    qtype = scalar_types.float4_e2m1f
    M = T
    for block in [8, 16, 32, 48, 64]:  # vLLM's choice in fused_marlin_moe
        if M * K / E / block < 0.9:
            break
    small = topk_ids.numel() < 1024 and E <= 64
    print(
        f"E={E} T={T} topk={K} H={H} I={N}: block_size_m={block}; moe_align_block_size takes its "
        f"{'small-batch (per-thread counts)' if small else 'atomicAdd'} path"
    )

    def align() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return moe_align_block_size(topk_ids, block, E, None, ignore_invalid_experts=True)

    def gemms(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
        out = _fused_marlin_moe(
            hidden_states=x,
            w1=mw13,
            w2=mw2,
            bias1=mb13,
            bias2=mb2,
            w1_scale=ms13,
            w2_scale=ms2,
            topk_weights=topk_w,
            num_topk=K,
            quant_type=qtype,
            apply_router_weight_on_input=False,
            expert_map=None,
            block_size_m=block,
            sorted_token_ids=sorted_ids,
            expert_ids=expert_ids,
            num_tokens_post_padded=padded,
            activation=MoEActivation.SWIGLUOAI,
            topk_ids=topk_ids,
        )
        return out.view(T, K, H).sum(1)

    def differ(u: torch.Tensor, v: torch.Tensor) -> int:
        return int((u.view(torch.int16) != v.view(torch.int16)).sum())

    runs = [align() for _ in range(a.repeats)]
    s0, e0, p0 = runs[0]
    n = int(p0.item())
    print(f"A. sorted row ids: {n} padded rows in {n // block} blocks")
    for i, (s, e, _p) in enumerate(runs[1:], 1):
        same_ids = torch.equal(s[:n], s0[:n])
        same_sets = torch.equal(canonical(s, e, block, n)[:n], canonical(s0, e0, block, n)[:n])
        moved = int((s[:n] != s0[:n]).sum())
        print(
            f"   call {i} against call 0: identical {same_ids}; the same rows per expert {same_sets}; "
            f"{moved} positions hold another row; expert ids identical {torch.equal(e, e0)}"
        )
    ref = gemms(s0, e0, p0)
    print(
        "B. one sorted order, run again: "
        + ", ".join(f"{differ(gemms(s0, e0, p0), ref)} elements differ" for _ in range(a.repeats))
    )
    print(
        "C. each call's own order: "
        + ", ".join(f"{differ(gemms(s, e, p), ref)} elements differ" for s, e, p in runs[1:])
    )
    canon = [gemms(canonical(s, e, block, n), e, p) for s, e, p in runs]
    print(
        "D. every expert's rows in ascending order: "
        + ", ".join(f"{differ(c, canon[0])} elements differ" for c in canon[1:])
    )
    end = [fused_marlin_moe(x, mw13, mw2, mb13, mb2, ms13, ms2, topk_w, topk_ids, qtype.id,
                            activation=MoEActivation.SWIGLUOAI) for _ in range(a.repeats)]  # fmt: skip
    print(
        "E. fused_marlin_moe end to end: "
        + ", ".join(f"{differ(o, end[0])} of {end[0].numel()} elements differ" for o in end[1:])
    )


if __name__ == "__main__":
    main()
