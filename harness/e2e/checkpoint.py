"""GPT-OSS checkpoints in their real format, read lazily (one tensor, one layer at a time).

A checkpoint is a Hugging Face folder: ``config.json`` (``model_type: gpt_oss`` with an MXFP4
``quantization_config``) and safetensors shards (``model.safetensors`` or the shards an
``model.safetensors.index.json`` maps). The MoE weights of layer N are (docs/formats.md)::

    model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   rows interleaved gate/up
    model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]       E8M0
    model.layers.N.mlp.experts.gate_up_proj_bias    bf16  [E, 2I]
    model.layers.N.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]
    model.layers.N.mlp.experts.down_proj_scales     uint8 [E, H, I/32]
    model.layers.N.mlp.experts.down_proj_bias       bf16  [E, H]
    model.layers.N.mlp.router.weight / .bias        [E, H] / [E]

and the rest (attention with sinks, norms, embeddings, lm_head) is stored as transformers names
it. ``moe_weights`` turns a layer's tensors into the oracle's canonical ``MoEWeights`` without
touching a bit (the blocks' last two axes are the packed K axis); nothing is ever dequantized
here, so a 120b checkpoint never exists in float64. A bad checkpoint is an error that names the
tensor: a missing one, a wrong shape or dtype, or a scale byte 255 (NaN in the OCP spec, 2^128 in
gpt-oss's own decoder: no trained weight has it, so it is corruption).

``SyntheticCheckpoint`` has the same interface and makes every tensor from a seed and its name:
the full-size gpt-oss-20b/120b architectures with random MXFP4 experts, for runs where real
weights cannot be fetched. ``write_checkpoint`` writes the real format (the tiny fixture).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mxmoe.harness.contract.inputs import generator_for, random_mxfp4_weights
from mxmoe.reference.moe import MoEWeights
from mxmoe.reference.mxfp4 import BLOCK, E8M0_NAN

TINY_DIR = Path(__file__).resolve().parent / "tiny"
"""The committed tiny GPT-OSS fixture (``tiny.py`` trains it)."""
TINY_CONFIG = dict(
    vocab_size=768,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=32,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    swiglu_limit=7.0,
)
"""GptOssConfig of the fixture (the rest as gpt-oss-20b: alpha 1.702, sinks, alternating layers)."""

_NOT_CONFIG = ("quantization_config", "architectures", "torch_dtype", "dtype", "transformers_version", "auto_map")


def hf_config(config: dict):  # noqa: ANN201 (transformers.GptOssConfig, imported lazily)
    """transformers' GptOssConfig of a checkpoint's config.json, eager attention (sinks)."""
    from transformers import GptOssConfig

    cfg = GptOssConfig.from_dict({k: v for k, v in config.items() if k not in _NOT_CONFIG})
    cfg._attn_implementation = "eager"
    return cfg


EXPERT_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                "down_proj_scales", "down_proj_bias")  # fmt: skip
PRESETS = {
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(num_hidden_layers=36, num_local_experts=128),
    "gpt-oss-tiny": None,
}
"""config.json of openai/gpt-oss-20b and -120b as far as they differ from GptOssConfig's defaults
(hidden 2880, intermediate 2880, 64 query and 8 KV heads of 64, top-4, vocabulary 201,088,
sliding window 128 on alternate layers, YaRN rope); ``gpt-oss-tiny`` is the tiny fixture's shape
(``TINY_CONFIG``), for exercising the synthetic path on a CPU."""


class CheckpointError(ValueError):
    """A checkpoint that is not GPT-OSS's MXFP4 format; the message names the file or tensor."""


def expert_name(layer: int, part: str) -> str:
    """The checkpoint name of one of a layer's expert tensors (``EXPERT_PARTS``)."""
    return f"model.layers.{layer}.mlp.experts.{part}"


class _Shapes:
    """What a GPT-OSS config implies about its tensors."""

    def __init__(self, config: dict) -> None:
        self.config = config
        try:
            self.layers = int(config["num_hidden_layers"])
            self.hidden = int(config["hidden_size"])
            self.intermediate = int(config["intermediate_size"])
            self.experts = int(config["num_local_experts"])
            self.top_k = int(config["num_experts_per_tok"])
        except KeyError as exc:
            raise CheckpointError(f"config.json has no {exc.args[0]!r} (a GPT-OSS config has it)") from None
        if self.hidden % BLOCK or self.intermediate % BLOCK:
            raise CheckpointError(
                f"hidden_size ({self.hidden}) and intermediate_size ({self.intermediate}) must be multiples of "
                f"{BLOCK} for MXFP4 experts"
            )

    def expected(self, layer: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Expected shape and dtype of each of a layer's expert tensors, by checkpoint name (the
        router and the rest are checked against transformers' model when it loads them)."""
        e, h, i = self.experts, self.hidden, self.intermediate
        out = {
            expert_name(layer, "gate_up_proj_blocks"): ((e, 2 * i, h // BLOCK, 16), torch.uint8),
            expert_name(layer, "gate_up_proj_scales"): ((e, 2 * i, h // BLOCK), torch.uint8),
            expert_name(layer, "gate_up_proj_bias"): ((e, 2 * i), torch.bfloat16),
            expert_name(layer, "down_proj_blocks"): ((e, h, i // BLOCK, 16), torch.uint8),
            expert_name(layer, "down_proj_scales"): ((e, h, i // BLOCK), torch.uint8),
            expert_name(layer, "down_proj_bias"): ((e, h), torch.bfloat16),
        }
        return out


class Checkpoint:
    """The interface both checkpoint kinds implement: ``config``, ``names``, ``tensor``, and the
    validated per-layer views built on them."""

    config: dict
    where: str

    def names(self) -> list[str]:
        """Every tensor name."""
        raise NotImplementedError

    def _raw(self, name: str, device: str | torch.device) -> torch.Tensor:
        raise NotImplementedError

    @property
    def shapes(self) -> _Shapes:
        """The config's sizes."""
        return _Shapes(self.config)

    def tensor(
        self,
        name: str,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> torch.Tensor:
        """One tensor, checked against the expected shape and dtype where given."""
        if name not in self._names_set():
            want = "" if shape is None else f" (expected {dtype} {list(shape)})"
            raise CheckpointError(f"{self.where}: no tensor {name!r}{want}")
        t = self._raw(name, device)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"{self.where}: tensor {name!r} has dtype {t.dtype}, expected {dtype}")
        return t

    def _names_set(self) -> set[str]:
        if getattr(self, "_name_cache", None) is None:
            self._name_cache = set(self.names())
        return self._name_cache

    def moe_weights(self, layer: int, device: str | torch.device = "cpu") -> MoEWeights:
        """Layer ``layer``'s experts as canonical MXFP4 weights (interleaved w13 rows), bit for bit."""
        s = self.shapes
        if not 0 <= layer < s.layers:
            raise CheckpointError(f"{self.where}: layer must be in 0..{s.layers - 1}, got {layer}")
        exp = s.expected(layer)
        t = {name: self.tensor(name, *exp[name], device=device) for name in exp}
        for part in ("gate_up_proj_scales", "down_proj_scales"):
            name = expert_name(layer, part)
            nan = torch.nonzero(t[name] == E8M0_NAN)
            if nan.numel():
                where = tuple(int(v) for v in nan[0])
                raise CheckpointError(
                    f"{self.where}: tensor {name!r} holds E8M0 scale byte 255 (NaN in the OCP MX spec) in "
                    f"{nan.shape[0]} block(s), first at index {where}: the checkpoint is corrupt"
                )

        def packed(part: str) -> torch.Tensor:
            b = t[expert_name(layer, part)]
            return b.reshape(*b.shape[:2], b.shape[2] * 16)

        return MoEWeights(
            w13_blocks=packed("gate_up_proj_blocks"),
            w13_scales=t[expert_name(layer, "gate_up_proj_scales")],
            w2_blocks=packed("down_proj_blocks"),
            w2_scales=t[expert_name(layer, "down_proj_scales")],
            w13_bias=t[expert_name(layer, "gate_up_proj_bias")],
            w2_bias=t[expert_name(layer, "down_proj_bias")],
            w13_layout="interleaved",
        )


class GptOssCheckpoint(Checkpoint):
    """A checkpoint folder on disk; shards are opened lazily and tensors read one at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        if not self.path.is_dir():
            raise CheckpointError(f"--model {path}: no such folder (a GPT-OSS checkpoint folder holds config.json)")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.where}: no config.json")
        self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
        if self.config.get("model_type") != "gpt_oss":
            raise CheckpointError(
                f"{cfg_path}: model_type is {self.config.get('model_type')!r}; only 'gpt_oss' is supported"
            )
        quant = (self.config.get("quantization_config") or {}).get("quant_method")
        if quant != "mxfp4":
            raise CheckpointError(
                f"{cfg_path}: quantization_config.quant_method is {quant!r}; the experts must be stored as MXFP4 "
                "('mxfp4'), as openai/gpt-oss-* ship them"
            )
        self._shapes = _Shapes(self.config)
        self._where_is = self._index()
        self._handles: dict[Path, object] = {}

    def _index(self) -> dict[str, Path]:
        from safetensors import safe_open

        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            out = {name: self.path / shard for name, shard in weight_map.items()}
            missing = sorted({p.name for p in out.values() if not p.is_file()})
            if missing:
                raise CheckpointError(f"{index}: names shard(s) that are not there: {', '.join(missing)}")
            return out
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.where}: no *.safetensors file and no model.safetensors.index.json")
        out = {}
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                out.update({name: shard for name in f.keys()})
        return out

    def names(self) -> list[str]:
        """Every tensor name, in sorted order."""
        return sorted(self._where_is)

    def _raw(self, name: str, device: str | torch.device) -> torch.Tensor:
        from safetensors import safe_open

        shard = self._where_is[name]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
        return self._handles[shard].get_tensor(name).to(device)


class SyntheticCheckpoint(Checkpoint):
    """A GPT-OSS checkpoint that does not exist on disk: each tensor is drawn from ``seed`` and its
    name (``harness.contract.inputs.generator_for``), on ``device``. Experts: uniformly random MXFP4 codes
    with trained-like scale bytes (``random_mxfp4_weights``); dense weights: normal with the
    config's initializer_range (0.02), norms 1, sinks 0. It runs the real architecture at full
    size; its outputs mean nothing beyond the comparison of backends."""

    def __init__(self, config: dict, seed: str = "synthetic") -> None:
        self.config = dict(config)
        self.seed = seed
        self.where = f"synthetic:{seed}"
        self._shapes_of = self._dense_shapes()

    def _dense_shapes(self) -> dict[str, tuple[int, ...]]:
        from transformers import GptOssForCausalLM

        with torch.device("meta"):
            model = GptOssForCausalLM(hf_config(self.config))
        out = {}
        for name, t in model.state_dict().items():
            if ".mlp.experts." in name:
                continue
            out[name] = tuple(t.shape)
        s = _Shapes(self.config)
        for layer in range(s.layers):
            for name, (shape, _) in s.expected(layer).items():
                out.setdefault(name, shape)
        return out

    def names(self) -> list[str]:
        """Every tensor name."""
        return sorted(self._shapes_of)

    def _raw(self, name: str, device: str | torch.device) -> torch.Tensor:
        shape = self._shapes_of[name]
        gen = generator_for(f"{self.seed}-{name}", device)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16, device=device)
        if name.endswith("sinks"):
            return torch.zeros(shape, dtype=torch.bfloat16, device=device)
        if name.endswith("_bias") and ".experts." in name:
            return (0.02 * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16)
        if name.endswith(("proj_blocks", "proj_scales")):
            raise AssertionError("expert tensors are made per layer (moe_weights)")
        std = float(self.config.get("initializer_range", 0.02))
        return (std * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16)

    def moe_weights(self, layer: int, device: str | torch.device = "cpu") -> MoEWeights:
        """Random MXFP4 experts of layer ``layer`` (one generator per layer), biases bf16."""
        s = self.shapes
        gen = generator_for(f"{self.seed}-layer{layer}-experts", device)
        w = random_mxfp4_weights(gen, s.experts, s.hidden, s.intermediate, device=device)
        small = {n: (0.02 * getattr(w, n).float()).to(torch.bfloat16) for n in ("w13_bias", "w2_bias")}
        return MoEWeights(w.w13_blocks, w.w13_scales, w.w2_blocks, w.w2_scales, **small, w13_layout="interleaved")


def synthetic_config(preset: str) -> dict:
    """config.json of a full-size architecture by name (``PRESETS``)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    cfg = hf_config(PRESETS[preset] or TINY_CONFIG).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    return cfg


def open_checkpoint(spec: str) -> Checkpoint:
    """``tiny`` (the committed fixture), ``random:gpt-oss-20b`` / ``random:gpt-oss-120b`` (full-size
    synthetic), or a checkpoint folder."""
    if spec == "tiny":
        return GptOssCheckpoint(TINY_DIR)
    if spec.startswith("random:"):
        preset = spec.removeprefix("random:")
        if preset not in PRESETS:
            raise CheckpointError(f"--model random:NAME takes NAME in {', '.join(PRESETS)}; got {preset!r}")
        return SyntheticCheckpoint(synthetic_config(preset), seed=spec)
    return GptOssCheckpoint(spec)


def write_checkpoint(out: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write ``config.json`` and ``model.safetensors`` (GPT-OSS's names; metadata format 'pt' and
    nothing else: safetensors writes metadata keys in hash order, so a second key would make the
    same tensors a different file from run to run)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    meta = {"format": "pt"}
    # clone: tensors that share storage (one array under two names) would be refused by safetensors
    data = {k: v.contiguous().clone() for k, v in sorted(tensors.items())}
    save_file(data, str(out / "model.safetensors"), metadata=meta)

