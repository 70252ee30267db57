"""One GPQA run of one backend: lm-eval over the project's task YAMLs, then the per-sample records,
the statistics and the verdict, written where the sign-off report reads them.

Files, per (task, backend label), in the results folder:

* ``gpqa-<task>-<label>-results.json``: lm-eval's own results (``results``, ``configs``,
  ``versions``, ``n-samples``, ...), without its ``samples``, which hold the questions;
* ``gpqa-<task>-<label>-samples.jsonl``: one record per (question, repeat): question id (a hash),
  repeat, choice order, correct and extracted letter, correctness (and, for generations, the seed
  and the response's length in characters); no question or answer text;
* ``gpqa-<task>-<label>.json``: the run's summary: accuracy and interval, the paired comparison
  with the baseline, the threshold, the verdict (``harness.gpqa.stats``), times, data file hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from mxmoe.harness.gpqa import data, stats
from mxmoe.harness.run.results import stamp

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
VARIANTS = ("main", "diamond", "extended")
FORMS = ("mc", "cot")
TASKS = tuple(f"gpqa_{v}_{f}" for f in FORMS for v in VARIANTS)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a run evaluates: a task of ``TASKS`` over a data file, its repeats and limit, and, for
    the chain-of-thought form, the reasoning effort, the token budget and the temperature."""

    task: str
    data: Path
    repeats: int = 1
    limit: int | None = None
    effort: str = "low"
    max_tokens: int = 32768
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.effort not in ("low", "medium", "high"):
            raise ValueError(f"effort must be one of low, medium, high; got {self.effort!r}")

    @property
    def variant(self) -> str:
        return self.task.split("_")[1]

    @property
    def form(self) -> str:
        return self.task.split("_")[2]

    @property
    def lm_eval_task(self) -> str:
        return f"mxmoe_{self.task}"

    @property
    def dataset(self) -> str:
        """What the questions are, in words: the tiny fixture's generated task (a folder holding its
        ``fixture.json``) is a synthetic task in GPQA's format, never GPQA itself."""
        if (Path(self.data).parent / "fixture.json").is_file():
            return f"synthetic GPQA-format task ({Path(self.data).name}, the tiny fixture's; not GPQA {self.variant})"
        return f"GPQA {self.variant}"

    def describe(self) -> dict:
        return {"task": self.task, "dataset": self.dataset, "data": self.data.name, "data_sha256": sha256(self.data),
                "repeats": self.repeats,
                "limit": self.limit, "effort": self.effort if self.form == "cot" else None,
                "max_tokens": self.max_tokens if self.form == "cot" else None,
                "temperature": self.temperature if self.form == "cot" else None}  # fmt: skip


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def evaluate(lm: Any, spec: Spec, samples_out: list | None = None) -> tuple[dict, list[dict]]:
    """Run lm-eval on ``spec``'s task with ``lm``: (lm-eval's results without the samples, the
    per-sample records). ``samples_out``, where given, receives lm-eval's logged samples themselves
    (prompts and responses, text included: ``oai_evals`` compares them in memory and writes none)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    meta = {"data": str(spec.data), "repeats": spec.repeats, "limit": spec.limit}
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=meta)
    cot = spec.form == "cot"
    gen = {"max_gen_toks": spec.max_tokens, "temperature": spec.temperature, "reasoning_effort": spec.effort}
    out = simple_evaluate(
        model=lm,
        tasks=[spec.lm_eval_task],
        task_manager=manager,
        log_samples=True,
        apply_chat_template=cot,
        gen_kwargs=gen if cot else None,
        bootstrap_iters=0,
    )
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    samples = out.pop("samples")[spec.lm_eval_task]
    if samples_out is not None:
        samples_out.extend(samples)
    return out, records(samples, spec)


def records(samples: list[dict], spec: Spec) -> list[dict]:
    """lm-eval's logged samples as records without text, in (repeat, question) order."""
    from mxmoe.harness.gpqa.lm import mc_letter, sample_seed

    out = []
    for s in samples:
        doc = s["doc"]
        rec = {"question_id": doc["question_id"], "repeat": int(doc["repeat"]),
               "permutation": [int(i) for i in doc["permutation"]], "answer": doc["answer"]}  # fmt: skip
        if spec.form == "mc":
            rec["extracted"] = mc_letter(s["filtered_resps"])
            rec["correct"] = bool(s["acc"])
        else:
            got = s["filtered_resps"]
            rec["extracted"] = got[0] if isinstance(got, list) else got
            rec["correct"] = bool(s["exact_match"])
            rec["seed"] = sample_seed(doc)
            rec["chars"] = len(s["resps"][0][0]) if s.get("resps") else 0
        out.append(rec)
    return sorted(out, key=lambda r: (r["repeat"], r["question_id"]))


def paths(out: Path, task: str, label: str) -> dict[str, Path]:
    stem = out / f"gpqa-{task}-{label}"
    return {"summary": Path(f"{stem}.json"), "samples": Path(f"{stem}-samples.jsonl"),
            "lm_eval": Path(f"{stem}-results.json")}  # fmt: skip


def write(out: Path, spec: Spec, label: str, summary: dict, lm_eval: dict | None, recs: list[dict] | None) -> Path:
    """Write a run's files (an ERROR run has only its summary); returns the summary's path. Needs no
    lm-eval: its results are written with numpy values as lists and anything else as text."""
    out.mkdir(parents=True, exist_ok=True)
    p = paths(out, spec.task, label)
    for key in ("samples", "lm_eval"):
        p[key].unlink(missing_ok=True)
    if recs is not None:
        p["samples"].write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    if lm_eval is not None:
        p["lm_eval"].write_text(json.dumps(lm_eval, indent=1, default=_plain) + "\n")
    p["summary"].write_text(json.dumps(summary, indent=1) + "\n")
    return p["summary"]


def _plain(value: object) -> object:
    """What json cannot write of lm-eval's results: numpy scalars and arrays, sets, the rest as text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def read_baseline(where: Path, task: str) -> tuple[str, list[dict]]:
    """(label, records) of a previous run: a ``-samples.jsonl`` file, or a folder holding exactly one
    for ``task``. An ERROR run has none and cannot be a baseline."""
    where = Path(where)
    if where.is_dir():
        found = sorted(where.glob(f"gpqa-{task}-*-samples.jsonl"))
        if len(found) != 1:
            names = ", ".join(f.name for f in found) or "none"
            raise FileNotFoundError(f"--baseline {where}: needs exactly one gpqa-{task}-*-samples.jsonl, found {names}")
        where = found[0]
    if not where.is_file():
        raise FileNotFoundError(f"--baseline: no such file or folder {where}")
    label = where.name.removeprefix(f"gpqa-{task}-").removesuffix("-samples.jsonl")
    recs = [json.loads(line) for line in where.read_text().splitlines() if line.strip()]
    if not recs:
        raise ValueError(f"--baseline {where}: no samples")
    return label, recs


def summarize(
    spec: Spec,
    label: str,
    recs: list[dict] | None,
    *,
    model: str | None,
    bar: tuple[float, str] | None,
    baseline: tuple[str, list[dict]] | None,
    seconds: float,
    forward_seconds: float | None = None,
    error: str | None = None,
    declined: str | None = None,
    extra: dict | None = None,
) -> dict:
    """A run's summary: its statistics and verdict (``stats.verdict``; ``declined``: why the
    backend would not run here, a SKIP)."""
    acc = stats.accuracy(recs) if recs else None
    pair = stats.paired(baseline[1], recs) if recs and baseline is not None else None
    outcome, reason = stats.verdict(acc, bar, pair, error, declined=declined)
    answered = sum(1 for r in recs if r["extracted"] != data.NO_ANSWER) if recs else 0
    return {
        **stamp("gpqa"),
        "backend": label,
        "model": model,
        **spec.describe(),
        "outcome": outcome,
        "reason": reason,
        "accuracy": dataclasses.asdict(acc) if acc else None,
        "answered": answered,
        "baseline": baseline[0] if baseline else None,
        "paired": dataclasses.asdict(pair) | {"differs": pair.differs} if pair else None,
        "threshold": {"value": bar[0], "source": bar[1]} if bar else None,
        "seconds": round(seconds, 3),
        "forward_seconds": None if forward_seconds is None else round(forward_seconds, 3),
        **(extra or {}),
    }
