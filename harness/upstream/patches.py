"""The patches: one-line bugs of the project's own, as data, per vendor.

Each patch is one bug. Where a vendor has the same line in two kernel variants (triton_kernels'
``_matmul_ogs`` and its persistent twin ``_p_matmul_ogs``), the patch carries the same one-line
change for each, so the bug is there whichever variant the kernel's heuristics pick. The old line
must occur exactly once in its file (``apply``), or exactly once after an anchor line that itself
occurs once (``Edit.after``: where a release passes the same argument in two calls): a vendor
update that moves it is an error naming the file and the line, not a silently unpatched run.
"""

from __future__ import annotations

from dataclasses import dataclass

CATEGORIES = ("activation", "bias", "routing-weight", "scale", "layout", "routing", "write-back")


@dataclass(frozen=True)
class Edit:
    """Replace the line ``old`` (exact, indentation included) of ``file`` (relative to the
    package folder) with ``new``; with ``after``, the first ``old`` after that line."""

    file: str
    old: str
    new: str
    after: str = ""
    """A line that occurs once in the file; ``old`` is then the first of its lines after it (a
    FlashInfer 0.7 wrapper passes each argument twice, to its custom op and from it to the runner)."""


class PatchError(ValueError):
    """An edit that does not apply to the vendor source at hand; the message names file and line."""


def replace_line(text: str, edit: Edit, what: str) -> str:
    """``text`` (the content of ``edit.file``) with ``edit.old`` replaced by ``edit.new``. The old
    line must occur exactly once (with ``edit.after``: its anchor once, and the old line after it):
    a vendor release that moved or doubled it is a PatchError naming ``what`` (the patch or build),
    the file and the line, never a silently unedited file."""
    lines = text.split("\n")
    if edit.after:
        anchors = [i for i, line in enumerate(lines) if line == edit.after]
        if len(anchors) != 1:
            raise PatchError(
                f"{what}: the anchor line {edit.after.strip()!r} occurs {len(anchors)} times in {edit.file} "
                "(exactly once expected: another vendor release?)"
            )
        hits = [i for i, line in enumerate(lines) if i > anchors[0] and line == edit.old][:1]
        if not hits:
            raise PatchError(f"{what}: the line {edit.old.strip()!r} does not occur after {edit.after.strip()!r} "
                             f"in {edit.file} (another vendor release?)")  # fmt: skip
    else:
        hits = [i for i, line in enumerate(lines) if line == edit.old]
        if len(hits) != 1:
            raise PatchError(
                f"{what}: the line {edit.old.strip()!r} occurs {len(hits)} times in {edit.file} "
                "(exactly once expected: another vendor release?)"
            )
    lines[hits[0]] = edit.new
    return "\n".join(lines)


@dataclass(frozen=True)
class Patch:
    """One bug planted in a vendor kernel."""

    slug: str
    category: str
    fault: str
    edits: tuple[Edit, ...]

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"Patch.category must be one of {', '.join(CATEGORIES)}; got {self.category!r}")
        if not self.edits:
            raise ValueError(f"Patch {self.slug!r} has no edits")


_SW = "swiglu_details/_swiglu.py"
_MM = "matmul_ogs_details/_matmul_ogs.py"
_PMM = "matmul_ogs_details/_p_matmul_ogs.py"
_HV = "tensor_details/layout_details/hopper_value.py"
_HS = "tensor_details/layout_details/hopper_scale.py"
_RC = "routing_details/_routing_compute.py"
_RG = "matmul_ogs_details/_reduce_grouped.py"

TRITON_PATCHES: tuple[Patch, ...] = (
    Patch(
        "swiglu-no-plus-one", "activation", "fused swiglu returns s * up instead of s * (up + 1)",
        (Edit(_SW, "    return tl.fma(s, linear, s)  # (s * (linear + 1))", "    return s * linear"),),
    ),
    Patch(
        "swiglu-alpha-dropped", "activation", "fused swiglu's sigmoid without alpha (1.702 read as 1)",
        (Edit(_SW, "    s = gelu / (1 + tl.exp(-alpha * gelu))", "    s = gelu / (1 + tl.exp(-gelu))"),),
    ),
    Patch(
        "swiglu-gate-up-swapped", "layout", "fused swiglu splits the interleaved pair as (up, gate)",
        (Edit(
            _SW,
            "    gelu, linear = tl.split(tl.reshape(input, (input.shape[0], input.shape[1] // 2, 2)))",
            "    linear, gelu = tl.split(tl.reshape(input, (input.shape[0], input.shape[1] // 2, 2)))",
        ),),
    ),
    Patch(
        "swiglu-gate-unclamped", "activation", "the gate is never clamped at the limit",
        (Edit(_SW, "        gelu = clip(gelu, limit, clip_lower=False)", "        gelu = gelu"),),
    ),
    Patch(
        "swiglu-up-clamped-above-only", "activation", "up is clamped from above only (no -limit floor)",
        (Edit(_SW, "        linear = clip(linear, limit, clip_lower=True)",
              "        linear = clip(linear, limit, clip_lower=False)"),),
    ),
    Patch(
        "bias-of-expert-0", "bias", "every expert adds expert 0's bias (the expert stride dropped)",
        (
            Edit(_MM, "        BPtrs = B + expt_id * stride_b_e + offs_y_n", "        BPtrs = B + offs_y_n"),
            Edit(_PMM, "            BPtrs = B + expt_id1 * stride_b_e + offs_y_n", "            BPtrs = B + offs_y_n"),
        ),
    ),
    Patch(
        "bias-every-split", "bias", "the bias added by every split-K slice, not only the first",
        (
            Edit(_MM, "        if pid_k == 0:", "        if pid_k >= 0:"),
            Edit(_PMM, "            if pid_k1 == 0:", "            if pid_k1 >= 0:"),
        ),
    ),
    Patch(
        "gammas-row-offset", "routing-weight", "routing weights read without the expert's row offset (misassigned)",
        (
            Edit(
                _MM,
                "        gammas = tl.load(Gammas + start_m + offs_m, mask=mask_m, other=0.0)",
                "        gammas = tl.load(Gammas + offs_m, mask=mask_m, other=0.0)",
            ),
            Edit(
                _PMM,
                "            gammas = tl.load(Gammas + start_m1 + offs_m, mask=mask_m, other=0.0)",
                "            gammas = tl.load(Gammas + offs_m, mask=mask_m, other=0.0)",
            ),
        ),
    ),
    Patch(
        "gammas-twice", "routing-weight", "each row scaled by its routing weight squared (applied twice)",
        (
            Edit(_MM, "    out *= gammas[:, None]", "    out *= gammas[:, None] * gammas[:, None]"),
            Edit(_PMM, "            out *= gammas[:, None]", "            out *= gammas[:, None] * gammas[:, None]"),
        ),
    ),
    Patch(
        "gammas-odd-rows-high", "routing-weight",
        "the routing weights of odd rows scaled by 1 + 2^-7 in the epilogue (each within bf16 rounding)",
        (
            Edit(_MM, "    out *= gammas[:, None]",
                 "    out *= (gammas * tl.where(offs_m % 2 == 1, 1.0078125, 1.0))[:, None]"),
            Edit(_PMM, "            out *= gammas[:, None]",
                 "            out *= (gammas * tl.where(offs_m % 2 == 1, 1.0078125, 1.0))[:, None]"),
        ),
    ),  # fmt: skip
    Patch(
        "scales-of-tile-0", "scale", "every N tile reads the first tile's E8M0 scales",
        (Edit(
            _MM,
            "        offs_n_scale = (pid_n * SCALE_BLOCK_N + tl.arange(0, SCALE_BLOCK_N)) % N",
            "        offs_n_scale = tl.arange(0, SCALE_BLOCK_N) % N",
        ),),
    ),
    Patch(
        "e8m0-times-two", "scale", "the Hopper upcast multiplies by twice the scale (E8M0 bias 126)",
        (Edit(_HV, "    x = x * scale", "    x = x * scale * 2"),),
    ),
    Patch(
        "hopper-scale-unswizzle", "scale", "the Hopper scale unswizzle permutes two axes the wrong way",
        (Edit(_HS, "    x = x.trans(0, 3, 1, 6, 4, 2, 5)", "    x = x.trans(0, 3, 1, 6, 2, 4, 5)"),),
    ),
    Patch(
        "e2m1-bias", "layout", "the FP4 upcast's exponent bias off by one (2^125 for 2^126: every value halved)",
        (Edit(
            _HV,
            "            mov.b32 bias, 0x7e807e80; // 2 ** 126 == 2 ** (bias_bf16 - bias_fp2)",
            "            mov.b32 bias, 0x7e007e00; // 2 ** 125",
        ),),
    ),
    Patch(
        "routing-no-softmax", "routing", "routing() skips the softmax over the chosen k (raw logits as weights)",
        (Edit(
            "routing.py",
            "                                           apply_softmax=not sm_first, y_indx=expt_indx, n_rows=n_rows)",
            "                                           apply_softmax=sm_first, y_indx=expt_indx, n_rows=n_rows)",
        ),),
    ),
    Patch(
        "routing-inclusive-offsets", "routing", "tokens placed at inclusive, not exclusive, run lengths (off by one)",
        (Edit(
            _RC,
            "    exclusive_run_lengths = (expts_and_inclusive_run_lengths - 1) & 0xffff",
            "    exclusive_run_lengths = (expts_and_inclusive_run_lengths) & 0xffff",
        ),),
    ),
    Patch(
        "writeback-row-dropped", "write-back",
        "the top-k reduce's write-back leaves the last row of every 16-token tile unwritten (AITER #3538's kind)",
        (Edit(_RG, "        tl.store(out_ptr, acc, mask=out_n_mask)",
              "        tl.store(out_ptr, acc, mask=out_n_mask & (pid_t % 16 != 15))"),),
    ),
    Patch(
        "routing-sigmoid-for-softmax", "routing", "the top-k kernel weights the chosen k by sigmoid, not softmax",
        (Edit(
            "topk_details/_topk_forward.py",
            "        y_values = tl.softmax(y_values.to(tl.float32), dim=1, keep_dims=True).to(x_dtype)",
            "        y_values = tl.sigmoid(y_values.to(tl.float32)).to(x_dtype)",
        ),),
    ),
)  # fmt: skip

_AK = "ops/triton/_triton_kernels/moe/moe_op_gemm_a16w4.py"
_AA = "ops/triton/_triton_kernels/moe/activations.py"
_AR = "ops/triton/_triton_kernels/moe/reduce.py"
_ATK = "ops/triton/_triton_kernels/moe/moe_routing/topk.py"
_ARH = "ops/triton/moe/moe_routing/routing.py"

AITER_PATCHES: tuple[Patch, ...] = (
    Patch(
        "swiglu-alpha-dropped", "activation", "swiglu's sigmoid without alpha (silu(g), not g sigmoid(1.702 g))",
        (Edit(_AA, "    s = gelu / (1 + tl.exp2(-1.44269504089 * alpha * gelu))",
              "    s = gelu / (1 + tl.exp2(-1.44269504089 * gelu))"),),
    ),
    Patch(
        "swiglu-no-plus-one", "activation", "swigluoai returns s * up instead of s * (up + 1)",
        (Edit(_AA, "        return tl.fma(s, linear, s)  # s * (linear + 1)", "        return s * linear"),),
    ),
    Patch(
        "swiglu-up-clamped-above-only", "activation", "up is clamped from above only (no -limit floor)",
        (Edit(_AA, "        linear = clip(linear, limit, clip_lower=True)",
              "        linear = clip(linear, limit, clip_lower=False)"),),
    ),
    Patch(
        "swiglu-gate-unclamped", "activation", "the gate is never clamped at the limit",
        (Edit(_AA, "        gelu = clip(gelu, limit, clip_lower=False)", "        gelu = gelu"),),
    ),
    Patch(
        "swiglu-gate-up-swapped", "layout", "swiglu splits the interleaved pair as (up, gate)",
        (Edit(
            _AA,
            "    gelu, linear = tl.split(tl.reshape(input, (input.shape[0], input.shape[1] // 2, 2)))",
            "    linear, gelu = tl.split(tl.reshape(input, (input.shape[0], input.shape[1] // 2, 2)))",
        ),),
    ),
    Patch(
        "bias-of-expert-0", "bias", "every expert adds expert 0's bias (the expert stride dropped)",
        (Edit(_AK, "        BPtrs = B + expt_id * stride_b_e + offs_y_n", "        BPtrs = B + offs_y_n"),),
    ),
    Patch(
        "bias-split-guard", "bias", "the split-K bias guard off by one (the bias never added)",
        (Edit(_AK, "        if pid_k == 0:", "        if pid_k == 1:"),),
    ),
    Patch(
        "gammas-row-offset", "routing-weight", "routing weights read without the expert's row offset (misassigned)",
        (Edit(_AK, "        gammas = tl.load(Gammas + start_m + offs_m, mask=mask_m, other=0.0)",
              "        gammas = tl.load(Gammas + offs_m, mask=mask_m, other=0.0)"),),
    ),
    Patch(
        "gammas-twice", "routing-weight", "each row scaled by its routing weight squared (applied twice)",
        (Edit(_AK, "        out *= gammas[:, None]", "        out *= gammas[:, None] * gammas[:, None]"),),
    ),
    Patch(
        "scales-of-tile-0", "scale", "every N tile reads the first tile's E8M0 scales",
        (Edit(_AK, "    offs_w_n_scale = (pid_n * SCALE_BLOCK_N + tl.arange(0, SCALE_BLOCK_N)) % N",
              "    offs_w_n_scale = (tl.arange(0, SCALE_BLOCK_N)) % N"),),
    ),
    Patch(
        "scales-of-expert-0", "scale", "every expert reads expert 0's E8M0 scales",
        (Edit(_AK, "    WMxScale += expt_id * stride_w_mx_e", "    WMxScale += 0 * expt_id * stride_w_mx_e"),),
    ),
    Patch(
        "e8m0-plus-one", "scale", "every E8M0 byte read one too high (weights doubled)",
        (Edit(_AK, "            w_scales = tl.load(WMxScalePtrs)",
              "            w_scales = tl.load(WMxScalePtrs) + 1"),),
    ),
    Patch(
        "scale-pointer-not-advanced", "scale",
        "the scale pointer not advanced along K (K blocks reuse the first scales)",
        (Edit(_AK, "        WMxScalePtrs += (PACKED_MX_BLOCK * SPLIT_K) * stride_w_mx_k",
              "        WMxScalePtrs += 0 * stride_w_mx_k"),),
    ),
    Patch(
        "gather-not-offset", "layout", "the gather index not offset to the expert's first row (wrong tokens)",
        (Edit(_AK, "        GatherIndx += start_m", "        GatherIndx += 0"),),
    ),
    Patch(
        "reduce-keeps-last", "routing-weight", "the top-k reduce keeps the last row instead of summing",
        (Edit(_AR, "        acc += curr", "        acc = curr"),),
    ),
    Patch(
        "reduce-first-slot", "routing-weight", "the top-k reduce sums the first slot k times",
        (Edit(_AR, "            indxs = indxs + (tl.load(InIndx + start + i),)",
              "            indxs = indxs + (tl.load(InIndx + start),)"),),
    ),
    Patch(
        "routing-no-softmax", "routing", "routing skips the softmax over the chosen k (raw logits as weights)",
        (Edit(_ARH, "            apply_softmax=not sm_first,", "            apply_softmax=sm_first,"),),
    ),
    Patch(
        "routing-softmax-twice", "routing", "softmax over all experts before the top-k, then again over the k",
        (Edit(_ARH, "        if sm_first:", "        if not sm_first:"),),
    ),
    Patch(
        "routing-sort-key-inverted", "routing", "the float-to-sort-key transform inverted (the wrong experts chosen)",
        (Edit(_ATK, "    return x ^ tl.where((x & tm) != 0, fm, tm)",
              "    return x ^ tl.where((x & tm) != 0, tm, fm)"),),
    ),
)  # fmt: skip

_VQ = "model_executor/layers/quantization/utils/mxfp4_utils.py"
_VO = "model_executor/layers/fused_moe/oracle/mxfp4.py"
_VM = "model_executor/layers/quantization/utils/marlin_utils_fp4.py"
VLLM_PATCHES: tuple[Patch, ...] = (
    # One-line bugs in vLLM 0.34.0's own weight preparation (its Python, under vllm/): each changes
    # what one backend's kernel is fed, never the kernel itself, so the direct adapters (which
    # convert the weights themselves) must not see it and vLLM's layer must.
    Patch(
        "triton-scale-pad-dropped", "scale",
        "TRITON/TRITON_UNFUSED on Hopper: the MXFP4 scales' K groups no longer padded to a multiple of 4 "
        "before the swizzle (the fix of vLLM #47303 undone)",
        (Edit(_VQ, "                pad_k = -K % 4", "                pad_k = 0"),),
    ),
    Patch(
        "flashinfer-w13-unswapped", "layout",
        "FLASHINFER_CUTLASS_MXFP4_BF16: w13's weights left [w1; w3] where FlashInfer reads [w3; w1] (its "
        "scales and bias still swapped)",
        (Edit(_VO, "        w13_weight_swapped = torch.cat([w3_w, w1_w], dim=1)",
              "        w13_weight_swapped = torch.cat([w1_w, w3_w], dim=1)"),),
    ),
    Patch(
        "marlin-scale-pairs-unpermuted", "scale",
        "MARLIN: the E8M0 scales' pair permutation for 16-bit activations undone (applied a second time: the "
        "swap of each group's middle pair is its own inverse). 0.34.0 gave NVFP4's scales the same permuting "
        "line as MXFP4's, so the edit is on the line after it, the one only MXFP4's has",
        (Edit(_VM, "    return marlin_scales.to(torch.float8_e8m0fnu)",
              "    return marlin_scales.view(-1, 4)[:, [0, 2, 1, 3]].view(marlin_scales.size(0), -1).to("
              "torch.float8_e8m0fnu)"),),
    ),
    Patch(
        "marlin-w2-bias-unpermuted", "bias",
        "MARLIN: w2's bias left in its natural column order where Marlin's epilogue reads it in runs of 32 "
        "permuted (marlin_permute_bias; w13's bias still permuted): every expert's output bias lands on "
        "other columns of its run, a sub-bound error where the biases are small",
        (Edit(_VM, "    w2_bias = permute_bias(w2_bias)",
              "    w2_bias = None if w2_bias is None else w2_bias.to(param_dtype)"),),
    ),
)  # fmt: skip
"""Bugs planted in vLLM's own MXFP4 weight preparation (``python -m harness mutants --vendor vllm``)."""


_FC = "fused_moe/core.py"
_RUN_MOE = "        run_moe("
FLASHINFER_PATCHES: tuple[Patch, ...] = (
    # One-line bugs in FlashInfer's Python wrapper of its CUTLASS MoE (``cutlass_fused_moe``), in its
    # call into the compiled runner (``run_moe``, once in 0.6.14, 0.7.2.post1 and 0.7.4; 0.7 also
    # passes each argument on to its custom op first): each changes what the kernel is handed, under
    # every tactic.
    Patch(
        "fc2-bias-dropped", "bias", "the second GEMM's bias not handed to the kernel",
        (Edit(_FC, "            fc2_expert_biases,", "            None,", _RUN_MOE),),
    ),
    Patch(
        "swiglu-limit-dropped", "activation", "swigluoai's clamp limit not handed to the kernel (no clamp)",
        (Edit(_FC, "            swiglu_limit,", "            None,", _RUN_MOE),),
    ),
    Patch(
        "swiglu-alpha-dropped", "activation", "swigluoai's alpha not handed to the kernel (its default instead)",
        (Edit(_FC, "            swiglu_alpha,", "            None,", _RUN_MOE),),
    ),
    Patch(
        "routing-weights-ignored", "routing-weight", "every chosen expert combined with weight 1",
        (Edit(_FC, "            token_final_scales,", "            torch.ones_like(token_final_scales),", _RUN_MOE),),
    ),
)  # fmt: skip
"""The patches of ``mutants --vendor flashinfer`` (GPU only: the kernel is SM90 CUDA). With
``--tactics all`` each runs under every declared tactic of the adapter as well, a row each."""

