"""Honest variants: real low-precision implementations that differ from the oracle only the way
production kernels legitimately do (accumulation order, split-K, where they round to bf16). The
engine must never fail them; their worst error/bound ratio says how tight the bound is."""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Backend, Declaration
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.harness.instruments.torch_moe import TorchMoE
from mxmoe.reference.moe import Precision

_FUSED = Precision(intermediate="bf16", output=torch.bfloat16)
"""A fused kernel: float32 accumulators, the intermediate stored in bf16, a bf16 output."""


def _declare(
    id_: str, description: str, precision: Precision, layout: str = "interleaved", quant: str = "w4a16"
) -> Declaration:
    return Declaration(
        id=id_,
        quant=quant,
        archs=ARCHS,
        description=description,
        w13_layout=layout,
        arithmetic=Arithmetic(precision=precision),
        kind="instrument",
    )


class HonestFp32(TorchMoE):
    """float32 GEMMs (BLAS order), bf16 intermediate and output: the typical fused kernel."""

    declaration = _declare("honest-fp32", "fp32 GEMMs, bf16 intermediate and output", _FUSED)


class HonestSplitK(TorchMoE):
    """As HonestFp32, K summed in 4 float32 partial GEMMs (split-K), rows chunked [up; gate]."""

    split_k = 4
    declaration = _declare(
        "honest-splitk", "4-way split-K fp32, bf16 intermediate and output", _FUSED, "chunked_up_gate"
    )


class HonestBf16Gemm(TorchMoE):
    """bf16 GEMMs with fp32 accumulation, each result rounded once to bf16 (an unfused kernel),
    pair-swapped rows."""

    gemm = "bf16"
    declaration = _declare(
        "honest-unfused",
        "bf16 GEMMs, bf16 GEMM1 output, intermediate, expert output and output",
        Precision(gemm1_output="bf16", intermediate="bf16", expert_output="bf16", output=torch.bfloat16),
        "pair_swapped",
    )


class HonestBf16Gemm1(TorchMoE):
    """float32 GEMMs whose GEMM1 output (plus bias) is stored in bf16, float32 everywhere else and
    a float32 output: the one rounding whose error the activation's curvature turns into a mean
    (``harness.judge.bounds._second_order_mean``), alone, for ``rounding_mc``'s Monte Carlo check.
    Not among ``HONEST``: the catalogue's unfused variant already covers this arithmetic."""

    declaration = _declare(
        "honest-bf16-gemm1",
        "fp32 GEMMs, GEMM1 output in bf16, fp32 elsewhere",
        Precision(gemm1_output="bf16", output=torch.float32),
    )


class HonestBiasAfter(TorchMoE):
    """fp32 GEMMs whose products are stored in bf16 before the bias is added in float32 (GEMM1's
    in the activation, GEMM2's in the combine), float32 routing weights, rows chunked [up; gate]:
    the arithmetic FlashInfer's CUTLASS MoE declares (``Precision.bias_after_rounding``), so that
    an honest kernel of that rounding order is shown clean (a suite checks the two declarations
    stay equal; the instruments sit below the kernels and do not import them)."""

    declaration = _declare(
        "honest-bias-after",
        "fp32 GEMMs, bf16 products with the biases added after, bf16 intermediate and output",
        Precision(gemm1_output="bf16", intermediate="bf16", expert_output="bf16", routing_weights="fp32",
                  output=torch.bfloat16, bias_after_rounding=True),  # fmt: skip
        "chunked_up_gate",
    )


class HonestBf16Epilogue(TorchMoE):
    """bf16 GEMMs with fp32 accumulation whose every output is rounded to bf16, the bf16 bias added
    to it in bf16 (a second rounding), each expert's row multiplied by its bf16 routing weight in
    bf16 (a third) and the top-k rows summed in float32, rounded once: the arithmetic MARLIN
    declares (vLLM's Marlin MoE epilogue, then ``moe_sum``), so that an honest kernel of that rounding
    order is shown clean (a suite checks the two declarations stay equal)."""

    gemm = "bf16"
    declaration = _declare(
        "honest-bf16-epilogue",
        "bf16 GEMMs, bf16 products, bias adds and weighted rows, an fp32 top-k sum, bf16 output",
        Precision(gemm1_output="bf16", intermediate="bf16", expert_output="bf16", routing_weights="bf16",
                  combine="bf16-terms", output=torch.bfloat16, bias_after_rounding=True,
                  bias_add_rounds=True),  # fmt: skip
    )


class HonestBf16Weights(TorchMoE):
    """As HonestFp32 with the routing weights rounded to bf16, and declared so."""

    declaration = _declare(
        "honest-bf16weights",
        "fp32 GEMMs, bf16 routing weights, intermediate and output",
        Precision(intermediate="bf16", routing_weights="bf16", output=torch.bfloat16),
        "chunked_gate_up",
    )


class HonestBf16Combine(TorchMoE):
    """As HonestFp32 with the top-k sum in bfloat16 (each slot's weighted output rounded, then each
    partial sum), and declared so (``Precision.combine``): a combine kernel that adds bf16 rows in bf16."""

    declaration = _declare(
        "honest-bf16-combine",
        "fp32 GEMMs, bf16 intermediate, top-k combine and output",
        Precision(intermediate="bf16", combine="bf16", output=torch.bfloat16),
    )


class HonestMxfp8(TorchMoE):
    """MXFP8 activations and intermediate (the *_MXFP8 backends' arithmetic), fp32 GEMMs."""

    declaration = _declare(
        "honest-mxfp8",
        "MXFP8 (FLOOR) activation input and intermediate, fp32 GEMMs, bf16 output",
        Precision(activation_input="mxfp8", intermediate="mxfp8", output=torch.bfloat16),
        quant="w4a8-mxfp8",
    )


HONEST = (HonestFp32, HonestSplitK, HonestBf16Gemm, HonestBiasAfter, HonestBf16Epilogue, HonestBf16Weights,
          HonestBf16Combine, HonestMxfp8)  # fmt: skip


class Oracle(Backend):
    """The oracle as a backend: the exact float64 layer (``CaseInputs.reference``) with its output
    rounded once to bf16. The model-level checks run a model with this MoE as their baseline
    (``harness.e2e``); judged itself, its one rounding is the whole of its bound, so its worst
    error/bound reaches 1 and never exceeds it."""

    declaration = Declaration(
        id="oracle",
        archs=ARCHS,
        description="the float64 oracle, output rounded once to bf16",
        arithmetic=Arithmetic(precision=Precision(output=torch.bfloat16), accumulate="fp64"),
        kind="instrument",
    )

    def convert(self, inputs: CaseInputs) -> None:
        """Nothing: the oracle reads the canonical weights."""
        return None

    def run(self, prepared: None, inputs: CaseInputs, out: torch.Tensor) -> None:
        """The exact layer, rounded to ``out``'s dtype."""
        out.copy_(inputs.reference(Precision(output=out.dtype)))
