"""The padding audit: what each backend's layout costs in weight memory at gpt-oss shapes.

For gpt-oss-20b and -120b at TP 1, 2, 4 and 8 and for every backend, the bytes of the converted
MXFP4 blocks and scales of all ranks against the ideal (the unsharded, unpadded layer), and the
waste in percent. The bytes come from a real conversion (``Backend.convert_weights``) of one
expert of rank 0's shard at the full shape, times the number of experts: every rank allocates the
same padded partition, and experts are converted independently. The ROCm TP8 case is the one
vLLM PR #50622's review found: a 360-wide partition padded to 512.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mxmoe.harness.contract.backend import Backend
from mxmoe.harness.contract.cases import MODELS, Case, make_case
from mxmoe.harness.contract.convert import partition_sizes
from mxmoe.harness.contract.inputs import CaseInputs, generator_for, random_mxfp4_weights
from mxmoe.reference.mxfp4 import BLOCK

AUDIT_MODELS = ("gptoss20b", "gptoss120b")
AUDIT_TPS = (1, 2, 4, 8)


def ideal_bytes(hidden: int, intermediate: int, experts: int) -> int:
    """MXFP4 blocks and scales of a layer with no padding: w13 [2I, H] and w2 [H, I], half a byte
    per element and one scale byte per 32."""
    elements = 3 * hidden * intermediate * experts
    return elements // 2 + elements // BLOCK


@dataclass(frozen=True)
class AuditRow:
    """One (model, TP, backend) line of the audit."""

    model: str
    tp: int
    backend: str
    hidden: int
    padded_hidden: int
    partition: int
    """vLLM's intermediate size per partition, I / TP (before any round-up)."""
    shard: int
    """The width of rank 0's loaded gpt-oss shard (ceil((I/32)/TP) * 32)."""
    padded_intermediate: int
    converted_bytes: int
    ideal_bytes: int

    @property
    def waste(self) -> float:
        """Converted bytes over ideal bytes, minus one (0.42 = 42% more memory than needed)."""
        return self.converted_bytes / self.ideal_bytes - 1

    def to_dict(self) -> dict[str, object]:
        """Plain data for the report."""
        d = dict(self.__dict__)
        d["waste"] = self.waste
        return d


def _one_expert(case: Case) -> CaseInputs:
    """Rank 0's shard of one expert of ``case``'s layer (random MXFP4 codes; only shapes matter)."""
    start, stop = case.intermediate_shard
    gen = generator_for(f"padding-audit-{case.model}-{case.tp}", "cpu")
    w = random_mxfp4_weights(gen, 1, case.hidden, stop - start, bias=case.bias, w13_layout=case.layout)
    x = torch.zeros(0, case.hidden, dtype=torch.bfloat16)
    return CaseInputs(case, x, torch.zeros(0, case.experts), w, None, None)


def audit(
    backends: list[Backend], models: tuple[str, ...] = AUDIT_MODELS, tps: tuple[int, ...] = AUDIT_TPS
) -> list[AuditRow]:
    """The audit rows, model by model, TP by TP, backend by backend."""
    rows = []
    for name in models:
        m = MODELS[name]
        for tp in tps:
            case = make_case(name, 1, tp=tp, tp_rank=0)
            one = _one_expert(case)
            for b in backends:
                conv = b.convert_weights(one)
                target = conv.target
                rows.append(
                    AuditRow(
                        model=name,
                        tp=tp,
                        backend=b.declaration.id,
                        hidden=m.hidden,
                        padded_hidden=target.hidden,
                        partition=math.ceil(m.intermediate / tp),
                        shard=partition_sizes(case)[1],
                        padded_intermediate=target.intermediate,
                        converted_bytes=conv.nbytes() * m.experts * tp,
                        ideal_bytes=ideal_bytes(m.hidden, m.intermediate, m.experts),
                    )
                )
    return rows
