"""The catalogue of faulty kernels the harness must catch.

Each fault is HonestFp32 (fp32 GEMMs, bf16 intermediate and output; ``instruments.honest``) with
one real bug class put in, declared exactly as the honest kernel is: the harness is told nothing
about the fault. Where a fault hits one expert or one block, it hits the one where its effect is
material (the expert with the most routing weight, its w2 block of largest magnitude), because a
change below the honest rounding error is not a bug the harness can or should flag. Each names
the shipped bug or the peers' blind spot it stands for (``docs/faults.md`` lists them); the run
that shows the catalogue caught is ``audits.catalogue``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs, generator_for
from mxmoe.harness.instruments.honest import HonestBf16Gemm, HonestFp32
from mxmoe.reference.activation import convert_layout, split_gate_up
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK, dequantize_mxfp4, fake_quantize
from mxmoe.reference.routing import route

SHIPPED = "docs/shipped-bugs.md"
"""Where the bugs that shipped, which the faults stand for, are written up."""
PEERS = "docs/peers.md"
"""Where the peers' acceptance rules, and what they let through, are written up."""


class Mutant(HonestFp32):
    """HonestFp32 with one fault. ``slug`` names it (id ``mutant-<slug>``), ``fault`` says what it
    does in one line, ``reference`` where it shipped (or None)."""

    slug: ClassVar[str]
    fault: ClassVar[str]
    reference: ClassVar[str | None] = None
    full: ClassVar[bool] = False
    """Run every case (not only until the first catch)."""
    control: ClassVar[bool] = False
    """A change that is not a bug: it must never fire."""

    def reaches(self, case: Case) -> bool:
        """Whether the fault can change ``case``'s output at all. Every fault but a bucket's does;
        a case list none of whose cases a fault reaches shows nothing about catching it (the
        catalogue says 'not reached', not caught or missed)."""
        return True

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        if "slug" in cls.__dict__:
            cls.declaration = dataclasses.replace(
                cls.declaration if "declaration" in cls.__dict__ else HonestFp32.declaration,
                id=f"mutant-{cls.slug}",
                description=cls.fault,
                kind="instrument",
            )


def busiest_expert(inputs: CaseInputs) -> int:
    """The local expert with the largest total routing weight."""
    r = inputs.routing()
    ids = inputs.local_ids(r.ids)
    total = torch.zeros(inputs.weights.num_experts, dtype=torch.float64, device=ids.device)
    keep = ids >= 0
    return int(total.index_add_(0, ids[keep], r.weights[keep].abs()).argmax())


def _largest_w2_block(w: MoEWeights, e: int) -> tuple[int, int]:
    w2 = dequantize_mxfp4(w.w2_blocks[e], w.w2_scales[e])
    mags = w2.abs().reshape(w2.shape[0], -1, BLOCK).sum(-1)
    return divmod(int(mags.argmax()), mags.shape[1])


# -- layout -------------------------------------------------------------------------------------


class _ReadsLayout(Mutant):
    reads: ClassVar[str]

    def activate(self, h: torch.Tensor, inputs: CaseInputs) -> torch.Tensor:
        from mxmoe.reference.activation import gated_activation

        c = inputs.case
        return gated_activation(h, c.activation, self.reads, c.alpha, c.beta, c.limit)


class InterleavedReadAsChunked(_ReadsLayout):
    slug, reads = "interleaved-as-chunked", "chunked_gate_up"
    fault = "w13 converted interleaved, read as chunked [gate; up]"
    reference = f"{SHIPPED}: gate/up layout mix-ups between backends"


class GateUpSwapped(_ReadsLayout):
    slug, reads = "gate-up-swapped", "chunked_up_gate"
    fault = "w13 converted [gate; up], read as [up; gate]"
    reference = f"{SHIPPED}: gate/up layout mix-ups (FlashInfer CUTLASS is up-first)"
    declaration = dataclasses.replace(HonestFp32.declaration, w13_layout="chunked_gate_up")


class PairSwappedRead(_ReadsLayout):
    slug, reads = "pair-swapped", "pair_swapped"
    fault = "w13 converted interleaved, read pair-swapped [u0, g0, ...] (TRT-LLM-gen's order)"
    reference = f"{SHIPPED}: gate/up layout mix-ups (vLLM swaps every two rows for TRT-LLM-gen)"


class NibbleOrderSwapped(Mutant):
    slug = "nibble-order"
    fault = "FP4 nibbles unpacked high nibble first"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        def swap(b: torch.Tensor) -> torch.Tensor:
            return (b >> 4) | (b << 4)

        return dataclasses.replace(w, w13_blocks=swap(w.w13_blocks), w2_blocks=swap(w.w2_blocks))


class ScalesWrongAxis(Mutant):
    slug = "scales-wrong-axis"
    fault = "E8M0 scales [N, K/32] read with the other axis' stride"
    reference = f"{SHIPPED}: scale layouts changed across FlashInfer releases (K = 128 hid one)"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        def wrong(s: torch.Tensor) -> torch.Tensor:
            e, n, g = s.shape
            return s.reshape(e, g, n).transpose(1, 2).contiguous()

        return dataclasses.replace(w, w13_scales=wrong(w.w13_scales), w2_scales=wrong(w.w2_scales))


class E8M0Bias128(Mutant):
    slug = "e8m0-bias-128"
    fault = "E8M0 decoded as 2^(s - 128) instead of 2^(s - 127)"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        def dec(s: torch.Tensor) -> torch.Tensor:
            return torch.where((s > 0) & (s < 255), s - 1, s)

        return dataclasses.replace(w, w13_scales=dec(w.w13_scales), w2_scales=dec(w.w2_scales))


class OneScaleByteOff(Mutant):
    slug = "one-scale-byte"
    fault = "one E8M0 byte of one w2 block of one expert off by +1"
    reference = f"{SHIPPED}: Hopper out-of-bounds scale reads; peers let a single wrong byte through ({PEERS})"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        if inputs.case.tokens == 0:
            return w
        e = busiest_expert(inputs)
        row, blk = _largest_w2_block(w, e)
        s = w.w2_scales.clone()
        s[e, row, blk] += 1
        return dataclasses.replace(w, w2_scales=s)


class OneExpertSkipped(Mutant):
    slug = "expert-skipped"
    fault = "one expert's weights never loaded (its contribution is zero)"
    reference = f"{SHIPPED}: peers let 'the last expert skipped' through ({PEERS})"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        if inputs.case.tokens == 0:
            return w
        e = busiest_expert(inputs)
        out = {}
        for name in ("w13_blocks", "w2_blocks", "w13_bias", "w2_bias"):
            t = getattr(w, name)
            if t is not None:
                t = t.clone()
                t[e] = 0
            out[name] = t
        return dataclasses.replace(w, **out)


# -- routing ------------------------------------------------------------------------------------


class HardcodedRenormalize(Mutant):
    slug = "routing-hardcoded"
    fault = "routing method hard-coded to Renormalize whatever the model asks"
    reference = "vLLM PR #37128 and #32564 review: routing_method_type hard-coded to 1 in the modular TRTLLM path"

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        r = route(inputs.router_logits, inputs.case.top_k, "Renormalize")
        return r.weights.float(), inputs.local_ids(r.ids)


class NotRenormalized(Mutant):
    slug = "not-renormalized"
    fault = "routing weights of the chosen experts not renormalized (softmax or sigmoid over all)"

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(inputs)
        c = inputs.case
        logits = inputs.router_logits.double()
        r = inputs.routing()
        if c.routing in ("Renormalize", "RenormalizeNaive"):
            weights = torch.softmax(logits, dim=-1).gather(1, r.ids).float()
        elif c.routing in ("DeepSeekV3", "MiniMax2", "SigmoidRenorm"):
            scale = c.routed_scaling_factor if c.routing != "SigmoidRenorm" else 1.0
            weights = (torch.sigmoid(logits).gather(1, r.ids) * scale).float()
        return weights, ids


class CorrectionBiasInWeights(Mutant):
    slug = "bias-in-weights"
    fault = "the selection-only correction bias added into the routing weights (DeepSeekV3, MiniMax2)"

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(inputs)
        c = inputs.case
        if inputs.correction_bias is None:
            return weights, ids
        r = inputs.routing()
        biased = (torch.sigmoid(inputs.router_logits.double()) + inputs.correction_bias.double()).gather(1, r.ids)
        return (biased / (biased.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor).float(), ids


class RouterWeightTwice(Mutant):
    slug = "weight-twice"
    fault = "routing weight applied twice (in the finalize and again in the combine)"

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(inputs)
        return weights * weights, ids


class RouterWeightOnInput(Mutant):
    slug = "weight-on-input"
    fault = "routing weight applied to GEMM1's input where the model applies it to the output"

    def weight_on_input(self, inputs: CaseInputs) -> bool:
        return True


class TopkWeightsMisassigned(Mutant):
    slug = "weights-misassigned"
    fault = "routing weights paired with the wrong slots (reversed top-k order)"

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(inputs)
        return weights.flip(-1), ids


class ExpertMapIgnored(Mutant):
    slug = "expert-map-ignored"
    fault = "expert-parallel rank uses global expert ids as local indices"
    reference = "vLLM PR #37128: DP/EP failures during the MXFP4 oracle refactor"

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, _ = super().route_tokens(inputs)
        return weights, inputs.routing().ids


class TiesOtherWay(Mutant):
    slug = "ties-other-way"
    fault = "CONTROL: ties broken toward the higher expert index (AITER) on tie-free logits: not a bug"
    full, control = True, True

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        c = inputs.case
        kw = dict(inputs.routing_kwargs)
        if kw.get("correction_bias") is not None:
            kw["correction_bias"] = kw["correction_bias"].flip(-1)
        r = route(inputs.router_logits.flip(-1), c.top_k, c.routing, **kw)
        return r.weights.float(), inputs.local_ids(inputs.router_logits.shape[1] - 1 - r.ids)


# -- activation ---------------------------------------------------------------------------------


class _Swiglu(Mutant):
    """swigluoai computed by its own (faulty) formula; silu cases are left correct."""

    def glu(self, g: torch.Tensor, u: torch.Tensor, alpha: float, beta: float, limit: float | None) -> torch.Tensor:
        raise NotImplementedError

    def activate(self, h: torch.Tensor, inputs: CaseInputs) -> torch.Tensor:
        c = inputs.case
        if c.activation != "swigluoai":
            return super().activate(h, inputs)
        g, u = (t.contiguous() for t in split_gate_up(h, self.declaration.w13_layout))
        return self.glu(g, u, c.alpha, c.beta, c.limit)


class MissingPlusOne(_Swiglu):
    slug = "missing-plus-one"
    fault = "swigluoai without the '+1' on up (beta = 0)"

    def glu(self, g, u, alpha, beta, limit):  # noqa: ANN001, ANN201
        if limit:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * u


class NoClamp(_Swiglu):
    slug = "no-clamp"
    fault = "swigluoai without the clamp at limit"
    reference = f"{SHIPPED} / {PEERS}: peers let 'a missing clamp' through"

    def glu(self, g, u, alpha, beta, limit):  # noqa: ANN001, ANN201
        return g * torch.sigmoid(alpha * g) * (u + beta)


class ClampWrongSide(_Swiglu):
    slug = "clamp-wrong-side"
    fault = "gate clamped from below (max(g, -limit)) instead of above"

    def glu(self, g, u, alpha, beta, limit):  # noqa: ANN001, ANN201
        if limit:
            g, u = g.clamp(min=-limit), u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + beta)


class ClampAfterSigmoid(_Swiglu):
    slug = "clamp-after-sigmoid"
    fault = "clamp applied after the sigmoid, to g * sigmoid(alpha g) (the 'swiglustep' variant)"

    def glu(self, g, u, alpha, beta, limit):  # noqa: ANN001, ANN201
        glu = g * torch.sigmoid(alpha * g)
        if limit:
            glu, u = glu.clamp(max=limit), u.clamp(-limit, limit)
        return glu * (u + beta)


class AlphaOne(_Swiglu):
    slug = "alpha-one"
    fault = "swigluoai with alpha = 1.0 instead of the model's (1.702)"
    reference = f"{SHIPPED} / {PEERS}: peers let 'alpha 1.0' through"

    def glu(self, g, u, alpha, beta, limit):  # noqa: ANN001, ANN201
        if limit:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return g * torch.sigmoid(g) * (u + beta)


# -- biases -------------------------------------------------------------------------------------


class B13Dropped(Mutant):
    slug = "b13-dropped"
    fault = "GEMM1 bias never added"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        return dataclasses.replace(w, w13_bias=None)


class B2Dropped(Mutant):
    slug = "b2-dropped"
    fault = "GEMM2 bias never added"
    reference = f"{SHIPPED} / {PEERS}: peers let 'a dropped b2 bias' through"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        return dataclasses.replace(w, w2_bias=None)


def _one_expert_bias(w: MoEWeights, inputs: CaseInputs, name: str,
                     change: Callable[[torch.Tensor, int], torch.Tensor]) -> MoEWeights:  # fmt: skip
    """``w`` with bias ``name`` (``w2_bias`` or ``w13_bias``) of the busiest expert e replaced by
    ``change(bias, e)``; unchanged without that bias or tokens."""
    b = getattr(w, name)
    if b is None or inputs.case.tokens == 0:
        return w
    e = busiest_expert(inputs)
    out = b.clone()
    out[e] = change(b, e).to(b.dtype)
    return dataclasses.replace(w, **{name: out})


class B2DroppedOneExpert(Mutant):
    slug = "b2-dropped-one-expert"
    fault = "GEMM2 bias dropped for one expert only"
    reference = f"{SHIPPED} / {PEERS}: peers let 'a bias dropped for one expert' through"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        return _one_expert_bias(w, inputs, "w2_bias", lambda b, e: torch.zeros_like(b[e]))


class B2DoubledOneExpert(Mutant):
    slug = "b2-doubled-one-expert"
    fault = "GEMM2 bias added twice for one expert"
    reference = f"{SHIPPED}: a bias added in the epilogue of every split or every rank"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        return _one_expert_bias(w, inputs, "w2_bias", lambda b, e: 2 * b[e].float())


class B2OtherExpert(Mutant):
    slug = "b2-other-expert"
    fault = "one expert adds the next expert's GEMM2 bias (a bias misassigned)"
    reference = f"{SHIPPED}: triton_kernels' bias read without the expert's stride"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        return _one_expert_bias(w, inputs, "w2_bias", lambda b, e: b[(e + 1) % b.shape[0]])


class B13DroppedOneExpert(Mutant):
    slug = "b13-dropped-one-expert"
    fault = "GEMM1 bias dropped for one expert only"
    reference = f"{SHIPPED} / {PEERS}: peers let 'a bias dropped for one expert' through"

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        return _one_expert_bias(w, inputs, "w13_bias", lambda b, e: torch.zeros_like(b[e]))


# -- tokens, outputs, inputs, padding, precision ------------------------------------------------


class CapacityDrop(Mutant):
    slug = "capacity-drop"
    fault = "tokens beyond a fixed capacity of 8 per expert silently dropped"

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(inputs)
        flat = ids.reshape(-1).clone()
        for e in flat.unique():
            if e < 0:
                continue
            where = torch.nonzero(flat == e).reshape(-1)
            flat[where[8:]] = -1
        return weights, flat.reshape(ids.shape)


class RowsUnwritten(Mutant):
    slug = "rows-unwritten"
    fault = "the last token's output row never written"
    reference = f"{SHIPPED} / {PEERS}: peers let 'an unwritten output row' through"

    def run(self, prepared: object, inputs: CaseInputs, out: torch.Tensor) -> None:
        full = torch.empty_like(out)
        super().run(prepared, inputs, full)
        out[:-1] = full[:-1]


class InputMutated(Mutant):
    slug = "input-mutated"
    fault = "the layer's input x scaled in place (a converter or kernel writing into its input)"
    reference = f"{SHIPPED}: converters that mutate the checkpoint tensors in place"

    def run(self, prepared: object, inputs: CaseInputs, out: torch.Tensor) -> None:
        super().run(prepared, inputs, out)
        inputs.x.mul_(2)


class GarbageInPadding(Mutant):
    slug = "garbage-padding"
    fault = "padded intermediate rows/columns left uninitialised (torch.empty) instead of zero"
    reference = f"{SHIPPED}: padded regions must be zero (AITER's e8m0_shuffle pads with torch.empty)"
    declaration = dataclasses.replace(HonestFp32.declaration, intermediate_align=64)

    def prepare_weights(self, w: MoEWeights, inputs: CaseInputs) -> MoEWeights:
        real = inputs.weights.intermediate_size
        pad = w.intermediate_size - real
        if pad == 0:
            return w
        gen = generator_for(f"garbage-{inputs.case.id}", "cpu")

        def junk(like: torch.Tensor, lo: int = 0, hi: int = 256) -> torch.Tensor:
            return torch.randint(lo, hi, like.shape, generator=gen, dtype=torch.uint8).to(like.device)

        def rows(t: torch.Tensor, scale: bool) -> torch.Tensor:
            c = convert_layout(t, w.w13_layout, "chunked_gate_up", 1).clone()
            i = c.shape[1] // 2
            for start in (real, i + real):
                c[:, start : start + pad] = junk(c[:, start : start + pad], *((118, 125) if scale else (0, 256)))
            return convert_layout(c, "chunked_gate_up", w.w13_layout, 1).contiguous()

        w2b, w2s = w.w2_blocks.clone(), w.w2_scales.clone()
        w2b[:, :, real // 2 :] = junk(w2b[:, :, real // 2 :])
        w2s[:, :, real // BLOCK :] = junk(w2s[:, :, real // BLOCK :], 118, 125)
        return dataclasses.replace(
            w, w13_blocks=rows(w.w13_blocks, False), w13_scales=rows(w.w13_scales, True), w2_blocks=w2b, w2_scales=w2s
        )


class IntermediateMxfp8(Mutant):
    slug = "intermediate-mxfp8"
    fault = "intermediate quantized to MXFP8 while the backend declares bf16"
    reference = f"{SHIPPED} / {PEERS}: peers let 'an MXFP8 intermediate' through"

    def activate(self, h: torch.Tensor, inputs: CaseInputs) -> torch.Tensor:
        a = super().activate(h, inputs)
        return fake_quantize(a.double(), "mxfp8", "floor").float()


class RoutingWeightsBf16(Mutant):
    slug = "routing-weights-bf16"
    fault = "routing weights silently rounded to bf16 while the backend declares fp32 (rate reported)"
    reference = f"FlashInfer's routing kernels emit bf16 weights (docs/formats.md); {PEERS}: only it and one byte pass"
    full = True

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(inputs)
        return weights.to(torch.bfloat16).float(), ids


class CombineBf16(Mutant):
    slug = "combine-bf16"
    fault = "the top-k combine summed in bf16 while the backend declares fp32 (an undeclared rounding point)"
    reference = f"a combine kernel that adds bf16 rows in bf16; {PEERS}: every element stays within tolerance"
    combine = torch.bfloat16


class DecodeBucketWrong(Mutant):
    slug = "bucket-3-4"
    fault = (
        "at a production hidden size (H >= 2048), calls of 3 or 4 tokens take a kernel that drops every token's "
        "last top-k expert; every other token count is exact"
    )
    reference = (
        "AITER issue #3933: the kernel picked for 3-4 tokens at DeepSeek-V4-Pro's MoE shape computed wrong output "
        "(gsm8k 0.04 at concurrency 4, about 1.0 at 2 and 8)"
    )
    BUCKET: ClassVar[tuple[int, ...]] = (3, 4)
    MIN_HIDDEN: ClassVar[int] = 2048

    def reaches(self, case: Case) -> bool:
        """Only its bucket at a production hidden size."""
        return case.tokens in self.BUCKET and case.hidden >= self.MIN_HIDDEN

    def route_tokens(self, inputs: CaseInputs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(inputs)
        if self.reaches(inputs.case):
            ids = ids.clone()
            ids[:, -1] = -1
        return weights, ids


class NameErrorAtCall(Mutant):
    slug = "nameerror-at-call"
    fault = "the kernel call raises NameError (a split-out module missing an import)"
    reference = "vLLM PR #50622: patch_gating_output used without its import in aiter_mxfp4_w4a16_moe.py"

    def run(self, prepared: object, inputs: CaseInputs, out: torch.Tensor) -> None:
        raise NameError("name 'patch_gating_output' is not defined")


MUTANTS: tuple[type[Mutant], ...] = tuple(
    c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, Mutant) and "slug" in c.__dict__
)

SUB_BOUND: tuple[type[Mutant], ...] = (
    B2DroppedOneExpert, B2DoubledOneExpert, B2OtherExpert, B13DroppedOneExpert, OneScaleByteOff,
    RoutingWeightsBf16, CombineBf16,
)  # fmt: skip
"""The faults whose every element can stay within the bound (a bias, a routing weight, the combine,
a scale byte): caught, where they are, by the systematic and energy tests, whose power depends on
how much rounding the declared arithmetic itself allows."""


def _on_bf16_gemm1(cls: type[Mutant]) -> type[Mutant]:
    """``cls``'s fault put in the other arithmetic family: bf16 GEMMs whose every result is rounded
    to bf16, GEMM1's output included (``honest-unfused``: MARLIN's and TRITON_UNFUSED's kind),
    declared as that honest kernel is.

    Why: on float32 GEMM1 outputs these faults are caught by tests whose power comes from how little
    the arithmetic rounds; rounding GEMM1's output to bf16 adds an error through the activation to
    every element, and the catalogue has to measure detection there too, not assume it."""
    name = f"{cls.__name__}OnBf16Gemm1"
    made = type(name, (cls,), {
        "__module__": __name__, "__qualname__": name, "__doc__": f"{cls.__name__} on ``honest-unfused``'s arithmetic.",
        "slug": f"{cls.slug}-bf16-gemm1", "fault": f"{cls.fault}; on bf16 GEMMs with GEMM1's output in bf16",
        "reference": cls.reference, "gemm": HonestBf16Gemm.gemm, "declaration": HonestBf16Gemm.declaration,
    })  # fmt: skip
    globals()[name] = made  # loadable as module:Class, as every catalogue fault is
    return made


ON_BF16_GEMM1: tuple[type[Mutant], ...] = tuple(_on_bf16_gemm1(cls) for cls in SUB_BOUND)
"""The sub-bound faults again on the bf16-GEMM1 arithmetic (the catalogue's second family). Kept out of
``MUTANTS``: the diagnosis explains an output by the faults of the arithmetic a backend declares, and
these are the same faults."""


def mutant_specs() -> list[str]:
    """``module:Class`` of every catalogue fault, for the registry's loader (a model's layer can be
    planted with one: ``model-check --plant``)."""
    return [f"{__name__}:{cls.__name__}" for cls in MUTANTS]
