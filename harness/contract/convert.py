"""Conversion of canonical MXFP4 MoE weights into a backend's layout, and back.

Every backend's conversion is the same three steps, so that one tested implementation serves all:

1. **Row layout**: w13 rows (with their scales and bias) reordered from the checkpoint's layout
   (GPT-OSS interleaved, or standard chunked [gate; up]) to the backend's declared layout.
2. **Padding**: the hidden size and the TP partition's intermediate size rounded up to the
   backend's alignment (``harness.contract.padding``; zero-filled, so the padded layer equals the
   canonical one), biases cast to the backend's bias dtype.
3. **Storage**: the backend's own byte arrangement (transposes, tile permutes, scale swizzles),
   as a list of named invertible ``Storage`` steps declared by the backend module.

After steps 1-2 the weights are still plain ``MoEWeights`` (the *logical* form): the oracle runs
on them under the backend's declared layout and must give the canonical layer's output, which is
how a converter whose layout does not match its declaration is caught. Step 3 only rearranges
bytes and adds zeros. ``Converted.canonical()`` undoes all three, bit for bit. Nothing here
modifies its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.padding import pad_weights, round_up, unpad_weights
from mxmoe.reference.activation import check_layout, convert_layout
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK

ROLES = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias")
"""The tensors a conversion carries, by name (the fields of ``MoEWeights``)."""
BIAS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Storage:
    """One invertible storage step. ``forward(t, role)`` rearranges tensor ``role``;
    ``inverse(t, role, shape)`` gives back the tensor of ``shape`` it came from. Both must be
    pure: bits are moved (whole bytes, nibbles or single bits), zero padding may be added,
    nothing else."""

    name: str
    roles: tuple[str, ...]
    forward: Callable[[torch.Tensor, str], torch.Tensor]
    inverse: Callable[[torch.Tensor, str, torch.Size], torch.Tensor]
    description: str = ""

    def __post_init__(self) -> None:
        bad = [r for r in self.roles if r not in ROLES]
        if bad or not self.roles:
            raise ValueError(f"Storage.roles must be a non-empty subset of {', '.join(ROLES)}; got {self.roles}")


@dataclass(frozen=True)
class Target:
    """What a conversion produces: the declared row layout, the padded sizes, the bias dtype and
    the storage steps."""

    layout: str
    hidden: int
    intermediate: int
    bias_dtype: str = "bf16"
    storage: tuple[Storage, ...] = ()

    def __post_init__(self) -> None:
        check_layout(self.layout, "Target.layout")
        if self.bias_dtype not in BIAS_DTYPES:
            raise ValueError(f"Target.bias_dtype must be one of {', '.join(BIAS_DTYPES)}; got {self.bias_dtype!r}")
        for name in ("hidden", "intermediate"):
            v = getattr(self, name)
            if v < BLOCK or v % BLOCK:
                raise ValueError(f"Target.{name} must be a positive multiple of {BLOCK}, got {v}")


def partition_sizes(case: Case) -> tuple[int, int]:
    """(hidden, intermediate per TP partition) as a serving engine sizes the layer before
    padding: I / tp rounded up (vLLM divides the intermediate size by tp), but never less than
    the gpt-oss-style shard this rank actually loads (ceil((I/32)/tp) * 32)."""
    start, stop = case.intermediate_shard
    return case.hidden, max(math.ceil(case.intermediate / case.tp), stop - start)


def padded_sizes(case: Case, hidden_align: int, intermediate_align: int) -> tuple[int, int]:
    """(hidden, intermediate) of ``case``'s converted weights under the given alignments."""
    h, i = partition_sizes(case)
    return round_up(h, hidden_align), round_up(i, intermediate_align)


def _tensors(w: MoEWeights) -> dict[str, torch.Tensor]:
    return {r: getattr(w, r) for r in ROLES if getattr(w, r) is not None}


@dataclass(frozen=True)
class Converted:
    """Weights in a backend's layout. ``tensors`` are in storage form (what a kernel reads)."""

    tensors: dict[str, torch.Tensor]
    target: Target
    source_layout: str
    source_hidden: int
    source_intermediate: int
    source_bias_dtype: torch.dtype | None
    shapes: tuple[dict[str, torch.Size], ...] = field(repr=False, default=())
    """Shapes of every tensor before each storage step (for the inverses)."""

    def logical(self) -> MoEWeights:
        """The weights before the storage steps: padded, in the declared row layout."""
        t = dict(self.tensors)
        for step, shapes in zip(reversed(self.target.storage), reversed(self.shapes)):
            for role in step.roles:
                if role in t:
                    t[role] = step.inverse(t[role], role, shapes[role])
                    if t[role].shape != shapes[role]:
                        raise AssertionError(
                            f"storage step {step.name!r} inverted {role} to {tuple(t[role].shape)}, "
                            f"expected {tuple(shapes[role])}"
                        )
        return MoEWeights(**{r: t.get(r) for r in ROLES}, w13_layout=self.target.layout)

    def canonical(self) -> MoEWeights:
        """The canonical weights this was converted from, bit for bit."""
        w = unpad_weights(self.logical(), self.source_hidden, self.source_intermediate)
        if self.source_bias_dtype is not None:
            w = replace(
                w,
                w13_bias=None if w.w13_bias is None else w.w13_bias.to(self.source_bias_dtype),
                w2_bias=None if w.w2_bias is None else w.w2_bias.to(self.source_bias_dtype),
            )
        return to_layout(w, self.source_layout)

    def nbytes(self, roles: tuple[str, ...] = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales")) -> int:
        """Bytes of the stored tensors of ``roles`` (by default the MXFP4 blocks and scales)."""
        return sum(t.numel() * t.element_size() for r, t in self.tensors.items() if r in roles)


def to_layout(w: MoEWeights, layout: str) -> MoEWeights:
    """``w`` with w13 rows (blocks, scales, bias) in ``layout``."""
    src = w.w13_layout
    if src == layout:
        return w

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else convert_layout(t, src, layout, dim=1).contiguous()

    return replace(
        w, w13_blocks=rows(w.w13_blocks), w13_scales=rows(w.w13_scales), w13_bias=rows(w.w13_bias), w13_layout=layout
    )


def convert_weights(w: MoEWeights, target: Target) -> Converted:
    """Convert canonical ``w`` to ``target`` (row layout, padding, bias dtype, storage steps)."""
    bias = w.w13_bias if w.w13_bias is not None else w.w2_bias
    padded = pad_weights(to_layout(w, target.layout), target.hidden, target.intermediate)
    dt = BIAS_DTYPES[target.bias_dtype]
    padded = replace(
        padded,
        w13_bias=None if padded.w13_bias is None else padded.w13_bias.to(dt),
        w2_bias=None if padded.w2_bias is None else padded.w2_bias.to(dt),
    )
    t = _tensors(padded)
    shapes = []
    for step in target.storage:
        shapes.append({r: v.shape for r, v in t.items()})
        for role in step.roles:
            if role in t:
                t[role] = step.forward(t[role], role)
    return Converted(
        tensors=t,
        target=target,
        source_layout=w.w13_layout,
        source_hidden=w.hidden_size,
        source_intermediate=w.intermediate_size,
        source_bias_dtype=None if bias is None else bias.dtype,
        shapes=tuple(shapes),
    )
