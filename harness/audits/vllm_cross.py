"""The same case through vLLM's own layer and through the project's direct adapter of the same
backend: bit-identical, or the difference explained.

Each vLLM backend the project adapts directly (``kernels/oai_triton.py`` for TRITON, ...) is also
driven through vLLM's layer (``kernels/vllm_layer.py``: vLLM's selection, round-up, weight loading
and conversion, its kernel call). Both call the same vendor kernel on the same inputs, so their
outputs should agree bit for bit. Where they do not, one of two things differs: vLLM's conversion
or call, or the adapter's. The oracle says which: each side is judged on its own (the bound, the
systematic test, the determinism check), and

- one side failing where the other passes is that side's error ("vllm" or "adapter");
- both within the bound but different is a difference of rounding only (a different tile
  configuration, accumulation order or rounding point); the row names the side farther from the
  oracle (its worst error/bound) and is not a failure;
- both failing is "both".

A peer's test compares a kernel with its own reference; none compares the serving engine's
assembly of the kernel with an independent assembly of the same kernel. Where they are
identical, a PASS of the direct adapter is also a PASS of what vLLM ships, and a FAIL of one
that the other does not share is located at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mxmoe.harness.contract.backend import Backend
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs
from mxmoe.harness.contract.platforms import device_for, host_arch
from mxmoe.harness.judge.engine import Result, bitwise_differences, run_case

PREFIX = "vllm-"
"""The vLLM driver of backend ``X`` is ``vllm-X`` (``kernels.vllm_layer``)."""


@dataclass
class CrossRow:
    """One case through both paths."""

    case: str
    vllm: str
    adapter: str
    vllm_outcome: str
    adapter_outcome: str
    vllm_worst: float | None
    adapter_worst: float | None
    differing: int | None
    """Elements that differ bit for bit (None where one side did not run)."""
    verdict: str
    """identical / rounding / vllm / adapter / both / not compared."""
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def pairs(backends: list[Backend]) -> list[tuple[Backend, Backend]]:
    """(vLLM driver, direct adapter) for every driver whose adapter is among ``backends``."""
    by_id = {b.declaration.id: b for b in backends}
    return [
        (b, by_id[b.declaration.id[len(PREFIX) :]])
        for b in backends
        if b.declaration.id.startswith(PREFIX) and b.declaration.id[len(PREFIX) :] in by_id
    ]


def _side(backend: Backend, case: Case, arch: str, inputs: CaseInputs) -> tuple[Result, torch.Tensor | None]:
    """``run_case`` on ``inputs``, keeping the output of the first of its two runs (None where the
    backend did not run or raised)."""
    seen: dict[str, torch.Tensor] = {}
    run = backend.run

    def recording(prepared: object, inp: CaseInputs, out: torch.Tensor) -> None:
        run(prepared, inp, out)
        seen.setdefault("out", out)

    backend.run = recording  # the engine calls backend.run: keep the output it judged
    try:
        result, _ = run_case(backend, case, arch, inputs=inputs)
    finally:
        del backend.run
    return result, seen.get("out") if result.outcome in ("PASS", "FAIL") else None


def _worst(r: Result) -> float | None:
    """The worst error/bound of a side that ran (None for one that did not)."""
    return r.metrics.worst_ratio if r.metrics.elements else None


def cross(vllm: Backend, adapter: Backend, case: Case, arch: str | None = None) -> CrossRow:
    """``case`` through both (see the module docstring)."""
    arch = arch or host_arch()
    inputs = make_inputs(case, device_for(arch))
    rv, out_v = _side(vllm, case, arch, inputs)
    ra, out_a = _side(adapter, case, arch, inputs)
    row = CrossRow(case.id, vllm.declaration.id, adapter.declaration.id, rv.outcome, ra.outcome, _worst(rv),
                   _worst(ra), None, "not compared", "")  # fmt: skip
    if out_v is None or out_a is None:
        why = [f"{r.backend} {r.outcome}: {r.reason}" for r, o in ((rv, out_v), (ra, out_a)) if o is None]
        row.detail = "; ".join(why)
        return row
    row.differing = bitwise_differences(out_v, out_a)
    bad_v, bad_a = rv.outcome != "PASS", ra.outcome != "PASS"
    if row.differing == 0 and not (bad_v or bad_a):
        row.verdict, row.detail = "identical", "bit for bit"
        return row
    if row.differing == 0 and bad_v and bad_a:
        row.verdict = "both"
        row.detail = f"identical outputs, both {rv.outcome}: {rv.reason}"
    elif bad_v and not bad_a:
        row.verdict = "vllm"
        row.detail = f"vLLM's conversion or call: {rv.reason} (the adapter passes, worst {row.adapter_worst:.3g}x)"
    elif bad_a and not bad_v:
        row.verdict = "adapter"
        row.detail = f"the adapter's conversion or call: {ra.reason} (vLLM's layer passes, worst {row.vllm_worst:.3g}x)"
    elif bad_a and bad_v:
        row.verdict = "both"
        row.detail = f"vLLM's layer: {rv.reason}; the adapter: {ra.reason}"
    else:
        key_v = (row.vllm_worst or 0.0, rv.metrics.rms_rel_err)
        key_a = (row.adapter_worst or 0.0, ra.metrics.rms_rel_err)
        farther = ("vLLM's layer is farther from the oracle" if key_v > key_a else
                   "the adapter is farther from the oracle" if key_a > key_v else
                   "neither is farther from the oracle")  # fmt: skip
        farther += f" (by worst ratio, then RMS relative error: {key_v[1]:.4g} vs {key_a[1]:.4g})"
        row.verdict = "rounding"
        row.detail = (f"both within the bound (worst {row.vllm_worst:.3g}x through vLLM, {row.adapter_worst:.3g}x "
                      f"direct): {row.differing} elements differ in rounding; {farther}")  # fmt: skip
    return row


BLAMING = ("vllm", "adapter", "both")
"""Verdicts that locate an error (the command exits 1 on any)."""
