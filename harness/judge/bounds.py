"""The per-element error bound: how far an honest backend's output may be from the exact layer.

Derivation. The oracle computes the layer exactly (float64; its own error, ~2^-53 of the sum of
magnitudes, is folded into every accumulation below). A backend rounds at the points its
``Arithmetic`` declares and accumulates in its declared format with unit roundoff ``u``. Every
quantity is carried with a bound ``E`` on |kernel value - exact value|, propagated to first order
through the same computation on absolute values (|X| |W|, not |X W|), with the second-order
terms of the activation kept:

* Accumulating n products (a GEMM row, or the k-way combine) plus a bias in any order errs by at
  most ``gamma(n + 2) * sum |terms|`` (one rounding per product, n - 1 per sum, one for the
  bias), ``gamma(n) = n u' / (1 - n u')`` with ``u' = u + 2^-53`` (Higham, Accuracy and Stability
  of Numerical Algorithms, 2nd ed., eq. 3.5); erroneous inputs add ``|W| E_in`` (the GEMM is
  linear).
* Rounding a value ``v`` (known to within ``E``) to a format errs by at most half an ulp of
  ``|v| + E`` in that format (``rounding_bound``); for MXFP8, half an E4M3 ulp at the largest
  scale the block's amax allows, or the saturation excess under FLOOR.
* The activation f(g, u) at the clamped point: ``|df/dg| E_g + |df/du| E_u + E_g E_u |d2f/dgdu|
  + 0.5 E_g^2 max|d2f/dg2|`` (the clamps are 1-Lipschitz, so they do not enlarge E), plus its
  evaluation error ``activation_ulps * u * |g sigma(alpha g)| (|u| + beta)``.
* Routing weights: ``routing_ulps * u * |w|`` plus their declared rounding.
* The activation input is not an error source: a correct kernel quantizes the same x with the
  same rule, so the oracle applies that rounding too (``Arithmetic.precision.activation_input``).
  With the router weight on the input (Llama4), the product w x may round differently on the two
  sides, so there it counts both roundings.

That ``rigorous`` bound holds for honest arithmetic at ANY summation order (split-K, tiles,
atomics) and for any data. Its worst case assumes every rounding error in a long sum has the same
sign, so at K = 2880 it is about 30 times the error honest kernels make, and a single wrong scale
byte can hide inside it. Hence a second, ``probabilistic`` tier (Higham and Mary, "A new approach
to probabilistic rounding error analysis", SISC 2019): model each elementary rounding error as
independent, mean zero and bounded by the same worst case ``r_i``; the error of an element is then
a sum ``sum c_i d_i`` (first order) and Hoeffding's inequality bounds it by
``LAMBDA * sqrt(sum (c_i r_i)^2)`` except with probability ``2 exp(-LAMBDA^2 / 2)`` (2.5e-14 per
element at LAMBDA = 8). The squares are propagated alongside the worst case (through a GEMM:
``|W|^2 @ R^2``); what is not a sum of independent errors (the final rounding of the element, the
routing weights' error shared by a token's slots, the router weight on the input) stays
worst-case. The activation's second-order terms are split: their fluctuation, independent across
the intermediate's elements, is carried by taking the squared ranges at the activation's largest
slopes over the rigorous error box (McDiarmid's inequality, Hoeffding's tail for a function of
independent errors); their mean, which lines up over GEMM2's sum and over every element a
projection spans, is predicted where it can be (below) and only what the prediction does not know
stays worst-case. The verdict uses the smaller of the two bounds; exceeding only the probabilistic
one is reported as such.

The second-order mean (``_second_order_mean``). With ``f = G(g) S``, ``S = u + beta``, the term
``G''(xi) dg^2 (S + du) / 2`` has the mean ``G''(g) S E[dg^2] / 2`` up to third order, and
``E[dg^2]`` is the sum of the variances of ``dg``'s independent parts plus its mean squared. A
declared rounding of GEMM1's output is one of those parts, and far the largest where it rounds
to bf16 (2^-9 of the value, against float32 accumulation's 2^-24 of the row's magnitudes).
Under round-to-nearest, on a value whose place in its cell is uniform (the energy test's model),
its variance is ``r^2 / 3``, ``r`` the cell's half-ulp: not unknown, so the mean it adds is
predicted, signed (``SlotTerms.mean``; the tests subtract it from the error before they project
it). What stays worst-case is what the prediction does not know: the accumulation's roundings
(each at most its squared range) and the coherent part, at ``alpha (|S| + e_u)(q + l^2) / 4`` as
before; half the spread of ``r^2 / 3`` where the value's admissible magnitudes span two binades;
the change of ``G''`` over the error's box (``|G'''|`` is at most ``0.3082 alpha^2``); and the up
projection's mean times the rounding's variance. Where a clamp's kink lies within the gate's box
there is no prediction, and every part stays at its largest second moment. A kink within an
input's box also moves the error's mean by as much as the input passes it on average (``_beyond``:
at most the rigorous reach, and at most Hoeffding's tail integrated past it), kept worst-case.

What the prediction assumes and cannot see: the uniform place in the cell. A value that lands on
the bf16 grid more often than chance (an input of few significant bits, summed over few terms)
rounds with less variance than ``r^2 / 3``, and its mean is then smaller than predicted by at most
the prediction itself, which the tests would read as an error of that size (at gpt-oss shapes
about 1e-4 of an element's noise; ``harness.instruments.rounding_mc`` measures the prediction
against a real kernel of that arithmetic). A rounding other than to nearest (truncation,
stochastic rounding) has another mean and another variance: a deviation from the declared
arithmetic, which the tests are there to report.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mxmoe.harness.contract.backend import ACCUMULATORS, Arithmetic
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.reference.activation import split_gate_up
from mxmoe.reference.moe import Precision, round_to
from mxmoe.reference.mxfp4 import BLOCK, dequantize_mxfp4, shared_exponent
from mxmoe.reference.routing import route, topk_margin

_IEEE = {"fp32": (23, -126), "bf16": (7, -126), "fp16": (10, -14), "fp64": (52, -1022)}
_DTYPE_POINT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_U64 = 2.0**-53
LAMBDA = 8.0
"""Hoeffding multiplier of the probabilistic bound: an honest element exceeds it with probability
at most 2 exp(-LAMBDA^2 / 2) = 2.5e-14 under the model of independent rounding errors."""
_PAD_SLACK = 64
"""Padded slots a batch of experts may add beyond doubling its slots (tiny experts batch freely)."""
_BOUND_BATCH = 1 << 28
"""Float64 elements a batch of experts may hold in the bound's pass (2 GiB: their dequantized
weights and magnitudes, and again their slots' intermediate terms)."""


def significand_bits(dtype: torch.dtype) -> int:
    """Significand bits of an output dtype, the implicit one included (bf16: 8)."""
    return _IEEE[_DTYPE_POINT[dtype]][0] + 1


def _half_ulp(m: torch.Tensor, mbits: int, emin: int) -> torch.Tensor:
    """Half an ulp of magnitude ``m`` in a format with ``mbits`` mantissa bits and smallest normal
    exponent ``emin`` (the largest rounding error of any value of magnitude up to ``m``)."""
    _, exp = torch.frexp(m)
    e = torch.clamp(exp.to(torch.float64) - 1, min=emin)
    return torch.exp2(e - mbits - 1)


def _mx_bound(hi: torch.Tensor, lo: torch.Tensor, rule: str) -> torch.Tensor:
    """Largest MXFP8 quantization error of elements whose magnitudes lie in [lo, hi], blocks of 32
    along the last axis, under scale ``rule``."""
    return torch.maximum(*_mx_parts(hi, lo, rule))


def _mx_parts(hi: torch.Tensor, lo: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rounding, saturation) parts of ``_mx_bound``: half an E4M3 ulp at the block's scale, and
    the excess over 448 times the scale that the element is clipped by (always toward zero)."""
    shape = hi.shape
    hb = hi.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    lb = lo.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    e_hi = shared_exponent(hb.amax(-1), rule, "e4m3").unsqueeze(-1)
    e_lo = shared_exponent(lb.amax(-1), rule, "e4m3").unsqueeze(-1)
    step = torch.exp2(e_hi)
    rounding = _half_ulp(hb / step, 3, -6) * step
    saturation = torch.clamp(hb - 448.0 * torch.exp2(e_lo), min=0.0)
    return rounding.reshape(shape), saturation.reshape(shape)


def clipping_bound(point: str, magnitude: torch.Tensor, err: torch.Tensor, mx_rule: str = "floor") -> torch.Tensor:
    """The part of ``rounding_bound`` that is not a rounding but a clip toward zero (MXFP8's
    saturation under FLOOR): deterministic in sign, so ``harness.judge.systematic`` counts it among the
    coherent errors. Zero for every other point."""
    if point != "mxfp8":
        return torch.zeros_like(magnitude)
    return _mx_parts(magnitude + err, torch.clamp(magnitude - err, min=0.0), mx_rule)[1]


def rounding_bound(point: str, magnitude: torch.Tensor, err: torch.Tensor, mx_rule: str = "floor") -> torch.Tensor:
    """Largest error of rounding, at ``point``, a value of magnitude ``magnitude`` known to within
    ``err`` (float64 tensors of one shape)."""
    if point == "mxfp8":
        return _mx_bound(magnitude + err, torch.clamp(magnitude - err, min=0.0), mx_rule)
    if point not in _IEEE:
        raise ValueError(f"point must be one of {', '.join((*_IEEE, 'mxfp8'))}; got {point!r}")
    if point == "fp64":
        return (magnitude + err) * _U64
    return _half_ulp(magnitude + err, *_IEEE[point])


def _gamma(n: int, u: float) -> float:
    nu = n * (u + _U64)
    return nu / (1.0 - nu)


@dataclass(frozen=True)
class SlotTerms:
    """The per-slot pieces of the bound's propagation, kept for ``harness.judge.systematic``: the
    element-wise tiers cannot say how an error is spread over a token's elements, these can.
    Slots of experts not on this rank are zero. The [T, k, *] tensors are float32 (they are the
    largest the harness keeps: 0.9 GB each at DeepSeek-V3, T=4096), the rest float64."""

    ids: torch.Tensor
    """[T, k] local expert of each slot, -1 where it is not on this rank."""
    slot_out: torch.Tensor
    """[T, k, H] each slot's exact weighted output (the oracle's terms of the top-k sum)."""
    weight: torch.Tensor
    """[T, k] the factor between the expert's output and the slot's (its routing weight; 1 with
    the weight on the input)."""
    intermediate: torch.Tensor
    """[T, k, I] the exact activation each slot feeds to GEMM2."""
    intermediate_sq: torch.Tensor
    """[T, k, I] squared ranges of the independent errors of that activation (GEMM1's rounding
    carried through the activation, its evaluation, its storage), unweighted."""
    variance: torch.Tensor
    """[T, H] per element: the squared ranges of every independent error (the probabilistic
    tier's sum, plus the element's final rounding, which is independent across elements)."""
    coherent: torch.Tensor
    """[T, H] per element: the worst-case part (routing-weight errors shared by a token's slots,
    the activation input's error, what the prediction of the activation's second-order mean does
    not know, a clamp's kink, MXFP8 clipping): what may legitimately line up."""
    mean: torch.Tensor
    """[T, H] the predicted mean of an honest kernel's error (float64): the activation's
    second-order term under the declared rounding of GEMM1's output, carried through GEMM2 and the
    combine. The tests subtract it from the error before they project it; zero where GEMM1's output
    keeps float64."""
    bias13_effect: torch.Tensor | None = None
    """[T, k, I] the first-order change of each slot's activation per unit of its expert's GEMM1
    bias: ``df/dg * b_gate + df/du * b_up`` at the exact (clamped) point, zero where a clamp binds.
    It carries a b13 fault (dropped, doubled, another expert's) to the output, for the bias
    hypotheses of ``harness.judge.systematic``; None without biases."""

    @functools.cached_property
    def groups(self) -> ExpertSlots:
        """The slots by expert (``ExpertSlots``), found once for every test that reads them."""
        return ExpertSlots.of(self.ids)


@dataclass(frozen=True)
class Bounded:
    """The exact layer and the bounds on an honest backend's deviation from it, float64 [T, H]."""

    ref: torch.Tensor
    rigorous: torch.Tensor
    """Holds for any data and any order of honest arithmetic."""
    probabilistic: torch.Tensor
    """Holds except with probability 2.5e-14 per element, rounding errors modelled as independent."""
    terms: SlotTerms | None = None
    """What the systematic-error test (``harness.judge.systematic``) needs beyond the bound; None where
    the oracle admits alternatives (a tie) or the bound was assembled from shards."""

    @property
    def bound(self) -> torch.Tensor:
        """The bound the verdict uses: the smaller of the two."""
        return torch.minimum(self.rigorous, self.probabilistic)


def oracle_precision(arithmetic: Arithmetic) -> Precision:
    """The oracle's precision for a backend: exact everywhere but the activation input, which a
    correct kernel rounds exactly as the oracle does, and an MXFP8 intermediate, which it rounds
    as the oracle does wherever its own activation lies in the oracle's rounding cell
    (``_mx_intermediate``: the bound checks that element by element).

    Why the intermediate. E4M3 keeps 3 significand bits under a scale shared by 32 elements, so a
    rounding moves an element by up to 6% of itself, or all of it where it is small against its
    block. Left out of the oracle, that error is not the mean-zero noise the systematic and energy
    tests model: where an activation's values crowd one side of a cell (swigluoai's many near-zero
    values, flushed to zero together), their errors line up with the expert's output, and an
    honest MXFP8 kernel at gpt-oss-20b, T=128 projected there at z = 14 (threshold 7.8)."""
    p = arithmetic.precision
    inter = p.intermediate if p.intermediate == "mxfp8" else "fp64"
    return Precision(activation_input=p.activation_input, intermediate=inter, mx_rule=p.mx_rule)


def _mx_intermediate(
    a: torch.Tensor, e_a: torch.Tensor, q_a: torch.Tensor, l_a: torch.Tensor, l_sys: torch.Tensor, rule: str
) -> tuple[torch.Tensor, ...]:
    """The intermediate rounded to MXFP8 by the oracle (blocks of 32 along the last axis), with the
    error left to a kernel whose activation lies within ``e_a`` of the exact ``a``: (rounded value,
    rigorous error, squared independent ranges, coherent part, the systematic test's coherent part).

    Where the block's scale is the same at both ends of every admissible value and the element's
    interval ``[a - e_a, a + e_a]`` rounds to one value, the kernel's rounded element is the
    oracle's exactly: no error is left, whatever the kernel's own was before the rounding. Anywhere
    else it may land in another cell: at most ``e_a`` plus a rounding at each end, the kernel's
    own error deciding which (independent across elements); the coherent parts stay, the clip of
    a saturating element among them."""
    mag = a.abs()
    hi, lo = mag + e_a, torch.clamp(mag - e_a, min=0.0)
    shape = a.shape
    blocks = (*shape[:-1], shape[-1] // BLOCK, BLOCK)
    same_scale = shared_exponent(hi.reshape(blocks).amax(-1), rule, "e4m3") == shared_exponent(
        lo.reshape(blocks).amax(-1), rule, "e4m3"
    )
    one_cell = round_to(a - e_a, "mxfp8", rule) == round_to(a + e_a, "mxfp8", rule)
    exact = one_cell & same_scale.unsqueeze(-1).expand(blocks).reshape(shape)
    rounding, clip = _mx_parts(hi, lo, rule)  # rounding_bound is their maximum, clipping_bound the clip
    r = torch.maximum(rounding, clip)
    zero = torch.zeros_like(a)
    return (
        round_to(a, "mxfp8", rule),
        torch.where(exact, zero, e_a + 2 * r),
        torch.where(exact, zero, q_a + (2 * r) ** 2),
        torch.where(exact, zero, l_a),
        torch.where(exact, zero, l_sys + clip),
    )


@dataclass(frozen=True)
class ExpertSlots:
    """The routed slots of a layer grouped by expert: for each expert with any (ascending), its
    token and slot indices, in the order ``torch.nonzero(ids == e, as_tuple=True)`` gives them.

    Why: the bound and the tests after it work expert by expert, and a ``nonzero`` per expert is
    one host synchronization each; on a GPU, for gpt-oss-120b's 128 experts at a few tokens each,
    those and the launches around them cost more than the arithmetic they select. Found here with
    one synchronization, and kept as a padded index for sums over each expert's slots at once."""

    experts: list[int]
    tokens: list[torch.Tensor]
    slots: list[torch.Tensor]
    sizes: list[int]
    """Each expert's number of slots."""
    padded: torch.Tensor
    """[experts, most slots of one expert]: each expert's flat slot indices (``token * k + slot``),
    padded with ``ids.numel()`` (an index one past the last: append a zero to read it)."""

    @classmethod
    def of(cls, ids: torch.Tensor) -> ExpertSlots:
        """Group ``ids`` ([T, k] expert ids, -1 for a slot routed nowhere)."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: each expert's slots in row-major order
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        pairs = torch.stack([experts.to(torch.int64), counts.to(torch.int64)]).tolist() if flat.numel() else [[], []]
        routed = [(e, n) for e, n in zip(*pairs, strict=True) if e >= 0]
        skip = sum(n for e, n in zip(*pairs, strict=True) if e < 0)  # the -1s sort first
        order = order[skip:]
        tokens, slots = [], []
        lo = 0
        for _, n in routed:
            idx = order[lo : lo + n]
            tokens.append(idx // k)
            slots.append(idx % k)
            lo += n
        width = max((n for _, n in routed), default=0)
        padded = torch.full((len(routed), width), flat.numel(), dtype=torch.int64, device=ids.device)
        if routed:
            sizes = torch.tensor([n for _, n in routed], device=ids.device)
            rank = torch.repeat_interleave(torch.arange(len(routed), device=ids.device), sizes)
            start = torch.cumsum(sizes, 0) - sizes
            padded[rank, torch.arange(order.numel(), device=ids.device) - start[rank]] = order
        return cls([e for e, _ in routed], tokens, slots, [n for _, n in routed], padded)

    def chunks(self, per_slot: int, slot_budget: int, per_expert: int, expert_budget: int) -> list[tuple[int, int]]:
        """Ranges ``[lo, hi)`` of consecutive experts to compute together, each padded to its most
        slots: at ``per_slot`` elements a padded slot, within ``slot_budget`` elements, and at
        ``per_expert`` elements an expert (its dequantized weights), within ``expert_budget``. An
        expert alone past a budget is a range of its own (its caller may split its slots).

        Why: expert by expert, gpt-oss-120b's 128 experts at a few tokens each cost a couple of
        hundred small operations each, and on a GPU those launches, not the arithmetic, were most
        of a test's time."""
        sizes = self.sizes
        most = max(1, expert_budget // max(1, per_expert))
        out, lo, width, held = [], 0, 0, 0
        for i, n in enumerate(sizes):
            wider, count = max(width, n), i - lo + 1
            # padding at most doubles the work (a hot expert beside cold ones goes alone)
            wasteful = count * wider > 2 * (held + n) + _PAD_SLACK
            if i > lo and (count > most or count * wider * per_slot > slot_budget or wasteful):
                out.append((lo, i))
                lo, wider, held = i, n, 0
            width, held = wider, held + n
        if sizes:
            out.append((lo, len(sizes)))
        return out

    def width(self, lo: int, hi: int) -> int:
        """The most slots of one expert among experts ``lo`` to ``hi - 1``."""
        return max(self.sizes[lo:hi])

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per expert, the sum of ``values`` ([..., T, k]) over its slots: [..., experts]."""
        flat = values.reshape(*values.shape[:-2], -1)
        flat = torch.cat([flat, torch.zeros_like(flat[..., :1])], dim=-1)
        return flat[..., self.padded].sum(-1)


_G3 = 0.3082
"""An upper bound of ``max |G'''(g)| / alpha^2`` for ``G(g) = g sigmoid(alpha g)`` (0.30818, at
``alpha g`` = 1.03): how fast the activation's curvature can change over an error's box."""


@dataclass(frozen=True)
class _Carried:
    """A quantity of a batch of slots as the bound carries it ([E, n, *] float64): its exact value,
    a rigorous bound on a kernel's error, the squared ranges of the error's independent parts (the
    probabilistic tier's sum), its coherent part kept worst-case (``lin``; ``sys`` is the
    systematic test's, which adds MXFP8 clipping), and the predicted mean of the error (signed:
    ``_second_order_mean``), which the coherent part is then the error of."""

    value: torch.Tensor
    err: torch.Tensor
    sq: torch.Tensor
    lin: torch.Tensor
    sys: torch.Tensor
    mean: torch.Tensor | float = 0.0


@dataclass(frozen=True)
class _Rounded:
    """What one declared rounding point adds to a value: its rigorous error, its squared range, and
    the range ``[var_lo, var_hi]`` of its variance under round-to-nearest, where the rounded value's
    place in its cell is uniform (``r^2 / 3`` at the smallest and at the largest half-ulp the value's
    admissible magnitudes allow)."""

    err: torch.Tensor
    sq: torch.Tensor
    var_lo: torch.Tensor
    var_hi: torch.Tensor


def _gemm1_input(
    p: Precision, x64: torch.Tensor, x_in: torch.Tensor, tok: torch.Tensor, we: torch.Tensor, ew: torch.Tensor,
    on_input: bool, u: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The input rows GEMM1 reads and their error. Without the router weight on the input, the
    oracle's own rounding of x (a correct kernel rounds the same x the same way): no error. With
    it (Llama4), the product ``w x`` may round differently on the two sides, so both roundings
    count, with the weight's error."""
    if not on_input:
        xe = x_in[tok]
        return xe, torch.zeros_like(xe)
    prod = x64[tok] * we
    xe = round_to(prod, p.activation_input, p.mx_rule)
    e_x = x64[tok].abs() * ew + u * prod.abs()
    if p.activation_input != "fp64":
        e_x = e_x + 2 * rounding_bound(p.activation_input, prod.abs(), e_x, p.mx_rule)
    return xe, e_x


def _accumulated(a: _Carried, w: torch.Tensor, bias: torch.Tensor, u: float) -> _Carried:
    """``a @ w^T + bias`` accumulated in the declared format: Higham's ``gamma(K + 2)`` on each
    row's sum of magnitudes (rigorous), one independent rounding per product and per sum (their
    squared ranges), and the input's errors carried through ``|W|`` (its independent ones through
    ``|W|^2``, its coherent ones and its mean through ``|W|`` and ``W``: the GEMM is linear)."""
    mag_w = w.abs().mT
    n = w.shape[2] + 2
    value = a.value @ w.mT + bias
    m = (a.value.abs() + a.err) @ mag_w + bias.abs()
    mean = a.mean @ w.mT if isinstance(a.mean, torch.Tensor) else 0.0
    return _Carried(
        value=value,
        err=a.err @ mag_w + _gamma(n, u) * m,
        sq=a.sq @ (mag_w**2) + n * ((u + _U64) * m) ** 2,
        lin=a.lin @ mag_w,
        sys=a.sys @ mag_w,
        mean=mean,
    )


def _declared_rounding(p: Precision, point: str, c: _Carried, bias: torch.Tensor) -> _Rounded | None:
    """The rounding of a GEMM's output at ``point``: of its product, or of product plus bias
    (``Precision.bias_after_rounding``), and Marlin's second rounding of the bias add in that format
    (``Precision.bias_add_rounds``), its own independent error. None where the point keeps float64."""
    if point == "fp64":
        return None
    zero = torch.zeros_like(c.value)
    rounded = (c.value - bias if p.bias_after_rounding else c.value).abs()
    r = rounding_bound(point, rounded, c.err)
    r_lo = rounding_bound(point, torch.clamp(rounded - c.err, min=0.0), zero)
    if p.bias_add_rounds:
        value, known = c.value.abs(), c.err + r
        r_add = rounding_bound(point, value, known)
        r_add_lo = rounding_bound(point, torch.clamp(value - known, min=0.0), zero)
    else:
        r_add = r_add_lo = zero
    return _Rounded(err=r + r_add, sq=r**2 + r_add**2, var_lo=(r_lo**2 + r_add_lo**2) / 3,
                    var_hi=(r**2 + r_add**2) / 3)  # fmt: skip


def _beyond(distance: torch.Tensor, e: torch.Tensor, q: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
    """An upper bound of ``E[(X - distance)+]`` for an error X within ``e`` (rigorous) whose
    independent part has squared ranges ``q`` and whose mean is at most ``lin``: how far, on average,
    X passes a clamp's kink at ``distance``. At most ``e - distance`` (rigorous), and at most
    ``integral over t > d of exp(-t^2 / 2q) = sqrt(pi q / 2) erfc(d / sqrt(2q))`` plus ``-d`` where
    ``d = distance - lin`` is negative (Hoeffding's tail of the independent part)."""
    reach = torch.clamp(e - distance, min=0.0)
    d = distance - lin
    qs = torch.where(q > 0, q, 1.0)
    tail = torch.sqrt(math.pi * qs / 2) * torch.special.erfc(torch.clamp(d, min=0.0) / torch.sqrt(2 * qs))
    tail = torch.where(q > 0, tail, 0.0) + torch.clamp(-d, min=0.0)
    return torch.minimum(reach, tail)


def _second_order_mean(
    g: torch.Tensor, shift: torch.Tensor, e_g: torch.Tensor, e_u: torch.Tensor, q_g: torch.Tensor,
    acc_g: torch.Tensor, l_g: torch.Tensor, l_u: torch.Tensor, var_lo: torch.Tensor, var_hi: torch.Tensor,
    smooth: torch.Tensor, alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The mean of the activation's second-order term ``G''(xi) dg^2 (S + du) / 2``, ``S = u + beta``:
    (its prediction, signed; what bounds the prediction's error, kept worst-case).

    ``E[dg^2]`` is the sum of the variances of ``dg``'s independent parts and its mean squared. The
    declared rounding of GEMM1's output is one of those parts, and under round-to-nearest its
    variance is known: ``r^2 / 3`` (``_declared_rounding``), between ``var_lo`` and ``var_hi`` where
    the value's binade is not. So the mean is predicted, ``G''(g) S (var_lo + var_hi) / 4``, and only
    what the prediction does not know stays worst-case: the accumulation's roundings (``acc_g``; each
    at most its squared range) and the mean of ``dg`` (``l_g``), as before; half the binade's spread;
    the change of ``G''`` over the error's box (``|G'''| <= 0.3082 alpha^2``); and ``E[du]`` (``l_u``)
    times the rounding's variance. Where a clamp's kink lies within the gate's box (not ``smooth``),
    or where that leaves more than no prediction would, no prediction: ``alpha (|S| + e_u)(q_g +
    l_g^2) / 4`` with every part at its second moment's largest, as for any other arithmetic."""
    s = torch.sigmoid(alpha * g)
    g2 = alpha * s * (1 - s) * (2 + alpha * g * (1 - 2 * s))  # G''(g)
    predicted = 0.25 * g2 * shift * (var_lo + var_hi)
    second = acc_g + l_g**2  # what E[dg^2] holds besides the rounding's variance, at most
    spread = 0.25 * alpha * (shift.abs() + e_u) * second + 0.25 * g2.abs() * shift.abs() * (var_hi - var_lo)
    spread = spread + 0.5 * _G3 * alpha**2 * e_g * (shift.abs() + e_u) * (var_hi + second)
    spread = spread + 0.5 * g2.abs() * var_hi * l_u
    worst = 0.25 * alpha * (shift.abs() + e_u) * (q_g + l_g**2)
    # Either pair is a valid one: keep the prediction where what it leaves is the smaller (a large
    # rigorous box, wide inputs', can make the change of G'' over it the larger term)
    use = smooth & (spread < worst)
    return torch.where(use, predicted, 0.0), torch.where(use, spread, worst)


def _activation(
    h: _Carried, rounded: _Rounded | None, accumulation: torch.Tensor, layout: str, alpha: float, beta: float,
    limit: float | None, activation_ulps: float, u: float,
) -> tuple[_Carried, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The activation ``f = G(g) (u + beta)``, ``G(g) = g sigmoid(alpha g)``, of GEMM1's output ``h``
    (rounded as ``rounded`` says; ``accumulation``: the squared ranges of its accumulation's
    roundings), with the clamps of ``limit``; and its slopes ``(df/dg, df/du)`` at the exact point,
    zero where a clamp binds (``SlotTerms.bias13_effect``).

    Rigorous: ``|df/dg| E_g + |df/du| E_u + E_g E_u |G'| + E_g^2 (|S| + E_u) alpha / 4``, plus the
    evaluation's own error. Probabilistic (docs/bound.md, "The activation's second-order terms"):
    each elementary error moves the activation by at most its range times the largest slope over
    the box the rigorous errors allow (McDiarmid's inequality, Hoeffding's tail), so the squared
    ranges are taken at those slopes; the second-order terms' mean is predicted where it can be
    (``_second_order_mean``). Where a clamp binds even at the far end of every admissible error,
    the clamped value is the limit itself, exactly: that input's errors reach nothing after it. Where
    a clamp's kink lies within an input's box, the error's mean moves by as much as the input passes
    the kink on average (``_beyond``), kept worst-case."""
    g, up = split_gate_up(h.value, layout)
    e_g, e_u = split_gate_up(h.err, layout)
    q_g, q_u = split_gate_up(h.sq, layout)
    l_g, l_u = split_gate_up(h.lin, layout)
    acc_g = split_gate_up(accumulation, layout)[0]
    zero = torch.zeros_like(g)
    var_lo, var_hi = (zero, zero) if rounded is None else (
        split_gate_up(rounded.var_lo, layout)[0], split_gate_up(rounded.var_hi, layout)[0])  # fmt: skip
    kink_g = kink_u = zero
    smooth = torch.ones_like(g, dtype=torch.bool)
    free_g = free_u = None
    if limit:
        free_g, free_u = g <= limit, up.abs() <= limit  # where the clamps pass a change of the bias
        held_g, held_u = g - e_g >= limit, up.abs() - e_u >= limit
        gate = (e_g, q_g, l_g, acc_g, var_lo, var_hi)
        e_g, q_g, l_g, acc_g, var_lo, var_hi = (torch.where(held_g, 0.0, v) for v in gate)
        e_u, q_u, l_u = (torch.where(held_u, 0.0, v) for v in (e_u, q_u, l_u))
        kink_g = _beyond((limit - g).abs(), e_g, q_g, l_g)
        kink_u = _beyond((limit - up).abs(), e_u, q_u, l_u) + _beyond((limit + up).abs(), e_u, q_u, l_u)
        smooth = (limit - g).abs() >= e_g
        g, up = torch.clamp(g, max=limit), torch.clamp(up, min=-limit, max=limit)
    s = torch.sigmoid(alpha * g)
    gated = g * s
    d_gated = s * (1 + alpha * g * (1 - s))  # G'(g)
    shift = up + beta
    a = gated * shift
    dg, du = d_gated.abs() * shift.abs(), gated.abs()
    second = d_gated.abs() * e_g * e_u + 0.5 * alpha * e_g**2 * (shift.abs() + e_u)  # |G''| <= alpha / 2
    evaluation = activation_ulps * u * gated.abs() * (up.abs() + abs(beta))
    slope_g = d_gated.abs() + 0.5 * alpha * e_g  # |G'| over the box
    dg_box, du_box = slope_g * (shift.abs() + e_u), gated.abs() + slope_g * e_g
    mean, spread = _second_order_mean(g, shift, e_g, e_u, q_g, acc_g, l_g, l_u + kink_u, var_lo, var_hi, smooth, alpha)
    coherent = dg * l_g + du * l_u + d_gated.abs() * l_g * l_u + spread + dg_box * kink_g + du_box * kink_u
    out = _Carried(
        value=a,
        err=dg * e_g + du * e_u + second + evaluation,
        sq=dg_box**2 * q_g + du_box**2 * q_u + evaluation**2,
        lin=coherent,
        sys=coherent,
        mean=mean,
    )
    dfg, dfu = d_gated * shift, gated
    if free_g is not None:
        dfg, dfu = dfg * free_g, dfu * free_u
    return out, (dfg, dfu)


def _rounded_intermediate(p: Precision, a: _Carried) -> _Carried:
    """The activation as GEMM2 reads it. An MXFP8 intermediate is rounded by the oracle too
    (``_mx_intermediate``); its cells are too coarse for the mean of the error before the rounding
    to say what the mean after it is, so the predicted mean joins the coherent part there. Any
    other declared rounding adds an independent error, mean zero."""
    if p.intermediate == "mxfp8":
        moved = abs(a.mean)
        value, err, sq, lin, sys = _mx_intermediate(a.value, a.err, a.sq, a.lin + moved, a.sys + moved, p.mx_rule)
        return _Carried(value, err, sq, lin, sys)
    if p.intermediate == "fp64":
        return a
    r = rounding_bound(p.intermediate, a.value.abs(), a.err, p.mx_rule)
    return dataclasses.replace(a, err=a.err + r, sq=a.sq + r**2)


def _with_rounding(c: _Carried, rounded: _Rounded | None) -> _Carried:
    """``c`` with a declared rounding's error added (independent, mean zero)."""
    if rounded is None:
        return c
    return dataclasses.replace(c, err=c.err + rounded.err, sq=c.sq + rounded.sq)


def _combined(
    p: Precision, k: int, u: float, val: torch.Tensor, err: torch.Tensor, mag: torch.Tensor, sq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k sum of each token's slots ([T, k, H]): (rigorous error, squared independent
    ranges) of the sum before the output's final rounding. A ``bf16`` combine rounds each slot's
    weighted output, then each of the k - 1 partial sums (at most the sum of magnitudes), every one
    an independent rounding of its element; a ``bf16-terms`` sum is float32's after the slots'
    roundings, which the k + 1 roundings of the sum count."""
    combine_err = combine_sq = torch.zeros_like(val[:, 0])
    if p.combine in ("bf16", "bf16-terms"):
        r_slot = rounding_bound("bf16", mag, err)
        err, mag, sq = err + r_slot, mag + r_slot, sq + r_slot**2
        if p.combine == "bf16":
            r_sum = rounding_bound("bf16", mag.sum(1), err.sum(1))
            combine_err, combine_sq = (k - 1) * r_sum, (k - 1) * r_sum**2
    rigorous = err.sum(1) + _gamma(k + 1, u) * mag.sum(1) + combine_err
    return rigorous, sq.sum(1) + (k + 1) * ((u + _U64) * mag.sum(1)) ** 2 + combine_sq


def _final_rounding(point: str, out: torch.Tensor, rigorous: torch.Tensor) -> torch.Tensor:
    """The element's own final rounding to the output's format: one error, not a sum, so worst case
    in both tiers. Half an ulp of the output format plus half an fp32 ulp covers a result rounded
    through fp32 first."""
    final = rounding_bound(point, out.abs(), rigorous)
    if point in ("bf16", "fp16"):
        final = final + rounding_bound("fp32", out.abs(), rigorous)
    return final


def reference_and_bound(inputs: CaseInputs, arithmetic: Arithmetic) -> Bounded:
    """The oracle's output for ``inputs`` and the per-element bound for ``arithmetic``: the layer
    recomputed slot by slot with every declared error carried (``_Carried``) through GEMM1
    (``_accumulated``), its output's rounding (``_declared_rounding``), the activation
    (``_activation``), the intermediate's rounding (``_rounded_intermediate``), GEMM2, the expert
    output's rounding, the routing weights, the combine (``_combined``) and the final rounding
    (``_final_rounding``)."""
    case = inputs.case
    p = arithmetic.precision
    u = ACCUMULATORS[arithmetic.accumulate]
    w = inputs.weights
    on_input = case.routing == "Llama4"
    ref = inputs.reference(oracle_precision(arithmetic))
    routing = route(inputs.router_logits, case.top_k, case.routing, **inputs.routing_kwargs)
    t, k, hidden = case.tokens, case.top_k, w.hidden_size
    dev = inputs.x.device
    ids = routing.ids
    if inputs.expert_map is not None:
        ids = inputs.expert_map.to(dev, torch.int64)[ids]
    wts = routing.weights
    e_w = arithmetic.routing_ulps * u * wts.abs()
    if p.routing_weights != "fp64":  # also on the input (Llama4): the kernel scales x by the rounded weight
        e_w = e_w + rounding_bound(p.routing_weights, wts.abs(), e_w)

    x64 = inputs.x.to(torch.float64)
    flat_n = t * k
    # Per routed slot (row token * k + slot; one spare row last, where padding writes), [T*k+1, *]:
    val = torch.zeros(flat_n + 1, hidden, dtype=torch.float64, device=dev)  # each slot's weighted output
    err = torch.zeros_like(val)
    mag = torch.zeros_like(val)
    sq = torch.zeros_like(val)  # probabilistic tier: sum of squared independent error ranges
    lin = torch.zeros_like(val)  # probabilistic tier: the parts kept worst-case
    coh = torch.zeros_like(val)  # lin's counterpart for the systematic test, summed over each token's slots
    mean = torch.zeros_like(val)  # the predicted mean of each slot's error
    # kept for harness.judge.systematic, in float32: directions and sizes to 1e-7 are plenty for a test
    # whose threshold is z ~ 7, and DeepSeek-V3 at T=4096 holds 1.9 GB per tensor even so
    act = torch.zeros(flat_n + 1, w.intermediate_size, dtype=torch.float32, device=dev)
    act_sq = torch.zeros_like(act)
    bias13 = torch.zeros_like(act) if w.w13_bias is not None else None
    factor = torch.zeros(flat_n + 1, dtype=torch.float64, device=dev)
    alpha = case.alpha if case.activation == "swigluoai" else 1.0
    beta = case.beta if case.activation == "swigluoai" else 0.0
    limit = case.limit if case.activation == "swigluoai" else None
    x_in = round_to(x64, p.activation_input, p.mx_rule)
    wts_flat, e_w_flat = wts.reshape(-1), e_w.reshape(-1)
    groups = ExpertSlots.of(ids)
    if groups.experts and groups.experts[-1] >= w.num_experts:
        raise ValueError(f"routing names expert {groups.experts[-1]} of a layer of {w.num_experts}")
    two_i = 2 * w.intermediate_size
    # Experts a batch at a time, padded to the batch's most slots: a padded slot reads token 0 and
    # writes the spare row, so it changes nothing. Weights: w13, w2, their magnitudes, |w2|^2.
    weights_each = 7 * hidden * w.intermediate_size
    for lo_e, hi_e in groups.chunks(24 * two_i, _BOUND_BATCH, weights_each, _BOUND_BATCH):
        chunk = groups.experts[lo_e:hi_e]
        idx = groups.padded[lo_e:hi_e, : groups.width(lo_e, hi_e)]  # [E, n]; padding is flat_n
        valid = idx < flat_n
        at = torch.where(valid, idx, 0)
        tok = at // k
        we, ew = wts_flat[at].unsqueeze(-1), e_w_flat[at].unsqueeze(-1)  # [E, n, 1]
        w1 = torch.stack([dequantize_mxfp4(w.w13_blocks[e], w.w13_scales[e]) for e in chunk])  # [E, 2I, H]
        w2 = torch.stack([dequantize_mxfp4(w.w2_blocks[e], w.w2_scales[e]) for e in chunk])  # [E, H, I]
        if w.w13_bias is None:
            b1 = torch.zeros(len(chunk), 1, w1.shape[1], dtype=torch.float64, device=dev)
        else:
            b1 = w.w13_bias[chunk].double().unsqueeze(1)  # [E, 1, 2I]
        if w.w2_bias is None:
            b2 = torch.zeros(len(chunk), 1, w2.shape[1], dtype=torch.float64, device=dev)
        else:
            b2 = w.w2_bias[chunk].double().unsqueeze(1)  # [E, 1, H]
        xe, e_x = _gemm1_input(p, x64, x_in, tok, we, ew, on_input, u)
        # an error of x reaches every row: coherent, kept worst-case
        h = _accumulated(_Carried(xe, e_x, torch.zeros_like(xe), e_x, e_x), w1, b1, u)
        accumulation = h.sq
        rounded = _declared_rounding(p, p.gemm1_output, h, b1)
        a, (dfg, dfu) = _activation(_with_rounding(h, rounded), rounded, accumulation, w.w13_layout, alpha, beta,
                                    limit, arithmetic.activation_ulps, u)  # fmt: skip
        a = _rounded_intermediate(p, a)
        y = _accumulated(a, w2, b2, u)
        y = _with_rounding(y, _declared_rounding(p, p.expert_output, y, b2))
        rows = torch.where(valid, idx, flat_n)  # each routed slot once; padding to the spare row
        act[rows], act_sq[rows] = a.value.float(), a.sq.float()
        if bias13 is not None:
            bg, bu = split_gate_up(b1.expand(-1, a.value.shape[1], -1), w.w13_layout)
            bias13[rows] = (dfg * bg + dfu * bu).float()
        if on_input:
            val[rows], err[rows], mag[rows] = y.value, y.err, y.value.abs() + y.err
            sq[rows], lin[rows], coh[rows], mean[rows] = y.sq, y.lin, y.sys, y.mean
            factor[rows] = 1.0
        else:
            factor[rows] = we.squeeze(-1)
            val[rows] = we * y.value
            err[rows] = we.abs() * y.err + ew * (y.value.abs() + y.err)
            mag[rows] = (we.abs() + ew) * (y.value.abs() + y.err)
            # A token's routing weights come from one softmax: their errors are shared, worst-case.
            sq[rows] = we**2 * y.sq
            lin[rows] = we.abs() * y.lin + ew * (y.value.abs() + y.err)
            coh[rows] = we.abs() * y.sys + ew * (y.value.abs() + y.err)
            mean[rows] = we * y.mean
    val, err, mag, sq, lin, coh, mean = (v[:flat_n].reshape(t, k, hidden) for v in (val, err, mag, sq, lin, coh, mean))
    inter = w.intermediate_size
    act, act_sq = act[:flat_n].reshape(t, k, inter), act_sq[:flat_n].reshape(t, k, inter)
    bias13 = None if bias13 is None else bias13[:flat_n].reshape(t, k, inter)
    factor = factor[:flat_n].reshape(t, k)
    # each token's slots in ascending expert order, one after another (as the systematic test reads it)
    coherent = torch.zeros(t, hidden, dtype=torch.float64, device=dev)
    by_expert = torch.argsort(ids, dim=1)
    for j in range(k):
        coherent = coherent + coh.gather(1, by_expert[:, j, None, None].expand(-1, 1, hidden)).squeeze(1)
    out = val.sum(1)
    shift = mean.sum(1)
    rigorous, q_out = _combined(p, k, u, val, err, mag, sq)
    final = _final_rounding(_DTYPE_POINT[p.output], out, rigorous)
    rigorous = rigorous + final
    # the predicted mean enters as its size: the bound stays centred on the exact layer
    probabilistic = LAMBDA * q_out.sqrt() + lin.sum(1) + shift.abs() + final
    # The bound's own pass recomputes the layer: it must agree with the oracle, or the two code
    # paths disagree about the math and neither the bound nor the verdict can be trusted.
    scale = mag.sum(1)
    if not torch.all((out - ref).abs() <= 1e-10 * (scale + ref.abs()) + 1e-300):
        raise AssertionError("harness.judge.bounds disagrees with reference.moe on this case: a harness bug")
    terms = SlotTerms(
        ids=ids,
        slot_out=val.float(),
        weight=factor,
        intermediate=act,
        intermediate_sq=act_sq,
        variance=q_out + final**2,
        coherent=coherent,
        mean=shift,
        bias13_effect=bias13,
    )
    return Bounded(ref=ref, rigorous=rigorous, probabilistic=probabilistic, terms=terms)


def tied_tokens(inputs: CaseInputs) -> torch.Tensor:
    """Which tokens' top-k boundary is an exact tie (bool [T]): there a kernel may pick either
    expert. The engine's cases are tie-free by construction; a model's real bf16 logits are not."""
    c = inputs.case
    return topk_margin(inputs.router_logits, c.top_k, c.routing, **inputs.selection_kwargs) == 0


def tie_aware_bound(
    inputs: CaseInputs, arithmetic: Arithmetic
) -> tuple[Bounded | Callable[[torch.Tensor], Bounded], int]:
    """The oracle and bound of ``inputs``, and the number of tokens whose top-k boundary is an
    exact tie. With such tokens, a function of the backend's output instead: on each tied token it
    takes whichever resolution of the tie the output is closer to (ties to the lower index, as the
    oracle breaks them, or to the higher), judged by the worst error/bound of that token's row.
    The higher-index resolution nudges the logits, which is exact where selection orders the
    logits themselves (Renormalize, GPT-OSS's routing, and the other logit-ordered methods)."""
    low = reference_and_bound(inputs, arithmetic)
    tied = tied_tokens(inputs)
    n = int(tied.sum())
    if n == 0:
        return low, 0
    z = inputs.router_logits.to(torch.float64)
    # Nudge each logit up by a sliver of the smallest gap between distinct logits of its row, more
    # for higher indices: exact ties now resolve to the higher index, no other order changes, and
    # the routing weights move by about 2^-30 of a gap (far below any bound).
    srt = torch.sort(z, dim=1).values
    gaps = srt.diff(dim=1)
    gaps = torch.where(gaps > 0, gaps, torch.full_like(gaps, math.inf)).amin(dim=1, keepdim=True)
    gaps = torch.where(torch.isfinite(gaps), gaps, torch.ones_like(gaps))
    e = z.shape[1]
    nudge = gaps * 2.0**-30 * torch.arange(e, dtype=torch.float64, device=z.device) / e
    high = reference_and_bound(dataclasses.replace(inputs, router_logits=z + nudge), arithmetic)

    def choose(got: torch.Tensor) -> Bounded:
        g = got.to(torch.float64)

        def row_worst(b: Bounded) -> torch.Tensor:
            ratio = (g - b.ref).abs() / b.bound
            return torch.nan_to_num(ratio, nan=math.inf).amax(dim=1)

        rows = (tied & (row_worst(high) < row_worst(low))).unsqueeze(1)
        return Bounded(
            ref=torch.where(rows, high.ref, low.ref),
            rigorous=torch.where(rows, high.rigorous, low.rigorous),
            probabilistic=torch.where(rows, high.probabilistic, low.probabilistic),
        )

    return choose, n
