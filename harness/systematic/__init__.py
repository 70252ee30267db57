"""The systematic-error test: faults too small for the per-element bound, caught by their shape.

Why. The bound (``harness.bounds``) judges each element alone, so a fault whose error per element
is below honest rounding passes it: bf16 routing weights in a backend that declares fp32 ones
(relative error up to 2^-9 of each slot, against bf16 output rounding of the same size), or one
E8M0 byte off by one on a block whose share of its element is small. Such errors are not shaped
like rounding, though. Honest rounding errors are sums of many independent, mean-zero elementary
errors; a fault's error is a fixed vector: a token's error lies along one slot's output (a wrong
routing weight, a mis-scaled expert), or, over the tokens of one expert, along the footprint of one
weight block (a wrong scale byte). Projecting the error on that vector adds up what rounding
cancels, the way a matched filter does.

Derivation. ``harness.bounds`` models the error of an element, to first order, as ``sum c_i d_i``
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

from mxmoe.harness.systematic.detect import ALPHA, Systematic, systematic_test

__all__ = ["ALPHA", "Systematic", "systematic_test"]
