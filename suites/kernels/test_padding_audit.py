"""The padding audit at gpt-oss shapes, and the vendor storage steps' index formulas checked
against independent statements of them. Ids carry architectures (``pytest -k gfx942``)."""

from __future__ import annotations

import json

import pytest
import torch

from mxmoe.harness.audits.padding_audit import AUDIT_MODELS, AUDIT_TPS, audit, ideal_bytes
from mxmoe.harness.cli.app import main
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.convert import padded_sizes
from mxmoe.harness.run.registry import discover
from mxmoe.kernels import storage

BACKENDS = [item.backend for item in discover() if item.backend.declaration.kind == "backend"]
ROCM = [b for b in BACKENDS if b.declaration.vllm_backend and b.declaration.vllm_backend.startswith("AITER")]


@pytest.fixture(scope="module")
def rows():
    return audit(BACKENDS)


def test_every_model_tp_backend(rows):
    assert len(rows) == len(AUDIT_MODELS) * len(AUDIT_TPS) * len(BACKENDS)
    assert all(r.converted_bytes >= r.ideal_bytes for r in rows)
    assert ideal_bytes(2880, 2880, 32) == 3 * 2880 * 2880 * 32 * 17 // 32


@pytest.mark.parametrize("backend", ROCM, ids=lambda b: f"{b.declaration.id}-{'-'.join(b.declaration.archs)}")
@pytest.mark.parametrize("model", AUDIT_MODELS)
def test_rocm_tp8_gptoss_360_padded_to_512(rows, backend, model):
    (r,) = [r for r in rows if r.model == model and r.tp == 8 and r.backend == backend.declaration.id]
    assert (r.partition, r.padded_intermediate, r.padded_hidden) == (360, 512, 3072)
    assert r.padded_intermediate / r.partition - 1 == pytest.approx(0.4222, abs=1e-4)  # 42% (docs/backends.md)
    assert r.waste == pytest.approx(512 * 3072 / (360 * 2880) - 1, rel=1e-9)  # with the hidden round-up


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"{b.declaration.id}-{'-'.join(b.declaration.archs)}")
def test_audit_bytes_match_a_whole_conversion(backend):
    """The audit's per-expert extrapolation equals converting every expert of a small layer."""
    from mxmoe.harness.contract.inputs import make_inputs

    case = make_case("tpsmall", 1, tp=2, tp_rank=1)
    conv = backend.convert_weights(make_inputs(case, "cpu"))
    h, i = padded_sizes(case, backend.declaration.hidden_align, backend.declaration.intermediate_align)
    assert (conv.target.hidden, conv.target.intermediate) == (h, i)
    assert conv.nbytes() >= case.experts * 3 * h * i * 17 // 32


def test_cli_padding_records_json_gfx942(tmp_path, capsys):
    path = tmp_path / "padding.json"
    assert main(["padding", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("gptoss120b") and " 8 " in ln and "aiter-triton" in ln]
    assert line and "360->512" in line[0] and "42.2%" in line[0] and "51.7%" in line[0]
    data = json.loads(path.read_text())
    assert {"model", "tp", "backend", "converted_bytes", "ideal_bytes", "waste"} <= set(data["rows"][0])


def test_epilogue_row_shuffle_formula():
    # FlashInfer get_shuffle_matrix_a_row_indices, tile 128 (blocks of 32): new row j of a block is
    # old row 4 * (j % 8) + j // 8.
    idx = storage.epilogue_tile_rows(64)
    assert idx[:10].tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 1, 5]
    assert idx[32:34].tolist() == [32, 36]
    assert sorted(idx.tolist()) == list(range(64))


def test_swizzle_128x4_offsets():
    e, r, c = 2, 130, 6
    t = torch.arange(e * r * c, dtype=torch.int64).reshape(e, r, c)
    src = (t % 251 + 1).to(torch.uint8)  # no zero bytes
    out = storage.swizzle_128x4(view_fp8=False).forward(src, "w13_scales").reshape(e, -1)
    rp, cp = 256, 8
    for m, k in [(0, 0), (1, 0), (31, 3), (32, 0), (127, 5), (128, 2), (129, 5)]:
        off = ((m // 128) * (cp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
        assert out[1, off] == src[1, m, k], (m, k)
    assert out.shape[1] == rp * cp and int((out == 0).sum()) == e * (rp * cp - r * c)


def test_sm90_scale_interleave_formula():
    s = torch.arange(2 * 3 * 8, dtype=torch.uint8).reshape(2, 3, 8)
    out = storage.sm90_scale_interleave().forward(s, "w2_scales")
    assert out.shape == (2, 2, 12)
    for e, r, kb, g in [(0, 0, 0, 0), (1, 2, 1, 3), (0, 1, 1, 2)]:
        assert out[e, kb, 4 * r + g] == s[e, r, 4 * kb + g]


def test_sm90_weight_interleave_is_a_nibble_permutation():
    src = storage.sm90_nibble_source(32, 128)
    assert sorted(src.tolist()) == list(range(32 * 128))
    # rows r and r + 8 of a 16-row group are interleaved element by element
    assert src[:4].tolist() == [0, 8 * 128, 1, 8 * 128 + 1]


def test_aiter_a16w4_weight_shuffle_tiles():
    """AITER shuffle_weight_a16w4: w2 bytes in [N/16][Kb/16][16 rows][16 bytes] tiles; for w13
    the gate and up halves alternate per 16-row group."""
    e, n, kb = 1, 32, 128
    t = torch.randint(1, 255, (e, 2 * n, kb), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    step = storage.aiter_a16w4_weight_shuffle()
    w2 = step.forward(t[:, :n], "w2_blocks").reshape(-1)
    w13 = step.forward(t, "w13_blocks").reshape(-1)
    for row, col in [(0, 0), (5, 17), (16, 3), (31, 127), (17, 64)]:
        off = ((row // 16) * (kb // 16) + col // 16) * 256 + (row % 16) * 16 + col % 16
        assert w2[off] == t[0, row, col]
        for half in (0, 1):
            off13 = (((row // 16) * 2 + half) * (kb // 16) + col // 16) * 256 + (row % 16) * 16 + col % 16
            assert w13[off13] == t[0, half * n + row, col]
