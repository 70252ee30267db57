"""vLLM CI's GPQA gate beside the harness's own GPQA, sample by sample.

vLLM's CI gate for GPT-OSS (``tests/evals/gpt_oss/test_gpqa_correctness.py``, after
``uv pip install 'gpt-oss[eval]==0.0.5'``) starts ``vllm serve`` and runs ``python -m gpt_oss.evals
--eval gpqa --model M --reasoning-effort low --base-url URL --n-threads 200``: OpenAI's ``GPQAEval``
(GPQA diamond, 8 repeats) through its default sampler, ``ResponsesSampler`` (the Responses API),
and fails a backend whose score is below the config's threshold less 0.05. This module runs that
eval class with that sampler, unchanged, against a base URL on a local GPQA-format CSV
(``gpt_oss_samples``); runs the harness's ``cot`` task through lm-eval and the harness's chat
client against the same server (``harness_samples``); and compares the two per sample: the same
question, choice order and correct letter, the same prompt messages, the same response, the same
extracted letter, the same grade (``compare``).

A comparison of responses means something only where the server answers a prompt the same way
whoever sends it: ``LoopbackServer`` is such a server (chat completions and responses, on
loopback), its response a function of the prompt alone, either a bank of answer forms
(``canned_answer``) or the tiny GPT-OSS fixture sampling with a seed drawn from the prompt
(``TinyAnswerer``). Text (questions, prompts, responses) stays in memory: ``compare`` returns
counts, letters and hashes only, so that GPQA's text is never written or printed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import html
import importlib.metadata
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from mxmoe.harness.contract.inputs import seed_for
from mxmoe.harness.gpqa import data

GPT_OSS_PIN = "0.0.5"
"""The gpt-oss release vLLM's CI installs for the gate (``.buildkite/test_areas/lm_eval.yaml``)."""
GPQA_URL = "https://openaipublic.blob.core.windows.net/simple-evals/gpqa_{variant}.csv"
"""Where ``GPQAEval`` reads its CSV; ``gpt_oss_samples`` serves a local file in its place."""
CI_MAX_TOKENS = 131_072
"""The token budget ``gpt_oss/evals/__main__.py`` gives the sampler (0.0.5's ResponsesSampler,
with a reasoning model, does not send it: the server's own default applies)."""

INSTALL = (f"pip install 'gpt-oss[eval]=={GPT_OSS_PIN}' (it declares Python 3.12 only); on another Python: "
           f"pip install openai && pip install --no-deps --ignore-requires-python 'gpt-oss=={GPT_OSS_PIN}' "
           "(its GPQA path imports only pandas, numpy, jinja2, tqdm and openai)")  # fmt: skip


class Unavailable(ImportError):
    """gpt-oss's evals (or the openai client they call the server with) are not importable."""


class OaiEvalsError(RuntimeError):
    """gpt-oss's eval did not run as vLLM's CI runs it: its data source moved, or its sampler kept
    failing against the server (it would retry forever; here it stops)."""


def gpt_oss_modules() -> SimpleNamespace:
    """gpt-oss's GPQA eval, its grader and both samplers, and the installed gpt-oss version;
    ``Unavailable`` saying how to install them where they are not importable."""
    try:
        from gpt_oss.evals import abcd_grader, chat_completions_sampler, gpqa_eval, responses_sampler
    except ImportError as exc:
        raise Unavailable(f"gpt-oss's evals (gpt_oss.evals) are not importable ({exc}): {INSTALL}") from exc
    try:
        version = importlib.metadata.version("gpt-oss")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return SimpleNamespace(gpqa_eval=gpqa_eval, abcd_grader=abcd_grader, responses_sampler=responses_sampler,
                           chat_completions_sampler=chat_completions_sampler, version=version)  # fmt: skip


# gpt-oss's modules are patched (data source, retry sleeps) for the length of a run: one run at a time
_PATCHING = threading.RLock()


class _LocalPandas:
    """``pandas`` as ``gpqa_eval`` sees it during a run: ``read_csv`` of GPQA's URL reads the local
    file with the same call; any other URL is an error (a moved data source, never a download)."""

    def __init__(self, real: ModuleType, url: str, path: Path) -> None:
        self._real, self._url, self._path = real, url, path

    def read_csv(self, source: Any, *args: Any, **kwargs: Any) -> Any:
        if source != self._url:
            raise OaiEvalsError(f"gpt-oss's GPQA eval reads {source!r}, not {self._url!r}: its data source changed "
                                "and oai_evals no longer knows which local file stands for it")  # fmt: skip
        return self._real.read_csv(self._path, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _BoundedSleep:
    """``time`` as gpt-oss's samplers see it: their ``while True`` retry loop (any exception, an empty
    chat completion included) sleeps 2**trial seconds; past ``retries`` trials this raises instead."""

    def __init__(self, real: ModuleType, retries: int) -> None:
        self._real, self._retries = real, retries

    def sleep(self, seconds: float) -> None:
        if seconds >= 2**self._retries:
            raise OaiEvalsError(f"gpt-oss's sampler failed {self._retries + 1} times on one sample (printed above); "
                                "it would retry forever")  # fmt: skip
        self._real.sleep(min(seconds, 1.0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _patched(module: ModuleType, name: str, value: object) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment variables set for a while where unset: OPENAI_API_KEY, which the openai client
    refuses to start without (vLLM's CI sets ``dummy``)."""
    added = [k for k in values if k not in os.environ]
    for k in added:
        os.environ[k] = values[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def letter(extracted: str | None) -> str | None:
    """An extracted answer as a letter, or None where it is none: gpt-oss's grader returns the
    response's first character where no pattern matches, the harness ``[no answer]``."""
    return extracted if extracted in tuple(data.LETTERS) else None


def gpt_oss_samples(
    data_path: str | Path,
    base_url: str,
    model: str,
    *,
    variant: str = "diamond",
    repeats: int = 1,
    limit: int | None = None,
    effort: str = "low",
    sampler: str = "responses",
    temperature: float = 1.0,
    max_tokens: int = CI_MAX_TOKENS,
    threads: int = 1,
    retries: int = 3,
) -> list[dict]:
    """gpt-oss's own GPQA eval against ``base_url`` on the CSV ``data_path``, one record per sample
    in the eval's order: its prompt messages, the response, the letter gpt-oss extracted (and its
    raw value), the correct letter, the grade, and the harness's reading of the same response.

    The sampler is built as ``gpt_oss/evals/__main__.py`` builds it for vLLM's CI (a reasoning model
    at ``effort``, ``temperature``, ``max_tokens``; ``sampler`` "responses", the default there, or
    "chat_completions"), and ``GPQAEval`` as it is built there, with ``repeats`` and ``limit``
    (``num_examples``; gpt-oss allows it with one repeat only). The eval is called once per sample
    (a copy holding that one example), so that every result is known to be that sample's even where
    two samples send the same prompt; ``threads`` such calls run at once."""
    m = gpt_oss_modules()
    if limit is not None and repeats != 1:
        raise ValueError("gpt-oss's GPQAEval samples questions (num_examples) only with one repeat")
    classes = {"responses": m.responses_sampler.ResponsesSampler,
               "chat_completions": m.chat_completions_sampler.ChatCompletionsSampler}  # fmt: skip
    if sampler not in classes:
        raise ValueError(f"sampler must be one of {', '.join(classes)}; got {sampler!r}")
    with _PATCHING, _env(OPENAI_API_KEY="dummy"):
        chosen = classes[sampler](model=model, reasoning_model=True, reasoning_effort=effort, temperature=temperature,
                                  base_url=base_url, max_tokens=max_tokens)  # fmt: skip
        local = _LocalPandas(m.gpqa_eval.pandas, GPQA_URL.format(variant=variant), Path(data_path))
        with _patched(m.gpqa_eval, "pandas", local):
            evaluation = m.gpqa_eval.GPQAEval(n_repeats=repeats, variant=variant, num_examples=limit, debug=False,
                                              n_threads=1)  # fmt: skip
        per_repeat = len(evaluation.examples) // repeats

        def one(item: tuple[int, dict]) -> dict:
            index, example = item
            single = copy.copy(evaluation)
            single.examples = [example]
            return _gpt_oss_record(m, index, index // per_repeat, example, single(chosen))

        with contextlib.ExitStack() as stack:
            for mod in (m.responses_sampler, m.chat_completions_sampler):
                stack.enter_context(_patched(mod, "time", _BoundedSleep(mod.time, retries)))
            # the eval draws a progress bar per call, and a call here is one sample
            stack.enter_context(_patched(m.gpqa_eval.report, "tqdm", _no_bar))
            pool = stack.enter_context(ThreadPoolExecutor(max(1, threads)))
            return list(pool.map(one, enumerate(evaluation.examples)))


def _no_bar(items: Any, *args: Any, **kwargs: Any) -> Any:
    return items


_CORRECT = re.compile(r"<p>Correct Answer: (.*?)</p>", re.S)
_EXTRACTED = re.compile(r"<p>Extracted Answer: (.*?)</p>", re.S)


def _gpt_oss_record(m: SimpleNamespace, index: int, repeat: int, example: dict, result: Any) -> dict:
    """One sample's record from the ``EvalResult`` of one example: the conversation it returns (the
    messages sent, then the response) and its report, where the correct and the extracted letter
    are written (gpt-oss's own ``gpqa_eval`` reads the correct letter back from there too)."""
    convo, report = result.convos[0], result.htmls[0]
    response = convo[-1]["content"]
    sent = list(convo[:-1])
    while sent and sent[-1].get("role") == "assistant":  # the chat sampler appends the reasoning it got back
        sent.pop()
    raw = m.abcd_grader.extract_abcd(response)
    written = _EXTRACTED.search(report)
    if written is None or html.unescape(written.group(1)) != raw:
        raise OaiEvalsError(f"sample {index}: gpt-oss's report does not hold the answer its grader extracts")
    rid = example.get("Record ID")
    known = isinstance(rid, str) and rid  # a missing id (NaN) is numbered by its row there, unknown here
    qid = data.question_id({"Record ID": rid, "Question": example["Question"]}) if known else None
    return {
        "index": index,
        "question_id": qid,
        "repeat": repeat,
        "permutation": [int(i) for i in example["permutation"]],
        "messages": [{"role": str(x["role"]), "content": x["content"]} for x in sent],
        "response": response,
        "answer": _CORRECT.search(report).group(1),
        "extracted": letter(raw),
        "extracted_raw": raw,
        "correct": float(result.score) == 1.0,
    }


def harness_samples(
    data_path: str | Path,
    base_url: str,
    model: str,
    *,
    variant: str = "diamond",
    repeats: int = 1,
    limit: int | None = None,
    effort: str = "low",
    max_tokens: int = 32768,
    temperature: float = 1.0,
    concurrency: int = 1,
) -> list[dict]:
    """The harness's ``cot`` task through lm-eval against ``base_url``, as ``gpqa --base-url`` runs
    it (``run.evaluate`` with the server route's client), one record per sample in lm-eval's
    document order (which is OpenAI's sample order): the messages lm-eval sent, the response, the
    letter the task's filter extracted (None for ``[no answer]``), the correct letter, the grade."""
    from mxmoe.harness.gpqa import run
    from mxmoe.harness.gpqa.lm import ServerChatLM

    spec = run.Spec(f"gpqa_{variant}_cot", Path(data_path), repeats, limit, effort, max_tokens, temperature)
    raw: list[dict] = []
    run.evaluate(ServerChatLM.for_server(base_url, model, concurrency), spec, samples_out=raw)
    out = []
    for s in sorted(raw, key=lambda s: int(s["doc_id"])):
        doc, context = s["doc"], s["arguments"][0][0]
        # lm-eval's JsonChatStr (the messages as JSON), which its logging turns into a plain 1-tuple
        messages = json.loads(context[0] if isinstance(context, tuple | list) else context)
        got = s["filtered_resps"][0] if isinstance(s["filtered_resps"], list) else s["filtered_resps"]
        out.append({
            "index": int(s["doc_id"]),
            "question_id": doc["question_id"],
            "repeat": int(doc["repeat"]),
            "permutation": [int(i) for i in doc["permutation"]],
            "messages": [{"role": str(x["role"]), "content": x["content"]} for x in messages],
            "response": s["resps"][0][0],
            "answer": doc["answer"],
            "extracted": letter(got),
            "extracted_raw": got,
            "correct": bool(s["exact_match"]),
        })  # fmt: skip
    return out


def _sha(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _first_difference(a: list[dict], b: list[dict]) -> str | None:
    """Where two message lists first differ, in words and offsets, never their text."""
    if len(a) != len(b):
        return f"{len(a)} messages against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x["role"] != y["role"]:
            return f"message {i}: role {x['role']!r} against {y['role']!r}"
        cx, cy = str(x["content"]), str(y["content"])
        if cx != cy:
            at = next((k for k, (p, q) in enumerate(zip(cx, cy)) if p != q), min(len(cx), len(cy)))
            return f"message {i}: content differs from character {at} (lengths {len(cx)}, {len(cy)})"
    return None


CHECKS = ("question", "prompt", "answer", "response", "extracted", "grade", "harness_reads_theirs",
          "gpt_oss_reads_ours")  # fmt: skip
"""What ``compare`` checks per sample: the same question, repeat and choice order; the same prompt
messages; the same correct letter; the same response; the same extracted letter; the same grade;
and, response by response, each side's extractor reading the other's response as the other does."""


def compare(theirs: list[dict], ours: list[dict], extract_abcd: Callable[[str], str] | None = None) -> dict:
    """Sample-by-sample agreement of gpt-oss's records (``theirs``) and the harness's (``ours``):
    per check of ``CHECKS``, how many samples agree, and every sample where any check fails, by
    index, question id, letters and hashes (no text). ``extract_abcd``: gpt-oss's grader, for
    the cross-reading of the harness's responses (skipped without it)."""
    counts = dict.fromkeys(CHECKS, 0)
    differences = []
    for a, b in zip(theirs, ours):
        checks = {
            "question": a["question_id"] in (None, b["question_id"]) and a["repeat"] == b["repeat"]
            and a["permutation"] == b["permutation"],
            "prompt": a["messages"] == b["messages"],
            "answer": a["answer"] == b["answer"],
            "response": a["response"] == b["response"],
            "extracted": a["extracted"] == b["extracted"],
            "grade": a["correct"] == b["correct"],
            "harness_reads_theirs": data.extract_answer(data.final_text(a["response"])) == a["extracted"],
            "gpt_oss_reads_ours": letter(extract_abcd(b["response"])) == b["extracted"] if extract_abcd else True,
        }  # fmt: skip
        for k, ok in checks.items():
            counts[k] += bool(ok)
        if not all(checks.values()):
            differences.append({
                "index": b["index"], "question_id": b["question_id"], "repeat": b["repeat"],
                "failed": [k for k, ok in checks.items() if not ok],
                "answer": [a["answer"], b["answer"]], "extracted": [a["extracted_raw"], b["extracted_raw"]],
                "correct": [a["correct"], b["correct"]],
                "prompt_sha": [_sha(a["messages"]), _sha(b["messages"])],
                "prompt_difference": _first_difference(a["messages"], b["messages"]),
                "response_sha": [_sha(a["response"]), _sha(b["response"])],
            })  # fmt: skip
    n = min(len(theirs), len(ours))
    return {
        "samples": [len(theirs), len(ours)],
        "agree": counts,
        "all_agree": len(theirs) == len(ours) and all(v == n for v in counts.values()),
        "accuracy": [sum(r["correct"] for r in theirs) / max(1, len(theirs)),
                     sum(r["correct"] for r in ours) / max(1, len(ours))],  # fmt: skip
        "differences": differences,
    }


# -- a loopback server whose response depends on the prompt alone


@dataclasses.dataclass(frozen=True)
class Request:
    """What a client asked the loopback server: the endpoint (``chat`` or ``responses``), the
    messages, and the settings it sent (None where it sent none)."""

    endpoint: str
    messages: list[dict]
    effort: str | None
    max_tokens: int | None
    temperature: float | None
    seed: int | None
    keys: tuple[str, ...]


Answer = Callable[[Request], tuple[str, str]]
"""A request -> (reasoning, final text), as a server with gpt-oss's reasoning parser splits them."""


def _text(content: Any) -> str:
    """A message's content as text: a string, or the Responses API's parts (``input_text``)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, dict))


def request_of(endpoint: str, payload: dict) -> Request:
    """The request a chat-completions or responses payload makes."""
    if endpoint == "chat":
        messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in payload.get("messages", [])]
        effort, budget = payload.get("reasoning_effort"), payload.get("max_tokens")
    else:
        given = payload.get("input", [])
        given = [{"role": "user", "content": given}] if isinstance(given, str) else given
        messages = [{"role": m.get("role", "user"), "content": _text(m.get("content"))} for m in given]
        effort, budget = (payload.get("reasoning") or {}).get("effort"), payload.get("max_output_tokens")
    return Request(endpoint, messages, effort, budget, payload.get("temperature"), payload.get("seed"),
                   tuple(sorted(payload)))  # fmt: skip


def _chat_reply(model: str, reasoning: str, text: str) -> dict:
    message = {"role": "assistant", "content": text, "reasoning": reasoning or None}
    return {"id": "chatcmpl-loopback", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}  # fmt: skip


def _responses_reply(model: str, reasoning: str, text: str) -> dict:
    """A Responses API answer shaped as vLLM's for gpt-oss: a reasoning item, then the message."""
    output = []
    if reasoning:
        output.append({"type": "reasoning", "id": "rs_loopback", "summary": [],
                       "content": [{"type": "reasoning_text", "text": reasoning}]})  # fmt: skip
    output.append({"type": "message", "id": "msg_loopback", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]})  # fmt: skip
    usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    return {"id": "resp_loopback", "object": "response", "created_at": 0, "model": model, "status": "completed",
            "output": output, "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "usage": usage}  # fmt: skip


class LoopbackServer:
    """An OpenAI-compatible server on a loopback port (``/v1/models``, ``/v1/chat/completions``,
    ``/v1/responses``) answering every request with ``answer(request)`` and keeping the requests
    (``requests``). A request ``answer`` raises on is answered 500 with the error."""

    def __init__(self, answer: Answer, model_id: str = "loopback-gpt-oss") -> None:
        outer = self
        self.requests: list[Request] = []
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, obj: dict, code: int = 200) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self._send({"object": "list", "data": [{"id": model_id, "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint = "chat" if self.path.rstrip("/").endswith("/chat/completions") else "responses"
                if endpoint == "responses" and not self.path.rstrip("/").endswith("/responses"):
                    self._send({"error": {"message": f"no route {self.path}"}}, 404)
                    return
                req = request_of(endpoint, payload)
                with outer._lock:
                    outer.requests.append(req)
                try:
                    reasoning, text = answer(req)
                except Exception as exc:  # noqa: BLE001 (the client sees a server error, as from vLLM)
                    self._send({"error": {"message": f"{type(exc).__name__}: {exc}"}}, 500)
                    return
                reply = _chat_reply if endpoint == "chat" else _responses_reply
                self._send(reply(model_id, reasoning, text))

        self.model = model_id
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prompt_key(req: Request) -> str:
    """What a loopback answer may depend on: the messages and the reasoning effort, nothing a
    client adds of its own (a seed, a token budget, a temperature)."""
    return json.dumps({"messages": req.messages, "effort": req.effort}, sort_keys=True)


ANSWER_FORMS = (
    "**Answer:** {L}",
    "Answer: ({L})",
    "The answer is {L}.",
    "Final answer: {L}",
    "answer - {l}",
    "Answers – {L}",
    "So the final result is \\boxed{{{L}}}.",
    "\\boxed{{\\text{{{L}}}}}",
    "I choose option {L}.",
    "Choice: {L}",
    "**{L}**",
    "({L})",
    "{L}",
    "{L}. It is the only one of its kind.",
    "{l})",
    "{l}",
    "Answer: {L}, though ({M}) is close.",
    "({M}) is tempting, but **Answer: {L}**",
    "All of the other options are wrong, so {L}.",
    "I cannot tell.",
    "",
)
"""Final answers as a reasoning model writes them, each form once a letter ``{L}`` (``{l}`` in
lowercase) and a distractor ``{M}`` are drawn; some declare no letter, some are read differently by
a grader that is not gpt-oss's (a lowercase bare letter, a sentence starting with a capital A-D)."""


def canned_answer(req: Request) -> tuple[str, str]:
    """One of ``ANSWER_FORMS`` with a letter, all drawn from the prompt; the reasoning names another
    letter, which no grader should read."""
    seed = seed_for("loopback-canned-" + prompt_key(req))
    form = ANSWER_FORMS[seed % len(ANSWER_FORMS)]
    pick = data.LETTERS[(seed >> 8) % 4]
    other = data.LETTERS[(data.LETTERS.index(pick) + 1 + (seed >> 16) % 3) % 4]
    return f"Answer: {other} looks right at first.", form.format(L=pick, l=pick.lower(), M=other)


def canned_form(req: Request) -> int:
    """Which of ``ANSWER_FORMS`` ``canned_answer`` gives ``req``."""
    return seed_for("loopback-canned-" + prompt_key(req)) % len(ANSWER_FORMS)


class TinyAnswerer:
    """The tiny GPT-OSS fixture as a loopback server's model: the request's messages in its chat
    template at the request's effort (harmony's default, medium, where none is sent), sampled at
    the request's temperature (1.0 where none is sent, as vLLM samples gpt-oss) for at most
    ``max_tokens`` (or the request's, if fewer), from a seed drawn from the prompt alone. What it
    generates is split as vLLM's reasoning parser splits a harmony generation: the analysis before
    the final channel is the reasoning, the final channel the text."""

    def __init__(self, backend: str = "emulation", max_tokens: int = 24) -> None:
        from tokenizers import Tokenizer

        from mxmoe.harness.contract.platforms import host_arch
        from mxmoe.harness.e2e.checkpoint import TINY_DIR, open_checkpoint
        from mxmoe.harness.e2e.model import MoEModel
        from mxmoe.harness.gpqa.lm import MoELM, chat_template_of
        from mxmoe.harness.run.registry import discover, select

        model = MoEModel(open_checkpoint("tiny"), host_arch())
        model.use(select(discover(), (backend,))[0])
        self.lm = MoELM(model, Tokenizer.from_file(str(TINY_DIR / "tokenizer.json")), chat_template_of(TINY_DIR))
        self.max_tokens = max_tokens
        self._lock = threading.Lock()

    def __call__(self, req: Request) -> tuple[str, str]:
        with self._lock:
            self.lm.effort = req.effort or "medium"
            context = self.lm.apply_chat_template(req.messages)
            budget = min(self.max_tokens, req.max_tokens or self.max_tokens)
            temperature = 1.0 if req.temperature is None else float(req.temperature)
            raw = self.lm._generate([context], [seed_for("loopback-tiny-" + prompt_key(req))], max_gen_toks=budget,
                                    temperature=temperature, do_sample=True)[0]  # fmt: skip
        final = "<|channel|>final<|message|>"
        reasoning = raw.rsplit(final, 1)[0] if final in raw else ""
        return reasoning, data.final_text(raw)
