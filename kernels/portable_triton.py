"""PORTABLE_TRITON: the project's own fused MXFP4 MoE in Triton, for every host Triton runs on.

Why it exists: a backend the harness can run everywhere (compiled on NVIDIA and AMD GPUs, under
Triton's interpreter on a CPU in CI) that is written the way production kernels are (tokens
grouped by expert, MXFP4 dequantized inside the GEMM, the activation fused into GEMM1's
epilogue), so that the whole pipeline, from case to verdict, is exercised on a real Triton
kernel on every pull request.

The layer (``kernels/portable_triton_kernels.py`` holds the kernels):

1. routing in torch (``reference.routing``; weights rounded to float32);
2. the (token, slot) pairs sorted by local expert (stable), cut into blocks of BLOCK_M rows;
3. GEMM1 on MXFP4 w13 dequantized per tile, plus bias, then the activation (silu, or swigluoai
   with alpha, beta and limit; gate and up rows interleaved or chunked), stored as bfloat16;
4. GEMM2, plus bias, times the routing weight, one float32 row per (token, slot);
5. the top-k rows of each token summed in float32 (torch, fixed order), rounded to bfloat16.

No atomics: two runs give the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from mxmoe.harness.contract.backend import Arithmetic, Backend, BackendUnavailable, Declaration
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import ARCHS, host_arch, use_triton_interpreter_without_gpu
from mxmoe.reference.moe import MoEWeights, Precision, round_to

_TRITON_ARCHS = ARCHS
"""Everywhere Triton runs: compiled on the GPUs, interpreted on ``cpu``."""
_INTERPRETER_MAX_WORK = 8 * 2**20
"""The largest case (tokens x top-k x H x 2I) run under the interpreter: a gpt-oss-20b TP8 shard
at T=1 (about 20 s there); the whole gpt-oss-20b layer at T=1 takes over two minutes, which
belongs on a GPU."""


@dataclass(frozen=True)
class Prepared:
    """The converted weights the kernels read (contiguous, on the case's device)."""

    weights: MoEWeights
    hidden: int


def _blocks(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Sort the valid (token, slot) pairs by expert and cut them into blocks of ``block_m`` rows.

    Returns (sorted pair index, per-block expert, per-block first row, per-block end of its
    expert's rows), all int32 on ``ids``' device. A pair with a negative id (an expert on another
    EP rank) is dropped."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs = torch.nonzero(flat >= 0).reshape(-1)
    local = flat[pairs]
    order = torch.sort(local, stable=True).indices
    sorted_pairs = pairs[order]
    counts = torch.bincount(local, minlength=experts)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    nblk = (counts + block_m - 1) // block_m
    blk_expert = torch.repeat_interleave(torch.arange(experts, device=ids.device), nblk)
    first_blk = torch.cumsum(nblk, 0) - nblk
    within = torch.arange(blk_expert.numel(), device=ids.device) - first_blk[blk_expert]
    blk_start = starts[blk_expert] + within * block_m
    i32 = torch.int32
    return sorted_pairs.to(i32), blk_expert.to(i32), blk_start.to(i32), ends[blk_expert].to(i32)


class PortableTriton(Backend):
    """The project's fused MoE in Triton (see the module docstring)."""

    declaration = Declaration(
        id="portable-triton",
        archs=_TRITON_ARCHS,
        production=False,  # the project's own kernel: no inference engine ships it
        description="the project's fused MXFP4 MoE in Triton: in-kernel dequant, fused activation, no atomics",
        w13_layout="interleaved",
        bias_dtype="fp32",
        arithmetic=Arithmetic(
            precision=Precision(
                activation_input="bf16",
                gemm1_output="fp32",
                intermediate="bf16",
                expert_output="fp32",
                routing_weights="fp32",
                output=torch.bfloat16,
            ),
        ),
    )
    _kernels: Any = None

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; on ``cpu`` (the interpreter) only cases up to gpt-oss-20b at T=1."""
        reason = super().supports(case, arch)
        if reason is None and arch == "cpu":
            work = case.tokens * case.top_k * case.hidden * 2 * case.intermediate
            if work > _INTERPRETER_MAX_WORK:
                return (
                    f"{self.declaration.id} under the Triton interpreter (cpu) takes cases up to a gpt-oss-20b "
                    "TP8 shard at T=1; larger ones run compiled on a GPU"
                )
        return reason

    @staticmethod
    def interpreter_unsupported() -> str | None:
        """Why the installed triton's interpreter cannot run these kernels (its ``dot_scaled`` needs
        triton 3.8 or newer there), or None. Compiled on a GPU, any triton of the declared archs does."""
        from importlib import metadata

        try:
            version = metadata.version("triton")
        except metadata.PackageNotFoundError:
            return None  # no triton at all: load says so
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
        if (major, minor) < (3, 8):
            return f"Triton's interpreter runs these kernels from triton 3.8 (dot_scaled); this triton is {version}"
        return None

    def load(self) -> None:
        """Import the kernels: compiled where there is a GPU, interpreted (TRITON_INTERPRET=1,
        set here before Triton reads it) on a host without one."""
        if PortableTriton._kernels is not None:
            return
        use_triton_interpreter_without_gpu()
        try:
            import triton.language as tl
        except ImportError as exc:
            raise BackendUnavailable(f"{self.declaration.id} needs triton (pip install triton): {exc}") from exc
        if host_arch() == "cpu" and type(tl.zeros).__name__ != "InterpretedFunction":
            raise BackendUnavailable(
                f"{self.declaration.id}: this host has no GPU and triton was imported before TRITON_INTERPRET=1 "
                "was set; set it in the environment (the harness's CLI and pytest plugin set it at start)"
            )
        if type(tl.zeros).__name__ == "InterpretedFunction" and (why := self.interpreter_unsupported()):
            raise BackendUnavailable(f"{self.declaration.id}: {why}")
        from mxmoe.kernels import portable_triton_kernels

        PortableTriton._kernels = portable_triton_kernels

    @staticmethod
    def tiles(pairs_per_expert: float, interpreted: bool) -> tuple[int, int, int, dict[str, int]]:
        """(BLOCK_M, BLOCK_N, BLOCK_K, launch options): large tiles under the interpreter (its
        cost is per program and step), on a GPU by the rows each expert gets."""
        if interpreted:
            return 16, 128, 128, {}
        # Measured on an H200 (`python -m harness bench-backend --backend portable-triton`): 64x64x64
        # tiles with Triton's default warps and stages beat 128-wide tiles, 8 warps or more stages
        # at every gpt-oss shape; the in-kernel dequantization, not the MMA, bounds this kernel.
        return (16 if pairs_per_expert <= 16 else 64), 64, 64, {}

    def _interpreted(self) -> bool:
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

    def convert(self, inputs: CaseInputs) -> Prepared:
        """The declared conversion (interleaved rows, padding, float32 biases), contiguous."""
        if inputs.x.device.type == "cpu" and not self._interpreted():
            raise BackendUnavailable(
                f"{self.declaration.id}: Triton kernels are compiled for the GPU in this process; "
                "CPU tensors need TRITON_INTERPRET=1 set before Triton is imported"
            )
        return Prepared(self.convert_weights(inputs).logical(), inputs.weights.hidden_size)

    def run(self, prepared: Prepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """Route, group, GEMM1 + activation, GEMM2 + weight, combine (see the module docstring)."""
        k = self._kernels
        case = inputs.case
        w = prepared.weights
        dev = inputs.x.device
        e_local, two_i, _ = w.w13_blocks.shape
        hp, ip = 2 * w.w13_blocks.shape[2], two_i // 2
        routing = inputs.routing()
        weights = round_to(routing.weights, "fp32").to(torch.float32).reshape(-1).contiguous()
        ids = inputs.local_ids(routing.ids)
        t = case.tokens
        pairs_total = t * case.top_k
        interp = self._interpreted()
        block_m, block_n, block_k, launch = self.tiles(pairs_total / max(e_local, 1), interp)
        sorted_pairs, blk_expert, blk_start, blk_end = _blocks(ids, e_local, block_m)
        on_input = case.routing == "Llama4"
        x = inputs.padded_x(hp)
        if on_input:  # the router weight scales each (token, slot)'s input, rounded to bf16
            pair_tok = torch.arange(pairs_total, device=dev) // case.top_k
            a = (x[pair_tok].float() * weights[:, None]).to(torch.bfloat16).contiguous()
            a_rows = sorted_pairs
        else:
            a = x.to(torch.bfloat16).contiguous()
            a_rows = (sorted_pairs.to(torch.int64) // case.top_k).to(torch.int32)
        n_sorted = sorted_pairs.numel()
        inter = torch.empty(max(n_sorted, 1), ip, dtype=torch.bfloat16, device=dev)
        pair_out = torch.zeros(max(pairs_total, 1), hp, dtype=torch.float32, device=dev)
        nblk = blk_expert.numel()
        b13 = w.w13_bias if w.w13_bias is not None else torch.zeros(1, device=dev)
        b2 = w.w2_bias if w.w2_bias is not None else torch.zeros(1, device=dev)
        if nblk:
            limit = case.limit if case.limit else 0.0
            k.gemm1_activation_kernel[(nblk, -(-ip // block_n))](
                a, a_rows, w.w13_blocks, w.w13_scales, b13, inter, blk_expert, blk_start, blk_end,
                hp, ip, float(case.alpha), float(case.beta), float(limit),
                HAS_BIAS=w.w13_bias is not None, SWIGLUOAI=case.activation == "swigluoai",
                HAS_LIMIT=bool(case.limit), INTERLEAVED=w.w13_layout == "interleaved",
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INTERPRETED=interp, **launch,
            )  # fmt: skip
            k.gemm2_combine_kernel[(nblk, -(-hp // block_n))](
                inter, w.w2_blocks, w.w2_scales, b2, sorted_pairs, weights, pair_out,
                blk_expert, blk_start, blk_end, ip, hp,
                HAS_BIAS=w.w2_bias is not None, APPLY_WEIGHT=not on_input,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INTERPRETED=interp, **launch,
            )  # fmt: skip
        combined = pair_out[:pairs_total].view(t, case.top_k, hp).sum(dim=1)
        out.copy_(combined[:, : out.shape[1]])


class PortableTritonChunked(PortableTriton):
    """The same kernels reading w13 as chunked [gate; up] (the standard checkpoint layout)."""

    declaration = Declaration(
        id="portable-triton-chunked",
        archs=_TRITON_ARCHS,
        production=False,
        description="portable-triton with w13 rows chunked [gate; up]",
        w13_layout="chunked_gate_up",
        bias_dtype="fp32",
        arithmetic=PortableTriton.declaration.arithmetic,
    )
