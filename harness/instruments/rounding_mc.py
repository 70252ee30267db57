"""A Monte Carlo check of what the judge predicts for arithmetic that stores GEMM1's output in bf16.

Why. ``harness.judge.bounds`` models each rounding as an independent, mean-zero error, uniform on
its cell under round-to-nearest, and from that predicts two things the tests after it rest on: the
spread of the error (each element's variance is a third of its summed squared ranges, so an honest
element's error over its range, less the predicted mean, has an RMS of 1/sqrt(3)), and the mean the
activation's curvature adds to the error where GEMM1's output is rounded (``SlotTerms.mean``).
Neither is taken on faith here: a real kernel of that arithmetic (``HonestBf16Gemm1``) runs on
draws of one case's shape, and what it does is measured.

* **Spread.** Over every element of every draw, the RMS of ``(got - ref - mean) / sqrt(variance)``
  against 1/sqrt(3).
* **Mean.** At gpt-oss shapes the mean is about 1e-4 of an element's noise, too small to measure
  from the kernel's output in any feasible number of draws. So it is measured where it arises: the
  kernel's own GEMM1 output (float32 accumulation, rounded to bf16) goes through the activation in
  float64, less the exact activation and less its first-order change (``G'(g) S dg + G(g) du`` at the
  exact point); what is left is the second-order term itself, with no first-order noise around it.
  Carried through GEMM2 and the routing weights exactly (both linear), it gives each output element's
  measured mean; the ratio ``<measured, predicted> / <predicted, predicted>`` should be 1. Its spread
  over the draws gives its standard error.

Draws are the case's replicas 1, 2, ... (inputs from the case id and replica, the layer's weights
shared), so a run is reproducible and its draws are independent of the case's own (replica 0)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import torch

from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs
from mxmoe.harness.instruments.honest import HonestBf16Gemm1
from mxmoe.harness.judge.bounds import Bounded, reference_and_bound
from mxmoe.reference.activation import gated_activation, split_gate_up
from mxmoe.reference.moe import round_to
from mxmoe.reference.mxfp4 import dequantize_mxfp4

SPREAD = 1 / math.sqrt(3)
"""The RMS of an honest element's error over its range under uniform rounding."""


@dataclass(frozen=True)
class MonteCarlo:
    """What the draws of one case measured against what the judge predicted."""

    case: str
    draws: int
    elements: int
    spread: float
    """The RMS of ``(got - ref - mean) / sqrt(variance)`` over every element of every draw."""
    shift: float
    """``<measured mean, predicted mean> / <predicted, predicted>`` over every draw (1: as predicted)."""
    shift_se: float
    """The standard error of ``shift``, from its spread over the draws (inf with one draw)."""

    def agrees(self, within: float = 0.1) -> bool:
        """Whether both predictions hold within ``within`` (relative), and the measured mean is
        known well enough to say so (three standard errors inside the margin)."""
        return (abs(self.spread / SPREAD - 1) <= within and abs(self.shift - 1) <= within
                and 3 * self.shift_se <= within)  # fmt: skip

    def line(self) -> str:
        """One line for a log or a report."""
        return (f"{self.case}, {self.draws} draws, {self.elements:,} elements: spread of z {self.spread:.4f} against "
                f"{SPREAD:.4f} predicted ({self.spread / SPREAD - 1:+.1%}); mean shift {self.shift:.4f} +- "
                f"{self.shift_se:.4f} of the predicted ({self.shift - 1:+.1%})")  # fmt: skip


def _second_order(inputs: CaseInputs, bounded: Bounded) -> torch.Tensor:
    """The kernel's second-order activation term, carried to the output: [T, H] float64 (see the
    module docstring). The kernel's GEMM1 is ``HonestBf16Gemm1``'s: bf16 x, exact MXFP4 weights,
    float32 accumulation and bias, the result rounded to bf16."""
    case, w = inputs.case, inputs.weights
    terms = bounded.terms
    alpha, beta, limit = (case.alpha, case.beta, case.limit) if case.activation == "swigluoai" else (1.0, 0.0, None)
    x64 = inputs.x.double()
    out = torch.zeros(case.tokens, w.hidden_size, dtype=torch.float64, device=x64.device)
    groups = terms.groups
    for e, tok, slot in zip(groups.experts, groups.tokens, groups.slots, strict=True):
        w1 = dequantize_mxfp4(w.w13_blocks[e], w.w13_scales[e])
        w2 = dequantize_mxfp4(w.w2_blocks[e], w.w2_scales[e])
        b1 = w.w13_bias[e].double() if w.w13_bias is not None else torch.zeros(w1.shape[0], dtype=torch.float64)
        exact = x64[tok] @ w1.T + b1.to(x64.device)
        kernel = x64[tok].float() @ w1.float().T + b1.float().to(x64.device)
        kernel = round_to(kernel.double(), "bf16")
        g, up = split_gate_up(exact, w.w13_layout)
        gk, uk = split_gate_up(kernel, w.w13_layout)
        free_g = free_u = torch.ones_like(g)
        if limit is not None:
            free_g, free_u = (g <= limit).double(), (up.abs() <= limit).double()
            g, up = g.clamp(max=limit), up.clamp(min=-limit, max=limit)
            gk, uk = gk.clamp(max=limit), uk.clamp(min=-limit, max=limit)
        s = torch.sigmoid(alpha * g)
        gated, d_gated = g * s, s * (1 + alpha * g * (1 - s))  # G(g), G'(g) at the exact (clamped) point
        first = d_gated * (up + beta) * (gk - g) * free_g + gated * (uk - up) * free_u
        change = (gated_activation(kernel, case.activation, w.w13_layout, alpha, beta, limit)
                  - gated_activation(exact, case.activation, w.w13_layout, alpha, beta, limit))  # fmt: skip
        second = change - first
        weight = terms.weight[tok, slot].unsqueeze(1)
        out.index_add_(0, tok, weight * (second @ w2.T))
    return out


def gemm1_rounding_monte_carlo(case: Case, draws: int, device: str | torch.device = "cpu") -> MonteCarlo:
    """Run ``HonestBf16Gemm1`` on ``draws`` replicas of ``case`` and measure the judge's predictions
    (the module docstring says how)."""
    if draws < 1:
        raise ValueError(f"draws must be a positive int; got {draws!r}")
    backend = HonestBf16Gemm1()
    arithmetic = backend.declaration.arithmetic
    z2 = 0.0
    elements = 0
    num = den = 0.0
    ratios = []
    for r in range(1, draws + 1):
        inputs = make_inputs(dataclasses.replace(case, replica=case.replica + r), device)
        bounded = reference_and_bound(inputs, arithmetic)
        terms = bounded.terms
        got = torch.empty(case.tokens, case.hidden, dtype=arithmetic.precision.output, device=inputs.x.device)
        backend.run(backend.convert(inputs), inputs, got)
        z = (got.double() - bounded.ref - terms.mean) / terms.variance.sqrt()
        z2 += float((z**2).sum())
        elements += z.numel()
        measured = _second_order(inputs, bounded)
        n, d = float((measured * terms.mean).sum()), float((terms.mean**2).sum())
        num, den = num + n, den + d
        ratios.append(n / d if d > 0 else math.nan)
    se = statistics.stdev(ratios) / math.sqrt(draws) if draws > 1 else math.inf
    return MonteCarlo(case.id, draws, elements, math.sqrt(z2 / elements), num / den if den > 0 else math.nan, se)
