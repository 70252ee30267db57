"""A GPT-OSS model whose every MoE layer runs through a registry backend.

transformers' ``GptOssForCausalLM`` supplies attention (with sinks, sliding and full layers),
norms, rotary embeddings and the LM head; each decoder layer's MLP is replaced by ``BackendMoE``,
which computes the router logits as transformers does (a bf16 Linear with bias) and hands the
layer input, the logits and the layer's canonical MXFP4 weights to a backend of the registry,
the very adapter ``check`` and the pytest plugin use: ``convert`` once per layer (at the layer's
first call, so that the conversion sees real inputs), ``run`` per call. The oracle is a backend
too (``harness.instruments.honest.Oracle``), so "the model with the oracle's MoE" is the same code path.

The model is built on the meta device and only then materialized, so the bf16 expert parameters
transformers would allocate (38 GB for gpt-oss-20b) never exist; the experts stay MXFP4 (plus
whatever the backend's own layout costs). Dense weights are read from the checkpoint by name,
one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mxmoe.harness.contract.backend import BackendUnavailable
from mxmoe.harness.contract.cases import MODELS, Case, make_case
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import device_for
from mxmoe.harness.e2e.checkpoint import Checkpoint, CheckpointError, hf_config
from mxmoe.harness.judge.engine import poisoned
from mxmoe.harness.run.registry import Loaded


def layer_case(config: dict, tokens: int) -> Case:
    """The case that describes one MoE layer call of a GPT-OSS config: the zoo model of that
    shape where there is one (``gptoss20b``, ``gptoss120b``, ``gptosstiny``), else gpt-oss-20b's
    structure with the config's sizes (the id then says them)."""
    h, i = int(config["hidden_size"]), int(config["intermediate_size"])
    e, k = int(config["num_local_experts"]), int(config["num_experts_per_tok"])
    name = next(
        (n for n, m in MODELS.items() if (m.hidden, m.intermediate, m.experts, m.top_k) == (h, i, e, k)
         and m.activation == "swigluoai" and m.layout == "interleaved"),
        "gptoss20b",
    )  # fmt: skip
    limit = config.get("swiglu_limit", 7.0)
    return make_case(
        name,
        tokens,
        hidden=h,
        intermediate=i,
        experts=e,
        top_k=k,
        routing="Renormalize",
        activation="swigluoai",
        layout="interleaved",
        bias=True,
        alpha=float(config.get("swiglu_alpha", 1.702)),
        limit=float(limit) if limit else None,
    )


class BackendMoE(nn.Module):
    """One decoder layer's MoE through a registry backend. ``router`` is transformers' own router
    module (its weight and bias are loaded under the checkpoint's names); ``weights`` the layer's
    canonical MXFP4 experts; ``observer``, when set, takes over the call (the per-layer check)."""

    def __init__(self, layer: int, router: nn.Module, template: Case, arch: str) -> None:
        super().__init__()
        self.layer = layer
        self.router = router
        self.template = template
        self.arch = arch
        self.weights: Any = None
        self.loaded: Loaded | None = None
        self.prepared: dict[str, Any] = {}
        self.observer: Callable[[BackendMoE, CaseInputs], torch.Tensor] | None = None

    def inputs(self, hidden_states: torch.Tensor) -> CaseInputs:
        """The layer call as the engine's inputs: x [T, H] bf16 and the router logits [T, E]
        (transformers' bf16 Linear, held as float32: every value exact in bf16)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).to(torch.bfloat16).contiguous()
        logits = nn.functional.linear(x, self.router.weight.to(x.dtype), self.router.bias.to(x.dtype))
        case = dataclasses.replace(self.template, tokens=x.shape[0])
        return CaseInputs(case, x, logits.float(), self.weights, None, None)

    def prepared_for(self, inputs: CaseInputs) -> Any:
        """The backend's converted weights, made at the layer's first call and kept."""
        backend = self.loaded.backend
        key = backend.declaration.id
        if key not in self.prepared:
            self.prepared[key] = backend.convert(inputs)
        return self.prepared[key]

    def run(self, inputs: CaseInputs) -> torch.Tensor:
        """The backend's output for one call (its declared output dtype), unguarded."""
        backend = self.loaded.backend
        out = poisoned((inputs.case.tokens, inputs.case.hidden), backend.declaration.arithmetic.precision.output,
                       inputs.x.device)  # fmt: skip
        backend.run(self.prepared_for(inputs), inputs, out)
        return out

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """transformers' MLP contract: (output of the input's shape and dtype, router scores)."""
        inputs = self.inputs(hidden_states)
        out = self.observer(self, inputs) if self.observer is not None else self.run(inputs)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape), None


class MoEModel:
    """transformers' GptOssForCausalLM over a checkpoint, MoE layers through backends."""

    def __init__(self, ckpt: Checkpoint, arch: str, device: str | None = None) -> None:
        from transformers import GptOssForCausalLM

        self.ckpt = ckpt
        self.arch = arch
        self.device = torch.device(device or device_for(arch))
        self.config = hf_config(ckpt.config)
        with torch.device("meta"):
            hf = GptOssForCausalLM(self.config)
        self.layers: list[BackendMoE] = []
        for i, layer in enumerate(hf.model.layers):
            moe = BackendMoE(i, layer.mlp.router, layer_case(ckpt.config, 1), arch)
            layer.mlp = moe
            self.layers.append(moe)
        hf.to_empty(device=self.device)
        self._load_dense(hf)
        with torch.device(self.device):
            # non-persistent buffers (rotary inverse frequencies) are not in a checkpoint: remake them
            hf.model.rotary_emb = type(hf.model.rotary_emb)(config=self.config)
        hf.eval()
        self.hf = hf
        for moe in self.layers:
            moe.weights = ckpt.moe_weights(moe.layer, device=self.device)

    def _load_dense(self, hf: nn.Module) -> None:
        state = hf.state_dict()
        names = set(self.ckpt.names())
        missing = [n for n in state if n not in names]
        if missing:
            raise CheckpointError(
                f"{self.ckpt.where}: no tensor {missing[0]!r} ({len(missing)} dense tensor(s) missing)"
            )
        with torch.no_grad():
            for name, param in state.items():
                t = self.ckpt.tensor(name, tuple(param.shape), device=self.device)
                if not t.is_floating_point():
                    raise CheckpointError(f"{self.ckpt.where}: tensor {name!r} has dtype {t.dtype}, expected a float")
                param.copy_(t.to(param.dtype))

    def use(self, default: Loaded, plants: dict[int, Loaded] | None = None) -> None:
        """Run every MoE layer through ``default``, except layers named in ``plants``. Each backend
        is loaded and asked whether it takes this model's layer on this arch; a refusal is
        BackendUnavailable saying why."""
        plants = dict(plants or {})
        bad = [i for i in plants if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"planted layer(s) {bad} out of range: this model has layers 0..{len(self.layers) - 1}")
        for moe in self.layers:
            loaded = plants.get(moe.layer, default)
            backend = loaded.backend
            reason = backend.supports(dataclasses.replace(moe.template, tokens=1), self.arch)
            if reason:
                raise BackendUnavailable(f"layer {moe.layer}: {reason}")
            try:
                backend.load()
            except ImportError as exc:
                raise BackendUnavailable(f"{backend.declaration.id} cannot run here: {exc}") from exc
            moe.loaded = loaded

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced next-token logits [B, S, V] (float32) for token ids [B, S]."""
        out = self.hf(input_ids=ids.to(self.device), use_cache=False)
        return out.logits.float()

    def timed_logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``logits`` and its wall time in seconds (device synchronized)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        logits = self.logits(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits, time.perf_counter() - start

    def set_observer(self, observer: Callable[[BackendMoE, CaseInputs], torch.Tensor] | None) -> None:
        """Route every MoE call through ``observer`` (None: plain runs)."""
        for moe in self.layers:
            moe.observer = observer
