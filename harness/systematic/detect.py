"""The projections of the systematic-error test and their verdict (derivation: the package
docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mxmoe.harness.bounds import Bounded
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK, dequantize_mxfp4

ALPHA = 1e-6
"""Largest probability that an honest backend fires the test on one case (all hypotheses
together), under the model of independent, mean-zero rounding errors."""
_CHUNK = 1 << 24
"""Float64 elements per block-footprint chunk (128 MiB)."""


@dataclass(frozen=True)
class Systematic:
    """The test's result on one output: the largest z over every hypothesis, the threshold for
    ALPHA at this many hypotheses, and where the largest z is."""

    z: float
    threshold: float
    hypotheses: int
    family: str
    """``slot``, ``expert`` or ``block``: which hypothesis had the largest z."""
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
        if z.numel() == 0:
            return
        flat = int(torch.argmax(z))
        value = float(z.reshape(-1)[flat])
        if value > self.z:
            self.z, self.family = value, family
            self.where = where(flat) if callable(where) else str(where)


def systematic_test(
    weights: MoEWeights, bounded: Bounded, got: torch.Tensor, alpha: float = ALPHA
) -> Systematic | None:
    """Project ``got``'s error (against ``bounded.ref``) on every hypothesis of the package
    docstring. None when it does not apply: the bound carries no slot terms (a tie, a sharded
    bound), or an element is not finite (the bound has already failed it)."""
    terms = bounded.terms
    if terms is None or got.numel() == 0:
        return None
    err = got.to(torch.float64) - bounded.ref
    if not bool(torch.isfinite(err).all()):
        return None
    t, k, hidden = terms.slot_out.shape
    var, coh = terms.variance, terms.coherent
    ids = terms.ids
    # slot projections: P[t, j] = <e_t, v_tj>, v the slot's weighted output
    v = terms.slot_out.double()
    p_slot = torch.einsum("th,tjh->tj", err, v)
    c_slot = torch.einsum("th,tjh->tj", coh, v.abs())
    s2_slot = torch.einsum("th,tjh->tj", var, v**2)  # every source private to its element, as yet
    best = _Best()
    blocks = 0
    experts = torch.unique(ids[ids >= 0]).tolist()
    block_z = []
    for e in experts:
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w2 = dequantize_mxfp4(weights.w2_blocks[e], weights.w2_scales[e]).to(err.device)  # [H, I]
        wf2 = terms.weight[tok, slot].unsqueeze(1) ** 2
        q = terms.intermediate_sq[tok, slot].double() * wf2  # [n, I]: this slot's activation errors, weighted
        # those errors reach every element of the token: take their private share back out ...
        private = q @ (w2**2).T  # [n, H]
        s2_slot[tok] -= torch.einsum("nh,njh->nj", private, v[tok] ** 2)
        # ... and put them in projected: (W2^T v)_i^2 q_i, for every projection of the token
        s2_slot[tok] += torch.einsum("nji,ni->nj", (v[tok] @ w2) ** 2, q)
        # block footprints: over this expert's slots, element h along w_j sum_{i in b} a_ji W2[h, i]
        nb = w2.shape[1] // BLOCK
        a = (terms.intermediate[tok, slot].double() * terms.weight[tok, slot].unsqueeze(1)).reshape(-1, nb, BLOCK)
        wb = w2.reshape(hidden, nb, BLOCK)
        p_blk = torch.zeros(nb, hidden, dtype=torch.float64, device=err.device)
        c_blk, s2_blk = torch.zeros_like(p_blk), torch.zeros_like(p_blk)
        step = max(1, _CHUNK // (nb * hidden))
        for lo in range(0, tok.numel(), step):
            f = torch.einsum("nbi,hbi->nbh", a[lo : lo + step], wb)  # [n, nb, H]
            rows = tok[lo : lo + step]
            p_blk += torch.einsum("nbh,nh->bh", f, err[rows])
            c_blk += torch.einsum("nbh,nh->bh", f.abs(), coh[rows])
            s2_blk += torch.einsum("nbh,nh->bh", f**2, var[rows])
        z = _excess(p_blk, c_blk, s2_blk)
        blocks += z.numel()
        block_z.append(
            (z, e, lambda flat, e=e, nb=nb: f"the contribution of expert {e}'s w2 block (row {flat % hidden}, "
             f"block {flat // hidden}: columns {BLOCK * (flat // hidden)}..{BLOCK * (flat // hidden) + BLOCK - 1})")
        )  # fmt: skip
    s2_slot = s2_slot.clamp(min=0.0)
    routed = ids >= 0
    z_slot = torch.where(routed, _excess(p_slot, c_slot, s2_slot), torch.zeros_like(p_slot))
    flat_ids = ids.reshape(-1)
    best.offer(z_slot, "slot", lambda f: f"expert {int(flat_ids[f])}'s output (token {f // k}, slot {f % k})")
    for e in experts:
        mask = ids == e
        z = _excess(p_slot[mask].sum().reshape(1), c_slot[mask].sum().reshape(1), s2_slot[mask].sum().reshape(1))
        best.offer(z, "expert", f"expert {e}'s output over its {int(mask.sum())} tokens")
    for z, _e, where in block_z:
        best.offer(z, "block", where)
    n = int(routed.sum()) + len(experts) + blocks
    return Systematic(z=best.z, threshold=threshold(n, alpha), hypotheses=n, family=best.family, where=best.where)
