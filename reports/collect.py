"""Recorded results of many jobs and machines, read strictly and reconciled into one set.

A sign-off merges folders from CI jobs, pytest-xdist workers and GPU hosts. What is read:

* ``results-*.jsonl``: one case record per line (``harness.run.results.Recorder``);
* ``gpqa-<task>-<backend>.json``: a GPQA run's summary (``harness.gpqa.run``); its ``-samples.jsonl``
  beside it is read only for a baseline comparison, and lm-eval's ``-results.json`` is left alone;
* ``model-check-<backend>-<arch>.json`` (``model-check``), ``mutants*.json`` (the fault catalogue),
  ``padding*.json`` (the padding audit) and ``signoff-steps*.json`` (what each step of a
  ``signoff`` did): summaries stamped by ``harness.run.results.stamp``.

Reading is strict, because a report built from half a file says SHIP on evidence it does not
have: a line that is not a whole JSON object (a file cut off mid-line, a copy that stopped short),
a record of another schema version, or a file whose records lack the fields every record has is a
``ResultFileError`` naming the file and the line.

**The reconciliation rule.** Records are keyed by (test id, arch); the test id already names the
backend and the case. Records identical in every field (host and timestamp included) are one
record read twice (the same folder copied into two artifacts) and count once. Otherwise they are
runs of the same test, and no run's clock decides between them (hosts' clocks differ, and "the
latest run" of a kernel that is sometimes wrong is luck): the worst run is the verdict (a FAIL or
ERROR over a PASS or XFAIL, any of those over a SKIP; among equals the last read, in the order the
paths were given and the lines written), the others are kept as its history, and a key whose runs
disagree (a FAIL or ERROR on one run, a PASS or XFAIL on another) is listed as flaky, never
silently resolved.
Summaries are keyed under the same rule: a GPQA run by (task, backend, arch, data, limit, repeats)
(another sample of questions is another test), a model check by (backend, arch, model, planted faults), the fault
catalogue by (arch, profile), the padding audit (computed from the declarations) by nothing.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from mxmoe.harness.run.results import SCHEMA, from_json

CASE_FIELDS = ("schema", "test_id", "backend", "arch", "outcome", "timestamp", "host")
STAMP_FIELDS = ("schema", "kind", "timestamp", "host")
SUMMARIES: dict[str, tuple[tuple[str, ...], Callable[[dict], tuple]]] = {
    # kind -> (fields beyond the stamp, the reconciliation key)
    "gpqa": (("backend", "task", "outcome"),
             lambda r: ("gpqa", r["task"], r["backend"], r["host"].get("arch", ""), r.get("data_sha256"),
                        r.get("limit"), r.get("repeats"))),
    "model-check": (("backend", "arch", "passed", "layers"),
                    lambda r: ("model-check", r["backend"], r["arch"], r.get("model"),
                               json.dumps(r.get("planted") or {}, sort_keys=True))),
    "mutants": (("arch", "profile", "rows"), lambda r: ("mutants", r["arch"], r["profile"], r.get("vendor"))),
    "padding": (("rows",), lambda r: ("padding",)),
    "signoff-steps": (("steps",), lambda r: ("signoff-steps", r["host"].get("hostname"), r["timestamp"])),
}  # fmt: skip


class ResultFileError(ValueError):
    """A result file that cannot be read as this harness's records; the message names it."""


@dataclasses.dataclass
class Collection:
    """The reconciled records and what reconciling them found."""

    cases: list[dict]
    gpqa: list[dict]
    model_checks: list[dict]
    mutants: list[dict]
    padding: dict | None
    steps: list[dict]  # the sign-off manifests: each step ran, was skipped (and why) or failed
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


def read_summary(path: Path, kind: str) -> dict:
    """One summary file of ``kind`` (see ``SUMMARIES``), checked."""
    try:
        rec = from_json(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as exc:
        raise ResultFileError(f"{path}: not JSON ({exc.msg}); a {kind} summary is one JSON object") from None
    rec = _check(rec, STAMP_FIELDS, str(path))
    if rec["kind"] != kind:
        raise ResultFileError(f"{path}: kind {rec['kind']!r}, expected {kind!r} for a file named so")
    return _check(rec, SUMMARIES[kind][0], str(path))


_PATTERNS = {"gpqa": "gpqa-*.json", "model-check": "model-check-*.json", "mutants": "mutants*.json",
             "padding": "padding*.json", "signoff-steps": "signoff-steps*.json"}  # fmt: skip


def _kind_of(path: Path) -> str | None:
    if path.name.startswith("results-") and path.suffix == ".jsonl":
        return "cases"
    if path.name.endswith("-results.json"):  # lm-eval's own output beside a GPQA summary
        return None
    return next((k for k, pat in _PATTERNS.items() if fnmatch.fnmatchcase(path.name, pat)), None)


def _files(path: Path) -> dict[str, list[Path]]:
    """Result files under ``path`` by kind ("cases" or a summary kind)."""
    found: dict[str, list[Path]] = defaultdict(list)
    if path.is_file():
        kind = _kind_of(path)
        if kind is None:
            raise ResultFileError(f"{path}: not a result file (results-*.jsonl, {', '.join(_PATTERNS.values())})")
        found[kind].append(path)
        return found
    if not path.is_dir():
        raise ResultFileError(f"{path}: no such file or folder")
    for f in sorted(path.rglob("*")):
        kind = _kind_of(f) if f.is_file() else None
        if kind is not None:
            found[kind].append(f)
    if not found:
        raise ResultFileError(f"{path}: holds no result files (results-*.jsonl, {', '.join(_PATTERNS.values())})")
    return found


_BAD = ("FAIL", "ERROR", "False")
_RAN = ("PASS", "XFAIL", "True")


def _severity(rec: dict) -> int:
    """2 for a failing run, 1 for one that ran and passed, 0 for a skip or an unjudged run."""
    v = _verdict(rec)
    return 2 if v in _BAD else 1 if v in _RAN else 0


def _verdict(rec: dict) -> str:
    """What two runs of one key must agree on: the outcome (a model check's pass, the catalogue's
    verdicts row by row)."""
    if "outcome" in rec:
        return str(rec["outcome"])
    if "passed" in rec:
        return str(rec["passed"])
    return json.dumps([r.get("verdict") for r in rec.get("rows", [])])


def _disagree(runs: list[dict]) -> bool:
    """Runs of one key that disagree: one failed where another passed (a SKIP on one host and a PASS
    on another do not: one of them did not run); for the fault catalogue, any verdict differing."""
    verdicts = {_verdict(r) for r in runs}
    if "outcome" in runs[0] or "passed" in runs[0]:
        return bool(verdicts & set(_BAD)) and bool(verdicts & set(_RAN))
    return len(verdicts) > 1


def _reconcile(records: list[dict], key_of: Callable[[dict], tuple]) -> tuple[list, dict, list, int]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    duplicates = 0
    seen: set[str] = set()
    for rec in records:
        # where a summary was read ("source") is not part of it: a copied folder is still identical
        ident = json.dumps({k: v for k, v in rec.items() if k != "source"}, sort_keys=True, default=str)
        if ident in seen:
            duplicates += 1
            continue
        seen.add(ident)
        groups[key_of(rec)].append(rec)
    kept, history, flaky = [], {}, []
    for key, runs in groups.items():
        worst = max(range(len(runs)), key=lambda i: (_severity(runs[i]), i))
        kept.append(runs[worst])
        if len(runs) > 1:
            history[key] = runs[:worst] + runs[worst + 1 :]
            if _disagree(runs):
                flaky.append(key)
    return kept, history, flaky, duplicates


def collect(paths: list[str | Path]) -> Collection:
    """Read every result under ``paths`` (folders, searched recursively, or files) and reconcile
    them by the rule of the module docstring."""
    case_recs: list[dict] = []
    summaries: dict[str, list[dict]] = defaultdict(list)
    sources: list[str] = []
    for p in map(Path, paths):
        for kind, files in _files(p).items():
            for f in files:
                if kind == "cases":
                    case_recs.extend(read_case_file(f))
                else:
                    summaries[kind].append(read_summary(f, kind) | {"source": str(f)})
                sources.append(str(f))
    cases, history, flaky, duplicates = _reconcile(case_recs, lambda r: (r["test_id"], r["arch"]))
    kept: dict[str, list[dict]] = {}
    for kind, (_, key_of) in SUMMARIES.items():
        got, h, f, d = _reconcile(summaries[kind], key_of)
        kept[kind], duplicates = got, duplicates + d
        history.update(h)
        flaky.extend(f)
    cases.sort(key=lambda r: (r["backend"], r["arch"], r["test_id"]))
    kept["gpqa"].sort(key=lambda r: (r["task"], r["backend"]))
    kept["model-check"].sort(key=lambda r: (r["backend"], r["arch"]))
    padding = kept["padding"][0] if kept["padding"] else None
    return Collection(cases, kept["gpqa"], kept["model-check"], kept["mutants"], padding, kept["signoff-steps"],
                      history, flaky, duplicates, sources)  # fmt: skip
