"""The systematic-error test: faults too small for the per-element bound, caught by their shape.

Why. The bound (``harness.judge.bounds``) judges each element alone, so a fault whose error per element
is below honest rounding passes it: bf16 routing weights in a backend that declares fp32 ones
(relative error up to 2^-9 of each slot, against bf16 output rounding of the same size), or one
E8M0 byte off by one on a block whose share of its element is small. Such errors are not shaped
like rounding, though. Honest rounding errors are sums of many independent, mean-zero elementary
errors; a fault's error is a fixed vector: a token's error lies along one slot's output (a wrong
routing weight, a mis-scaled expert), or, over the tokens of one expert, along the footprint of one
weight block (a wrong scale byte). Projecting the error on that vector adds up what rounding
cancels, the way a matched filter does.

Derivation. ``harness.judge.bounds`` models the error of an element, to first order, as ``sum c_i d_i``
over independent elementary rounding errors ``|d_i| <= r_i`` (mean zero), plus a coherent part
``L`` kept worst-case (routing-weight errors, shared by a token's slots; the activation input's
error; second-order terms). A projection ``P = <e, v>`` of a token's error e on a vector v is then
``sum_i <c_i, v> d_i`` plus at most ``sum_h |v_h| L_h``, and Hoeffding's inequality gives

    P(|P| - sum_h |v_h| L_h >= z * s) <= 2 exp(-z^2 / 2),  s^2 = sum_i <c_i, v>^2 r_i^2.

For one element (v a unit vector) ``s^2`` is the bound's own per-element sum of squared ranges
plus the element's final rounding, which is independent across elements (``SlotTerms.variance``).
Over a token's elements the sources are not all private to one element: an error of the
activation ``a_i`` of slot j reaches every element through ``W2[:, i]``. The exact ``s^2`` moves
those sources from the per-element sum to their projected form:

    s^2 = sum_h v_h^2 (S_h - sum_j w_j^2 sum_i W2_j[h, i]^2 q_ji) + sum_j w_j^2 sum_i (W2_j^T v)_i^2 q_ji

with ``q_ji`` the squared ranges of slot j's activation errors (``SlotTerms.intermediate_sq``) and
``w_j`` its routing weight. Different tokens round independently, so sums of projections over
tokens add their ``s^2`` and their coherent parts.

The hypotheses (each a projection, z = (|P| - coherent) / s):

* slot: the error of token t along slot j's output ``w_j y_j``: a wrong routing weight, a slot
  dropped or doubled, a wrong expert's output;
* expert: the same summed over every slot routed to expert e: an expert scaled wrong;
* bias2, bias13: the same along the expert's change per unit of its biases, ``w_j b2_e`` and
  ``w_j W2_e (df/dg b_gate + df/du b_up)`` (a bias dropped, doubled or another expert's);
* block: the error of output element h over the tokens of expert e along the contribution of w2
  block (h, b) (``w_j sum_{i in b} a_ji W2_e[h, i]``): one E8M0 byte of w2 off (a wrong power of
  two scales exactly that contribution).

With N hypotheses in a case, the union bound over Hoeffding's tails puts the threshold at
``z* = sqrt(2 ln(2 N / ALPHA))``: an honest backend fires with probability at most ALPHA per case
(1e-6: a nightly matrix of ten thousand cases false-alarms with probability under 1%), under the
same model of independent, mean-zero rounding the bound's probabilistic tier rests on. Where that
model fails (a kernel that truncates instead of rounding to nearest, in every step of a long
sum), the test fires: that is a deviation from the declared arithmetic, and the finding says so.

What it cannot see: a fault whose footprint is a single element of a single token is judged by
the bound alone (its z is that element's error over its own range, and the threshold, raised by
the multiplicity, is above the bound's 8); see ``suites/systematic`` for the DeepSeek-V3 case.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mxmoe.harness.contract.platforms import cache_dir
from mxmoe.harness.judge.bounds import Bounded, SlotTerms, significand_bits
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK, dequantize_mxfp4

ALPHA = 1e-6
"""Largest probability that an honest backend fires the test on one case (all hypotheses
together), under the model of independent, mean-zero rounding errors."""
_CHUNK = 1 << 24
"""Float64 elements per block-footprint chunk (128 MiB)."""
_W2_BATCH = 1 << 27
"""Float64 elements of the experts' dequantized w2 the systematic test holds at once (1 GiB: 16 of
gpt-oss's 2880 x 2880)."""


@dataclass(frozen=True)
class Systematic:
    """The test's result on one output: the largest z over every hypothesis, the threshold for
    ALPHA at this many hypotheses, and where the largest z is."""

    z: float
    threshold: float
    hypotheses: int
    family: str
    """``slot``, ``expert``, ``bias2``, ``bias13`` or ``block``: which hypothesis had the largest z."""
    where: str
    """That hypothesis in words ("expert 7's output (token 3, slot 1)")."""

    @property
    def fired(self) -> bool:
        """Whether the error is systematic at the stated false-alarm rate."""
        return self.z > self.threshold

    def finding(self) -> str:
        """One line for a reason or a report."""
        verdict = "error correlates with" if self.fired else "largest projection:"
        return (f"{verdict} {self.where}, z = {self.z:.3g} (threshold {self.threshold:.3g} for a false-alarm "
                f"rate {ALPHA:g} per case over {self.hypotheses} projections)")  # fmt: skip


def threshold(hypotheses: int, alpha: float = ALPHA) -> float:
    """z* with ``hypotheses * 2 exp(-z*^2 / 2) = alpha``: the union bound over Hoeffding's tails."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1); got {alpha!r}")
    return math.sqrt(2.0 * math.log(2.0 * max(hypotheses, 1) / alpha))


def _excess(p: torch.Tensor, coherent: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """z of each projection: what exceeds the coherent allowance, over the Hoeffding scale; 0
    where no independent error reaches the projection (then it is zero too, or coherent)."""
    over = torch.clamp(p.abs() - coherent, min=0.0)
    return torch.where(s2 > 0, over / s2.clamp(min=1e-300).sqrt(), torch.zeros_like(over))


class _Best:
    """The largest z seen, and where."""

    def __init__(self) -> None:
        self.z, self.family, self.where = 0.0, "slot", "nothing"

    def offer(self, z: torch.Tensor, family: str, where: object) -> None:
        """``z``'s largest (the first, in row-major order, where several are) if it beats the best so
        far; ``where(flat index)`` says where it is in words, or gives ``(family, words)``."""
        if z.numel() == 0:
            return
        flat = int(torch.argmax(z))
        value = float(z.reshape(-1)[flat])
        if value > self.z:
            self.z, self.family = value, family
            said = where(flat) if callable(where) else str(where)
            if isinstance(said, tuple):
                self.family, said = said
            self.where = said


def _bias_directions(weights: MoEWeights, terms: SlotTerms, device: torch.device) -> dict[str, torch.Tensor]:
    """Each slot's output change per unit of its expert's biases, [T, k, H]: ``w_j b2_e`` (a b2
    fault) and ``w_j W2_e (df/dh . b13_e)`` (a b13 fault, carried through the activation's
    derivative). Only the families the layer has (no biases, or a zero b2 on a TP rank: none)."""
    out: dict[str, torch.Tensor] = {}
    ids, factor = terms.ids, terms.weight
    t, k, hidden = terms.slot_out.shape
    routed = ids >= 0
    if weights.w2_bias is not None and bool((weights.w2_bias != 0).any()):
        b2 = weights.w2_bias.to(device=device, dtype=torch.float64)
        out["bias2"] = torch.where(routed.unsqueeze(-1), b2[ids.clamp(min=0)] * factor.unsqueeze(-1), 0.0).float()
    if terms.bias13_effect is not None and weights.w13_bias is not None:
        v = torch.zeros(t, k, hidden, dtype=torch.float32, device=device)
        groups = terms.groups
        for e, tok, slot in zip(groups.experts, groups.tokens, groups.slots, strict=True):
            w2 = _w2(weights, e, device)
            d = terms.bias13_effect[tok, slot].double() * factor[tok, slot].unsqueeze(1)
            v[tok, slot] = (d @ w2.T).float()
        out["bias13"] = v
    return out


KEPT_W2_DTYPE = torch.bfloat16
"""What ``_w2`` keeps the dequantized w2 in between a case's backends. Exact: an MXFP4 value is an
E2M1 code (two mantissa bits) times a power of two from 2^-127 to 2^127, and bfloat16 has float32's
exponent range, subnormals down to 2^-133 and seven mantissa bits, so every value rounds to itself,
and the few past bfloat16's (and float32's) largest finite become infinite in both. Half float32's
bytes: a worker on a gpt-oss-120b case held 4.0 GiB of it in float32, all 128 experts', beside
every other thing its case keeps (2.0 in bfloat16, on an H100: the records' ``held: case`` at the
second test of a T=4096 case fell from 6.8 to 4.8 GiB); a GPU's share fits fewer such cases the
more each holds."""


def _w2(weights: MoEWeights, e: int, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Expert ``e``'s w2 dequantized, float64 on ``device`` (or ``dtype``). Kept per pair of w2
    tensors, as the norms are (``_per_tensors``): the backends checked on one case's inputs
    dequantize each expert once, not once each. Kept in bfloat16 (``KEPT_W2_DTYPE``)."""
    kept = _per_tensors(weights, "w2")
    if e not in kept:
        kept[e] = dequantize_mxfp4(weights.w2_blocks[e], weights.w2_scales[e]).to(KEPT_W2_DTYPE)
    return kept[e].to(device=device, dtype=dtype)


def systematic_test(
    weights: MoEWeights, bounded: Bounded, got: torch.Tensor, alpha: float = ALPHA
) -> Systematic | None:
    """Project ``got``'s error (against ``bounded.ref``) on every hypothesis of the package
    docstring. None when it does not apply: the bound carries no slot terms (a tie, a sharded
    bound), or an element is not finite (the bound has already failed it)."""
    terms = bounded.terms
    if terms is None or got.numel() == 0:
        return None
    err = got.to(torch.float64) - bounded.ref - terms.mean  # less its predicted mean (SlotTerms.mean)
    if not bool(torch.isfinite(err).all()):
        return None
    t, k, hidden = terms.slot_out.shape
    var, coh = terms.variance, terms.coherent
    ids = terms.ids
    # Directions per slot: the slot's weighted output (a wrong weight, a wrong expert), and its
    # change per unit of its expert's biases. P[t, j] = <e_t, v_tj> for each.
    dirs = {"slot": terms.slot_out, **_bias_directions(weights, terms, err.device)}
    proj = {}
    for name, d in dirs.items():
        v = d.double()
        proj[name] = [torch.einsum("th,tjh->tj", err, v), torch.einsum("th,tjh->tj", coh, v.abs()),
                      torch.einsum("th,tjh->tj", var, v**2)]  # every source private to its element, as yet  # fmt: skip
    best = _Best()
    groups = terms.groups
    experts = groups.experts
    # Experts a batch at a time (``ExpertSlots.chunks``), each padded to the batch's most slots; a padded
    # slot has weight 0, so each of its terms is 0 and it adds nothing anywhere.
    flat_n = t * k
    inter = terms.intermediate.reshape(flat_n, -1)
    inter_sq = terms.intermediate_sq.reshape(flat_n, -1)
    weight_flat = terms.weight.reshape(-1)
    nb = inter.shape[1] // BLOCK
    # each routed slot's change to its token's k projections, summed over the slots at the end
    change = {name: torch.zeros(flat_n + 1, k, dtype=torch.float64, device=err.device) for name in dirs}
    block_max, block_at = [], []
    for lo_e, hi_e in groups.chunks(nb * hidden, _CHUNK, hidden * inter.shape[1], _W2_BATCH):
        width = groups.width(lo_e, hi_e)
        idx = groups.padded[lo_e:hi_e, :width]  # [E, n] flat slot indices; padding is flat_n
        valid = idx < flat_n
        at = torch.where(valid, idx, 0)
        tok = at // k
        w2 = torch.stack([_w2(weights, e, err.device, torch.float32) for e in experts[lo_e:hi_e]]).double()  # [E, H, I]
        wt = torch.where(valid, weight_flat[at], 0.0)  # [E, n]
        q = inter_sq[at].double() * (wt**2).unsqueeze(-1)  # [E, n, I]: each slot's activation errors, weighted
        # those errors reach every element of the token: take their private share back out ...
        private = q @ (w2**2).mT  # [E, n, H]
        for name, d in dirs.items():
            v = d[tok].double()  # [E, n, k, H]
            # ... and put them in projected: (W2^T v)_i^2 q_i, for every projection of the token
            # (one product per expert over all its slots' k directions: w2 is read once per expert)
            vw = (v.reshape(v.shape[0], -1, hidden) @ w2).reshape(*v.shape[:3], -1)  # [E, n, k, I]
            change[name][idx] = (torch.einsum("enji,eni->enj", vw**2, q)
                                 - torch.einsum("enh,enjh->enj", private, v**2))  # fmt: skip
        # block footprints: over each expert's slots, element h along w_j sum_{i in b} a_ji W2[h, i]
        a = (inter[at].double() * wt.unsqueeze(-1)).reshape(hi_e - lo_e, width, nb, BLOCK)
        wb = w2.reshape(hi_e - lo_e, hidden, nb, BLOCK)
        p_blk = torch.zeros(hi_e - lo_e, nb, hidden, dtype=torch.float64, device=err.device)
        c_blk, s2_blk = torch.zeros_like(p_blk), torch.zeros_like(p_blk)
        step = max(1, _CHUNK // ((hi_e - lo_e) * nb * hidden))
        for lo in range(0, width, step):
            f = torch.einsum("enbi,ehbi->enbh", a[:, lo : lo + step], wb)  # [E, n, nb, H]
            rows = tok[:, lo : lo + step]
            p_blk += torch.einsum("enbh,enh->ebh", f, err[rows])
            c_blk += torch.einsum("enbh,enh->ebh", f.abs(), coh[rows])
            s2_blk += torch.einsum("enbh,enh->ebh", f**2, var[rows])
        z = _excess(p_blk, c_blk, s2_blk).reshape(hi_e - lo_e, -1)  # [E, nb * H]
        where = torch.argmax(z, dim=1, keepdim=True)  # each expert's first largest, kept on the device
        block_max.append(z.gather(1, where).squeeze(1))
        block_at.append(where.squeeze(1))
    for name in dirs:
        proj[name][2] = proj[name][2] + change[name][:flat_n].reshape(t, k, k).sum(1)
    routed = ids >= 0
    p_slot, c_slot, s2_slot = proj["slot"][0], proj["slot"][1], proj["slot"][2].clamp(min=0.0)
    z_slot = torch.where(routed, _excess(p_slot, c_slot, s2_slot), torch.zeros_like(p_slot))
    flat_ids = ids.reshape(-1)
    best.offer(z_slot, "slot", lambda f: f"expert {int(flat_ids[f])}'s output (token {f // k}, slot {f % k})")
    # Each expert's sum over its slots, every family at once: [experts, families], offered in the
    # order expert by expert, family by family (the first largest wins, as one offer each would).
    what = {"slot": "output", "bias2": "w2 bias (b2)", "bias13": "w13 bias (b13, through the activation)"}
    family = {"slot": "expert"}
    names = list(proj)
    z_expert = torch.stack(
        [_excess(*groups.sums(torch.stack([p_, c_, s2_.clamp(min=0.0)]))) for p_, c_, s2_ in proj.values()], dim=-1
    ) if experts else torch.zeros(0, len(names), dtype=torch.float64, device=err.device)  # fmt: skip
    sizes = groups.sizes
    best.offer(z_expert, "expert", lambda f: (family.get(names[f % len(names)], names[f % len(names)]),
               f"expert {experts[f // len(names)]}'s {what[names[f % len(names)]]} over its "
               f"{sizes[f // len(names)]} tokens"))  # fmt: skip
    if block_max:
        at = torch.cat(block_at).tolist()

        def block_words(i: int) -> str:
            b, row = divmod(at[i], hidden)
            return (f"the contribution of expert {experts[i]}'s w2 block (row {row}, block {b}: columns "
                    f"{BLOCK * b}..{BLOCK * b + BLOCK - 1})")  # fmt: skip

        best.offer(torch.cat(block_max), "block", block_words)
    n = int(routed.sum()) + z_expert.numel() + len(experts) * nb * hidden
    return Systematic(z=best.z, threshold=threshold(n, alpha), hypotheses=n, family=best.family, where=best.where)


_NORMS: dict[str, float] = {}
"""Squared spectral norms of dequantized w2 matrices (upper bounds: ``norm2_upper_bounds``), by a
digest of their bytes: a sweep judges many backends on one layer. They are also kept on disk, by
the same digest, under the cache (``platforms.cache_dir``): a second sign-off on a machine
computes none."""
_NORMS_MAX = 1 << 14
_NORMS_FOLDER = "spectral-norms"
_SVD_SLACK = 1e-4
"""Relative allowance for the float32 SVD's own error (a few float32 ulps of the norm)."""
_SQUARINGS = 14
"""Squarings of the Gram matrix behind a norm computed on a GPU: the bound is at most
``rank ** (1 / 2 ** (_SQUARINGS + 1))`` times the true squared norm (1 + 2.4e-4 at rank 2880)."""
_POWER_SLACK = 1e-6
"""Relative allowance for the float64 rounding of those products (about 1e-9 of the result at
gpt-oss sizes, worst case)."""
_POWER_BATCH = 8
"""Matrices squared at once on a GPU (8 x 66 MB at gpt-oss's 2880 x 2880, and two temporaries)."""


def norm2_upper_bounds(mats: list[torch.Tensor]) -> list[float]:
    """Upper bounds of ``||W||_2^2``, one per matrix, tight to a few 1e-4.

    Why two ways. On a CPU, a float32 SVD (rounded up by its own error, ``_SVD_SLACK``) is the
    cheaper: about 3 s at 2880 x 2880 on two cores. On a GPU the SVD is the slow part of the
    energy test (0.4 s per matrix on an H200, about a minute for gpt-oss-120b's 128 experts), while
    a float64 matrix product of that size takes about a millisecond. There the bound comes from
    the Gram matrix ``G = W^T W`` (or ``W W^T``, the smaller) by repeated squaring:
    ``||W||_2^2 = lambda_max(G)`` and, for ``k = 2 ** m``, ``lambda_max(G)^k = ||G^k||_2 <= ||G^k||_F
    <= rank^(1/2) lambda_max(G)^k``, so ``||G^k||_F ** (1 / k)`` is an upper bound at most
    ``rank ** (1 / 2k)`` times too large. Each square is normalized by its Frobenius norm (no
    overflow; the logarithms of the norms carry the scale), in float64, and the result is rounded
    up by ``_POWER_SLACK``. Both are upper bounds of the same quantity, so either keeps the energy
    test's false-alarm rate; they differ by at most 3e-4 of the norm."""
    out: list[float] = []
    cpu = [m for m in mats if m.device.type == "cpu"]
    if cpu and len(cpu) != len(mats):
        raise ValueError("norm2_upper_bounds: matrices on more than one device")
    if cpu:
        return [(float(torch.linalg.matrix_norm(m.float(), ord=2)) * (1 + _SVD_SLACK)) ** 2 for m in mats]
    for lo in range(0, len(mats), _POWER_BATCH):
        out += gram_power_bounds(torch.stack([m.double() for m in mats[lo : lo + _POWER_BATCH]])).tolist()
    return out


def gram_power_bounds(w: torch.Tensor, squarings: int = _SQUARINGS) -> torch.Tensor:
    """``norm2_upper_bounds``' GPU way for a batch ``[B, m, n]`` of float64 matrices, on their
    device: ``||G^k||_F ** (1 / k)`` for ``k = 2 ** squarings``, rounded up by ``_POWER_SLACK``."""
    if w.dtype != torch.float64 or w.dim() != 3:
        raise ValueError(f"gram_power_bounds: w must be float64 [B, m, n]; got {w.dtype} {tuple(w.shape)}")
    g = w.mT @ w if w.shape[-1] <= w.shape[-2] else w @ w.mT
    scale = torch.linalg.matrix_norm(g)  # Frobenius, [B]
    log_bound = torch.log(scale)
    b = g / scale.clamp(min=1e-300)[:, None, None]
    for i in range(1, squarings + 1):
        b = b @ b
        c = torch.linalg.matrix_norm(b)
        b = b / c.clamp(min=1e-300)[:, None, None]
        log_bound = log_bound + torch.log(c) * 2.0**-i
    return torch.where(scale > 0, torch.exp(log_bound) * (1 + _POWER_SLACK), torch.zeros_like(scale))


_BY_TENSORS: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, int, int, dict[str, dict]]] = {}
"""What is derived from one weights' w2 tensors (per-expert norms, dequantized matrices, the energy
test's thresholds), by those tensors: every backend checked on one case's inputs reuses it (hashing
gpt-oss-120b's 128 experts for the norms alone takes about 0.4 s)."""


def _digest(blocks: torch.Tensor, scales: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (blocks, scales):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def w2_norm2(blocks: torch.Tensor, scales: torch.Tensor, wait: bool = True) -> float | None:
    """||W2||_2^2 of one expert's MXFP4 w2 (exact to the SVD's float32 error, rounded up). Computed
    once per matrix and kept, in memory and on disk, by a digest of its bytes. Workers of one sweep
    judging the same weights at once do not each compute it: the one computing holds a lock on its
    digest, and another either waits for its result (``wait``) or returns None at once, so that it
    can compute other experts' meanwhile (``fill_w2_norms2``)."""
    key = _digest(blocks, scales)
    if key in _NORMS:
        return _NORMS[key]
    path = cache_dir() / _NORMS_FOLDER / key[:2] / key
    value = _read_norm(path)
    if value is None:
        with _locked(path.with_suffix(".lock"), wait) as held:
            if not held:
                return None
            value = _read_norm(path)  # written by the worker that held the lock before
            if value is None:
                value = norm2_upper_bounds([dequantize_mxfp4(blocks, scales)])[0]
                _write_norm(path, value)
    _keep_norm(key, value)
    return value


def _keep_norm(key: str, value: float) -> None:
    if len(_NORMS) >= _NORMS_MAX:
        _NORMS.clear()
    _NORMS[key] = value


def _write_norm(path: Path, value: float) -> None:
    """Whole or not at all: another worker may read it at once."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(repr(value), encoding="ascii")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: computed again next time


def _read_norm(path: Path) -> float | None:
    try:
        return float(path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(path: Path, wait: bool) -> Iterator[bool]:
    """An exclusive lock on ``path`` (created) for the block; yields whether it is held. Without
    ``wait``, False at once where another process holds it. Where no lock can be taken (a
    read-only cache, a platform without ``fcntl``) it yields True: each computes its own."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+b")  # noqa: SIM115 (closed below, after the lock is released)
    except (ImportError, OSError):
        yield True
        return
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        except OSError:
            yield True
            return
        yield True
    finally:
        f.close()  # releases the lock


def fill_w2_norms2(weights: MoEWeights, experts: list[int]) -> dict[int, float]:
    """``w2_norms2(weights)`` with ``experts`` filled in: first those no other process is computing
    (read from disk, or computed here), then those it is (waiting for its results), so that
    workers on the same weights share the SVDs instead of repeating them."""
    norms = w2_norms2(weights)
    later = []
    with contextlib.ExitStack() as locks:
        mine: list[tuple[int, str, Path]] = []  # computed here, together (a batch on a GPU)
        for e in experts:
            if e in norms:
                continue
            key = _digest(weights.w2_blocks[e], weights.w2_scales[e])
            path = cache_dir() / _NORMS_FOLDER / key[:2] / key
            value = _NORMS.get(key)
            if value is None:
                value = _read_norm(path)
            if value is None:
                if not locks.enter_context(_locked(path.with_suffix(".lock"), False)):
                    later.append(e)  # another process is computing it: waited for at the end
                    continue
                value = _read_norm(path)  # written by the one that held the lock before
            if value is None:
                mine.append((e, key, path))
                continue
            _keep_norm(key, value)
            norms[e] = value
        for lo in range(0, len(mine), _POWER_BATCH):  # dequantized a batch at a time (gpt-oss-120b's: 8.5 GB)
            batch = mine[lo : lo + _POWER_BATCH]
            mats = [dequantize_mxfp4(weights.w2_blocks[e], weights.w2_scales[e]) for e, _, _ in batch]
            for (e, key, path), value in zip(batch, norm2_upper_bounds(mats), strict=True):
                _write_norm(path, value)
                _keep_norm(key, value)
                norms[e] = value
    for e in later:
        norms[e] = w2_norm2(weights.w2_blocks[e], weights.w2_scales[e])
    return norms


def kept_for(weights: MoEWeights) -> dict:
    """What is kept for ``weights``' pair of w2 tensors (``_per_tensors``: dequantized matrices,
    norms, thresholds), or {} where nothing is: a worker counts it among the device memory it holds
    between a case's tests (``sweep.held_parts``)."""
    entry = _BY_TENSORS.get(_tensors_key(weights))
    return {} if entry is None else entry[4]


def _tensors_key(weights: MoEWeights) -> tuple[int, int]:
    """``_BY_TENSORS``' key for ``weights``' pair of w2 tensors."""
    return id(weights.w2_blocks), id(weights.w2_scales)


def _per_tensors(weights: MoEWeights, what: str) -> dict:
    """A dict kept for ``weights``' pair of w2 tensors while they live and are unchanged (their
    version counters), one per ``what``: what is derived from the weights alone is then derived
    once for every backend checked on them (``sweep.check_pair`` shares a case's inputs)."""
    b, s = weights.w2_blocks, weights.w2_scales
    key = _tensors_key(weights)
    entry = _BY_TENSORS.get(key)
    if entry is None or entry[0]() is not b or entry[1]() is not s or entry[2:4] != (b._version, s._version):

        def forget(ref: weakref.ref) -> None:  # the tensors are gone: so is what was derived from them
            if key in _BY_TENSORS and ref in _BY_TENSORS[key][:2]:
                del _BY_TENSORS[key]

        entry = _BY_TENSORS[key] = (weakref.ref(b, forget), weakref.ref(s, forget), b._version, s._version, {})
    return entry[4].setdefault(what, {})


def w2_norms2(weights: MoEWeights) -> dict[int, float]:
    """``w2_norm2`` of the experts of ``weights`` asked for so far, by expert, kept for its w2
    tensors (``_per_tensors``); the caller fills it as it goes (``energy_test``: the routed ones)."""
    return _per_tensors(weights, "norms")


_EXACT_NORM_FLOPS = 1 << 33
"""Multiply-adds one energy test may spend forming per-token covariances (``token_norm_bound``;
about a second on two CPU cores). At gpt-oss's shapes one token costs more, and there the crude
bound is already far below the trace."""
_NORM_BATCH = 1 << 23
"""Elements of the slots' scaled w2 that one batch of tokens holds (32 MiB in float32)."""
_F32_SLACK = 2.0**-22
"""Relative allowance per float32 rounding in ``token_norm_bound`` (twice the unit roundoff)."""


def token_covariances(
    weights: MoEWeights, terms: SlotTerms, tok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The error covariances of tokens ``tok`` as ``token_norm_bound`` forms them: ``sigma`` [n, H, H]
    float32, each token's divided by its ``scale`` [n] (its largest variance, so that float32 holds
    inputs of any range), and ``slack`` [n], in those units: how far the formed matrix, its
    eigenvalues and its Frobenius norm may be from the exact ones (float64, not over 3).

    ``Sigma_t = diag(private) + sum_j w_j^2 W2_j diag(q_j) W2_j^T`` costs ``k H^2 I`` multiply-adds.
    Only the experts these tokens' slots read are dequantized (gpt-oss-120b's 128 are 4.2 GB in
    float32, 2.1 as ``_w2`` keeps them); a slot routed nowhere reads a zero matrix."""
    ids = terms.ids[tok]
    n, k = ids.shape
    hidden, inter = terms.variance.shape[1], terms.intermediate_sq.shape[2]
    dev = terms.variance.device
    experts, where = torch.unique(ids, return_inverse=True)
    zero = torch.zeros(hidden, inter, dtype=torch.float32, device=dev)
    w2 = torch.stack([_w2(weights, e, dev, torch.float32) if e >= 0 else zero for e in experts.tolist()])
    q = terms.intermediate_sq[tok].double() * terms.weight[tok].unsqueeze(-1) ** 2  # [n, k, I]
    variance = terms.variance[tok].double()
    scale = torch.maximum(q.amax(dim=(1, 2)), variance.amax(dim=1)).clamp(min=1e-300)  # [n]
    q = (q / scale[:, None, None]).float()
    a = (w2[where] * q.sqrt().unsqueeze(2)).permute(0, 2, 1, 3).reshape(n, hidden, k * inter)
    gram = a @ a.mT  # [n, H, H]: sum over slots of w^2 W2 diag(q) W2^T
    on_diagonal = (a.double() ** 2).sum(dim=2)  # [n, H]
    # the private part is each element's variance less what its slots' activation errors put there
    # (less at most: those are summed from float32 q, each within _F32_SLACK of its own)
    private = (variance / scale[:, None] - (1 - _F32_SLACK) * on_diagonal).clamp(min=0.0)
    sigma = torch.diag_embed(private.float()) + gram
    # float32 storage of q, the products' sums (k I terms) and the eigensolver (H): within
    # 64 (H + k I) float32 ulps of ||Sigma||. That covers the Frobenius norm too: the formed matrix
    # is within (k I + 8) sqrt(H) + 2 unit roundoffs (2^-24) of ||Sigma||_F of the exact one in
    # Frobenius norm (each gram entry within k I + 6 of sum_m |a_hm a_gm|, whose Frobenius norm is at
    # most ||A||_F^2 = tr(gram) <= sqrt(H) ||gram||_F <= sqrt(H) ||Sigma||_F; the diagonal's two
    # roundings), below the slack's 256 (H + k I) for H up to 65536.
    slack = 64 * (hidden + k * inter) * _F32_SLACK * torch.linalg.matrix_norm(sigma).double()  # [n]
    return sigma, scale, slack


def token_norm_bound(weights: MoEWeights, terms: SlotTerms, crude: torch.Tensor) -> tuple[float, float | None]:
    """An upper bound of ``max_t ||Sigma_t||``, the largest eigenvalue of one token's error covariance
    (``energy_test``), given ``crude`` [T]: each token's cheap bound (its largest private variance plus,
    per slot, ``w^2 ||W2||_2^2 max_i q_i``, over 3).

    Why. On small cases the crude bound is several times the true norm (a slot's activation errors are
    not all at their largest, nor aligned with W2's top singular vector), and the tail's ``2 ||Sigma||
    t`` term made the threshold 3 to 12 times the prediction. The exact norm of a token's covariance
    (``token_covariances``, over 3) costs ``k H^2 I`` to form, so tokens are formed largest crude
    bound first, and the search stops once the next crude bound is below the largest exact norm
    found (it caps every token after it) or the budget (``_EXACT_NORM_FLOPS``) is spent (then that
    crude bound stands for the rest). Each exact norm is rounded up for float32 storage of q and the
    eigensolver's own error.

    A formed token rarely needs the eigensolver, the slow part (on a GPU, milliseconds per token):
    its Frobenius norm caps its largest eigenvalue, within a few percent on the token that holds the
    largest (one direction dominates each token's covariance; one to three tokens of a small nightly
    case have a cap above that largest eigenvalue). So within a batch the eigensolver takes tokens
    in descending cap order and stops at the first cap at or below the largest norm found: a token
    skipped could not have raised it, and the bound is the one every token's eigenvalues give.

    Returns that bound and, where every token's covariance was formed (a small case), an upper bound
    of ``tr(Sigma^2)`` from the tokens' Frobenius norms (else None: the caller bounds it by
    ``||Sigma|| tr Sigma``)."""
    ids = terms.ids
    t_all, k = ids.shape
    hidden, inter = terms.variance.shape[1], terms.intermediate_sq.shape[2]
    cost = k * hidden * hidden * inter
    every = t_all * cost <= _EXACT_NORM_FLOPS  # small enough to form every token's: tr(Sigma^2) too
    order = torch.argsort(crude, descending=True)
    caps = crude[order].tolist()
    per_batch = max(1, min(_NORM_BATCH // max(1, k * hidden * inter), _EXACT_NORM_FLOPS // max(1, cost)))
    best, squares, lo = 0.0, 0.0, 0
    while lo < t_all:
        if not every:
            if caps[lo] <= best:  # it caps every token after it
                return best, None
            if (lo + 1) * cost > _EXACT_NORM_FLOPS:  # the budget is spent: its crude bound stands
                return caps[lo], None
        hi = min(t_all, lo + per_batch, max(lo + 1, _EXACT_NORM_FLOPS // cost))
        sigma, scale, slack = token_covariances(weights, terms, order[lo:hi])
        wide = sigma.double()
        frobenius = torch.linalg.matrix_norm(wide)  # [n]: float64, its rounding far inside the slack
        trace = wide.diagonal(dim1=1, dim2=2).sum(dim=1)
        # what the eigensolver returns as the largest eigenvalue is at most frobenius + slack (its
        # error is inside the slack), so the token's exact norm below, (eigenvalue * scale + slack *
        # scale) / 3, is at most this cap: the same monotone roundings of operands at least as large
        cap = ((frobenius + slack) * scale + slack * scale) / 3.0
        frobenius, trace, slack = frobenius * scale, trace * scale, slack * scale
        if not bool(torch.isfinite(cap).all() and torch.isfinite(frobenius).all() and torch.isfinite(trace).all()):
            return max(best, caps[lo]), None  # out of float range even so: the crude bounds stand
        cap = torch.minimum(cap, crude[order[lo:hi]]).tolist()
        for i in sorted(range(len(cap)), key=cap.__getitem__, reverse=True):
            if cap[i] <= best:  # nor can any token after it raise the largest
                break
            top = torch.linalg.eigvalsh(sigma[i])[-1].double() * scale[i]
            best = max(best, min(float((top + slack[i]) / 3.0), caps[lo + i]))
        if every:
            # the exact covariance's ||Sigma_t||_F is at most frobenius + slack, so tr(Sigma_t^2) is at
            # most its square. Summed is the larger of that and sum_i (|v_i| + slack)^2 over the
            # eigenvalues, the bound the recorded verdicts were made with: sum_i v_i^2 is frobenius^2
            # and sum_i |v_i| the trace (Sigma_t is positive semidefinite), so it needs no eigenvalue,
            # differs from its eigenvalue form by their float32 rounding alone, and is the larger
            # wherever H >= 9 (the trace is at least frobenius - (1 + sqrt H) slack)
            per_token = frobenius**2 + 2.0 * slack * trace + hidden * slack**2
            squares += float(torch.maximum(per_token, (frobenius + slack) ** 2).sum()) / 9.0
        lo = hi
    if not math.isfinite(squares):
        return best, None
    return best, (squares if every else None)


@dataclass(frozen=True)
class Energy:
    """The energy test's result on one output: the error's energy over what the declared
    arithmetic predicts (``ratio``; about 1 or below for an honest kernel), the ratio it may reach
    at the false-alarm rate, and the precision that energy corresponds to."""

    ratio: float
    threshold: float
    effective_bits: float
    """The output format's significand bits, less half the log2 of ``ratio``: the precision at
    which a kernel rounding as declared would err this much (more than the format's own bits
    where the declared arithmetic is pessimistic)."""
    declared_bits: int

    @property
    def fired(self) -> bool:
        """Whether the error carries more energy than the declared arithmetic allows."""
        return self.ratio > self.threshold

    def finding(self) -> str:
        """One line for a reason or a report."""
        head = "error energy exceeds the declared arithmetic's" if self.fired else "error energy"
        return (f"{head}: {self.ratio:.3g}x its prediction (threshold {self.threshold:.3g}x for a false-alarm rate "
                f"{ALPHA:g} per case); effective precision {self.effective_bits:.2f} bits of the output's "
                f"{self.declared_bits}")  # fmt: skip


def energy_test(weights: MoEWeights, bounded: Bounded, got: torch.Tensor, alpha: float = ALPHA) -> Energy | None:
    """The sum of squared errors against the variance the declared rounding points predict.

    Why. A rounding point the declaration leaves out (a top-k combine summed in bf16 where fp32 is
    declared) adds an independent error to every element: no projection sees it, and each element
    stays within the bound, but the errors' energy grows by the undeclared roundings' share.

    Derivation. Under round-to-nearest each elementary error is uniform on its half-ulp interval
    (``|d_i| <= r_i``, the bound's ranges), so ``d_i / (r_i / sqrt 3)`` is sub-Gaussian with
    variance proxy 1 (a uniform's moment generating function is below the Gaussian's of the same
    variance). The error is then ``e = A x + c`` with x such a vector, independent across tokens
    and sources, and ``|c_h| <= coherent_h``. For ``Sigma = A A^T`` (block-diagonal by token), Hsu,
    Kakade and Zhang (2012, "A tail inequality for quadratic forms of subgaussian random vectors",
    Theorem 1) give, with t = ln(1 / alpha),

        P(|A x|^2 > tr Sigma + 2 sqrt(tr(Sigma^2) t) + 2 ||Sigma|| t) <= exp(-t),

    and ``|e| <= |A x| + |c|``. Here ``tr Sigma = sum(variance) / 3`` (the bound's squared ranges,
    ``SlotTerms.variance``), ``tr(Sigma^2)`` is summed from each token's squared Frobenius norm where
    every token's covariance is formed, else at most ``||Sigma|| tr Sigma``, and ``||Sigma||`` is the largest
    token's: exact where that is cheap, else at most its ``max_h variance_h / 3`` (its private
    errors) plus, per slot, ``w^2 ||W2||_2^2 max_i q_i / 3`` (the activation errors every element of
    the token shares through W2; spectral norms bounded from above: ``norm2_upper_bounds``), as
    ``token_norm_bound`` decides. The test fires when ``|e|``
    exceeds ``sqrt(bound) + |coherent|``; ``ratio`` is ``|e|^2 / tr Sigma``. The model is stronger
    than the projections' (uniform, not only bounded, roundings): a kernel that truncates, or
    rounds stochastically, is not rounding as declared, and this is the test that says so.

    What it cannot see: an undeclared rounding whose share of the predicted energy is below the
    threshold's margin over 1. That margin is widest where a case has few elements (the
    ``2 ||Sigma|| t`` term) and where the coherent allowance is large; the activation's
    second-order terms add only their mean to it (``harness.judge.bounds``), which brought the
    threshold of arithmetic that rounds GEMM1's output to bf16 from thousands to a few units.
    """
    terms = bounded.terms
    if terms is None or got.numel() == 0:
        return None
    err = got.to(torch.float64) - bounded.ref - terms.mean  # less its predicted mean (SlotTerms.mean)
    if not bool(torch.isfinite(err).all()):
        return None
    predicted = _predicted(weights, bounded, alpha)
    if predicted is None:
        return None
    trace, threshold_ratio = predicted
    ratio = float((err**2).sum()) / trace
    bits = significand_bits(got.dtype)
    eff = bits - 0.5 * math.log2(ratio) if ratio > 0 else math.inf
    return Energy(ratio=ratio, threshold=threshold_ratio, effective_bits=eff, declared_bits=bits)


def _predicted(weights: MoEWeights, bounded: Bounded, alpha: float) -> tuple[float, float] | None:
    """``energy_test``'s ``tr Sigma`` and threshold ratio (None where the trace is 0), kept per
    ``Bounded`` object for ``weights``' w2 tensors (``_per_tensors``).

    Why. They depend on the bound's terms and the weights alone, never on the output, and a sweep
    hands the same ``Bounded`` to every backend checked on a case with the same declared arithmetic
    (``sweep._Shared``): only the error's energy is the backend's. Kept by the object's identity (a
    weak reference checks it, and drops the entry with the object), not by its value: a frozen
    dataclass of tensors compares them element-wise."""
    kept = _per_tensors(weights, "thresholds")
    key = (id(bounded), alpha)
    entry = kept.get(key)
    if entry is not None and entry[0]() is bounded:
        return entry[1]
    terms = bounded.terms
    trace = float(terms.variance.sum()) / 3.0
    value = None
    if trace > 0:
        ids = terms.ids
        groups = terms.groups
        norms = fill_w2_norms2(weights, groups.experts)
        by_expert = torch.zeros(max(groups.experts, default=0) + 1, dtype=torch.float64)
        by_expert[groups.experts] = torch.tensor([norms[e] for e in groups.experts], dtype=torch.float64)
        routed = ids >= 0
        # per token, over its slots: w^2 ||W2||^2 max_i q_i (a slot routed nowhere adds 0)
        q = terms.intermediate_sq.amax(dim=2).double() * terms.weight**2
        shared = torch.where(routed, by_expert.to(ids.device)[ids.clamp(min=0)] * q, 0.0).sum(1)
        lam, squares = token_norm_bound(weights, terms, (terms.variance.amax(dim=1) + shared) / 3.0)
        if squares is None:
            squares = lam * trace  # tr(Sigma^2) <= ||Sigma|| tr Sigma
        t = math.log(1.0 / alpha)
        bound = trace + 2.0 * math.sqrt(squares * t) + 2.0 * lam * t
        coherent = float(terms.coherent.norm())
        value = (trace, (math.sqrt(bound) + coherent) ** 2 / trace)

    def forget(ref: weakref.ref) -> None:  # the Bounded is gone: so is its entry (not a newer one's)
        if kept.get(key, (None,))[0] is ref:
            del kept[key]

    kept[key] = (weakref.ref(bounded, forget), value)
    return value
