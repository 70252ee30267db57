"""The model-level subcommands: ``model-check`` and ``make-tiny`` (added to ``python -m harness``
by ``add_parsers``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mxmoe.harness.run.registry import Loaded


def _tokens(ckpt: object, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Token ids [B, S], the mask of positions compared, and what they are (for the header)."""
    from mxmoe.harness.cli.args import UsageError
    from mxmoe.harness.contract.inputs import generator_for
    from mxmoe.harness.e2e import task
    from mxmoe.harness.e2e.checkpoint import GptOssCheckpoint

    tok_file = ckpt.path / "tokenizer.json" if isinstance(ckpt, GptOssCheckpoint) else None
    if tok_file is None or not tok_file.is_file():
        if args.prompts:
            raise UsageError(f"--prompts needs a tokenizer.json in the checkpoint; {ckpt.where} has none")
        vocab = int(ckpt.config["vocab_size"])
        ids = torch.randint(0, vocab, (1, args.tokens), generator=generator_for(f"model-check-{args.tokens}"))
        return ids, torch.ones_like(ids, dtype=torch.bool), f"{args.tokens} random token ids (no tokenizer)"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise UsageError(f"--prompts: no such file {path}")
        texts = [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            raise UsageError(f"--prompts: {path} holds no non-empty line")
        what = f"{len(texts)} prompt(s) from {path}"
    else:
        test_csv = ckpt.path / "task-test.csv"
        rows = task.read_csv(test_csv) if test_csv.is_file() else task.make_rows(0, args.batch, prefix="check")
        texts = []
        for row in rows[: args.batch]:
            prompt, shown, correct = task.format_prompt(row)
            texts.append(prompt + task.answer_text(shown[correct]))
        what = f"{len(texts)} questions of the synthetic task (prompt and answer)"
    ids, mask = task.pad_batch([tok.encode(t).ids[: args.tokens] for t in texts], tok.token_to_id("<|pad|>") or 0)
    return ids, mask, f"{what}, {int(mask.sum())} tokens"


def backend_picker(backend_files: list[str]) -> Callable[[str, str], Loaded]:
    """``one(pattern, what)``: the single backend ``pattern`` names among the registry's, the files
    given and the catalogue's faults (which can be planted or run whole); a UsageError naming
    ``what`` when it names none or several."""
    from mxmoe.harness.cli.args import UsageError, warn_load_failures
    from mxmoe.harness.instruments.faults import mutant_specs
    from mxmoe.harness.run.registry import discover, select

    try:
        loaded = discover((*backend_files, *mutant_specs()))
    except ValueError as exc:
        raise UsageError(f"--backend-file: {exc}") from None
    warn_load_failures(loaded)

    def one(pattern: str, what: str) -> Loaded:
        try:
            hits = select(loaded, (pattern,))
        except ValueError as exc:
            raise UsageError(f"{what}: {exc}") from None
        if len(hits) != 1:
            raise UsageError(f"{what} {pattern!r} matches {len(hits)} backends; name exactly one")
        return hits[0]

    return one


def _cmd_model_check(args: argparse.Namespace) -> int:
    from mxmoe.harness.cli.args import UsageError, host_line
    from mxmoe.harness.contract.backend import BackendUnavailable
    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.e2e.checkpoint import CheckpointError, open_checkpoint
    from mxmoe.harness.e2e.layercheck import check_model
    from mxmoe.harness.e2e.model import MoEModel
    from mxmoe.harness.run.results import finite_json, stamp

    one = backend_picker(args.backend_file)
    backends = [one(b, "--backend") for b in args.backend]
    plants = {layer: one(ident, f"--plant {layer}=") for layer, ident in args.plant}
    oracle = one("oracle", "oracle")
    arch = host_arch()
    try:
        ckpt = open_checkpoint(args.model)
        ids, mask, what = _tokens(ckpt, args)
        print(f"{host_line('cpu' if arch == 'cpu' else 'cuda')} | arch {arch}")
        s = ckpt.shapes
        print(f"model-check: {ckpt.where} ({s.layers} layers, E={s.experts}, top-{s.top_k}, H={s.hidden}, "
              f"I={s.intermediate}); {what}", flush=True)  # fmt: skip
        model = MoEModel(ckpt, arch)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None

    def progress(v: object) -> None:
        r = v.result
        print(f"  layer {v.layer:3d} {r.backend:<28} {r.outcome:<5} worst err/bound {r.metrics.worst_ratio:.3g} "
              f"({r.seconds:.2f} s)", flush=True)  # fmt: skip

    out = Path(args.results)
    status = 0
    for backend in backends:
        print(f"\n== {backend.backend.declaration.id}" + "".join(f", layer {n}: {p.backend.declaration.id}"
                                                                for n, p in sorted(plants.items())), flush=True)
        try:
            found = check_model(model, ids, mask, backend, oracle, plants, results=out,
                                timing_repeats=args.repeats, progress=progress)  # fmt: skip
        except BackendUnavailable as exc:
            print(f"model-check: {exc}", file=sys.stderr)
            status = max(status, 2)
            continue
        _report(found)
        out.mkdir(parents=True, exist_ok=True)
        summary = out / f"model-check-{found.backend}-{arch}.json"
        record = stamp("model-check") | found.to_dict() | {"model": ckpt.where, "tokens": what, "arch": arch}
        summary.write_text(json.dumps(finite_json(record), indent=1, allow_nan=False) + "\n")
        print(f"results: {summary}")
        if not found.passed:
            status = max(status, 1)
    return status


def _report(found: object) -> None:
    """The per-layer table and the model-level lines of one backend's check."""
    from mxmoe.harness.cli.tables import format_table
    from mxmoe.harness.run.results import replay_command

    rows = []
    for v in found.layers:
        r, m = v.result, v.result.metrics
        rows.append((v.layer, r.backend, r.outcome, f"{m.worst_ratio:.3g}", m.over_bound, m.over_rigorous,
                     m.elements, v.tied_tokens, f"{r.seconds:.2f}"))  # fmt: skip
    print()
    print(format_table(("layer", "backend", "outcome", "worst err/bound", "over bound", "over rigorous", "elements",
                        "tied tokens", "seconds"), rows))  # fmt: skip
    first = found.first_failure
    print(f"\nfirst failing layer: {'none' if first is None else first}")
    if found.aborted:
        print(f"checked forward stopped: {found.aborted}")
    c = found.comparison
    if c is not None:
        print(f"vs the oracle-MoE model over {c.positions} positions: KL mean {c.kl_mean:.3e}, KL max {c.kl_max:.3e}, "
              f"top-1 agreement {c.top1_agreement:.4f}")  # fmt: skip
    if found.forward_seconds:
        print(f"forward ({found.backend}, unchecked): median {statistics.median(found.forward_seconds) * 1e3:.1f} ms "
              f"over {len(found.forward_seconds)}; oracle-MoE forward {found.oracle_forward_seconds * 1e3:.1f} ms "
              "(its first call)")  # fmt: skip
    for v in found.layers:
        if v.repro is not None:
            print(f"{v.result.outcome} layer {v.layer}: {v.result.reason}\n    replay: {replay_command(v.repro)}")


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from mxmoe.harness.e2e.tiny import train

    summary = train(args.out, seed=args.seed, steps=args.steps, qat_steps=min(args.qat_steps, args.steps))
    print(json.dumps(summary, indent=1))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``model-check`` and ``make-tiny`` to ``python -m harness``."""
    from mxmoe.harness.cli.args import backend_file, plant, positive
    from mxmoe.harness.e2e.tiny import SEED

    p = sub.add_parser("model-check", help="a GPT-OSS model with a backend's MoE: per-layer verdicts, KL, top-1")
    p.add_argument("--model", required=True, metavar="PATH|tiny|random:gpt-oss-20b",
                   help="a GPT-OSS checkpoint folder, the tiny fixture, or a full-size synthetic architecture")
    p.add_argument("--backend", required=True, action="append", metavar="ID",
                   help="the backend every MoE layer runs through (repeatable: each in turn, one model)")
    p.add_argument("--backend-file", action="append", default=[], type=backend_file, metavar="PATH.py:Class",
                   help="a backend class in a file (repeatable)")
    p.add_argument("--plant", action="append", default=[], type=plant, metavar="LAYER=ID",
                   help="run this layer through another backend (e.g. a catalogue fault; repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: the synthetic task's questions)")
    p.add_argument("--batch", type=positive(int), default=8, help="sequences of the default prompts (default 8)")
    p.add_argument("--tokens", type=positive(int), default=2048,
                   help="tokens per sequence: the length of random ids without a tokenizer, else a cap (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="unchecked forwards timed after a warm-up (default 3)")
    p.add_argument("--results", default="results", metavar="DIR", help="results folder (default ./results)")
    p.set_defaults(fn=_cmd_model_check, parser=p)

    p = sub.add_parser("make-tiny", help="train the tiny GPT-OSS fixture (tokenizer, task, model, MXFP4 checkpoint)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write it (the committed one is harness/e2e/tiny)")
    p.add_argument("--seed", type=int, default=SEED, help="(default %(default)s, the committed fixture's)")
    p.add_argument("--steps", type=positive(int), default=500, help="training steps (default %(default)s)")
    p.add_argument("--qat-steps", type=int, default=100, help="last steps with fake-quantized experts (default 100)")
    p.set_defaults(fn=_cmd_make_tiny, parser=p)
