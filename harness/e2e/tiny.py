"""The tiny GPT-OSS the project trains itself: ``python -m harness make-tiny --out DIR``.

No real GPT-OSS weights (nor GPQA) can be fetched where the project is built and tested, so the
model-level checks run on a model made here: a byte-level BPE tokenizer (``tokenizers``) trained
on the synthetic task's text (``harness.e2e.task``), and a GPT-OSS-architecture model
(transformers' ``GptOssForCausalLM``: swigluoai with alpha 1.702 and limit 7, interleaved w13
rows, biases everywhere, Renormalize top-k routing, attention sinks, sliding and full attention
layers) trained on CPU in a few minutes to answer the task. Training is in float32 with the
experts fake-quantized to MXFP4 (straight-through) for the last steps, so that the quantized
model keeps what it learned. The experts are then quantized to MXFP4 (FLOOR rule) and the model
is written in GPT-OSS's real checkpoint format (``harness.e2e.checkpoint``): bf16 attention,
norms, router and embeddings, uint8 ``*_blocks`` and ``*_scales``, bf16 expert biases.

Hidden size and intermediate size are 256: the smallest at which vLLM's Hopper configuration of
OpenAI triton_kernels compiles (N > 128 in both GEMMs), so that the GPU backends run on it too.
The fixture committed under ``harness/e2e/tiny/`` is this script's output for ``SEED``; it runs
on a fixed number of threads with deterministic algorithms, so the same torch build reproduces it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mxmoe.harness.e2e import task
from mxmoe.harness.e2e.checkpoint import TINY_CONFIG, GptOssCheckpoint, write_checkpoint
from mxmoe.harness.e2e.model import MoEModel
from mxmoe.reference.mxfp4 import fake_quantize, quantize_mxfp4

SEED = 20261130
SPECIAL = ("<|pad|>", "<|endoftext|>")
TRAIN_QUESTIONS, TEST_QUESTIONS = 4000, 200
FILES = ("config.json", "model.safetensors", "tokenizer.json", "task-test.csv")
"""What the script writes besides fixture.json (which records their SHA-256)."""
TEXT_WEIGHT = 0.1
"""Loss weight of predicting the prompt's own tokens (the model's distribution everywhere is what
the KL and top-1 comparisons read), against 1 for the answers."""
TRAIN_THREADS = 2
"""Fixed, so that the reductions (and hence the fixture) are the same on every run of one build."""


def build_tokenizer(texts: list[str], vocab_size: int):  # noqa: ANN201 (tokenizers.Tokenizer, imported lazily)
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _config():  # noqa: ANN202
    from transformers import GptOssConfig

    cfg = GptOssConfig(**TINY_CONFIG, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    cfg._attn_implementation = "eager"
    return cfg


class _FakeMxfp4(torch.nn.Module):
    """Straight-through MXFP4 round trip of an expert weight [E, K, N] along K (the checkpoint's
    blocks run along the input dimension)."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        q = fake_quantize(w.detach().transpose(1, 2), "mxfp4").transpose(1, 2).to(w.dtype)
        return w + (q - w).detach()


def _batch(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids, and per-position loss weights of the next token: ``TEXT_WEIGHT`` on the
    text (it teaches the words), 1 on the answer (from ``start`` on), 0 on the padding."""
    ids, mask = task.pad_batch([s for s, _ in examples], pad_id)
    weights = mask.float() * TEXT_WEIGHT
    for i, (s, start) in enumerate(examples):
        weights[i, start : len(s)] = 1.0
    return ids, weights


def train(
    out: str | Path,
    seed: int = SEED,
    steps: int = 500,
    qat_steps: int = 100,
    batch: int = 48,
    lr: float = 1e-3,
    log: Callable[[str], None] = print,
) -> dict:
    """Generate the task, train the tokenizer and the model, quantize, write the checkpoint to
    ``out``; returns the training summary (also written as ``out/fixture.json``)."""
    from transformers import GptOssForCausalLM


    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        test_rows = task.make_rows(seed + 1, TEST_QUESTIONS, prefix="test")
        train_rows = task.make_rows(seed, TRAIN_QUESTIONS, exclude={task.row_key(r) for r in test_rows}, prefix="train")
        task.write_csv(test_rows, out / "task-test.csv")
        texts = []
        for repeat in range(2):
            for row in train_rows:
                prompt, shown, correct = task.format_prompt(row, repeat)
                texts.append(prompt + task.answer_text(shown[correct]))
        tok = build_tokenizer(texts, TINY_CONFIG["vocab_size"])
        tok.save(str(out / "tokenizer.json"))
        pad_id, eos_id = (tok.token_to_id(s) for s in SPECIAL)
        assert (pad_id, eos_id) == (0, 1), (pad_id, eos_id)

        def encode(s: str) -> list[int]:
            return tok.encode(s).ids


        model = GptOssForCausalLM(_config())
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        gen = torch.Generator().manual_seed(seed)
        start = time.time()
        for step in range(steps):
            if step == steps - qat_steps:
                for layer in model.model.layers:
                    for name in ("gate_up_proj", "down_proj"):
                        torch.nn.utils.parametrize.register_parametrization(layer.mlp.experts, name, _FakeMxfp4())
            frac = step / steps
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
            picks = torch.randint(0, len(train_rows), (batch,), generator=gen).tolist()
            repeats = torch.randint(0, 1 << 30, (batch,), generator=gen).tolist()
            examples, choices, truth = [], [], []
            for i, r in zip(picks, repeats):
                prompt, shown, correct = task.format_prompt(train_rows[i], r)
                p = encode(prompt)
                examples.append((p + encode(task.answer_text(shown[correct])) + [eos_id], len(p)))
                choices.append([encode(task.answer_text(a))[0] for a in shown])
                truth.append(correct)
            ids, weights = _batch(examples, pad_id)
            result = model(input_ids=ids)
            nll = torch.nn.functional.cross_entropy(
                result.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
            )
            w = weights[:, 1:].flatten()
            loss = (nll * w).sum() / w.sum()
            # does the right choice's first token beat the other three's after "Answer:"?
            at = torch.tensor([start for _, start in examples])
            rows = torch.arange(len(examples))
            four = result.logits[rows, at - 1].gather(1, torch.tensor(choices))
            hits = (four.argmax(-1) == torch.tensor(truth)).float().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 50 == 0 or step == steps - 1:
                log(f"step {step:4d}/{steps}  loss {loss.item():.4f}  answers right {hits.item():.2f}  "
                    f"{time.time() - start:6.1f} s")
        model.eval()
        for layer in model.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                if torch.nn.utils.parametrize.is_parametrized(layer.mlp.experts, name):
                    # the float weights come back; quantized_state rounds them as the fake quantizer did
                    torch.nn.utils.parametrize.remove_parametrizations(
                        layer.mlp.experts, name, leave_parametrized=False
                    )
        fp32_acc = accuracy(lambda ids: model(input_ids=ids).logits, encode, test_rows, pad_id)
        log(f"float32 model (unquantized experts): test accuracy {fp32_acc:.3f}")
        state = quantized_state(model)
        write_checkpoint(out, state, config_dict())
        oracle_acc = oracle_accuracy(out, test_rows)
        log(f"MXFP4 checkpoint through the oracle's MoE: test accuracy {oracle_acc:.3f}")
        summary = {
            "seed": seed,
            "steps": steps,
            "qat_steps": qat_steps,
            "batch": batch,
            "lr": lr,
            "train_questions": TRAIN_QUESTIONS,
            "test_questions": TEST_QUESTIONS,
            "float32_test_accuracy": fp32_acc,
            "oracle_moe_test_accuracy": oracle_acc,
            "train_seconds": round(time.time() - start, 1),
            "torch": torch.__version__,
            "sha256": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in FILES},
        }
        (out / "fixture.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary
    finally:
        torch.set_num_threads(threads)


def oracle_accuracy(folder: str | Path, rows: list[dict]) -> float:
    """Test accuracy of the checkpoint in ``folder`` with the oracle as every layer's MoE."""
    from tokenizers import Tokenizer

    from mxmoe.harness.run.registry import load_spec

    model = MoEModel(GptOssCheckpoint(folder), "cpu")
    model.use(load_spec("mxmoe.harness.instruments.honest:Oracle"))
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return accuracy(model.logits, lambda s: tok.encode(s).ids, rows, tok.token_to_id(SPECIAL[0]))


def accuracy(logits_fn: task.LogitsFn, encode: Callable[[str], list[int]], rows: list[dict], pad_id: int) -> float:
    """Share of ``rows`` whose highest-likelihood answer is the correct one."""
    picks = task.score_choices(logits_fn, encode, rows, pad_id)
    return sum(p == t for p, t in picks) / len(picks)


def config_dict() -> dict:
    """config.json of the fixture: GPT-OSS's own keys, with its MXFP4 quantization_config."""
    cfg = _config().to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    cfg["torch_dtype"] = "bfloat16"
    # swiglu_alpha is transformers 5.2x's knob, not a key of gpt-oss's config.json (1.702 is its default)
    for key in ("_attn_implementation", "_experts_implementation", "transformers_version", "swiglu_alpha"):
        cfg.pop(key, None)
    return cfg


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state in GPT-OSS's checkpoint naming: experts as MXFP4 blocks [E, N, K/32, 16]
    and scales [E, N, K/32] (rows of the transposed HF parameter), everything else bf16."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).to(torch.float64), "floor")
            e, n, half_k = blocks.shape
            out[name + "_blocks"] = blocks.reshape(e, n, half_k // 16, 16).contiguous()
            out[name + "_scales"] = scales.contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out
