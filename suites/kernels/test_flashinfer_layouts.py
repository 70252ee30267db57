"""The project's FlashInfer storage steps against FlashInfer's own pure-torch layout helpers, on
the same bytes, with K > 128 (at K = 128 the old and new SM90 scale layouts coincide, which once
hid a bug). Runs wherever flashinfer-python imports (./dev installs 0.6.14 on GPU-less hosts)."""

from __future__ import annotations

import pytest
import torch

from mxmoe.kernels import storage

fi_core = pytest.importorskip(
    "flashinfer.fused_moe.core", reason="flashinfer-python is not installed (./dev installs it on hosts without a GPU)"
)


def _bytes(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [256, 768])
def test_trtllm_epilogue_row_shuffle_matches_flashinfer_sm100(rows):
    w = _bytes(rows, 144)
    idx = fi_core.get_w2_permute_indices_with_cache({}, w, 128)
    assert torch.equal(idx.cpu().long(), storage.epilogue_tile_rows(rows))
    s = _bytes(rows, 96)  # 96 scale groups: K = 3072 > 128
    idx_sf = fi_core.get_w2_permute_indices_with_cache({}, s, 128, num_elts_per_sf=16)
    assert torch.equal(idx_sf.cpu().long(), storage.epilogue_tile_rows(rows))


@pytest.mark.parametrize("groups", [8, 92])  # K = 256 and K = 2944 (gpt-oss H = 2880 padded to 128)
def test_sm90_scale_interleave_matches_flashinfer_sm90(groups):
    s = _bytes(3, 256, groups, seed=groups)
    theirs = fi_core.interleave_moe_scales_for_sm90_mixed_gemm(s)
    ours = storage.sm90_scale_interleave().forward(s, "w13_scales")
    assert theirs.shape == ours.shape and torch.equal(theirs.cpu(), ours)
