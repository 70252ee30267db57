"""MoE routing methods, by name, in float64 (docs/formats.md).

Methods are named, never numbered: the integers of the enums in FlashInfer and vLLM drift between
versions (FlashInfer's ``Unspecified`` was 6, 8, 9 and is 10; 9 is now ``TopKSigmoid``).

=================  ===================================  =========================================
name               selects                              weights of the chosen k
=================  ===================================  =========================================
Default            top-k of softmax over all E          those softmax probabilities (no renorm)
Renormalize        top-k of the logits                  softmax over the k logits
RenormalizeNaive   top-k of softmax over all E          the k probabilities / their sum
DeepSeekV3         top-k of s + bias, inside the        s / (sum of s + 1e-20) * scaling factor,
                   topk_group best groups (a group's    with s = sigmoid(logits) UNBIASED
                   score: sum of its top-2 s + bias)
Llama4             top-1 of the logits                  sigmoid(logit), applied to GEMM1's input
TopK               top-k of the logits                  the raw logits
SigmoidRenorm      top-k of sigmoid(logits)             sigmoid / their sum
Sigmoid            top-k of sigmoid(logits)             sigmoid
TopKSigmoid        top-k of the logits                  sigmoid of the k logits
MiniMax2           top-k of sigmoid + bias              unbiased sigmoid / (sum + 1e-20) * scale
=================  ===================================  =========================================

Selection goes through a stable descending sort, so exact ties go to the lower expert index.
Kernels break ties differently (AITER keeps the higher index, triton_kernels the lower), so cases
must be tie-free or accept either choice: ``topk_margin`` tells how close a case is to a tie.
Where a method selects on a monotone transform of the logits (softmax, sigmoid), the reference
selects on the logits themselves: the same choice in exact math, without ties that rounding of the
transform could create.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUTING_METHODS = (
    "Default",
    "Renormalize",
    "RenormalizeNaive",
    "DeepSeekV3",
    "Llama4",
    "TopK",
    "SigmoidRenorm",
    "Sigmoid",
    "TopKSigmoid",
    "MiniMax2",
)
_BIASED = ("DeepSeekV3", "MiniMax2")
_SCALED = ("DeepSeekV3", "MiniMax2")
_GROUPED = ("DeepSeekV3",)
NORM_EPS = 1e-20
"""Added to the sum before dividing in DeepSeekV3 and MiniMax2, as the kernels do."""


def check_method(method: str) -> None:
    """Raise ValueError unless ``method`` is one of ROUTING_METHODS."""
    if method not in ROUTING_METHODS:
        raise ValueError(f"method must be one of {', '.join(ROUTING_METHODS)}; got {method!r}")


@dataclass(frozen=True)
class Routing:
    """The routing of a batch: ``weights`` float64 [T, k] and expert ``ids`` int64 [T, k]."""

    weights: torch.Tensor
    ids: torch.Tensor


def _validate(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    correction_bias: torch.Tensor | None,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
) -> None:
    check_method(method)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise ValueError("logits must be a floating-point tensor [T, E]")
    n_exp = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k must be an int in 1..E={n_exp}, got {top_k!r}")
    if method == "Llama4" and top_k != 1:
        raise ValueError(f"top_k must be 1 for method Llama4, got {top_k}")
    if correction_bias is not None:
        if method not in _BIASED:
            raise ValueError(f"correction_bias is used only by {', '.join(_BIASED)}; method is {method}")
        if correction_bias.shape != (n_exp,) or not correction_bias.is_floating_point():
            raise ValueError(f"correction_bias must be a floating-point tensor [E={n_exp}]")
    if routed_scaling_factor != 1.0 and method not in _SCALED:
        raise ValueError(f"routed_scaling_factor is used only by {', '.join(_SCALED)}; method is {method}")
    if (n_group is None) != (topk_group is None):
        raise ValueError("n_group and topk_group must be given together")
    if n_group is not None:
        if method not in _GROUPED:
            raise ValueError(f"n_group and topk_group are used only by {', '.join(_GROUPED)}; method is {method}")
        if n_group < 1 or n_exp % n_group or n_exp // n_group < 2:
            raise ValueError(f"n_group must divide E={n_exp} into groups of at least 2, got {n_group}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in 1..n_group={n_group}, got {topk_group}")
        if top_k > topk_group * (n_exp // n_group):
            raise ValueError(f"top_k={top_k} exceeds the {topk_group * (n_exp // n_group)} experts in the kept groups")


def _selection_scores(
    logits: torch.Tensor,
    method: str,
    correction_bias: torch.Tensor | None,
    n_group: int | None,
    topk_group: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-expert scores whose top-k is the selection (excluded experts at -inf), and for grouped
    methods the per-group scores."""
    if method not in _BIASED:
        return logits, None
    bias = logits.new_zeros(logits.shape[1]) if correction_bias is None else correction_bias.to(logits)
    scores = torch.sigmoid(logits) + bias
    if n_group is None:
        return scores, None
    t, e = scores.shape
    grouped = scores.reshape(t, n_group, e // n_group)
    group_scores = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
    keep = _stable_topk(group_scores, topk_group)
    mask = torch.zeros(t, n_group, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, keep, True)
    mask = mask.repeat_interleave(e // n_group, dim=1)
    return scores.masked_fill(~mask, float("-inf")), group_scores


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row; ties go to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    *,
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> Routing:
    """Route each token: the k experts chosen from ``logits`` [T, E] by ``method`` and their
    weights, in float64. The router's own bias (GPT-OSS) is part of ``logits``; ``correction_bias``
    is the selection-only bias of DeepSeekV3 and MiniMax2."""
    _validate(logits, top_k, method, correction_bias, n_group, topk_group, routed_scaling_factor)
    z = logits.to(torch.float64)
    scores, _ = _selection_scores(z, method, correction_bias, n_group, topk_group)
    ids = _stable_topk(scores, top_k)
    chosen = z.gather(1, ids)
    if method == "Default":
        weights = torch.softmax(z, dim=-1).gather(1, ids)
    elif method == "Renormalize":
        weights = torch.softmax(chosen, dim=-1)
    elif method == "RenormalizeNaive":
        probs = torch.softmax(z, dim=-1).gather(1, ids)
        weights = probs / probs.sum(-1, keepdim=True)
    elif method == "TopK":
        weights = chosen
    elif method in ("Llama4", "Sigmoid", "TopKSigmoid"):
        weights = torch.sigmoid(chosen)
    elif method == "SigmoidRenorm":
        s = torch.sigmoid(chosen)
        weights = s / s.sum(-1, keepdim=True)
    else:  # DeepSeekV3, MiniMax2: unbiased sigmoid of the chosen, normalised and scaled
        s = torch.sigmoid(chosen)
        weights = s / (s.sum(-1, keepdim=True) + NORM_EPS) * routed_scaling_factor
    return Routing(weights=weights, ids=ids)


def topk_margin(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    *,
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
) -> torch.Tensor:
    """Per token, how far the selection is from a tie (float64 [T]): the gap between the k-th and
    the (k+1)-th selection score, and for grouped methods also between the topk_group-th and the
    next group score (the smaller of the two). 0 means an exact tie at the boundary, where kernels
    may legitimately choose differently; +inf means nothing competes (k = E)."""
    _validate(logits, top_k, method, correction_bias, n_group, topk_group, 1.0)
    z = logits.to(torch.float64)
    scores, group_scores = _selection_scores(z, method, correction_bias, n_group, topk_group)
    inf = torch.full((z.shape[0],), float("inf"), dtype=torch.float64, device=z.device)
    margin = inf
    ordered = torch.sort(scores, dim=-1, descending=True).values
    if top_k < ordered.shape[1]:
        nxt = ordered[:, top_k]
        gap = ordered[:, top_k - 1] - nxt
        margin = torch.where(torch.isinf(nxt), inf, gap)
    if group_scores is not None and topk_group < group_scores.shape[1]:
        g = torch.sort(group_scores, dim=-1, descending=True).values
        margin = torch.minimum(margin, g[:, topk_group - 1] - g[:, topk_group])
    return margin


def has_boundary_ties(logits: torch.Tensor, top_k: int, method: str, tol: float = 0.0, **kwargs: object) -> bool:
    """Whether any token's top-k boundary is within ``tol`` of a tie (see ``topk_margin``)."""
    return bool((topk_margin(logits, top_k, method, **kwargs) <= tol).any())
