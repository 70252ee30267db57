"""GPT-OSS checkpoints: the real format reads into the canonical weights bit for bit, transformers'
own MXFP4 dequantization agrees with the oracle's, and a bad checkpoint names the bad tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxmoe.harness.contract.inputs import generator_for, random_mxfp4_weights
from mxmoe.harness.e2e.checkpoint import (
    TINY_DIR,
    CheckpointError,
    GptOssCheckpoint,
    expert_name,
    open_checkpoint,
    write_checkpoint,
)
from mxmoe.reference.mxfp4 import dequantize_mxfp4

pytest.importorskip("transformers", reason="the model-level checks need transformers (pip install transformers)")


def _checkpoint_of(tmp_path, weights, layers=1, extra=None):
    """A minimal real-format checkpoint holding ``weights`` as every layer's experts."""
    e, two_i, half_h = weights.w13_blocks.shape
    h, i = 2 * half_h, two_i // 2
    t = {}
    for n in range(layers):
        t[expert_name(n, "gate_up_proj_blocks")] = weights.w13_blocks.reshape(e, two_i, h // 32, 16)
        t[expert_name(n, "gate_up_proj_scales")] = weights.w13_scales
        t[expert_name(n, "gate_up_proj_bias")] = weights.w13_bias
        t[expert_name(n, "down_proj_blocks")] = weights.w2_blocks.reshape(e, h, i // 32, 16)
        t[expert_name(n, "down_proj_scales")] = weights.w2_scales
        t[expert_name(n, "down_proj_bias")] = weights.w2_bias
    t.update(extra or {})
    cfg = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}, "num_hidden_layers": layers,
           "hidden_size": h, "intermediate_size": i, "num_local_experts": e, "num_experts_per_tok": 2}  # fmt: skip
    write_checkpoint(tmp_path, t, cfg)
    return GptOssCheckpoint(tmp_path)


def test_a_real_format_checkpoint_reads_into_the_canonical_weights_bit_for_bit(tmp_path):
    w = random_mxfp4_weights(generator_for("ckpt-roundtrip"), 4, 96, 64)
    got = _checkpoint_of(tmp_path, w, layers=2).moe_weights(1)
    for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias"):
        a, b = getattr(got, name), getattr(w, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.w13_layout == "interleaved"


def test_the_tiny_fixture_reads_bit_for_bit():
    ckpt = open_checkpoint("tiny")
    raw = load_file(str(TINY_DIR / "model.safetensors"))
    for layer in range(ckpt.shapes.layers):
        w = ckpt.moe_weights(layer)
        blocks = raw[expert_name(layer, "gate_up_proj_blocks")]
        assert torch.equal(w.w13_blocks, blocks.reshape(*blocks.shape[:2], -1))
        assert torch.equal(w.w2_scales, raw[expert_name(layer, "down_proj_scales")])
        assert torch.equal(w.w2_bias, raw[expert_name(layer, "down_proj_bias")])


def test_transformers_dequantization_agrees_with_the_oracle_exactly():
    """transformers' MXFP4 loader (``convert_moe_packed_tensors``: the function its
    ``Mxfp4Config(dequantize=True)`` path runs) against the oracle, on the fixture's experts and on
    every (code, scale byte) pair up to 252; above that bf16 overflows in transformers."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = open_checkpoint("tiny")
    raw = load_file(str(TINY_DIR / "model.safetensors"))
    for layer in range(ckpt.shapes.layers):
        w = ckpt.moe_weights(layer)
        for part, blocks, scales in (
            ("gate_up_proj", w.w13_blocks, w.w13_scales),
            ("down_proj", w.w2_blocks, w.w2_scales),
        ):
            hf = convert_moe_packed_tensors(
                raw[expert_name(layer, part + "_blocks")], raw[expert_name(layer, part + "_scales")]
            )
            ref = dequantize_mxfp4(blocks, scales).transpose(1, 2)  # transformers' [E, K, N]
            assert torch.equal(hf.double(), ref), (layer, part)
    # every byte (both nibbles' codes) under every scale byte 0..254: row r holds all 256 bytes in
    # 16 blocks, each with scale byte r
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 1, 16, 16).expand(1, 255, 16, 16)
    scales = torch.arange(255, dtype=torch.int32).to(torch.uint8).reshape(1, 255, 1).expand(1, 255, 16)
    hf = convert_moe_packed_tensors(blocks.contiguous(), scales.contiguous())[0].T.double()  # [255, 512]
    ref = dequantize_mxfp4(blocks.reshape(1, 255, 256), scales)[0]
    assert torch.equal(hf[:253], ref[:253])
    # bytes 253 and 254 reach 6 * 2^126 > bf16's largest finite value: transformers' bf16 is inf there
    big = ref[253:].abs() > torch.finfo(torch.bfloat16).max
    assert big.any() and torch.isinf(hf[253:][big]).all()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.pop(expert_name(0, "down_proj_scales")),
         "no tensor 'model.layers.0.mlp.experts.down_proj_scales'"),
        (lambda t: t.__setitem__(expert_name(0, "gate_up_proj_bias"), torch.zeros(4, 64, dtype=torch.bfloat16)),
         "tensor 'model.layers.0.mlp.experts.gate_up_proj_bias' has shape [4, 64], expected [4, 128]"),
        (lambda t: t.__setitem__(expert_name(0, "down_proj_bias"), torch.zeros(4, 96)),
         "tensor 'model.layers.0.mlp.experts.down_proj_bias' has dtype torch.float32, expected torch.bfloat16"),
        (lambda t: t[expert_name(0, "gate_up_proj_scales")].__setitem__((2, 5, 1), 255),
         "tensor 'model.layers.0.mlp.experts.gate_up_proj_scales' holds E8M0 scale byte 255"),
    ],
    ids=["missing", "shape", "dtype", "scale255"],
)
def test_a_bad_checkpoint_names_the_tensor(tmp_path, mutate, message):
    w = random_mxfp4_weights(generator_for("ckpt-bad"), 4, 96, 64)
    ckpt = _checkpoint_of(tmp_path, w)
    t = load_file(str(tmp_path / "model.safetensors"))
    mutate(t)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        GptOssCheckpoint(tmp_path).moe_weights(0)
    del ckpt


def test_a_scale_byte_255_error_gives_its_index(tmp_path):
    w = random_mxfp4_weights(generator_for("ckpt-255"), 4, 96, 64)
    w.w2_scales[3, 17, 1] = 255
    message = r"down_proj_scales' holds E8M0 scale byte 255 .* in 1 block\(s\), first at index \(3, 17, 1\)"
    with pytest.raises(CheckpointError, match=message):
        _checkpoint_of(tmp_path, w).moe_weights(0)


def test_folders_that_are_not_gpt_oss_mxfp4_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        open_checkpoint(str(tmp_path / "absent"))
    with pytest.raises(CheckpointError, match="no config.json"):
        open_checkpoint(str(tmp_path))
    shutil.copy(TINY_DIR / "config.json", tmp_path / "config.json")
    cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type is 'llama'; only 'gpt_oss'"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quant_method is 'fp8'; the experts must be stored as MXFP4"):
        open_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="random:NAME takes NAME in gpt-oss-20b, gpt-oss-120b, gpt-oss-tiny"):
        open_checkpoint("random:gpt-oss-7b")


def test_a_synthetic_checkpoint_is_a_function_of_its_seed():
    a, b = open_checkpoint("random:gpt-oss-20b"), open_checkpoint("random:gpt-oss-20b")
    assert a.shapes.layers == 24 and a.shapes.experts == 32 and a.shapes.hidden == 2880
    name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(a.tensor(name), b.tensor(name)) and a.tensor(name).shape == (4096, 2880)
    assert open_checkpoint("random:gpt-oss-120b").shapes.experts == 128
