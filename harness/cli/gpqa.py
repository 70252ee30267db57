"""The ``gpqa`` subcommand (added to ``python -m harness`` by ``add_parsers``): GPQA through lm-eval
on a GPT-OSS model whose MoE runs through registry backends in this process, or against an
OpenAI-compatible server (one it is given, or ``vllm serve`` it starts)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _model_name(ckpt: Any) -> str | None:
    """gpt-oss-20b / gpt-oss-120b when a real checkpoint has that architecture (their thresholds
    apply), ``tiny`` for the fixture; None otherwise (random weights are no model to score)."""
    from mxmoe.harness.e2e.checkpoint import TINY_DIR, GptOssCheckpoint

    if not isinstance(ckpt, GptOssCheckpoint):
        return None
    if ckpt.path.resolve() == TINY_DIR.resolve():
        return "tiny"
    s = ckpt.shapes
    return {(24, 32, 2880): "gpt-oss-20b", (36, 128, 2880): "gpt-oss-120b"}.get((s.layers, s.experts, s.hidden))


def _threshold(model: str | None, spec: Any) -> tuple[float, str] | None:
    """The accuracy bar of ``stats.threshold``; none for a sample of the questions (--limit), whose
    accuracy is not the one the bar was set on: there the verdict rests on the baseline."""
    from mxmoe.harness.e2e.checkpoint import TINY_DIR
    from mxmoe.harness.gpqa import stats
    from mxmoe.harness.gpqa.run import sha256

    if spec.limit is not None:
        return None
    if model == "tiny":
        fixture = json.loads((TINY_DIR / "fixture.json").read_text())
        if spec.form == "mc" and sha256(spec.data) == fixture["sha256"]["task-test.csv"]:
            acc = fixture["oracle_moe_test_accuracy"]
            return acc - stats.MARGIN, f"tiny fixture: oracle-MoE accuracy at training {acc:.3f} - {stats.MARGIN}"
        return None
    return stats.threshold(model, spec.variant, spec.form, spec.effort)


def _table(summaries: list[dict]) -> str:
    from mxmoe.harness.cli.tables import format_table

    rows = []
    for s in summaries:
        a, p = s["accuracy"], s["paired"]
        acc = f"{a['accuracy']:.4f} [{a['low']:.3f}, {a['high']:.3f}]" if a else "-"
        vs = (f"{p['agreement']:.3f}", f"{p['baseline_only']}/{p['backend_only']}", f"{p['mcnemar_p']:.3g}",
              f"{p['difference']:+.4f} [{p['low']:+.3f}, {p['high']:+.3f}]") if p else ("-",) * 4  # fmt: skip
        n = f"{a['correct']}/{a['samples']}" if a else "-"
        fwd = "-" if s.get("forward_seconds") is None else f"{s['forward_seconds']:.1f}"
        rows.append((s["backend"], s["outcome"], acc, n, *vs, f"{s['seconds']:.1f}", fwd))
    head = ("backend", "verdict", "accuracy [95% CI]", "correct", "agreement", "only base/only this", "McNemar p",
            "difference [95% CI]", "seconds", "forward s")  # fmt: skip
    return format_table(head, rows)


def _finish(summaries: list[dict], out: Path) -> int:
    print()
    print(_table(summaries))
    for s in summaries:
        print(f"{s['backend']}: {s['outcome']}: {s['reason']}")
    print("seconds: the backend's whole run (lm-eval included); forward s: the model's forwards in it")
    print(f"results: {out}/gpqa-*.json, -samples.jsonl, -results.json")
    return 1 if any(s["outcome"] in ("FAIL", "ERROR") for s in summaries) else 0


def _cmd_gpqa(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.gpqa import data

    try:
        from mxmoe.harness.gpqa import run
        from mxmoe.harness.gpqa.lm import ServerError
    except ImportError as exc:
        raise UsageError(str(exc)) from None

    server = args.base_url is not None or args.serve is not None
    if args.base_url and args.serve:
        raise UsageError("--base-url and --serve exclude each other: give a running server's URL, or let it start one")
    if args.model is None and not args.base_url:
        raise UsageError("--model is needed (in this process, or the model --serve vllm serves)")
    data_path = args.data
    if data_path is None:
        if args.model != "tiny":
            raise UsageError("--data PATH is needed: the GPQA CSV (gpqa_diamond.csv, gpqa_main.csv, gpqa_extended.csv)")
        from mxmoe.harness.e2e.checkpoint import TINY_DIR

        data_path = TINY_DIR / "task-test.csv"
    task = args.task or ("gpqa_diamond_mc" if args.model == "tiny" and not server else "gpqa_diamond_cot")
    try:
        spec = run.Spec(task, Path(data_path), args.repeats, args.limit, args.effort, args.max_tokens,
                        args.temperature)  # fmt: skip
        n_rows = len(data.read_rows(spec.data))  # a missing or malformed file stops here, before any output
        if spec.limit is not None and spec.limit > n_rows:
            raise ValueError(f"--limit {spec.limit} exceeds the {n_rows} questions in {spec.data}")
    except (ValueError, data.DataError) as exc:
        raise UsageError(str(exc)) from None
    if server and spec.form != "cot":
        raise UsageError(f"--task {task}: a chat server serves the chain-of-thought form only (gpqa_*_cot); the "
                         "log-likelihood form needs the model in this process")  # fmt: skip
    out = Path(args.results)
    print(f"gpqa: {task} over {spec.data}: {spec.dataset} ({n_rows} questions, {args.limit or n_rows} used, "
          f"{spec.repeats} repeat(s))"
          + (f", effort {spec.effort}, max {spec.max_tokens} tokens" if spec.form == "cot" else ""),
          flush=True)  # fmt: skip
    if server:
        try:
            return _server_run(args, spec, out)
        except ServerError as exc:
            print(f"gpqa: {exc}", file=sys.stderr)
            return 2
    return _in_process(args, spec, out)


def _baseline_records(args: argparse.Namespace, spec: Any) -> tuple[str, list[dict]] | None:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.gpqa import run

    if args.baseline is None or not (Path(args.baseline).exists() or "/" in args.baseline):
        return None
    try:
        return run.read_baseline(Path(args.baseline), spec.task)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _in_process(args: argparse.Namespace, spec: Any, out: Path) -> int:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.cli.model import backend_picker
    from mxmoe.harness.contract.backend import BackendUnavailable
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.e2e.checkpoint import CheckpointError, open_checkpoint
    from mxmoe.harness.e2e.model import MoEModel
    from mxmoe.harness.gpqa import run
    from mxmoe.harness.gpqa.lm import MoELM, chat_template_of

    one = backend_picker(args.backend_file)
    backends = [one(b, "--backend") for b in args.backend]
    plants = {layer: one(ident, f"--plant {layer}=") for layer, ident in args.plant}
    previous = _baseline_records(args, spec)
    base_backend = one(args.baseline, "--baseline") if args.baseline and previous is None else None
    try:
        ckpt = open_checkpoint(args.model)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    folder = getattr(ckpt, "path", None)
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise UsageError(f"--model {args.model}: GPQA needs the checkpoint's tokenizer.json; {ckpt.where} has none")
    from tokenizers import Tokenizer

    arch = host_arch()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = MoEModel(ckpt, arch)
    name = _model_name(ckpt)
    bar = _threshold(name, spec)
    print(f"model {ckpt.where} ({name or 'no published threshold'}), arch {arch}; threshold: "
          f"{f'{bar[0]:.3f} ({bar[1]})' if bar else 'none'}", flush=True)  # fmt: skip
    suffix = "".join(f"+layer{n}-{p.backend.declaration.id}" for n, p in sorted(plants.items()))
    summaries = []

    def one_run(item: Any, baseline: tuple[str, list[dict]] | None, planted: dict) -> tuple[dict, list | None]:
        label = item.backend.declaration.id + (suffix if planted else "")
        print(f"\n== {label}", flush=True)
        start = time.perf_counter()
        lm = MoELM(model, tokenizer, chat_template_of(folder), effort=spec.effort, batch_size=args.batch)
        try:
            model.use(item, planted)
            lm_eval, recs = run.evaluate(lm, spec)
            error = declined = None
        except BackendUnavailable as exc:  # its own gate: a SKIP naming why, as in a kernel check
            lm_eval, recs, error, declined = None, None, None, f"cannot run here: {exc}"
        except Exception:  # one backend's crash never loses the others' results
            lm_eval, recs, error, declined = None, None, f"raised:\n{traceback.format_exc()}", None
        summary = run.summarize(spec, label, recs, model=name, bar=bar, baseline=baseline,
                                seconds=time.perf_counter() - start, forward_seconds=lm.forward_seconds, error=error,
                                declined=declined,
                                extra={"arch": arch, "checkpoint": ckpt.where, "route": "in-process"})  # fmt: skip
        path = run.write(out, spec, label, summary, lm_eval, recs)
        print(f"{label}: {summary['outcome']} ({path})", flush=True)
        summaries.append(summary)
        return summary, recs

    baseline = previous
    if base_backend is not None:
        _, recs = one_run(base_backend, None, {})
        baseline = (base_backend.backend.declaration.id, recs) if recs else None
        if baseline is None:
            print("gpqa: the baseline did not finish; the backends are judged without it", file=sys.stderr)
    for item in backends:
        one_run(item, baseline, plants)
    return _finish(summaries, out)


def _server_run(args: argparse.Namespace, spec: Any, out: Path) -> int:
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.gpqa import run, server
    from mxmoe.harness.gpqa.lm import ServerChatLM, ServerError

    if len(args.backend) != 1:
        raise ServerError("a server route runs one backend (--backend once)")
    backend = args.backend[0]
    previous = _baseline_records(args, spec)
    if args.baseline is not None and previous is None:
        raise ServerError(f"--baseline {args.baseline}: against a server the baseline is a previous run's "
                          "-samples.jsonl or its folder")  # fmt: skip
    proc = None
    if args.serve:
        try:
            proc = server.VllmServer(args.model, backend, out / f"vllm-{backend}.log", args.serve_arg)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print(f"starting: {' '.join(proc.command)} (log {proc.log})", flush=True)
        proc.start()
    base_url = proc.base_url if proc else args.base_url
    try:
        ids = server.served_models(base_url)
        served = args.served_model or ids[0]
        if served not in ids:
            raise ServerError(f"--served-model {served!r}: {base_url} serves {', '.join(ids)}")
        name = args.model_name or next((m for m in ("gpt-oss-120b", "gpt-oss-20b") if m in served), None)
        bar = _threshold(name, spec)
        label = f"server-{backend}"
        print(f"server {base_url}, model {served} ({name or 'no published threshold'}); threshold: "
              f"{f'{bar[0]:.3f} ({bar[1]})' if bar else 'none'}\n== {label}", flush=True)  # fmt: skip
        lm = ServerChatLM(model=served, base_url=base_url.rstrip("/") + "/chat/completions", tokenizer_backend=None,
                          tokenized_requests=False, num_concurrent=args.concurrency, max_retries=3,
                          timeout=args.request_timeout)  # fmt: skip
        start = time.perf_counter()
        error = lm_eval = recs = None
        try:
            lm_eval, recs = run.evaluate(lm, spec)
            if recs and lm.answered and all(r["chars"] == 0 for r in recs):
                raise ServerError(f"every one of the {len(recs)} responses was empty")
        except Exception as exc:  # noqa: BLE001 (a dead or garbled server is this run's ERROR)
            tail = ""
            if proc is not None:
                try:
                    proc.check_alive()
                except ServerError as dead:
                    tail = f"\n{dead}"
                else:
                    tail = f"\nserver log {proc.log}, its end:\n{proc.tail()}"
            error = f"{type(exc).__name__}: {exc}{tail}"
            lm_eval = recs = None
        extra = {"route": "server", "base_url": base_url, "served_model": served,
                 "command": proc.command if proc else None}  # fmt: skip
        summary = run.summarize(spec, label, recs, model=name, bar=bar, baseline=previous,
                                seconds=time.perf_counter() - start, error=error, extra=extra)  # fmt: skip
        path = run.write(out, spec, label, summary, lm_eval, recs)
        print(f"{label}: {summary['outcome']} ({path})", flush=True)
        return _finish([summary], out)
    finally:
        if proc is not None:
            proc.stop()


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``gpqa`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import backend_file, plant, positive
    from mxmoe.harness.gpqa.run import TASKS

    p = sub.add_parser("gpqa", help="GPQA (lm-eval) with a backend's MoE, in this process or against a server")
    p.add_argument("--model", metavar="PATH|tiny",
                   help="a GPT-OSS checkpoint folder or the tiny fixture (in this process); with --serve, what vLLM "
                        "serves")  # fmt: skip
    p.add_argument("--backend", required=True, action="append", metavar="ID",
                   help="registry backend the MoE runs through (repeatable); with --serve vllm, vLLM's --moe-backend "
                        "value; with --base-url, a label for what the server runs")  # fmt: skip
    p.add_argument("--backend-file", action="append", default=[], type=backend_file, metavar="PATH.py:Class")
    p.add_argument("--plant", action="append", default=[], type=plant, metavar="LAYER=ID",
                   help="run one layer through another backend (a catalogue fault, say)")
    p.add_argument("--baseline", metavar="ID|DIR|FILE",
                   help="compare with a registry backend run first (e.g. oracle), or a previous run's "
                        "-samples.jsonl (or its folder)")  # fmt: skip
    p.add_argument("--task", choices=TASKS,
                   help="default gpqa_diamond_cot (gpt-oss's form); gpqa_diamond_mc for --model tiny, whose "
                        "model learned the log-likelihood form only")  # fmt: skip
    p.add_argument("--data", metavar="PATH", help="the GPQA CSV (default for --model tiny: its generated task)")
    p.add_argument("--repeats", type=positive(int), default=1,
                   help="samples per question, each with its own choice order (vLLM's CI: 8; default 1)")
    p.add_argument("--limit", type=positive(int), help="a sample of this many questions (OpenAI's draw)")
    p.add_argument("--effort", choices=("low", "medium", "high"), default="low", help="reasoning effort (default low)")
    p.add_argument("--max-tokens", type=positive(int), default=32768, help="generation budget (default 32768)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--batch", type=positive(int), default=8, help="sequences per forward in this process")
    p.add_argument("--base-url", metavar="URL", help="a running OpenAI-compatible server, http://HOST:PORT/v1")
    p.add_argument("--serve", choices=("vllm",), help="start `vllm serve --model ... --moe-backend BACKEND` here")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for vllm serve (repeatable, e.g. --serve-arg=--tensor-parallel-size=2)")
    p.add_argument("--served-model", metavar="NAME", help="the server's model id (default: the first it lists)")
    p.add_argument("--model-name", choices=("gpt-oss-20b", "gpt-oss-120b"),
                   help="which published threshold applies to a served model (default: read from its id)")
    p.add_argument("--concurrency", type=positive(int), default=64, help="requests in flight to a server")
    p.add_argument("--request-timeout", type=positive(int), default=3600, help="seconds per server request")
    p.add_argument("--results", default="results", metavar="DIR", help="results folder (default ./results)")
    p.set_defaults(fn=_cmd_gpqa, parser=p)
