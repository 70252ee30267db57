"""Views of a sign-off report (``build``): Markdown for a pull-request comment, JUnit XML for CI
test views, the JSON itself, and the HTML page (``html``). Each is rendered from the report alone.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from mxmoe.harness.audits.catalogue import BAD_VERDICTS
from mxmoe.reports.build import NO_PRODUCTION, headline, production_line

MD_FAILURES = 10
"""Failures listed in the Markdown (all of them are in the HTML and JSON): a PR comment stays short."""


def ratio(v: float | None) -> str:
    """An error/bound ratio as the tables print it."""
    if v is None:
        return "-"
    return "inf" if v == float("inf") else f"{v:.3g}"


def bits_cell(v: float | None) -> str:
    """The lowest effective precision of a backend's runs (the energy test), as the tables print it."""
    return "-" if v is None else f"{v:.2f} bits"


def gpqa_cell(g: dict) -> str:
    """'0.995 [0.972, 0.999] PASS, vs oracle +0.000 p=1' for one GPQA run."""
    if g["accuracy"] is None:
        return f"{g['outcome']}"
    text = f"{g['accuracy']:.3f} [{g['low']:.3f}, {g['high']:.3f}] {g['outcome']}"
    if g["paired"]:
        p = g["paired"]
        text += f", vs {g['baseline']} {p['difference']:+.3f} p={p['mcnemar_p']:.2g}"
    return text


def model_check_cell(m: dict | None) -> str:
    if m is None:
        return "-"
    n = len(m["layers"])
    ok = sum(v["outcome"] == "PASS" for v in m["layers"])
    verdict = "PASS" if m["passed"] else "FAIL"
    return f"{verdict} {ok}/{n} layers, worst {ratio(m['worst_ratio'])}"


def padding_cell(p: dict | None) -> str:
    if p is None:
        return "-"
    return f"{100 * p['waste']:.1f}% ({p['model']} TP{p['tp']})"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    esc = [[str(c).replace("|", "\\|").replace("\n", " ") for c in r] for r in rows]
    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|",
            *("| " + " | ".join(r) + " |" for r in esc)]  # fmt: skip


def ran(row: dict) -> bool:
    """Whether a row's backend ran anything on its arch (not only SKIPs)."""
    c = row["counts"]
    return sum(c.values()) > c["SKIP"] or bool(row["gpqa"]) or row["model_check"] is not None


def build_cell(row: dict) -> str:
    """Which build of the kernel ran (``Result.build``), or the harness's own code."""
    builds = row.get("builds") or []
    if builds:
        return " / ".join(builds)
    c = row["counts"]
    kernel = row["kind"] == "backend" and row.get("production", True) and sum(c.values()) > c["SKIP"]
    return "not recorded" if kernel else "-"  # no case of a production kernel ran: no build to name


def markdown(report: dict) -> str:
    """``signoff.md``: the verdict with every reason, one row per backend and arch that ran, the
    ones that did not (one line per reason, folded), faults caught, GPQA, the baseline diff and the
    first failures with their replay commands."""
    out = [f"## MXFP4 MoE sign-off: **{report['verdict']}**", "", production_line(report) + ".", ""]
    if report["reasons"]:
        out.append(f"Blocked by {len(report['reasons'])} reason(s):")
        out += [f"- **{r['rule']}**: {r['text']}" for r in report["reasons"]]
    elif report["verdict"] == "SHIP":
        out.append(f"Nothing blocks under the policy: {headline(report)}.")
    else:
        out.append("Nothing blocks under the policy, but no production kernel ran a case: not a sign-off of any "
                   "kernel an inference engine ships.")  # fmt: skip
    if report.get("steps"):
        out += ["", "Sign-off steps: " + "; ".join(
            f"{st['name']} ({st['host']}): {st['status']}" + (f" [{st['reason']}]" if st["status"] != "ran" else "")
            + (f" {st['seconds']:.0f} s" if st.get("seconds") is not None else "")
            for st in report["steps"])]  # fmt: skip
    if report["warnings"]:
        out += ["", f"{len(report['warnings'])} warning(s), not blocking:"]
        out += [f"- {r['rule']}: {r['text']}" for r in report["warnings"][:20]]
        if len(report["warnings"]) > 20:
            out.append(f"- ... {len(report['warnings']) - 20} more in signoff.html")
    inp = report["inputs"]
    hosts = "; ".join(f"{h['hostname']} ({h['arch']}{', ' + h['gpu'] if h.get('gpu') else ''}, torch {h['torch']}, "
                      f"triton {h['triton'] or '-'}): {h['records']}" for h in inp["hosts"])  # fmt: skip
    out += ["", f"Inputs: {inp['files']} files, {inp['records']} case records; records and summaries by host: "
                f"{hosts}; {inp['duplicates']} duplicates counted once, {inp['reruns']} earlier runs superseded, "
                f"{len(inp['flaky'])} flaky. Policy: {report['policy']['source']}.", ""]  # fmt: skip
    ran_rows = [r for r in report["rows"] if ran(r)]
    headers = ["backend", "arch", "req", "PASS", "FAIL", "ERROR", "SKIP", "XFAIL", "XPASS", "worst err/bound",
               "effective precision", "model check", "GPQA", "padding waste", "build"]  # fmt: skip
    body = [
        [r["backend"] + ("" if r.get("production", True) or r["kind"] != "backend" else " (harness's own)"),
         r["arch"], "yes" if r["required"] else "", *(str(r["counts"][o]) for o in
         ("PASS", "FAIL", "ERROR", "SKIP", "XFAIL", "XPASS")), ratio(r["worst_ratio"]),
         bits_cell(r.get("effective_bits")), model_check_cell(r["model_check"]),
         "; ".join(gpqa_cell(g) for g in r["gpqa"]) or "-",
         padding_cell(r["padding"]), build_cell(r)]
        for r in ran_rows
    ]  # fmt: skip
    out += _table(headers, body) if body else ["No backend ran a case."]
    idle = [r for r in report["rows"] if not ran(r)]
    if idle:
        out += ["", f"<details><summary>{len(idle)} backend/arch pairs did not run (SKIP only; never counted as "
                    "passes)</summary>", ""]  # fmt: skip
        by_reason: dict[str, list[str]] = {}
        for r in idle:
            for reason, n in r["skip_reasons"].items():
                by_reason.setdefault(f"{r['backend']} ({r['arch']})", []).append(f"{n} SKIP: {reason}")
        out += [f"- {who}: {'; '.join(why)}" for who, why in by_reason.items()]
        out += ["", "</details>"]
    hunts = [r["race_hunt"]["line"] for r in report["rows"] if r.get("race_hunt")]
    if hunts:
        out += ["", f"Race hunt (each kernel called again on the same inputs, every call compared bit for bit with "
                    f"its case's first; the policy asks {report['policy']['races_confidence']:g} confidence at rate "
                    f"{report['policy']['races_rate']:g}, from calls beside "
                    f"{report['policy']['races_contention']} on a GPU):"]  # fmt: skip
        out += [f"- {line}" for line in hunts]
    if report["faults"]:
        out += ["", "Faults caught (the planted catalogue; detection power of this run):"]
        for f in report["faults"]:
            missed = [r["id"] for r in f["rows"] if r["verdict"] == "MISSED"]
            alarms = [r["id"] for r in f["rows"] if r["verdict"] == "FALSE ALARM"]
            unshown = [f"{r['id']} ({r['verdict']})" for r in f["rows"] if r["verdict"] in ("NOT RUN", "HARNESS ERROR")]
            vendor = f", {f['vendor']}'s real kernels patched" if f.get("vendor") else ""
            out.append(f"- {f['arch']}{vendor} ({f['profile']} profile, {f['host']}): "
                       f"{f['caught']}/{f['faults']} faults caught, {f['clean']}/{f['honest']} honest variants clean"
                       + (f"; on the bf16-GEMM1 arithmetic, {f['measured_caught']}/{f['measured']} sub-bound faults "
                          "seen (measured, not required)" if f.get("measured") else "")
                       + (f"; MISSED: {', '.join(missed)}" if missed else "")
                       + (f"; not reached (no case of the profile is one the fault changes): "
                          f"{', '.join(f['unreached'])}" if f.get("unreached") else "")
                       + (f"; FALSE ALARM: {', '.join(alarms)}" if alarms else "")
                       + (f"; shown nothing: {', '.join(unshown)}" if unshown else ""))  # fmt: skip
    if report["gpqa"]:
        out += ["", "GPQA:", ""]
        out += _table(["task", "backend", "arch", "samples", "accuracy [95% CI]", "threshold", "paired vs baseline",
                       "verdict"], [
            [f"{g['task']}: {g['dataset']}", g["backend"], g["arch"], str(g["samples"] or "-"),
             "-" if g["accuracy"] is None else f"{g['accuracy']:.3f} [{g['low']:.3f}, {g['high']:.3f}]",
             "-" if g["threshold"] is None else f"{g['threshold']:.3f}",
             "-" if not g["paired"] else f"{g['baseline']}: {g['paired']['difference']:+.3f}, McNemar p = "
                                         f"{g['paired']['mcnemar_p']:.2g}",
             g["outcome"]]
            for g in report["gpqa"]])  # fmt: skip
    base = report.get("baseline")
    if base is not None:
        out += ["", f"Against the baseline ({base['sources']} files): {len(base['new_failures'])} new failures, "
                    f"{len(base['fixed'])} fixed, {base['ratio_changes_total']} worst-ratio changes of 1.5x or "
                    "across 1.0"]  # fmt: skip
        out += [f"- new {n['outcome']}: {n['test_id']} ({n['arch']}; was {n['before']}): {n['reason']}"
                for n in base["new_failures"][:MD_FAILURES]]  # fmt: skip
        out += [f"- fixed: {f['test_id']} ({f['arch']}; was {f['before']})" for f in base["fixed"][:MD_FAILURES]]
        out += [f"- ratio {c['test_id']} ({c['arch']}): {ratio(c['before'])} -> {ratio(c['now'])}"
                for c in base["ratio_changes"][:5]]  # fmt: skip
        out += [f"- GPQA {a['task']} {a['backend']} ({a['arch']}): {a['before']:.3f} -> {a['now']:.3f} "
                f"({a['difference']:+.3f}; {a['test'].split(' (')[0]} p = {a['p']:.2g}"
                f"{', significant' if a['significant'] else ''})" for a in base["accuracy"]]  # fmt: skip
    fails = report["failures"]
    if fails:
        out += ["", f"Failures ({len(fails)}; every one with its traceback in signoff.html):"]
        for f in fails[:MD_FAILURES]:
            reason = f["reason"].splitlines()[0] if f["reason"] else ""
            out.append(f"- {f['outcome']} `{f['test_id']}` ({f['where']}, {f['host']}): {reason}"
                       + (f"<br>diagnosis: {f['diagnosis']}" if f.get("diagnosis") else "")
                       + (f"<br>replay: `{f['replay']}`" if f["replay"] else ""))  # fmt: skip
        if len(fails) > MD_FAILURES:
            out.append(f"- ... {len(fails) - MD_FAILURES} more")
    return "\n".join(out) + "\n"


def junit(report: dict) -> str:
    """JUnit XML: one test suite per backend and arch (its kernel cases), and one for the sign-off
    itself (the verdict, each GPQA run, each model check, each fault-catalogue row)."""
    root = ET.Element("testsuites", name="mxmoe-signoff")
    suites: dict[str, ET.Element] = {}
    stats: dict[str, dict[str, int]] = {}

    def case(suite: str, name: str, outcome: str, message: str, seconds: float | None = None) -> None:
        if suite not in suites:
            suites[suite] = ET.SubElement(root, "testsuite", name=suite)
            stats[suite] = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        el = ET.SubElement(suites[suite], "testcase", classname=suite, name=name, time=f"{seconds or 0:.3f}")
        st = stats[suite]
        st["tests"] += 1
        if outcome in ("FAIL", "XPASS", "BLOCKED", NO_PRODUCTION, *BAD_VERDICTS):
            ET.SubElement(el, "failure", message=f"{outcome}: {message}"[:1000], type=outcome).text = message
            st["failures"] += 1
        elif outcome == "ERROR":
            ET.SubElement(el, "error", message=message[:1000], type="ERROR").text = message
            st["errors"] += 1
        elif outcome in ("SKIP", "XFAIL", "UNJUDGED"):
            ET.SubElement(el, "skipped", message=f"{outcome}: {message}"[:1000])
            st["skipped"] += 1

    reasons = "\n".join(r["text"] for r in report["reasons"])
    case("signoff", "verdict", report["verdict"], reasons or "nothing blocks")
    for g in report["gpqa"]:
        case("signoff", f"gpqa-{g['task']}-{g['backend']}-{g['arch']}", g["outcome"], g["reason"])
    for m in report["model_checks"]:
        case("signoff", f"model-check-{m['backend']}-{m['arch']}", "PASS" if m["passed"] else "FAIL",
             f"first failing layer {m['first_failure']}" if not m["passed"] else "")  # fmt: skip
    for f in report["faults"]:
        for r in f["rows"]:
            case("signoff", f"faults-{f['arch']}-{r['id']}", r["verdict"] if r["verdict"] in BAD_VERDICTS
                 else "PASS", r["fault"])  # fmt: skip
    step_outcome = {"ran": "PASS", "skipped": "FAIL", "failed": "ERROR", "interrupted": "ERROR", "not run": "FAIL"}
    for st in report.get("steps", []):
        case("signoff", f"step-{st['host']}-{st['name'].replace(' ', '-')}", step_outcome[st["status"]],
             st.get("reason", ""))  # fmt: skip
    by_id = {f["test_id"]: f for f in report["failures"]}
    for c in report["cases"]:
        message = c["reason"]
        if c["test_id"] in by_id and by_id[c["test_id"]]["replay"]:
            message += f"\nreplay: {by_id[c['test_id']]['replay']}"
        case(f"{c['backend']}.{c['arch']}", c["test_id"], c["outcome"], message, c.get("seconds"))
    for name, el in suites.items():
        for k, v in stats[name].items():
            el.set(k, str(v))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
