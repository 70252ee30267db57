"""FLASHINFER_CUTLASS_MXFP4_BF16: FlashInfer's CUTLASS fused MoE, MXFP4 weights x bf16 activations (Hopper)

Kernel: ``flashinfer.fused_moe.cutlass_fused_moe`` with ``use_w4_group_scaling`` (modular: the
engine routes and hands over global top-k ids, float32 weights and its EP rank; the kernel
keeps its own experts), called as vLLM 0.26's ``FlashInferExperts`` calls it. Weights as vLLM's
GPT-OSS converter prepares them: w13 rows chunked [up; gate], hidden and intermediate padded to
128, bf16 biases (the binding requires the output dtype), then the SM90 mixed-input GEMM's
layout of the INSTALLED FlashInfer (``kernels.flashinfer_common``): plain weights and [E, K/128,
4R] scales up to 0.6.9; the nibble interleave of row pairs (r, r + 8) plus those scales from
0.6.10 to 0.6.15 (the default, vLLM 0.26's pin 0.6.14); the bit-level repack and folded scales
from 0.6.16. SwiGLU-OAI is ActivationType.Swiglu with per-expert float32 alpha, beta and limit;
SiLU is the same member without them.

Arithmetic, as TensorRT-LLM's CutlassMoeFCRunner does it on the SM90 mixed-input path (read in
0.6.14's ``cutlass_fused_moe_kernels.cuh``; the H200 showed 1.0-1.7x over the bound on small
shapes while only the intermediate was declared): GEMM1 writes its product in bf16, the
activation kernel adds the bias in float32 and writes bf16; GEMM2 writes its product in bf16 and
the finalize kernel adds the bias and combines with the float32 routing weights in float32
(``bias_after_rounding``). The routing weight is applied on the output only (Llama4's on-input
weight is not declared).

Known upstream: FlashInfer issue #5438 reports that this kernel in 0.6.10-0.6.15 sporadically
writes wrong tiles (a race on the TMA descriptor between experts), fixed by the 0.6.16 rewrite;
the harness's determinism and bound checks are what show it: on the H200 with 0.6.14, 3-5 of the
24 ``odd`` cases at T=128 (H=96, I=160, 6 experts) fail in each run, different ones each time,
with 470-3900 elements differing between two runs and up to 452x over the bound.

Tactics (``FI_CUTLASS_TACTICS``): the runner lists its candidate GEMM configurations, GEMM1's then
GEMM2's, and the AutoTuner picks one of each per power-of-two bucket of the token count when vLLM
tunes at start-up (untuned, -1: the first of each list). In 0.6.14, on SM90 for bf16 x MXFP4
(``get_candidate_configs_sm90`` with weight-only grouped tiles, every config swap_ab), each list
is the same 28: tiles 64x16, 64x32, 64x64, 64x128 (ping-pong) and 128x16, 128x32, 128x64
(cooperative), each in clusters 1x1, 2x1, 1x2, 2x2; the 64x128 tiles dispatch to the 64x64 kernel
(the FP4 path fixes N at 64 for M=64), so 24 kernels are distinct. A tactic here forces one tile
and cluster on both GEMMs, by index (GEMM2's as GEMM1's count plus it), through the AutoTuner's
choice (``forced_tactic``); the lists of other releases differ (0.7.x lists 116 per GEMM), so a
tactic refuses a FlashInfer whose list it does not know. Every config the list holds is
instantiated in the project's subset build (it keeps every mixed-input launcher).

Its JIT module (fused_moe_90) takes 35-90 minutes to compile: ``check_call`` uses FlashInfer's
own build where it is prebuilt or compiled, else the project's bf16 x MXFP4 subset of it
(``python -m harness build-flashinfer``: 200 s on the H200), and compiles the whole module only
when asked (``MXMOE_FLASHINFER_JIT=1``). Every result says which build ran (``provenance``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from mxmoe.harness.contract.backend import Arithmetic, BackendUnavailable, Declaration, Tactic
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.convert import Converted, Target
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.judge.engine import poisoned
from mxmoe.kernels.flashinfer_common import (
    DEFAULT_SM90_GENERATION,
    SM90_LAYOUTS,
    FlashInferKernel,
    installed_version,
    sm90_generation,
)
from mxmoe.reference.moe import Precision

_SM90_W4A16_TILES = ((64, 16), (64, 32), (64, 64), (64, 128), (128, 16), (128, 32), (128, 64))
_SM90_CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2))
SM90_W4A16_CONFIGS = tuple((m, n, cx, cy) for m, n in _SM90_W4A16_TILES for cx, cy in _SM90_CLUSTERS)
"""The runner's candidate list for bf16 x MXFP4 on SM90 in FlashInfer 0.6.14, in its order (tile
M, N, cluster x, y): a tactic index is a position in it (module docstring)."""
TACTIC_LISTS_KNOWN = ("0.6.14",)
"""The FlashInfer releases whose SM90 bf16 x MXFP4 candidate list is ``SM90_W4A16_CONFIGS``."""
FI_CUTLASS_TACTICS = tuple(
    Tactic(f"m{m}n{n}c{cx}{cy}", (("config", i),), ("sm90",),
           f"GEMM configuration {i} of {len(SM90_W4A16_CONFIGS)}: tile {m}x{n}x128, cluster {cx}x{cy}, "
           f"{'ping-pong' if m == 64 else 'cooperative'}; FlashInfer's AutoTuner may pick it for any token bucket")
    for i, (m, n, cx, cy) in enumerate(SM90_W4A16_CONFIGS)
    if (m, n) != (64, 128)  # dispatched to the 64x64 kernel: the same kernels as 64x64's
)  # fmt: skip


@contextlib.contextmanager
def forced_tactic(config: int | None) -> Iterator[None]:
    """Around one ``cutlass_fused_moe`` call: FlashInfer's AutoTuner answers GEMM1's choice with
    ``config`` and GEMM2's with GEMM1's count plus ``config`` (the runner's indices), every other
    op as it would. None: nothing changed (the kernel's own pick). The AutoTuner is one object per
    process, so the override is removed afterwards: a tactic never leaks into another call."""
    if config is None:
        yield
        return
    from flashinfer.autotuner import AutoTuner

    tuner = AutoTuner.get()
    own = tuner.choose_one

    def choose_one(custom_op: str, runners: list, *args: object, **kwargs: object) -> tuple[object, int]:
        if custom_op not in ("trtllm::fused_moe::gemm1", "trtllm::fused_moe::gemm2"):
            return own(custom_op, runners, *args, **kwargs)
        runner = runners[0].fused_moe_runner
        counts = (runner.get_gemm1_tactic_count(), runner.get_gemm2_tactic_count())
        if counts != (len(SM90_W4A16_CONFIGS),) * 2:
            raise RuntimeError(f"FlashInfer's runner lists {counts[0]} GEMM1 and {counts[1]} GEMM2 tactics; the "
                               f"declared ones index a list of {len(SM90_W4A16_CONFIGS)} (FlashInfer 0.6.14's)")
        return runners[0], config + (counts[0] if custom_op.endswith("gemm2") else 0)

    tuner.choose_one = choose_one
    try:
        yield
    finally:
        del tuner.choose_one


class FlashInferCutlassMxfp4Bf16(FlashInferKernel):
    """FLASHINFER_CUTLASS_MXFP4_BF16 (see the module docstring)."""

    kernel = "flashinfer.fused_moe.cutlass_fused_moe"
    empty_batch = "vLLM never calls the experts with T = 0 (FlashInfer asserts input_activations)"
    jit_modules = {"sm90": "fused_moe_90"}
    storage = SM90_LAYOUTS[DEFAULT_SM90_GENERATION]
    declaration = Declaration(
        id="flashinfer-cutlass-mxfp4-bf16",
        archs=("sm90",),
        description="FlashInfer CUTLASS fused MoE (SM90 mixed-input GEMM), bf16 activations",
        quant="w4a16",
        w13_layout="chunked_up_gate",
        hidden_align=128,
        intermediate_align=128,
        vllm_backend="FLASHINFER_CUTLASS_MXFP4_BF16",
        vllm_needs_biases=True,
        router_weight_on_input=False,
        tactics=FI_CUTLASS_TACTICS,
        arithmetic=Arithmetic(
            precision=Precision(
                gemm1_output="bf16",
                intermediate="bf16",
                expert_output="bf16",
                routing_weights="fp32",
                output=torch.bfloat16,
                bias_after_rounding=True,
            )
        ),
    )

    def check_call(self) -> None:
        """As every FlashInfer adapter; and a forced tactic only on a release whose candidate
        list it indexes (``TACTIC_LISTS_KNOWN``)."""
        super().check_call()
        version = installed_version()
        if self.tactic is not None and version not in TACTIC_LISTS_KNOWN:
            raise BackendUnavailable(
                f"{self.declaration.id}: its tactic indexes FlashInfer {', '.join(TACTIC_LISTS_KNOWN)}'s SM90 "
                f"bf16 x MXFP4 candidate list; FlashInfer {version} is installed, whose list differs"
            )

    def target(self, case: Case) -> Target:
        """The declared target with the SM90 layout of the installed FlashInfer."""
        return replace(super().target(case), storage=SM90_LAYOUTS[sm90_generation(installed_version())])

    def run(self, prepared: Converted, inputs: CaseInputs, out: torch.Tensor) -> None:
        """One ``cutlass_fused_moe`` call with the engine's routing."""
        t = prepared.tensors
        x = inputs.padded_x(prepared.target.hidden)
        output = poisoned(tuple(x.shape), torch.bfloat16, x.device)  # unwritten shows as such
        with forced_tactic(None if self.tactic is None else int(self.tactic.as_dict()["config"])):
            self._fi.cutlass_fused_moe(
                input=x,
                fc1_expert_weights=t["w13_blocks"],
                fc2_expert_weights=t["w2_blocks"],
                quant_scales=[t["w13_scales"], t["w2_scales"]],
                use_w4_group_scaling=True,
                **self.cutlass_common(prepared, inputs, output),
            )
        out.copy_(output[:, : out.shape[1]])


class FlashInferCutlassMxfp4Bf16OldLayout(FlashInferCutlassMxfp4Bf16):
    """The same kernel fed the layout FlashInfer read up to 0.6.9 (plain packed weights, scales
    interleaved to [E, K/128, 4R]), whatever FlashInfer is installed: the weights vLLM's MXFP4
    oracle prepared before it called FlashInfer's 0.6.10 weight interleave, the integration behind
    the GPQA 0.0 on Hopper with no error raised (FlashInfer issue #3334, vLLM PR #46915;
    docs/shipped-bugs.md).
    An instrument: on FlashInfer 0.6.10+ it must FAIL, and how it fails (an error, or wrong
    numbers with no error) is the finding."""

    declaration = replace(
        FlashInferCutlassMxfp4Bf16.declaration,
        id="flashinfer-cutlass-mxfp4-bf16-old-layout",
        description="FLASHINFER_CUTLASS_MXFP4_BF16 fed FlashInfer 0.6.9's layout (vLLM's before #46915)",
        vllm_backend=None,
        vllm_needs_biases=False,  # not vLLM's backend: nothing of vLLM's conversion binds it
        kind="instrument",
        tactics=(),  # an instrument of the layout, not of the kernel's configurations
    )

    def built_to_fail(self) -> str | None:
        """From FlashInfer 0.6.10 on, the kernel reads another layout than the one fed here: it
        must FAIL over the bound there (measured on an H200 with 0.6.14: 49.5x, no error raised);
        on 0.6.9 and before the layout is the kernel's own and it must PASS."""
        from mxmoe.harness.upstream.fetch import release
        from mxmoe.kernels.flashinfer_common import installed_version

        version = installed_version()
        if version is None or release(version) < release("0.6.10"):
            return None
        return f"a FAIL over the bound: FlashInfer {version} reads the layout of 0.6.10 and later"

    def target(self, case: Case) -> Target:
        """The declared target with FlashInfer 0.6.9's SM90 layout."""
        return replace(super().target(case), storage=SM90_LAYOUTS["0.6.9"])
