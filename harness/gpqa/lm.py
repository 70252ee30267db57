"""The two lm-eval models a GPQA run uses: the in-process GPT-OSS whose MoE layers run through a
registry backend (``mxmoe``), and an OpenAI-compatible chat server (``mxmoe-chat-completions``).

``MoELM`` is an ``lm_eval.api.model.LM`` over ``harness.e2e.model.MoEModel``: log-likelihoods are
teacher-forced forwards in right-padded batches (contexts and continuations split as lm-eval's own
Hugging Face model splits them); generation is a KV-cached sampling loop over the checkpoint's chat
template, each sample drawn from its own generator seeded by the sample's identity (question id and
repeat), so a sample's tokens never depend on the clock or on which run it is in.

``ServerChatLM`` is lm-eval's ``local-chat-completions`` client with two changes a release
decision needs: a response that is not a chat completion (no ``choices``, no message) raises
``ServerError`` instead of becoming an empty answer scored wrong, and each request carries the
seed of its sample rather than one seed for the whole run.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import torch

from mxmoe.harness.contract.inputs import seed_for
from mxmoe.harness.e2e import task
from mxmoe.harness.gpqa import data

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.models.openai_completions import LocalChatCompletion
    from tqdm import tqdm
except ImportError as exc:  # the GPQA subcommand reports it; nothing else in the project needs lm-eval
    raise ImportError(f"the GPQA runs need lm-eval (pip install 'lm-eval[api]'): {exc}") from exc

EFFORTS = ("low", "medium", "high")
STOP_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")
"""Tokens that end a GPT-OSS generation (its generation_config's eos ids, by name)."""


class ServerError(RuntimeError):
    """The server died, was unreachable, or answered with something that is not a chat completion."""


def sample_seed(doc: dict) -> int:
    """The sampling seed of one (question, repeat)."""
    return seed_for(f"gpqa-{doc['question_id']}-repeat{doc['repeat']}")


def chat_template_of(folder: Any) -> str | None:
    """A checkpoint's chat template: ``chat_template.jinja`` (gpt-oss's repositories), else the
    ``chat_template`` of ``tokenizer_config.json``; None when it has neither."""
    if folder is None:
        return None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    return None


@register_model("mxmoe")
class MoELM(LM):
    """GPT-OSS in this process, every MoE layer through one registry backend (``model.use``)."""

    def __init__(
        self, model: Any, tokenizer: Any, chat_template: str | None, effort: str = "low", batch_size: int = 8
    ) -> None:
        super().__init__()
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {EFFORTS}, got {effort!r}")
        self.model = model
        self.tok = tokenizer
        self.template = chat_template
        self.effort = effort
        self.batch_size = batch_size
        self.pad_id = tokenizer.token_to_id("<|pad|>") or 0
        self.stop_ids = {i for i in (tokenizer.token_to_id(t) for t in STOP_TOKENS) if i is not None}
        self.max_length = int(model.config.max_position_embeddings)
        self.forward_seconds = 0.0
        self._chat = None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MoELM:
        """``lm_eval.simple_evaluate(model="mxmoe", model_args="model=tiny,backend=triton,effort=low,batch_size=8")``
        (after importing this module): the checkpoint (a folder, ``tiny``) through one registry backend."""
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v is not None}
        unknown = set(args) - {"model", "backend", "effort", "batch_size"}
        if unknown or "model" not in args or "backend" not in args:
            raise ValueError(f"model_args for mxmoe: model=PATH|tiny, backend=ID, effort=low|medium|high, "
                             f"batch_size=N; got {arg_string!r}")  # fmt: skip
        return cls.load(str(args["model"]), str(args["backend"]), str(args.get("effort", "low")),
                        int(extra.get("batch_size", args.get("batch_size", 8))))  # fmt: skip

    @classmethod
    def load(cls, model: str, backend: str, effort: str = "low", batch_size: int = 8) -> MoELM:
        """The checkpoint ``model`` on this host, every MoE layer through the registry backend ``backend``."""
        from tokenizers import Tokenizer

        from mxmoe.harness.contract.platforms import host_arch
        from mxmoe.harness.e2e.checkpoint import open_checkpoint
        from mxmoe.harness.e2e.model import MoEModel
        from mxmoe.harness.run.registry import discover, select

        ckpt = open_checkpoint(model)
        folder = getattr(ckpt, "path", None)
        if folder is None or not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{ckpt.where}: GPQA needs the checkpoint's tokenizer.json")
        hits = select(discover(), (backend,))
        if len(hits) != 1:
            raise ValueError(f"backend {backend!r} matches {len(hits)} backends; name exactly one")
        moe = MoEModel(ckpt, host_arch())
        moe.use(hits[0])
        return cls(moe, Tokenizer.from_file(str(folder / "tokenizer.json")), chat_template_of(folder), effort,
                   batch_size)  # fmt: skip

    # -- lm-eval's chat-template hooks
    @property
    def tokenizer_name(self) -> str:
        return "mxmoe-" + str(getattr(self.model.ckpt, "where", "model"))

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The checkpoint's own template (rendered by transformers), with the run's reasoning effort."""
        if self.template is None:
            raise ValueError(
                f"{self.tokenizer_name}: the chain-of-thought form needs the checkpoint's chat template "
                "(chat_template.jinja or tokenizer_config.json); this checkpoint has none"
            )
        if self._chat is None:
            from transformers import PreTrainedTokenizerFast

            self._chat = PreTrainedTokenizerFast(tokenizer_object=self.tok, chat_template=self.template)
        return self._chat.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt, reasoning_effort=self.effort
        )

    # -- scoring
    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def _timed_logits(self, ids: torch.Tensor) -> torch.Tensor:
        logits, seconds = self.model.timed_logits(ids)
        self.forward_seconds += seconds
        return logits

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Sum of the continuation's token log-probabilities after the context, and whether every
        continuation token is the argmax. Trailing spaces of a context move to its continuation and
        the continuation's tokens are those of the whole text past the context's, as in lm-eval's
        Hugging Face model."""
        seqs = []
        for req in requests:
            context, continuation = req.args
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self._encode(context + continuation)
            start = len(self._encode(context))
            if start == 0 or start >= len(whole):
                raise ValueError("loglikelihood needs a non-empty context and continuation")
            seqs.append((whole[-self.max_length :], start - max(0, len(whole) - self.max_length)))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        bar = tqdm(total=len(seqs), desc="log-likelihoods", disable=disable_tqdm)
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            ids, _ = task.pad_batch([seqs[i][0] for i in idx], self.pad_id)
            logp = torch.log_softmax(self._timed_logits(ids).float(), dim=-1)
            for j, i in enumerate(idx):
                s, start = seqs[i]
                targets = torch.tensor(s[start:], device=logp.device)
                rows = logp[j, start - 1 : len(s) - 1]
                out[i] = (float(rows.gather(1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all()))
            bar.update(len(idx))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("the GPQA tasks use loglikelihood and generate_until only")

    # -- generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Sampled continuations, in right-sized batches of the same generation settings."""
        out: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        bar = tqdm(total=len(requests), desc="generations", disable=disable_tqdm)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            effort = kwargs.pop("reasoning_effort", self.effort)
            if effort != self.effort:
                raise ValueError(f"reasoning_effort {effort!r} in the generation settings, {self.effort!r} in the "
                                 "model")  # fmt: skip
            for b in range(0, len(members), self.batch_size):
                idx = members[b : b + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in idx], [sample_seed(requests[i].doc) for i in idx],
                                       **kwargs)  # fmt: skip
                for i, text in zip(idx, texts):
                    out[i] = text
                bar.update(len(idx))
        bar.close()
        return out

    @torch.no_grad()
    def _generate(
        self,
        contexts: list[str],
        seeds: list[int],
        until: list[str] | str | None = None,
        max_gen_toks: int = 256,
        temperature: float = 0.0,
        do_sample: bool = False,
        **unknown: Any,
    ) -> list[str]:
        if unknown:
            raise ValueError(f"generation settings {sorted(unknown)} are not supported (until, max_gen_toks, "
                             "temperature, do_sample, reasoning_effort are)")  # fmt: skip
        until = [until] if isinstance(until, str) else list(until or [])
        device = self.model.device
        prompts = [self._encode(c) for c in contexts]
        width = max(len(p) for p in prompts)
        budget = min(int(max_gen_toks), self.max_length - width)
        if budget <= 0:
            raise ValueError(f"a prompt of {width} tokens leaves no room to generate (max length {self.max_length})")
        # left padding: every row's next token is at the same column
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = []
        for s in seeds:
            g = torch.Generator(device=device)
            g.manual_seed(s)
            gens.append(g)
        sample = do_sample and temperature > 0
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        cache = None
        step_ids, step_pos = ids, positions
        for _ in range(budget):
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            res = self.model.hf(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                past_key_values=cache, use_cache=True)  # fmt: skip
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(device)
            self.forward_seconds += time.perf_counter() - t0
            cache = res.past_key_values
            last = res.logits[:, -1, :].float()
            nxt = []
            for r in range(len(prompts)):
                if sample:
                    probs = torch.softmax(last[r] / temperature, dim=-1)
                    tok = int(torch.multinomial(probs, 1, generator=gens[r]))
                else:
                    tok = int(last[r].argmax())
                if not done[r]:
                    if tok in self.stop_ids:
                        done[r] = True
                    else:
                        new[r].append(tok)
                        if until and any(u in self.tok.decode(new[r][-64:], skip_special_tokens=False) for u in until):
                            done[r] = True
                nxt.append(tok if not done[r] else self.pad_id)
            if all(done):
                break
            step_ids = torch.tensor(nxt, device=device)[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        texts = []
        for r in range(len(prompts)):
            text = self.tok.decode(new[r], skip_special_tokens=False)
            for u in until:
                text = text.split(u, 1)[0]
            texts.append(text)
        return texts


@register_model("mxmoe-chat-completions")
class ServerChatLM(LocalChatCompletion):
    """lm-eval's chat-completions client, strict about what the server answers, one seed per sample."""

    @classmethod
    def for_server(cls, base_url: str, model: str, concurrency: int = 64, timeout: int = 3600) -> ServerChatLM:
        """The client for ``base_url`` (``http://HOST:PORT/v1``) with the settings of the ``gpqa``
        server route (chat completions, no local tokenizer, three retries), so that ``oai_evals``
        runs the harness's side as that route does (``harness/cli/gpqa.py`` builds the same inline)."""
        return cls(model=model, base_url=base_url.rstrip("/") + "/chat/completions", tokenizer_backend=None,
                   tokenized_requests=False, num_concurrent=concurrency, max_retries=3, timeout=timeout)  # fmt: skip

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._seeds: dict[str, collections.deque] = {}
        self._seed_now: int | None = None
        self.answered = 0

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's seed is its sample's; requests are matched to seeds by their messages
        (two repeats of a question that drew the same permutation send the same messages and get
        their two seeds in order)."""
        self._seeds = collections.defaultdict(collections.deque)
        for req in requests:
            self._seeds[str(req.args[0])].append(sample_seed(req.doc))
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _take(self, messages: Any) -> tuple[str, int | None]:
        key = str(messages[0]) if isinstance(messages, list | tuple) and messages else str(messages)
        queue = self._seeds.get(key)
        self._seed_now = queue.popleft() if queue else None
        return key, self._seed_now

    def _give_back(self, key: str, seed: int | None) -> None:
        """A failed request's seed goes back, so that its retry sends the same seed."""
        if seed is not None:
            self._seeds[key].appendleft(seed)

    def model_call(self, messages: Any, **kwargs: Any) -> Any:
        key, seed = self._take(messages)
        try:
            return super().model_call(messages, **kwargs)
        except BaseException:
            self._give_back(key, seed)
            raise

    async def amodel_call(self, session: Any, sem: Any, messages: Any, **kwargs: Any) -> Any:
        # the payload is built before the first await inside, so _seed_now is still this call's
        key, seed = self._take(messages)
        try:
            return await super().amodel_call(session, sem, messages, **kwargs)
        except BaseException:
            self._give_back(key, seed)
            raise

    def _create_payload(self, messages: Any, generate: bool = False, gen_kwargs: dict | None = None,
                        seed: int = 1234, eos: Any = None, **kwargs: Any) -> dict:  # fmt: skip
        seed = self._seed_now if self._seed_now is not None else seed
        return super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos, **kwargs)

    def parse_generations(self, outputs: Any, **kwargs: Any) -> list[str]:
        """The message content of each choice; anything that is not a chat completion is a
        ServerError quoting (the start of) what came back. A null content (every token spent on
        reasoning) is an empty response: no answer, scored wrong, as in gpt-oss's eval."""
        res = []
        for out in outputs if isinstance(outputs, list) else [outputs]:
            try:
                choices = sorted(out["choices"], key=lambda c: c.get("index", 0))
                texts = [c["message"]["content"] for c in choices]
            except (KeyError, TypeError, AttributeError) as exc:
                raise ServerError(f"the server's answer is not a chat completion ({exc!r}): {str(out)[:300]}") from None
            if not texts or any(t is not None and not isinstance(t, str) for t in texts):
                raise ServerError(f"the server's answer holds no text: {str(out)[:300]}")
            self.answered += len(texts)
            res.extend(t or "" for t in texts)
        return res


def mc_letter(loglikelihoods: list[tuple[float, bool]] | list[float]) -> str:
    """The letter of the most likely choice (the first of equals, as lm-eval's ``acc`` takes it)."""
    scores = [x[0] if isinstance(x, list | tuple) else x for x in loglikelihoods]
    return data.LETTERS[max(range(len(scores)), key=lambda i: (scores[i], -i))]
