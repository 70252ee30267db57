"""The sign-off: reconciled results (``collect``) judged by a policy (``policy``) into one report.

The report is plain data (``signoff.json`` is exactly it); the Markdown, HTML and JUnit views are
rendered from it alone (``render``), so every view says the same thing.

How records are read:

* A case record's outcome is the engine's. A FAIL whose reason is the engine's "unexpected pass
  of a strict xfail" is reported as **XPASS** (the declared bug no longer shows), not as a FAIL.
* A record whose test id ends in ``-layer<N>`` belongs to a model check (``LAYER_TEST_ID``): it is
  counted with that check, not with the backend's kernel cases.
* SKIPs are listed with their reasons and never counted as passes: a backend whose records are all
  SKIPs "did not run", and if the policy requires it, that blocks.

The verdict says no more than was computed:

* **BLOCKED** where any rule of the policy blocks (every reason is listed, not just the first); a
  sign-off step that failed or did not run (``signoff-steps*.json``) always blocks;
* **NO PRODUCTION KERNEL JUDGED** where nothing blocks but no production kernel ran a case: only the
  harness's own backends (``Declaration.production`` False: emulation, portable Triton) or none;
* **SHIP** otherwise. The headline counts the production kernels judged per architecture, so a
  SHIP always says what it covers.

A test whose runs disagree (FAIL on one, PASS on another) is reported by its failing run
(``collect``) and, under the default policy, blocks as flaky, naming its backend. A required
backend must have run every case of the policy's profile that it declares on the arch
(``[required] cases``), not one. A GPQA PASS counts only where the run had the power to see the
policy's smallest drop (``[gpqa] min_drop`` at ``power``); a smaller one is UNJUDGED.
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

from mxmoe.harness.audits.catalogue import BAD_VERDICTS
from mxmoe.harness.e2e.layercheck import LAYER_TEST_ID
from mxmoe.reports.collect import Collection
from mxmoe.reports.policy import EVIDENCE, Policy

SCHEMA = 1
"""Version of ``signoff.json``; a consumer meeting another must say so."""
XPASS_PREFIX = "unexpected pass of a strict xfail"
OUTCOMES = ("PASS", "FAIL", "ERROR", "SKIP", "XFAIL", "XPASS")
BAD = ("FAIL", "ERROR", "XPASS")
SIGNOFF_STEPS = ("oracle self-check", "kernel check", "fault catalogue", "padding audit", "model check", "GPQA",
                 "report")  # fmt: skip
"""The steps of ``python -m harness signoff``, in order; its manifest (``signoff-steps.json``)
records each but the last, and a step it does not list did not run."""


def outcome_of(rec: dict) -> str:
    """The report's outcome of a case record (XPASS told apart from FAIL)."""
    if rec["outcome"] == "FAIL" and str(rec.get("reason", "")).startswith(XPASS_PREFIX):
        return "XPASS"
    return rec["outcome"]


def _ratio(rec: dict) -> float | None:
    v = (rec.get("metrics") or {}).get("worst_ratio")
    return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else None


def _bits(rec: dict) -> float | None:
    """The record's effective precision (the energy test's, ``harness.judge.systematic``), if finite."""
    v = (rec.get("metrics") or {}).get("effective_bits")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _kind(rec: dict) -> str:
    return (rec.get("declaration") or {}).get("kind", "backend")


def _production(rec: dict) -> bool:
    """Whether the record's backend is a production kernel (``Declaration.production``)."""
    return bool((rec.get("declaration") or {}).get("production", True))


def _host_of(rec: dict) -> dict:
    h = rec.get("host") or {}
    return {k: h.get(k) for k in ("hostname", "arch", "gpu", "torch", "cuda", "hip")} | {
        "triton": (h.get("packages") or {}).get("triton")
    }


def _replay(rec: dict) -> str | None:
    """The replay command of a FAIL/ERROR record: the reproducer beside the file it was read from
    when it came along (a merged artifact), else the path the recording host wrote."""
    repro = rec.get("repro")
    if not repro:
        return None
    local = Path(rec.get("source", "")).parent / "repro" / Path(repro).name
    return f"python -m harness replay {local if local.is_file() else repro}"


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _message(rec: dict) -> str:
    """A record's reason in one line; for an ERROR, with the exception's own last line."""
    text = _first_line(rec.get("reason", ""))
    tb = [line.strip() for line in str(rec.get("traceback") or "").splitlines() if line.strip()]
    return f"{text} ({tb[-1]})" if rec["outcome"] == "ERROR" and tb else text


def _failure(rec: dict, where: str) -> dict:
    tb = [line for line in str(rec.get("traceback") or "").rstrip().splitlines()]
    return {
        "test_id": rec["test_id"],
        "backend": rec["backend"],
        "arch": rec["arch"],
        "outcome": outcome_of(rec),
        "where": where,
        "reason": _message(rec) if rec["outcome"] == "ERROR" else rec.get("reason", ""),
        "worst_ratio": _ratio(rec),
        "traceback_tail": "\n".join(tb[-15:]),
        "diagnosis": rec.get("diagnosis") or "",
        "replay": _replay(rec),
        "host": (rec.get("host") or {}).get("hostname"),
        "timestamp": rec.get("timestamp"),
    }


def _gpqa_view(g: dict) -> dict:
    acc = g.get("accuracy") or {}
    pair = g.get("paired")
    return {
        "task": g["task"],
        "dataset": g.get("dataset") or g["task"],
        "backend": g["backend"],
        "arch": (g.get("host") or {}).get("arch", ""),
        "host": (g.get("host") or {}).get("hostname"),
        "model": g.get("model"),
        "limit": g.get("limit"),
        "repeats": g.get("repeats"),
        "outcome": g["outcome"],
        "reason": g.get("reason", ""),
        "accuracy": acc.get("accuracy"),
        "low": acc.get("low"),
        "high": acc.get("high"),
        "samples": acc.get("samples"),
        "questions": acc.get("questions"),
        "threshold": (g.get("threshold") or {}).get("value"),
        "threshold_source": (g.get("threshold") or {}).get("source"),
        "baseline": g.get("baseline"),
        "paired": pair,
        "source": g.get("source"),
    }


def _model_check_view(m: dict) -> dict:
    layers = [
        {"layer": v["layer"], "outcome": v["outcome"], "worst_ratio": v.get("worst_ratio"), "reason": v.get("reason")}
        for v in m.get("layers", [])
    ]
    finite = [v["worst_ratio"] for v in layers if isinstance(v["worst_ratio"], (int, float))]
    return {
        "backend": m["backend"],
        "arch": m["arch"],
        "model": m.get("model"),
        "tokens": m.get("tokens"),
        "passed": bool(m["passed"]),
        "first_failure": m.get("first_failure"),
        "aborted": m.get("aborted") or "",
        "planted": m.get("planted") or {},
        "comparison": m.get("comparison"),
        "worst_ratio": max(finite) if finite else None,
        "layers": layers,
        "host": (m.get("host") or {}).get("hostname"),
    }


def _padding_by_backend(padding: dict | None) -> dict[str, dict]:
    """backend -> its worst padding waste over the audited models and TPs, and where."""
    out: dict[str, dict] = {}
    for r in (padding or {}).get("rows", []):
        best = out.get(r["backend"])
        if best is None or r["waste"] > best["waste"]:
            out[r["backend"]] = {"waste": r["waste"], "model": r["model"], "tp": r["tp"]}
    return out


def _baseline_diff(now: Collection, before: Collection, policy: Policy, reasons: list[dict]) -> dict:
    """New and fixed failures, worst-ratio changes and GPQA accuracy changes against a baseline."""
    from mxmoe.harness.gpqa import stats
    from mxmoe.reports.collect import SUMMARIES

    old = {(r["test_id"], r["arch"]): r for r in before.cases}
    new = {(r["test_id"], r["arch"]): r for r in now.cases}
    new_failures, fixed, changes = [], [], []
    for key, rec in sorted(new.items()):
        o_now = outcome_of(rec)
        prev = old.get(key)
        o_before = outcome_of(prev) if prev else None
        if o_now in BAD and o_before not in BAD:
            new_failures.append({"test_id": key[0], "arch": key[1], "outcome": o_now, "before": o_before or "absent",
                                 "reason": _first_line(rec.get("reason", ""))})  # fmt: skip
        elif o_before in BAD and o_now == "PASS":
            fixed.append({"test_id": key[0], "arch": key[1], "before": o_before})
        r_now, r_before = _ratio(rec), _ratio(prev) if prev else None
        if r_now is not None and r_before is not None and r_now > 0 and r_before > 0:
            factor = r_now / r_before
            if not math.isfinite(factor) or factor >= 1.5 or factor <= 1 / 1.5 or (r_now > 1) != (r_before > 1):
                changes.append({"test_id": key[0], "arch": key[1], "before": r_before, "now": r_now})
    changes.sort(key=lambda c: -abs(math.log(c["now"] / c["before"])) if math.isfinite(c["now"] / c["before"])
                 else -math.inf)  # fmt: skip
    key_of = SUMMARIES["gpqa"][1]
    old_g = {key_of(g): g for g in before.gpqa}
    accuracy = []
    for g in now.gpqa:
        prev = old_g.get(key_of(g))
        if prev is None or not g.get("accuracy") or not prev.get("accuracy"):
            continue
        a, b = g["accuracy"], prev["accuracy"]
        entry = {"task": g["task"], "backend": g["backend"], "arch": (g.get("host") or {}).get("arch", ""),
                 "before": b["accuracy"], "now": a["accuracy"],
                 "difference": a["accuracy"] - b["accuracy"]}  # fmt: skip
        try:
            pair = stats.paired(_samples(prev), _samples(g))
            entry |= {"test": "paired exact McNemar (same samples)", "p": pair.mcnemar_p, "low": pair.low,
                      "high": pair.high}  # fmt: skip
        except (OSError, ValueError, KeyError) as exc:
            from statsmodels.stats.proportion import test_proportions_2indep

            res = test_proportions_2indep(a["correct"], a["samples"], b["correct"], b["samples"])
            entry |= {"test": f"unpaired two-proportion test ({exc})", "p": float(res.pvalue)}
        entry["significant"] = entry["p"] < policy.baseline_alpha
        entry["regression"] = entry["significant"] and entry["difference"] < 0
        accuracy.append(entry)
        if entry["regression"] and policy.baseline_block_accuracy_regression:
            reasons.append({
                "rule": "baseline-accuracy",
                "backend": g["backend"],
                "arch": entry["arch"],
                "text": f"GPQA {g['task']} of {g['backend']} on {entry['arch']} fell from {b['accuracy']:.4f} to "
                        f"{a['accuracy']:.4f} against the baseline ({entry['test']}: p = {entry['p']:.2g} < "
                        f"{policy.baseline_alpha})",
            })  # fmt: skip
    return {
        "sources": len(before.sources),
        "new_failures": new_failures,
        "fixed": fixed,
        "ratio_changes": changes[:50],
        "ratio_changes_total": len(changes),
        "accuracy": accuracy,
    }


def _samples(summary: dict) -> list[dict]:
    """The per-sample records beside a GPQA summary (``-samples.jsonl``)."""
    import json

    path = Path(str(summary["source"]).removesuffix(".json") + "-samples.jsonl")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build(collection: Collection, policy: Policy, baseline: Collection | None = None) -> dict:
    """The report (see the module docstring); ``signoff.json`` is exactly this."""
    reasons: list[dict] = []
    warnings: list[dict] = []
    kernel = [r for r in collection.cases if not LAYER_TEST_ID.search(r["test_id"])]
    layer_recs = [r for r in collection.cases if LAYER_TEST_ID.search(r["test_id"])]

    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    declared: dict[str, tuple[str, ...]] = {}
    kinds: dict[str, str] = {}
    production: dict[str, bool] = {}
    for r in collection.cases:
        declared.setdefault(r["backend"], tuple((r.get("declaration") or {}).get("archs", ())))
        kinds.setdefault(r["backend"], _kind(r))
        production.setdefault(r["backend"], _production(r))
    for r in kernel:
        groups[(r["backend"], r["arch"])].append(r)
    gpqa = [_gpqa_view(g) for g in collection.gpqa]
    for raw, g in zip(collection.gpqa, gpqa):  # a PASS without the power to see the policy's drop is none
        if g["outcome"] == "PASS" and raw.get("accuracy"):
            from mxmoe.harness.gpqa import stats

            seen = stats.power_to_see(policy.gpqa_min_drop, raw["accuracy"], raw.get("paired"),
                                      raw.get("threshold") is not None)  # fmt: skip
            if seen < policy.gpqa_power:
                g["outcome"] = "UNJUDGED"
                g["reason"] = stats.underpowered(raw["accuracy"]["samples"], policy.gpqa_min_drop, seen,
                                                 policy.gpqa_power)  # fmt: skip
    checks = [_model_check_view(m) for m in collection.model_checks]
    covered = sorted({a for _, a in groups} | {g["arch"] for g in gpqa if g["arch"]} | {m["arch"] for m in checks})
    required_archs = sorted(set(covered if "*" in policy.required_archs else ()) |
                            {a for a in policy.required_archs if a != "*"})  # fmt: skip
    padding = _padding_by_backend(collection.padding)

    # One row per (backend, arch) that has any record.
    keys = sorted(set(groups) | {(g["backend"], g["arch"]) for g in gpqa} | {(m["backend"], m["arch"]) for m in checks})
    rows = []
    for backend, arch in keys:
        recs = groups.get((backend, arch), [])
        counts = Counter(outcome_of(r) for r in recs)
        ratios = [x for r in recs if outcome_of(r) in ("PASS", "FAIL", "XPASS") and (x := _ratio(r)) is not None]
        kind = kinds.get(backend, "backend")
        rows.append({
            "backend": backend,
            "arch": arch,
            "kind": kind,
            "required": policy.required(backend) and arch in required_archs and arch in declared.get(backend, ()),
            "judged": kind == "backend" and policy.blocks(backend),
            "production": kind == "backend" and production.get(backend, True),
            "builds": sorted({str(r.get("build")) for r in recs if r.get("build") and r["outcome"] != "SKIP"}),
            "counts": {o: counts.get(o, 0) for o in OUTCOMES},
            "worst_ratio": max(ratios) if ratios else None,
            "effective_bits": min(bits) if (bits := [x for r in recs if outcome_of(r) in ("PASS", "FAIL", "XPASS")
                                                     and (x := _bits(r)) is not None]) else None,  # fmt: skip
            "skip_reasons": dict(Counter(_first_line(r.get("reason", "")) for r in recs if r["outcome"] == "SKIP")),
            "gpqa": [g for g in gpqa if g["backend"] == backend and g["arch"] == arch],
            "model_check": next((m for m in checks if m["backend"] == backend and m["arch"] == arch
                                 and not m["planted"]), None),  # fmt: skip
            "padding": padding.get(backend),
            "race_hunt": _race_hunt(backend, arch, recs, policy, kind == "backend" and production.get(backend, True)),
        })  # fmt: skip

    # Rule: FAIL / ERROR / XPASS of a judged backend.
    for row in rows:
        c = row["counts"]
        bad = [r for r in groups.get((row["backend"], row["arch"]), []) if outcome_of(r) in BAD]
        if not bad:
            continue
        where = f"{row['backend']} on {row['arch']}"
        if c["FAIL"] + c["ERROR"]:
            first = min((r for r in bad if outcome_of(r) != "XPASS"), key=lambda r: r["test_id"])
            entry = {"rule": "failure", "backend": row["backend"], "arch": row["arch"],
                     "text": f"{where}: {c['FAIL']} FAIL, {c['ERROR']} ERROR of {sum(c.values())} cases (first: "
                             f"{first['test_id']}: {_message(first)})"}  # fmt: skip
            (reasons if row["judged"] else warnings).append(entry)
        if c["XPASS"]:
            entry = {"rule": "xpass", "backend": row["backend"], "arch": row["arch"],
                     "text": f"{where}: {c['XPASS']} XPASS of a strict xfail (the declared bug no longer shows: update "
                             "the declaration)"}  # fmt: skip
            (reasons if row["judged"] and policy.block_xpass else warnings).append(entry)

    # Rule: a required backend that never ran on a required arch it declares.
    registry = _registry()
    known = {ident: tuple(b.declaration.archs) for ident, b in registry.items()} | declared
    for pattern in policy.required_backends:
        matched = [b for b in known if fnmatch.fnmatchcase(b, pattern)]
        if not matched and not any(ch in pattern for ch in "*?["):
            reasons.append({"rule": "never-ran", "backend": pattern, "arch": "",
                            "text": f"required backend {pattern} has no record at all (not run, or misspelt in the "
                                    "policy)"})  # fmt: skip
        for backend in matched:
            for arch in required_archs:
                if arch not in known[backend]:
                    continue
                recs = groups.get((backend, arch), [])
                ran = {r["test_id"] for r in recs if r["outcome"] != "SKIP"}
                skips = Counter(_first_line(r.get("reason", "")) for r in recs if r["outcome"] == "SKIP")
                why = "; ".join(f"{n} SKIP: {reason}" for reason, n in skips.most_common())
                if not ran:
                    reasons.append({"rule": "never-ran", "backend": backend, "arch": arch,
                                    "text": f"required backend {backend} never ran on {arch} "
                                            f"({why or 'no record on this arch'})"})  # fmt: skip
                    continue
                expected = _expected_cases(registry.get(backend), arch, policy.required_cases)
                if expected is None:
                    continue
                missing = sorted(set(expected) - ran)
                if missing:
                    reasons.append({"rule": "coverage", "backend": backend, "arch": arch,
                                    "text": f"required backend {backend} ran {len(expected) - len(missing)} of the "
                                            f"{len(expected)} {policy.required_cases} cases it declares on {arch} "
                                            f"(not run: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
                                            f"{'; ' + why if why else ''})"})  # fmt: skip
    for arch in required_archs:
        if arch not in covered:
            reasons.append({"rule": "never-ran", "backend": "", "arch": arch,
                            "text": f"required architecture {arch} has no results"})  # fmt: skip

    # Rule: GPQA.
    for g in gpqa:
        where = f"{g['task']} ({g['dataset']}) of {g['backend']} on {g['arch']}"
        if g["outcome"] in ("FAIL", "ERROR"):
            entry = {"rule": "gpqa", "backend": g["backend"], "arch": g["arch"],
                     "text": f"{where}: {g['outcome']}: {_first_line(g['reason'])}"}  # fmt: skip
            (reasons if policy.gpqa_block and policy.blocks(g["backend"]) else warnings).append(entry)
        elif g["outcome"] == "UNJUDGED":
            warnings.append({"rule": "gpqa", "backend": g["backend"], "arch": g["arch"],
                             "text": f"{where}: not judged ({g['reason']})"})  # fmt: skip
        elif g["outcome"] == "SKIP":  # the backend's own gate: no accuracy, never a pass
            warnings.append({"rule": "gpqa", "backend": g["backend"], "arch": g["arch"],
                             "text": f"{where}: did not run ({_first_line(g['reason'])})"})  # fmt: skip

    # Rule: model checks.
    for m in checks:
        if m["passed"]:
            continue
        why = f"first failing layer {m['first_failure']}" if m["first_failure"] is not None else "no layer failed"
        if m["aborted"]:
            why += f"; the checked forward stopped: {_first_line(m['aborted'])}"
        entry = {"rule": "model-check", "backend": m["backend"], "arch": m["arch"],
                 "text": f"model check of {m['backend']} on {m['arch']} ({m['model']}) failed: {why}"}  # fmt: skip
        judged = kinds.get(m["backend"], "backend") == "backend" and policy.blocks(m["backend"]) and not m["planted"]
        (reasons if policy.model_check_block and judged else warnings).append(entry)

    # Rule: the fault catalogue.
    faults = []
    for mut in collection.mutants:
        rows_m = mut["rows"]
        wrong = [r for r in rows_m if r["verdict"] in BAD_VERDICTS]
        faults.append({
            "arch": mut["arch"],
            "profile": mut["profile"],
            "host": (mut.get("host") or {}).get("hostname"),
            "caught": sum(r["kind"] == "mutant" and r["verdict"] == "caught" for r in rows_m),
            "faults": sum(r["kind"] == "mutant" and r["verdict"] != "not reached" for r in rows_m),
            "unreached": [r["id"] for r in rows_m if r["verdict"] == "not reached"],
            "measured_caught": sum(r["kind"] == "measured" and r["verdict"] == "caught" for r in rows_m),
            "measured": sum(r["kind"] == "measured" for r in rows_m),
            "clean": sum(r["verdict"] == "clean" for r in rows_m),
            "honest": sum(r["kind"] in ("honest", "control") for r in rows_m),
            "vendor": mut.get("vendor"),
            "rows": rows_m,
        })  # fmt: skip
        for r in wrong:
            entry = {"rule": "faults", "backend": r["id"], "arch": mut["arch"],
                     "text": f"fault catalogue on {mut['arch']}: {r['id']} {r['verdict']} ({r['fault']})"}  # fmt: skip
            (reasons if policy.faults_block else warnings).append(entry)

    # Flaky tests: runs of one test that disagree; the failing run is the verdict (``collect``).
    kept = {(r["test_id"], r["arch"]): r for r in collection.cases}
    for key in collection.flaky:
        runs = [*collection.history.get(tuple(key), [])]
        now = kept.get(tuple(key))
        every = runs + ([now] if now else [])
        outcomes = ", ".join(f"{r.get('outcome') or r.get('passed')} on {(r.get('host') or {}).get('hostname')}"
                             for r in every)  # fmt: skip
        backend = now["backend"] if now else ""
        where = f"{backend} on {key[1]}: test {key[0]}" if now else " / ".join(map(str, key))
        entry = {"rule": "flaky", "backend": backend, "arch": key[1] if now else "",
                 "text": f"{where}: runs disagree ({outcomes}): a kernel that is sometimes wrong"}  # fmt: skip
        judged = now is None or (kinds.get(backend, "backend") == "backend" and policy.blocks(backend))
        (reasons if policy.block_flaky and judged else warnings).append(entry)

    # The sign-off's own steps: one that failed, was interrupted or did not run leaves its part of the
    # verdict unknown. A manifest is read for what it lacks too: a step it does not list did not run
    # (a job killed at its time limit leaves a manifest of the steps before).
    steps = []
    for manifest in collection.steps:
        host = (manifest.get("host") or {}).get("hostname")
        arch = (manifest.get("host") or {}).get("arch", "")
        listed = {st["name"] for st in manifest["steps"]}
        absent = [{"name": name, "status": "not run", "exit_status": None, "seconds": None,
                   "reason": "not in the manifest: the sign-off stopped before this step"}
                  for name in manifest.get("planned") or SIGNOFF_STEPS[:-1] if name not in listed]  # fmt: skip
        for st in [*manifest["steps"], *absent]:
            steps.append(st | {"host": host, "arch": arch})
            if st["status"] != "ran":
                what = {"failed": "failed", "interrupted": "was interrupted"}.get(st["status"], "did not run")
                status = f" (exit status {st['exit_status']})" if st.get("exit_status") is not None else ""
                reasons.append({"rule": "signoff-step", "backend": "", "arch": arch,
                                "text": f"sign-off step '{st['name']}' on {host} {what}{status}: "
                                        f"{_first_line(st.get('reason', ''))}"})  # fmt: skip

    # Rule: a hunted production kernel whose calls fell short of the policy's race-hunt power (one
    # that FAILed or ERRORed is blocked by that already, and a race seen is such a FAIL).
    for row in rows:
        hunt = row["race_hunt"]
        failed = row["counts"]["FAIL"] + row["counts"]["ERROR"]
        if (policy.races_block_short and hunt is not None and not failed
                and hunt["confidence"] < policy.races_confidence):  # fmt: skip
            reasons.append({"rule": "race-hunt", "backend": row["backend"], "arch": row["arch"],
                            "text": f"{hunt['line']}, short of the policy's {policy.races_confidence:g} "
                                    f"(`check --race-power {policy.races_rate:g},{policy.races_confidence:g}"
                                    + (f" --contention {hunt['contention']}" if hunt["contention"] else "")
                                    + "` makes enough calls)"})  # fmt: skip

    judged_any = any(row["judged"] and sum(row["counts"].values()) > row["counts"]["SKIP"] for row in rows)
    if not judged_any:
        reasons.append({"rule": "nothing-judged", "backend": "", "arch": "",
                        "text": "no backend of kind 'backend' ran a single case: nothing to sign off"})  # fmt: skip
    judged_production: dict[str, list[str]] = {arch: [] for arch in covered}
    for row in rows:
        if row["production"] and sum(row["counts"].values()) > row["counts"]["SKIP"]:
            judged_production.setdefault(row["arch"], []).append(row["backend"])
    evidence = _evidence(collection, policy, judged_production, checks, gpqa, faults, reasons)

    failures = [_failure(r, "kernel cases") for r in kernel if outcome_of(r) in BAD]
    failures += [_failure(r, "model check") for r in layer_recs if outcome_of(r) in BAD]
    failures += [
        {"test_id": f"gpqa-{g['task']}-{g['backend']}", "backend": g["backend"], "arch": g["arch"],
         "outcome": g["outcome"], "where": "GPQA", "reason": g["reason"], "worst_ratio": None, "traceback_tail": "",
         "diagnosis": "",
         "replay": None, "host": g["host"], "timestamp": None}
        for g in gpqa if g["outcome"] in ("FAIL", "ERROR")
    ]  # fmt: skip
    hosts: dict[str, dict] = {}
    for r in [*collection.cases, *collection.gpqa, *collection.model_checks, *collection.mutants]:
        h = _host_of(r)
        hosts.setdefault(f"{h['hostname']}/{h['arch']}", h | {"records": 0})["records"] += 1
    report = {
        "schema": SCHEMA,
        "kind": "signoff",
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "verdict": "",
        "production": judged_production,
        "evidence": evidence,
        "steps": steps,
        "reasons": reasons,
        "warnings": warnings,
        "policy": policy.to_dict(),
        "inputs": {
            "files": len(collection.sources),
            "records": len(collection.cases),
            "duplicates": collection.duplicates,
            "flaky": [list(k) for k in collection.flaky],
            "reruns": sum(len(v) for v in collection.history.values()),
            "hosts": list(hosts.values()),
            "archs": covered,
            "required_archs": required_archs,
        },
        "rows": rows,
        "skips": [
            {"backend": row["backend"], "arch": row["arch"], "reason": reason, "count": n}
            for row in rows
            for reason, n in sorted(row["skip_reasons"].items())
        ],
        "failures": failures,
        "gpqa": gpqa,
        "model_checks": checks,
        "faults": faults,
        "padding": (collection.padding or {}).get("rows", []),
        "cases": [
            {"test_id": r["test_id"], "backend": r["backend"], "arch": r["arch"], "case_id": r.get("case_id"),
             "outcome": outcome_of(r), "worst_ratio": _ratio(r), "reason": _first_line(r.get("reason", "")),
             "seconds": r.get("seconds")}
            for r in kernel
        ],  # fmt: skip
        "baseline": None if baseline is None else _baseline_diff(collection, baseline, policy, reasons),
    }
    report["verdict"] = verdict_of(reasons, judged_production)
    return report


def _race_hunt(backend: str, arch: str, recs: list[dict], policy: Policy, production: bool) -> dict | None:
    """A hunted production kernel's race hunt on ``arch`` (``[races]``), from the calls its kernel
    cases made (``Metrics.runs``; 2 a case in results made without the hunt): the calls, those that
    differed from their case's first run, and the confidence that no race reaches the policy's rate
    (0 where one was seen; for a backend declared non-deterministic, that no run is wrong at that
    rate); None for a backend not hunted or that ran no case."""
    from mxmoe.harness.run.contention import CONTENTIONS
    from mxmoe.harness.run.races import company_of, confidence_from, hunt_line

    if not production or not policy.hunted(backend):
        return None
    judged = [r for r in recs if r["outcome"] in ("PASS", "FAIL", "XFAIL") and (r.get("metrics") or {}).get("elements")]
    if not judged:
        return None

    def calls(r: dict) -> tuple[int, int]:
        return (r.get("metrics") or {}).get("runs") or 2, (r.get("metrics") or {}).get("runs_differing") or 0

    # On a GPU only calls made beside the policy's contention count towards the power: a race seen
    # anywhere is seen (a FAIL), but calls with the GPU to themselves rule out less than they seem to.
    company = None if arch == "cpu" else policy.races_contention
    counted = [r for r in judged if company is None or r.get("contention") == company]
    deterministic = bool((recs[0].get("declaration") or {}).get("deterministic", True))
    differing = sum(calls(r)[1] for r in judged)
    power = sum(calls(r)[0] for r in counted)
    shown = judged if differing and deterministic else counted  # a race seen is said, wherever it was seen
    if shown:
        line = hunt_line(backend, arch, [calls(r) for r in shown], policy.races_rate, deterministic,
                         None if company is None else company_of(r.get("contention") or "" for r in shown))  # fmt: skip
    else:
        line = f"{backend} ({arch}): no call beside {CONTENTIONS[company]}: no power against a race"
    if shown is counted and len(counted) < len(judged):
        said = sorted({str(r.get("contention") or "") for r in judged if r not in counted})
        why = "; ".join(f"hunted beside {CONTENTIONS.get(c, c)}" if c else "their two guarded runs alone, not hunted"
                        for c in said)  # fmt: skip
        line += (f" ({len(judged) - len(counted)} of its {len(judged)} cases not counted, {why}: the policy "
                 f"counts calls beside {CONTENTIONS[company]})")  # fmt: skip
    return {"calls": power, "differing": differing, "cases": len(counted), "contention": company,
            "confidence": 0.0 if differing and deterministic else confidence_from(power, policy.races_rate),
            "line": line}  # fmt: skip


def _evidence(collection: Collection, policy: Policy, production: dict[str, list[str]], checks: list[dict],
              gpqa: list[dict], faults: list[dict], reasons: list[dict]) -> dict:  # fmt: skip
    """The evidence a SHIP rests on (``[evidence]``): each kind the policy does not waive must be in
    the results on every architecture where a production kernel was judged, or a reason names it.
    Returns what the verdict rests on, what was waived and what is missing (names of ``EVIDENCE``)."""
    needed = policy.evidence()
    missing: list[str] = []

    def lack(kind: str, arch: str, text: str, command: str) -> None:
        hint = f"`python -m harness {command}` records it; a policy may waive it: [evidence] waive = [\"{kind}\"]"
        reasons.append({"rule": "evidence", "backend": "", "arch": arch, "text": f"{text} ({hint})"})
        if EVIDENCE[kind] not in missing:
            missing.append(EVIDENCE[kind])

    for arch, judged in sorted(production.items()):
        if not judged:
            continue
        if "catalogue" in needed and not any(f["arch"] == arch and not f["vendor"] for f in faults):
            lack("catalogue", arch, f"no fault catalogue on {arch} in these results: the harness's detection power "
                 "there is unmeasured", "mutants")  # fmt: skip
        if "model-check" in needed and not any(
            m["arch"] == arch and m["backend"] in judged and not m["planted"] for m in checks
        ):
            lack("model-check", arch, f"no model check of a production kernel on {arch} in these results",
                 "model-check")  # fmt: skip
        runs = [g for g in gpqa if g["arch"] == arch and g["backend"] in judged]
        if "gpqa" in needed and not any(g["outcome"] in ("PASS", "FAIL") for g in runs):
            seen = "; ".join(f"{g['backend']} {g['outcome']}" for g in runs[:3]) or "none ran"
            lack("gpqa", arch, f"no GPQA run of a production kernel on {arch} with the power to see a "
                 f"{policy.gpqa_min_drop:.0%} drop in these results ({seen})", "gpqa")  # fmt: skip
    if "padding" in needed and any(production.values()) and collection.padding is None:
        lack("padding", "", "no padding audit in these results", "padding --json FILE")
    return {"rests_on": [EVIDENCE[k] for k in needed if EVIDENCE[k] not in missing],
            "waived": [EVIDENCE[k] for k in policy.evidence_waive], "missing": missing, "policy": policy.source}


NO_PRODUCTION = "NO PRODUCTION KERNEL JUDGED"
VERDICTS = ("SHIP", "BLOCKED", NO_PRODUCTION)


def verdict_of(reasons: list[dict], production: dict[str, list[str]]) -> str:
    """BLOCKED where a rule blocks; else NO PRODUCTION KERNEL JUDGED where no production kernel ran a
    case on any arch; else SHIP (module docstring)."""
    if reasons:
        return "BLOCKED"
    return "SHIP" if any(production.values()) else NO_PRODUCTION


def headline(report: dict) -> str:
    """The verdict as one line: a SHIP says what it rests on and what the policy waived."""
    verdict = report["verdict"]
    ev = report.get("evidence") or {}
    if verdict != "SHIP" or not ev:
        return verdict
    rests = ev["rests_on"]
    if not ev["waived"]:
        return f"SHIP on {_joined(rests)}"
    only = " only" if len(rests) == 1 else ""
    return f"SHIP on {_joined(rests)}{only}: {_joined(ev['waived'])} waived by policy {ev['policy']}"


def _joined(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def production_line(report: dict) -> str:
    """The headline's count: production kernels judged per architecture."""
    parts = []
    for arch, backends in sorted(report.get("production", {}).items()):
        names = ", ".join(sorted(backends)) if backends else "none"
        parts.append(f"{arch}: {len(backends)} ({names})")
    return "production kernels judged: " + ("; ".join(parts) if parts else "none")


def _expected_cases(backend: object | None, arch: str, cases: str) -> list[str] | None:
    """The test ids a required ``backend`` (the registry's object) must have run on ``arch``
    (``[required] cases``); None where that is not known (``any``, or a backend the registry does
    not hold)."""
    if cases == "any" or backend is None:
        return None
    from mxmoe.harness.judge.engine import test_id
    from mxmoe.harness.run.profiles import profile_cases

    ident = backend.declaration.id
    return [test_id(ident, arch, c) for c in profile_cases(cases) if backend.supports(c, arch) is None]


def _registry() -> dict[str, object]:
    """The registry's backends by id: what a required backend with no record at all would have run
    on, and the cases it declares (its declaration is code, not a result)."""
    from mxmoe.harness.run.registry import discover

    try:
        return {item.backend.declaration.id: item.backend for item in discover()}
    except Exception:  # a broken entry point must not stop the report; its backends are then unknown
        return {}
