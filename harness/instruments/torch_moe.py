"""TorchMoE: a MoE layer written with torch ops at a chosen low precision, whose arithmetic (GEMM
dtype, accumulation order, rounding points) is set by class attributes and declared as data.

It is the base of the emulation backend (``kernels/emulation.py``), of the honest variants
(``instruments.honest``), of every planted fault (``instruments.faults``) and of the faulty
backends the suites write: a real low-precision implementation, so that the harness can be
checked against kernels that differ from the oracle only the way real ones legitimately do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxmoe.harness.contract.backend import Backend
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.reference.activation import gated_activation
from mxmoe.reference.moe import MoEWeights, Precision, round_to
from mxmoe.reference.mxfp4 import dequantize_mxfp4, fake_quantize

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-terms": torch.float32}
"""The dtype each GEMM operand or combine mode accumulates in (``bf16-terms``: float32, its terms
rounded to bf16 first)."""


@dataclass(frozen=True)
class Prepared:
    """Weights dequantized to the GEMM dtype (exact: every MXFP4 value is a bf16 value), w13 rows
    in the declared layout."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None


class TorchMoE(Backend):
    """A MoE layer in torch at low precision. ``gemm`` is the dtype the GEMMs read (fp32: float32
    GEMMs; bf16: bf16 operands with fp32 accumulation, rounded where the declaration says);
    ``split_k`` > 1 sums K in that many float32 partial products, last chunk first."""

    gemm: str = "fp32"
    split_k: int = 1
    combine: torch.dtype | None = None
    """The dtype the top-k combine accumulates in; None: the declared one (``Precision.combine``).
    A faulty kernel sets bfloat16 under an fp32 declaration, leaving a rounding point undeclared."""

    def convert(self, inputs: CaseInputs) -> Prepared:
        """The declared conversion (row layout, padding), then an exact dequantization."""
        w = self.prepare_weights(self.convert_weights(inputs).logical(), inputs)
        dt = _DTYPES[self.gemm]
        # One expert at a time, into one preallocated tensor: the float64 dequantization of all
        # gpt-oss experts at once is 6 GB, and a stack of per-expert copies doubles the peak.
        w13 = self._dequantized(w.w13_blocks, w.w13_scales, dt)
        w2 = self._dequantized(w.w2_blocks, w.w2_scales, dt)
        b13 = None if w.w13_bias is None else w.w13_bias.float()
        return Prepared(w13, w2, b13, None if w.w2_bias is None else w.w2_bias.float())

    @staticmethod
    def _dequantized(blocks: torch.Tensor, scales: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """[E, N, K] MXFP4 blocks and scales dequantized to ``dt``, one expert at a time."""
        e, n, half = blocks.shape
        out = torch.empty(e, n, 2 * half, dtype=dt, device=blocks.device)
        for i in range(e):
            out[i] = dequantize_mxfp4(blocks[i], scales[i]).to(dt)
        return out

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        """The converted MXFP4 weights as this implementation reads them (a hook: the identity)."""
        return w

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k] float32, rounded as declared; local expert ids [T, k], -1 for
        experts of other EP ranks)."""
        routing = inputs.routing()
        weights = round_to(routing.weights, self.declaration.arithmetic.precision.routing_weights).float()
        return weights, inputs.local_ids(routing.ids)

    def weight_on_input(self, inputs: CaseInputs) -> bool:
        """Whether the routing weight scales GEMM1's input (Llama4) rather than the expert output."""
        return inputs.case.routing == "Llama4"

    def activate(self, h: torch.Tensor, inputs: CaseInputs) -> torch.Tensor:
        """The gated activation of GEMM1's output (rows in the declared layout)."""
        c = inputs.case
        return gated_activation(h, c.activation, self.declaration.w13_layout, c.alpha, c.beta, c.limit)

    def _gemm(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a @ w.T on operands in the declared GEMM dtype, accumulated and returned in float32.

        Why float32 out: a bf16 GEMM kernel (a tensor core's, Triton's) accumulates in float32 and
        rounds once, after its epilogue's bias, where the declaration says. torch's bf16 matmul
        returns bf16, and adding the bias to that rounds twice: an undeclared rounding that the
        energy test sees. Products of bf16 values are exact in float32, so this is the same GEMM."""
        a = a.to(w.dtype)
        if w.dtype == torch.bfloat16:
            a, w = a.float(), w.float()
        if self.split_k <= 1:
            return (a @ w.T).float()
        parts = [(ac @ wc.T).float() for ac, wc in zip(a.chunk(self.split_k, dim=-1), w.chunk(self.split_k, dim=-1))]
        total = parts[-1]
        for part in reversed(parts[:-1]):
            total = total + part
        return total

    def _round(self, t: torch.Tensor, point: str, p: Precision) -> torch.Tensor:
        """Round a float32 tensor at a precision point, staying float32."""
        if point in ("fp64", "fp32"):
            return t
        if point == "bf16":
            return t.to(torch.bfloat16).float()
        return fake_quantize(t, "mxfp8", p.mx_rule).float()

    def run(self, prepared: Prepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """Route, then per expert: GEMM1 + bias, activation, GEMM2 + bias; combine (float32 unless
        declared or made otherwise)."""
        case = inputs.case
        p = self.declaration.arithmetic.precision
        weights, ids = self.route_tokens(inputs)
        on_input = self.weight_on_input(inputs)
        x = inputs.x.float()
        x = torch.nn.functional.pad(x, (0, prepared.w13.shape[-1] - x.shape[-1]))  # padded hidden: zeros
        combine = self.combine or _DTYPES[p.combine]
        terms_bf16 = self.combine is None and p.combine == "bf16-terms"  # each weighted row stored in bf16
        acc = torch.zeros(case.tokens, prepared.w2.shape[1], dtype=combine, device=x.device)
        for e in range(prepared.w13.shape[0]):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            we = weights[tok, slot].unsqueeze(1)
            xe = x[tok] * we if on_input else x[tok]
            xe = self._round(xe, p.activation_input, p)
            late = p.bias_after_rounding  # the GEMM's product rounded, the bias added after
            h = self._gemm(xe, prepared.w13[e])
            if prepared.b13 is not None and not late:
                h = h + prepared.b13[e]
            h = self._round(h, p.gemm1_output, p)
            if prepared.b13 is not None and late:
                h = h + prepared.b13[e]
                if p.bias_add_rounds:
                    h = self._round(h, p.gemm1_output, p)
            a = self._round(self.activate(h, inputs), p.intermediate, p)
            y = self._gemm(a, prepared.w2[e])
            if prepared.b2 is not None and not late:
                y = y + prepared.b2[e]
            y = self._round(y, p.expert_output, p)
            if prepared.b2 is not None and late:
                y = y + prepared.b2[e]
                if p.bias_add_rounds:
                    y = self._round(y, p.expert_output, p)
            row = y if on_input else y * we
            if terms_bf16:
                row = row.to(torch.bfloat16)
            acc.index_add_(0, tok, row.to(acc.dtype))
        out.copy_(acc[:, : out.shape[1]])
