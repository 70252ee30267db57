"""Recorded results of many jobs and machines, read strictly and reconciled into one set.

A sign-off merges folders from CI jobs, pytest-xdist workers and GPU hosts. What is read:

* ``results-*.jsonl``: one case record per line (``harness.results.Recorder``);
* ``gpqa-<task>-<backend>.json``: a GPQA run's summary (``harness.gpqa.run``); its ``-samples.jsonl``
  and lm-eval's ``-results.json`` beside it are not records and are left alone.

Reading is strict, because a report built from half a file says SHIP on evidence it does not
have: a line that is not a whole JSON object (a file cut off mid-line, a copy that stopped short),
a record of another schema version, or a file whose records lack the fields every record has is a
``ResultFileError`` naming the file and the line.

**The reconciliation rule.** Records are keyed by (test id, arch); the test id already names the
backend and the case. Records identical in every field (host and timestamp included) are one
record read twice (the same folder copied into two artifacts) and count once. Otherwise they are
runs of the same test: the latest (by timestamp; in the order written where equal) is the
verdict, the earlier ones are kept as its history, and a key whose runs disagree (a FAIL that
passed on rerun) is listed as flaky, never silently resolved.
GPQA summaries are keyed by (task, backend, arch) under the same rule.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from mxmoe.harness.results import SCHEMA, from_json

CASE_FIELDS = ("schema", "test_id", "backend", "arch", "outcome", "timestamp", "host")
GPQA_FIELDS = ("schema", "kind", "backend", "task", "outcome", "timestamp", "host")


class ResultFileError(ValueError):
    """A result file that cannot be read as this harness's records; the message names it."""


@dataclasses.dataclass
class Collection:
    """The reconciled records and what reconciling them found."""

    cases: list[dict]
    gpqa: list[dict]
    history: dict[tuple[str, ...], list[dict]]  # earlier runs of a key, oldest first
    flaky: list[tuple[str, ...]]  # keys whose runs disagree on the outcome
    duplicates: int  # identical records read more than once
    sources: list[str]


def _check(rec: object, fields: tuple[str, ...], where: str) -> dict:
    if not isinstance(rec, dict):
        raise ResultFileError(f"{where}: not a JSON object; not a result record of this harness")
    missing = [f for f in fields if f not in rec]
    if missing:
        raise ResultFileError(f"{where}: no {', '.join(missing)}; not a result record of this harness")
    if rec["schema"] != SCHEMA:
        raise ResultFileError(f"{where}: record schema {rec['schema']!r}, this harness reads schema {SCHEMA}")
    return rec


def read_case_file(path: Path) -> list[dict]:
    """The case records of one ``results-*.jsonl``, every line checked."""
    text = path.read_text(encoding="utf-8", errors="replace")
    out = []
    lines = text.split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            what = "truncated (the file ends mid-line)" if n == len(lines) and not text.endswith("\n") else "not JSON"
            raise ResultFileError(f"{where}: {what} ({exc.msg}); remove the line or rerun that job") from None
        out.append(from_json(_check(rec, CASE_FIELDS, where)))
    return out


def read_gpqa_file(path: Path) -> dict:
    """One GPQA run summary, checked."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultFileError(f"{path}: not JSON ({exc.msg}); a GPQA summary is one JSON object") from None
    rec = _check(rec, GPQA_FIELDS, str(path))
    if rec["kind"] != "gpqa":
        raise ResultFileError(f"{path}: kind {rec['kind']!r}, expected 'gpqa'")
    return rec


def _files(path: Path) -> tuple[list[Path], list[Path]]:
    if path.is_file():
        if path.name.startswith("results-") and path.suffix == ".jsonl":
            return [path], []
        if path.name.startswith("gpqa-") and path.suffix == ".json" and not path.name.endswith("-results.json"):
            return [], [path]
        raise ResultFileError(f"{path}: not a result file (results-*.jsonl, gpqa-<task>-<backend>.json)")
    if not path.is_dir():
        raise ResultFileError(f"{path}: no such file or folder")
    cases = sorted(path.rglob("results-*.jsonl"))
    gpqa = sorted(p for p in path.rglob("gpqa-*.json") if not p.name.endswith("-results.json"))
    if not cases and not gpqa:
        raise ResultFileError(f"{path}: holds no results-*.jsonl and no gpqa-*.json")
    return cases, gpqa


def _reconcile(
    records: list[dict], key_of: Callable[[dict], tuple], time_of: Callable[[dict], str]
) -> tuple[list, dict, list, int]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    duplicates = 0
    seen: set[str] = set()
    for rec in records:
        ident = json.dumps(rec, sort_keys=True, default=str)
        if ident in seen:
            duplicates += 1
            continue
        seen.add(ident)
        groups[key_of(rec)].append(rec)
    kept, history, flaky = [], {}, []
    for key, runs in groups.items():
        runs.sort(key=time_of)
        kept.append(runs[-1])
        if len(runs) > 1:
            history[key] = runs[:-1]
            if len({r["outcome"] for r in runs}) > 1:
                flaky.append(key)
    return kept, history, flaky, duplicates


def collect(paths: list[str | Path]) -> Collection:
    """Read every result under ``paths`` (folders, searched recursively, or files) and reconcile
    them by the rule of the module docstring."""
    case_recs: list[dict] = []
    gpqa_recs: list[dict] = []
    sources: list[str] = []
    for p in map(Path, paths):
        cases, gpqa = _files(p)
        for f in cases:
            case_recs.extend(read_case_file(f))
        gpqa_recs.extend(read_gpqa_file(f) for f in gpqa)
        sources.extend(str(f) for f in (*cases, *gpqa))
    cases, h1, f1, d1 = _reconcile(case_recs, lambda r: (r["test_id"], r["arch"]), lambda r: r["timestamp"])
    gpqa, h2, f2, d2 = _reconcile(gpqa_recs, lambda r: (r["task"], r["backend"], r["host"].get("arch", "")),
                                  lambda r: r["timestamp"])  # fmt: skip
    cases.sort(key=lambda r: (r["backend"], r["arch"], r["test_id"]))
    gpqa.sort(key=lambda r: (r["task"], r["backend"]))
    return Collection(cases, gpqa, {**h1, **h2}, [*f1, *f2], d1 + d2, sources)
