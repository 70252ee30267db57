"""The energy test's covariance norms (``token_norm_bound``): the eigensolver run only on the tokens
whose Frobenius caps could hold the largest eigenvalue gives the bound that running it on every token
gives, bit for bit; ``tr(Sigma^2)`` from the Frobenius norms is the eigenvalues' sum but for their
rounding, and both bound the exact covariances from above; only the formed tokens' experts are
dequantized, and kept in a dtype that holds every MXFP4 value as float32 does; and the threshold is
computed once per bound, whatever the outputs judged against it."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.instruments.honest import HonestFp32
from mxmoe.harness.judge import systematic
from mxmoe.harness.judge.bounds import reference_and_bound
from mxmoe.harness.judge.systematic import energy_test, token_covariances, token_norm_bound
from mxmoe.reference.mxfp4 import dequantize_mxfp4


def _exact_covariances(weights, terms) -> torch.Tensor:
    """Every token's covariance [T, H, H] in float64 from its definition, without the float32 forming
    or its allowances: ``diag(private) + sum_j w_j^2 W2_j diag(q_j) W2_j^T``, times 3."""
    t, k = terms.ids.shape
    hidden = terms.variance.shape[1]
    w2 = {e: dequantize_mxfp4(weights.w2_blocks[e], weights.w2_scales[e]).double() for e in terms.groups.experts}
    out = torch.zeros(t, hidden, hidden, dtype=torch.float64)
    for tok in range(t):
        private = terms.variance[tok].double().clone()
        for j in range(k):
            e = int(terms.ids[tok, j])
            if e < 0:
                continue
            q = terms.intermediate_sq[tok, j].double() * float(terms.weight[tok, j]) ** 2
            out[tok] += (w2[e] * q) @ w2[e].T
            private -= (w2[e] ** 2 * q).sum(1)
        out[tok] += torch.diag(private.clamp(min=0.0))
    return out


@pytest.mark.parametrize(
    ("model", "tokens", "skew"), [("tiny", 33, "uniform"), ("small", 40, "hot"), ("dsmini", 20, "uniform")]
)
def test_the_search_gives_every_tokens_eigenvalue_bound_and_frobenius_squares(model, tokens, skew):
    """Against the eigenvalues of every token (one batch: these cases are formed at once), with a
    cap above every token's norm and with caps that bind on some: the same bound to the bit; the
    squares within 1e-5 of the eigenvalues' sum with the same allowance, above the eigenvalues' own
    sum; and both above the exact covariances' (float64, from the definition)."""
    case = make_case(model, tokens, skew=skew)
    inputs = make_inputs(case, "cpu")
    terms = reference_and_bound(inputs, HonestFp32.declaration.arithmetic).terms
    order = torch.arange(tokens)
    sigma, scale, slack = token_covariances(inputs.weights, terms, order)
    values = torch.linalg.eigvalsh(sigma).double() * scale[:, None]  # every token's, ascending
    slack = slack * scale
    tops = (values[:, -1] + slack) / 3.0
    exact = _exact_covariances(inputs.weights, terms)
    true_top = float(torch.linalg.eigvalsh(exact)[:, -1].max()) / 3.0
    true_squares = float((exact**2).sum()) / 9.0
    generator = torch.Generator().manual_seed(tokens)
    for crude in (tops * 4.0, tops * (0.6 + 0.8 * torch.rand(tokens, generator=generator, dtype=torch.float64))):
        lam, squares = token_norm_bound(inputs.weights, terms, crude)
        assert lam == max(min(float(t), float(c)) for t, c in zip(tops, crude, strict=True))
        with_allowance = float(((values.abs() + slack[:, None]) ** 2).sum()) / 9.0
        assert abs(squares - with_allowance) <= 1e-5 * with_allowance, (squares, with_allowance)
        assert squares > float((values**2).sum()) / 9.0
        assert squares >= true_squares
    assert token_norm_bound(inputs.weights, terms, tops * 4.0)[0] >= true_top
    frobenius = torch.linalg.matrix_norm(sigma.double()) * scale
    assert torch.allclose(frobenius**2, (values**2).sum(1), rtol=1e-5, atol=0)


def test_only_the_formed_tokens_experts_are_dequantized(monkeypatch):
    """Past the budget of one token, that token's k experts are dequantized, not the layer's 16."""
    case = make_case("small", 64)
    inputs = make_inputs(case, "cpu")
    terms = reference_and_bound(inputs, HonestFp32.declaration.arithmetic).terms
    k, hidden, inter = terms.ids.shape[1], terms.variance.shape[1], terms.intermediate_sq.shape[2]
    monkeypatch.setattr(systematic, "_EXACT_NORM_FLOPS", k * hidden * hidden * inter)
    crude = terms.variance.amax(dim=1).double() * 100
    lam, squares = token_norm_bound(inputs.weights, terms, crude)
    assert squares is None and lam == sorted(crude.tolist())[-2]  # the second token's crude bound stands
    assert 0 < len(systematic._per_tensors(inputs.weights, "w2")) <= k < len(terms.groups.experts)


def test_the_threshold_is_computed_once_per_bound(monkeypatch):
    """Two outputs judged against one ``Bounded``: one threshold computation, the same threshold and
    their own ratios; another ``Bounded`` (equal, not the same object) is computed again, and its
    entry goes with it."""
    case = make_case("tiny", 17)
    inputs = make_inputs(case, "cpu")
    bounded = reference_and_bound(inputs, HonestFp32.declaration.arithmetic)
    calls = []
    real = systematic.token_norm_bound
    monkeypatch.setattr(systematic, "token_norm_bound", lambda *args: calls.append(args) or real(*args))
    first = energy_test(inputs.weights, bounded, bounded.ref.to(torch.bfloat16))
    second = energy_test(inputs.weights, bounded, (bounded.ref * (1 + 2.0**-6)).to(torch.bfloat16))
    assert len(calls) == 1 and first.threshold == second.threshold and first.ratio < second.ratio
    kept = systematic._per_tensors(inputs.weights, "thresholds")
    other = dataclasses.replace(bounded)
    assert energy_test(inputs.weights, other, bounded.ref.to(torch.bfloat16)) == first
    assert len(calls) == 2 and len(kept) == 2
    del other
    gc.collect()
    assert len(kept) == 1


def test_the_kept_w2_holds_every_mxfp4_value_as_float32_does():
    """Every E2M1 code under every scale byte (the NaN one too), dequantized exactly and stored in
    the dtype the energy test keeps w2 in: what it reads back is what float32 would give, bit for
    bit (the exact value, or the same infinity past float32's range)."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every byte: both codes of each
    blocks = codes.repeat(256, 1, 1)  # [scale, 16, 16]
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1, 1).expand(256, 16, 1).contiguous()
    exact = dequantize_mxfp4(blocks, scales).double()
    kept = exact.to(systematic.KEPT_W2_DTYPE)
    assert kept.element_size() < 4
    torch.testing.assert_close(kept.double(), exact.float().double(), rtol=0, atol=0, equal_nan=True)
    finite = exact.abs() <= torch.finfo(torch.float32).max
    assert bool(finite.any()) and bool((kept.double()[finite] == exact[finite]).all())
