"""The sign-off report (``python -m harness report``) built from recorded results.

The kernel records come from real runs (``run_case`` of real and deliberately wrong backends,
recorded and reproduced as ``check`` does), the model checks and the padding audit from their
commands; the GPQA summaries are written by ``harness.gpqa.run`` from per-sample records made here,
so that the regression's size (and its McNemar p) is known exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.cli.report import run_report
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.e2e.checkpoint import TINY_DIR
from mxmoe.harness.gpqa import run as gpqa_run
from mxmoe.harness.judge.engine import run_case
from mxmoe.harness.run import results as results_mod
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.results import Recorder, save_repro
from mxmoe.reports.collect import ResultFileError
from mxmoe.reports.policy import PolicyError, load_policy

HERE = Path(__file__).parent
CASES = [make_case("tiny", t) for t in (1, 3, 7)]
QUESTIONS = 200
"""The tiny fixture's question count: enough to see a 5-point drop against the oracle's answers."""
ARCH = host_arch()
"""Records are made where the suite runs (run_case on this host's arch)."""


def backend(name: str) -> object:
    if name == "emulation":
        return load_spec("mxmoe.kernels.emulation:Emulation")
    if name == "portable-triton":
        return load_spec("mxmoe.kernels.portable_triton:PortableTriton")
    return load_spec(f"{HERE / 'release_backends.py'}:{name}")


RACES = (0.5, 0.999)
"""The race hunt's rate and confidence in these tests' policies (``policy_file``): a rate that three
cases rule out in a few calls each, so that a production kernel's records carry a hunt of the power
the policy asks, as a sign-off's do, at a small fraction of its calls. ``record_cases`` makes its
calls without company, and these policies say so (``contention = "none"``): on a GPU host the
report counts only calls made beside the policy's contention, and these tests are about the other
rules (the contention's own are in suites/harness/test_race_hunt.py and test_contention.py)."""


def record_cases(folder: Path, loaded: object, cases: list = CASES) -> None:
    """What ``check`` does for each case: run it (a production kernel with the race hunt's repeats
    for ``RACES``, as the sign-off's check runs it), keep a reproducer of a FAIL or ERROR, record it."""
    from mxmoe.harness.run.races import hunt_plan

    d = loaded.backend.declaration
    hunted = d.kind == "backend" and d.production
    plan = hunt_plan(*RACES, [c.id for c in cases], set()) if hunted else {}
    rec = Recorder(folder)
    for case in cases:
        result, inputs = run_case(loaded.backend, case, ARCH, repeat=plan.get(case.id, 0))
        repro = None
        if result.outcome in ("FAIL", "ERROR") and inputs is not None:
            repro = save_repro(folder, result, inputs, loaded.spec)
        rec.record(result, loaded, repro)


def gpqa(folder: Path, label: str, wrong: set[int], baseline: tuple[str, list[dict]] | None = None) -> list[dict]:
    """A GPQA run of QUESTIONS questions, wrong on the question numbers in ``wrong``."""
    spec = gpqa_run.Spec("gpqa_diamond_mc", TINY_DIR / "task-test.csv")
    recs = [{"question_id": f"q{i:02d}", "repeat": 0, "permutation": [0, 1, 2, 3], "answer": "A",
             "extracted": "B" if i in wrong else "A", "correct": i not in wrong} for i in range(QUESTIONS)]  # fmt: skip
    summary = gpqa_run.summarize(spec, label, recs, model="tiny", bar=(0.7, "the test's bar"), baseline=baseline,
                                 seconds=1.0, extra={"arch": ARCH})  # fmt: skip
    gpqa_run.write(folder, spec, label, summary, None, recs)
    return recs


KERNELS_ONLY = ["catalogue", "padding", "model-check", "gpqa"]
"""``[evidence] waive`` of a policy that gates kernels alone (the named policy ``kernels-only``)."""


def policy_file(tmp: Path, required: list[str], cases: str = "any", waive: list[str] | None = None,
                extra: str = "") -> Path:  # fmt: skip
    """A policy requiring ``required``; ``cases`` "any": a required backend's 3 tiny cases suffice;
    ``waive``: the evidence kinds it waives (default: every kind but the kernel checks, for tests of
    the kernel rules on kernel records alone)."""
    path = tmp / "policy.toml"
    waived = KERNELS_ONLY if waive is None else waive
    races = "" if "[races]" in extra else (f"[races]\nrate = {RACES[0]}\nconfidence = {RACES[1]}\n"
                                            'contention = "none"\n')
    path.write_text(f"[required]\nbackends = {json.dumps(required)}\ncases = {json.dumps(cases)}\n"
                    f"[evidence]\nwaive = {json.dumps(waived)}\n{races}{extra}")  # fmt: skip
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One host's results of a release with a FAIL, an ERROR, an XFAIL, an XPASS, a backend that
    only SKIPs, a GPQA regression, two model checks (one with a planted fault) and the padding audit."""
    folder = tmp_path_factory.mktemp("release")
    for name in ("emulation", "WrongSignAt7", "RaisesAt3", "KnownBug", "NeedsVendor"):
        record_cases(folder, backend(name))
    oracle = gpqa(folder, "oracle", wrong={5})
    gpqa(folder, "emulation", wrong={5}, baseline=("oracle", oracle))
    gpqa(folder, "wrongsign-kernel", wrong=set(range(0, QUESTIONS, 2)), baseline=("oracle", oracle))
    argv = ["model-check", "--model", "tiny", "--batch", "2", "--repeats", "0", "--results", str(folder)]
    assert main([*argv, "--backend", "emulation"]) == 0
    planted = folder / "planted"
    assert main([*argv[:-1], str(planted), "--backend", "emulation", "--plant", "2=mutant-nibble-order"]) == 1
    assert main(["padding", "--json", str(folder / "padding.json")]) == 0
    return folder


def test_every_problem_lands_where_it_belongs_and_blocks_with_its_reason(release, tmp_path):
    policy = policy_file(tmp_path, ["emulation", "needs-vendor-kernel"])
    report, files = run_report([str(release)], tmp_path / "out", policy=str(policy))
    assert report["verdict"] == "BLOCKED"
    rows = {(r["backend"], r["arch"]): r for r in report["rows"]}
    counts = {b: rows[(b, ARCH)]["counts"] for b, _ in rows}
    assert counts["emulation"] == {"PASS": 3, "FAIL": 0, "ERROR": 0, "SKIP": 0, "XFAIL": 0, "XPASS": 0}
    assert counts["wrongsign-kernel"]["FAIL"] == 1 and counts["wrongsign-kernel"]["PASS"] == 2
    assert counts["raising-kernel"]["ERROR"] == 1
    assert counts["known-bug-kernel"] == {"PASS": 1, "FAIL": 0, "ERROR": 0, "SKIP": 0, "XFAIL": 1, "XPASS": 1}
    assert counts["needs-vendor-kernel"] == {"PASS": 0, "FAIL": 0, "ERROR": 0, "SKIP": 3, "XFAIL": 0, "XPASS": 0}

    by_rule: dict[str, list[str]] = {}
    for r in report["reasons"]:
        by_rule.setdefault(r["rule"], []).append(r["text"])
    assert sorted(by_rule) == ["failure", "gpqa", "never-ran", "xpass"]
    fails = " | ".join(by_rule["failure"])
    assert f"wrongsign-kernel on {ARCH}: 1 FAIL, 0 ERROR of 3 cases" in fails and "exceed the error bound" in fails
    assert f"raising-kernel on {ARCH}: 0 FAIL, 1 ERROR of 3 cases" in fails
    assert by_rule["xpass"] == [f"known-bug-kernel on {ARCH}: 1 XPASS of a strict xfail (the declared bug no longer "
                                "shows: update the declaration)"]  # fmt: skip
    assert by_rule["never-ran"] == [
        f"required backend needs-vendor-kernel never ran on {ARCH} (3 SKIP: needs-vendor-kernel cannot run here: "
        "needs-vendor-kernel needs the package 'vendor_moe' (pip: vendor-moe))"]  # fmt: skip
    assert len(by_rule["gpqa"]) == 1 and f"of wrongsign-kernel on {ARCH}: FAIL" in by_rule["gpqa"][0]
    assert "synthetic GPQA-format task" in by_rule["gpqa"][0]  # the tiny fixture's task is never called GPQA
    assert "McNemar" in by_rule["gpqa"][0]
    # the planted model check is the harness's control, not the release's: a warning, not a reason
    assert any(w["rule"] == "model-check" and "first failing layer 2" in w["text"] for w in report["warnings"])

    # skips are listed with their reason and never counted as passes
    assert {(s["backend"], s["count"]) for s in report["skips"]} == {("needs-vendor-kernel", 3)}
    assert not [r for r in report["rows"] if r["backend"] == "needs-vendor-kernel" and r["worst_ratio"] is not None]

    # every FAIL and ERROR is listed with its message and a replay command that finds its reproducer
    listed = {f["test_id"]: f for f in report["failures"]}
    fail = listed[f"wrongsign-kernel-{ARCH}-tiny-interleaved-t7"]
    error = listed[f"raising-kernel-{ARCH}-tiny-interleaved-t3"]
    assert fail["outcome"] == "FAIL" and error["outcome"] == "ERROR" and "illegal memory access" in error["reason"]
    for f in (fail, error):
        assert f["replay"].startswith("python -m harness replay ") and Path(f["replay"].split()[-1]).is_file()
    assert listed[f"known-bug-kernel-{ARCH}-tiny-interleaved-t1"]["outcome"] == "XPASS"
    assert any(f["where"] == "model check" and f["test_id"].endswith("-layer2") for f in report["failures"])

    # the views say the same: Markdown short enough for a PR comment, JSON with its schema, JUnit
    md = files["md"].read_text()
    assert md.startswith("## MXFP4 MoE sign-off: **BLOCKED**") and len(md) < 65536
    for r in report["reasons"]:
        assert r["text"] in md
    assert f"needs-vendor-kernel ({ARCH}): 3 SKIP" in md
    data = json.loads(files["json"].read_text())
    assert data["schema"] == 1 and data["verdict"] == "BLOCKED"
    suites = {s.get("name"): s for s in ET.parse(files["junit"]).getroot()}
    assert suites["signoff"].find("testcase[@name='verdict']/failure") is not None
    assert suites[f"wrongsign-kernel.{ARCH}"].get("failures") == "1"
    assert suites[f"raising-kernel.{ARCH}"].get("errors") == "1"
    assert suites[f"needs-vendor-kernel.{ARCH}"].get("skipped") == "3"
    known = suites[f"known-bug-kernel.{ARCH}"]
    assert known.get("failures") == "1" and known.get("skipped") == "1"  # its XPASS and its XFAIL


def _green(folder: Path, names: tuple[str, ...]) -> None:
    """A release where every backend of ``names`` passes its cases and GPQA."""
    oracle = gpqa(folder, "oracle", wrong={5})
    for name in names:
        loaded = backend(name)
        record_cases(folder, loaded)
        gpqa(folder, loaded.backend.declaration.id, wrong={5}, baseline=("oracle", oracle))


def test_the_harness_own_backends_alone_are_no_production_sign_off(tmp_path):
    """emulation and portable Triton pass everything, and still the verdict is not SHIP: no kernel an
    inference engine ships was judged; the report says so and the command exits non-zero."""
    _green(tmp_path / "own", ("emulation", "portable-triton"))
    policy = str(policy_file(tmp_path, ["emulation", "portable-triton"]))
    report, files = run_report([str(tmp_path / "own")], tmp_path / "out", policy=policy)
    assert report["reasons"] == [] and report["verdict"] == "NO PRODUCTION KERNEL JUDGED"
    assert report["production"] == {ARCH: []}
    assert files["md"].read_text().startswith("## MXFP4 MoE sign-off: **NO PRODUCTION KERNEL JUDGED**\n\n"
                                              f"production kernels judged: {ARCH}: 0 (none).")  # fmt: skip
    assert main(["report", str(tmp_path / "own"), "--out", str(tmp_path / "out2"), "--policy", policy]) == 1


def test_one_honest_production_backend_beside_them_ships(tmp_path):
    _green(tmp_path / "green", ("emulation", "portable-triton", "HonestOutside"))
    policy = str(policy_file(tmp_path, ["emulation", "portable-triton"]))
    report, files = run_report([str(tmp_path / "green")], tmp_path / "out", policy=policy)
    assert report["verdict"] == "SHIP" and report["reasons"] == []
    assert report["production"] == {ARCH: ["honest-outside-kernel"]}
    md = files["md"].read_text()
    assert f"production kernels judged: {ARCH}: 1 (honest-outside-kernel)" in md
    (row,) = [r for r in report["rows"] if r["backend"] == "honest-outside-kernel"]
    assert row["builds"] == ["outside-moe 1.2.3 (wheel)"] and "outside-moe 1.2.3 (wheel)" in md  # the build that ran
    assert main(["report", str(tmp_path / "green"), "--out", str(tmp_path / "out2"), "--policy", policy]) == 0


def test_a_required_backend_must_have_run_every_profile_case_it_declares(tmp_path):
    """One tiny case of emulation is not the pr profile: under the default policy (``cases = "pr"``)
    the missing cases block, named."""
    record_cases(tmp_path / "r", backend("HonestOutside"), CASES[:1])
    record_cases(tmp_path / "r", backend("emulation"), CASES[:1])
    path = tmp_path / "policy.toml"
    path.write_text('[required]\nbackends = ["emulation"]\n')
    report, _ = run_report([str(tmp_path / "r")], tmp_path / "out", policy=str(path))
    (cov,) = [r for r in report["reasons"] if r["rule"] == "coverage"]
    from mxmoe.harness.run.profiles import profile_cases

    n = len(profile_cases("pr"))
    assert cov["text"].startswith(f"required backend emulation ran 1 of the {n} pr cases it declares on {ARCH} "
                                  "(not run: emulation-")  # fmt: skip
    assert report["verdict"] == "BLOCKED"


def test_runs_that_disagree_block_as_flaky_whichever_came_last(tmp_path):
    """FAIL in one folder, PASS in a later one (by the clock and by the order given): the failing run is
    the verdict and the test blocks as flaky, naming its backend."""
    wrong = backend("WrongSignAt7")
    record_cases(tmp_path / "first", wrong, CASES[2:])
    wrong.backend.broken = False
    record_cases(tmp_path / "later", wrong, CASES[2:])
    record_cases(tmp_path / "later", backend("HonestOutside"))
    policy = str(policy_file(tmp_path, []))
    for order in (("first", "later"), ("later", "first")):
        report, _ = run_report([str(tmp_path / f) for f in order], tmp_path / "out", policy=policy)
        assert report["verdict"] == "BLOCKED"
        flaky = [r for r in report["reasons"] if r["rule"] == "flaky"]
        assert [r["backend"] for r in flaky] == ["wrongsign-kernel"], report["reasons"]
        assert f"test wrongsign-kernel-{ARCH}-tiny-interleaved-t7: runs disagree (" in flaky[0]["text"]
        (row,) = [r for r in report["rows"] if r["backend"] == "wrongsign-kernel"]
        assert row["counts"]["FAIL"] == 1 and row["counts"]["PASS"] == 0


def test_check_only_results_are_blocked_naming_each_missing_evidence_and_ship_only_where_a_policy_waives_it(
    tmp_path, capsys
):
    """What ``check`` alone records (kernel cases of emulation, portable Triton and an honest outside
    production kernel): under the default evidence rules BLOCKED, each missing kind named; under a
    policy that waives them, SHIP with a headline saying what it rests on and what was waived."""
    for name in ("emulation", "portable-triton", "HonestOutside"):
        record_cases(tmp_path / "r", backend(name), CASES[:1])
    (tmp_path / "strict").mkdir()
    strict = policy_file(tmp_path / "strict", [], waive=[])
    report, files = run_report([str(tmp_path / "r")], tmp_path / "out", policy=str(strict))
    assert report["verdict"] == "BLOCKED"
    texts = [r["text"] for r in report["reasons"] if r["rule"] == "evidence"]
    assert [r["rule"] for r in report["reasons"]] == ["evidence"] * 4, report["reasons"]
    assert texts[0].startswith(f"no fault catalogue on {ARCH} in these results") and "harness mutants" in texts[0]
    assert texts[1].startswith(f"no model check of a production kernel on {ARCH} in these results")
    assert texts[2].startswith(f"no GPQA run of a production kernel on {ARCH} with the power to see a 5% drop")
    assert texts[3].startswith("no padding audit in these results")
    assert report["evidence"]["missing"] == ["fault catalogue", "model check", "GPQA with power", "padding audit"]
    assert all(t in files["md"].read_text() for t in texts)

    waived = policy_file(tmp_path, [])
    report, files = run_report([str(tmp_path / "r")], tmp_path / "out2", policy=str(waived))
    assert report["verdict"] == "SHIP" and report["reasons"] == []
    line = (f"SHIP on kernel checks only: fault catalogue, padding audit, model check and GPQA with power waived "
            f"by policy {waived}")  # fmt: skip
    assert line in files["md"].read_text()
    assert main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out3"), "--policy", str(waived)]) == 0
    assert f"verdict: {line}" in capsys.readouterr().out


def test_the_named_kernels_only_policy_waives_all_but_the_kernel_checks_and_no_policy_waives_those(tmp_path):
    assert load_policy("kernels-only").evidence() == ("kernels",)
    assert load_policy("kernels-only").source == "kernels-only (reports/policy-kernels-only.toml)"
    assert load_policy().evidence() == ("kernels", "catalogue", "padding", "model-check", "gpqa")
    assert load_policy("default").evidence_waive == ()
    bad = tmp_path / "bad.toml"
    bad.write_text('[evidence]\nwaive = ["kernels"]\n')
    with pytest.raises(PolicyError, match="a SHIP always rests on kernel checks"):
        load_policy(bad)
    bad.write_text('[evidence]\nwaive = ["gpqa", "power"]\n')
    with pytest.raises(PolicyError, match="evidence.waive takes catalogue, padding, model-check, gpqa; got 'power'"):
        load_policy(bad)
    with pytest.raises(PolicyError, match="no such file, and not a policy's name"):
        load_policy("kernel-only")
    from mxmoe.harness.distributed.matrix import REPORT

    assert REPORT == ("./dev py -m harness report results --out report --policy kernels-only",)


def test_every_kind_of_evidence_present_ships_under_the_default_rules_and_each_one_missing_blocks(tmp_path):
    """Kernel cases, a run of the fault catalogue, the padding audit, a model check and GPQA of the
    production kernel with power, each recorded by its own command: SHIP on all five. Taking any one
    away blocks, naming it. (The catalogue runs one case here, so some faults are not caught: its
    verdicts are warnings under this policy; they block in the tests above.)"""
    folder = tmp_path / "r"
    spec = f"{HERE / 'release_backends.py'}:HonestOutside"
    record_cases(folder, backend("HonestOutside"))
    oracle = gpqa(folder, "oracle", wrong={5})
    gpqa(folder, "honest-outside-kernel", wrong={5}, baseline=("oracle", oracle))
    assert main(["model-check", "--model", "tiny", "--batch", "2", "--repeats", "0", "--results", str(folder),
                 "--backend-file", spec, "--backend", "honest-outside-kernel"]) == 0  # fmt: skip
    assert main(["padding", "--json", str(folder / "padding.json")]) == 0
    main(["mutants", "--case", "tiny-interleaved-t7", "--json", str(folder / "mutants.json")])
    policy = str(policy_file(tmp_path, [], waive=[], extra="[faults]\nblock = false\n"))
    report, files = run_report([str(folder)], tmp_path / "out", policy=policy)
    assert report["verdict"] == "SHIP", report["reasons"]
    line = "SHIP on kernel checks, fault catalogue, padding audit, model check and GPQA with power"
    assert report["evidence"]["rests_on"] == ["kernel checks", "fault catalogue", "padding audit", "model check",
                                              "GPQA with power"]  # fmt: skip
    assert f"Nothing blocks under the policy: {line}." in files["md"].read_text()
    for pattern, named in (("mutants.json", "no fault catalogue"), ("padding.json", "no padding audit"),
                           ("model-check-*.json", "no model check"),
                           ("gpqa-*honest-outside-kernel.json", "no GPQA run")):  # fmt: skip
        partial = tmp_path / f"without-{pattern.split('.')[0].strip('*-')}"
        shutil.copytree(folder, partial)
        for f in partial.glob(pattern):
            f.unlink()
        report, _ = run_report([str(partial)], tmp_path / "out", policy=policy)
        assert report["verdict"] == "BLOCKED"
        assert [r["text"][: len(named)] for r in report["reasons"]] == [named], report["reasons"]


def _manifest(folder: Path, names: list[str]) -> None:
    from mxmoe.harness.run.results import stamp

    steps = [{"name": n, "status": "ran", "exit_status": 0, "reason": "", "seconds": 1.0} for n in names]
    (folder / "signoff-steps.json").write_text(json.dumps(stamp("signoff-steps") | {"steps": steps}))


def test_a_manifest_is_read_for_the_steps_it_lacks(tmp_path):
    """A sign-off killed at a CI job's time limit leaves a manifest of the steps before: beside
    results that would ship, it blocks, naming each of the four steps that did not run."""
    _green(tmp_path / "r", ("emulation", "HonestOutside"))
    _manifest(tmp_path / "r", ["oracle self-check", "kernel check"])
    report, files = run_report([str(tmp_path / "r")], tmp_path / "out", policy=str(policy_file(tmp_path, [])))
    assert report["verdict"] == "BLOCKED"
    texts = [r["text"] for r in report["reasons"]]
    assert [t.split("'")[1] for t in texts] == ["fault catalogue", "padding audit", "model check", "GPQA"]
    assert all("did not run: not in the manifest: the sign-off stopped before this step" in t for t in texts)
    assert [st["status"] for st in report["steps"]] == ["ran", "ran", "not run", "not run", "not run", "not run"]
    suites = {s.get("name"): s for s in ET.parse(files["junit"]).getroot()}
    assert suites["signoff"].get("failures") == str(1 + 4)  # the verdict and the four steps


SIGTERM_CHILD = """
import sys, time
import mxmoe.harness.audits.selfcheck as selfcheck
from mxmoe.harness.cli import signoff
from mxmoe.harness.cli.app import main
from mxmoe.harness.contract import platforms

host, results, pids = sys.argv[1:]
platforms.host_arch = lambda: host
selfcheck.run_selfcheck = lambda device: []
signoff._signoff_backends = lambda: []
# on a GPU the catalogue and the padding audit run beside the kernel check, each its own process
BESIDE = "import os, sys, time; open(sys.argv[1], 'a').write(str(os.getpid()) + ' '); time.sleep(300)"
signoff.Background.command = (sys.executable, "-c", BESIDE, pids)


def run(argv):
    if argv[0] == ("mutants" if host == "cpu" else "check"):
        print(f"{argv[0]} begun", flush=True)
        time.sleep(300)
    return 0


signoff._run = run
sys.exit(main(["signoff", "--results", results]))
"""


def _first_line_with(proc, marker: str, timeout: float) -> bool:
    """Whether ``proc`` printed a line containing ``marker`` within ``timeout`` seconds (its
    output read in a thread, so that a child that never prints it cannot hang the test)."""
    import queue
    import threading

    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            if marker in lines.get(timeout=left):
                return True
        except queue.Empty:
            break
    return False


@pytest.mark.parametrize("host", ["cpu", "sm90"])
def test_a_sign_off_sent_sigterm_mid_step_says_so_and_does_not_ship(tmp_path, host):
    """The sign-off's own process, its steps made quick and one made endless, gets SIGTERM in it: on
    a CPU in the catalogue (the steps one after the other), on a GPU in the kernel check (the
    catalogue and the padding audit beside it, their processes ended with it). It exits 128 + 15
    with the manifest naming the interrupted step, and the report on that folder (beside results
    that would ship) is BLOCKED by it and the steps after."""
    import signal
    import subprocess

    results, pids = tmp_path / "results", tmp_path / "beside-pids.txt"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, host, str(results), str(pids)], cwd=HERE.parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    interrupted = "fault catalogue" if host == "cpu" else "kernel check"
    begun = _first_line_with(proc, "mutants begun" if host == "cpu" else "check begun", 120)
    for _ in range(300 if host != "cpu" else 0):  # both processes beside it up, before the signal
        if pids.exists() and len(pids.read_text().split()) == 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert begun, err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "sign-off interrupted by SIGTERM" in err
    manifest = json.loads((results / "signoff-steps.json").read_text())
    assert manifest["planned"] == ["oracle self-check", "kernel check", "fault catalogue", "padding audit",
                                   "model check", "GPQA"]  # fmt: skip
    ran = [("kernel check", "ran")] if host == "cpu" else []
    assert [(st["name"], st["status"]) for st in manifest["steps"]] == [
        ("oracle self-check", "ran"), *ran, (interrupted, "interrupted")]  # fmt: skip
    assert manifest["steps"][-1]["reason"].startswith("SIGTERM received")
    if host != "cpu":  # the two steps started beside the kernel check did not outlive the sign-off
        beside = [int(x) for x in pids.read_text().split()]
        assert len(beside) == 2
        for pid in beside:
            for _ in range(50):
                if not Path(f"/proc/{pid}").exists() or "zombie" in _proc_state(pid):
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"process {pid} started beside the kernel check outlived the sign-off")
    _green(results, ("emulation", "HonestOutside"))
    report, _ = run_report([str(results)], tmp_path / "out", policy=str(policy_file(tmp_path, [])))
    assert report["verdict"] == "BLOCKED"
    texts = [r["text"] for r in report["reasons"]]
    assert f"'{interrupted}'" in texts[0] and "was interrupted: SIGTERM received" in texts[0]
    after = ["padding audit", "model check", "GPQA"] if host == "cpu" else ["fault catalogue", "padding audit",
                                                                           "model check", "GPQA"]  # fmt: skip
    assert [t.split("'")[1] for t in texts[1:]] == after


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


def test_the_sign_off_takes_a_backend_that_declined_every_kernel_case_out_of_its_model_check(tmp_path):
    """On the H200, vLLM's EMULATION loads but vLLM's oracle refuses its deployment (no amd-quark):
    its kernel cases SKIP, and its model check must not stand as a failure of a kernel that never
    ran. Found there; the sign-off now leaves it out of that step (and on a CPU, where GPQA comes
    after the kernel check, out of GPQA too), naming why. On a GPU, GPQA runs beside the kernel
    check and the backend's own decline there is its GPQA SKIP (suites/gpqa)."""
    from mxmoe.harness.cli.signoff import _ran_kernel_cases

    record_cases(tmp_path, backend("emulation"), CASES[:1])
    record_cases(tmp_path, backend("DeclinesEverything"))
    ran, declined = _ran_kernel_cases(str(tmp_path), ["emulation", "declines-everything-kernel", "unrecorded"], ARCH)
    assert ran == ["emulation", "unrecorded"]  # one with no record at all is not taken for a decline
    assert declined == {"declines-everything-kernel": "declines-everything-kernel cannot run this case: the "
                        "deployment is refused on this host (it requires amd-quark)"}  # fmt: skip


def test_a_sign_off_whose_catalogue_step_crashed_does_not_ship(tmp_path):
    from mxmoe.harness.run.results import stamp

    _green(tmp_path / "r", ("emulation", "HonestOutside"))
    steps = [{"name": "kernel check", "status": "ran", "exit_status": 0, "reason": "", "seconds": 1.0},
             {"name": "fault catalogue", "status": "failed", "exit_status": None,
              "reason": "raised RuntimeError: CUDA error: an illegal memory access", "seconds": 2.0},
             {"name": "GPQA", "status": "skipped", "exit_status": None, "reason": "it needs lm-eval", "seconds": 0.0}]
    (tmp_path / "r" / "signoff-steps.json").write_text(json.dumps(stamp("signoff-steps") | {"steps": steps}))
    report, _ = run_report([str(tmp_path / "r")], tmp_path / "out", policy=str(policy_file(tmp_path, [])))
    assert report["verdict"] == "BLOCKED"
    texts = [r["text"] for r in report["reasons"] if r["rule"] == "signoff-step"]
    assert len(texts) == 5 and "'fault catalogue'" in texts[0] and "failed" in texts[0] and "illegal memory" in texts[0]
    assert "'GPQA'" in texts[1] and "did not run" in texts[1] and "lm-eval" in texts[1]
    # and the steps this manifest does not list did not run either
    assert [t.split("'")[1] for t in texts[2:]] == ["oracle self-check", "padding audit", "model check"]


def test_an_underpowered_gpqa_pass_is_unjudged(tmp_path):
    record_cases(tmp_path / "r", backend("HonestOutside"))
    spec = gpqa_run.Spec("gpqa_diamond_mc", TINY_DIR / "task-test.csv", limit=8)
    recs = [{"question_id": f"q{i:02d}", "repeat": 0, "permutation": [0, 1, 2, 3], "answer": "A", "extracted": "A",
             "correct": True} for i in range(8)]  # fmt: skip
    summary = gpqa_run.summarize(spec, "honest-outside-kernel", recs, model="tiny", bar=None,
                                 baseline=("oracle", recs), seconds=1.0, extra={"arch": ARCH})  # fmt: skip
    assert summary["outcome"] == "UNJUDGED" and "too few samples to judge: 8 samples" in summary["reason"]
    gpqa_run.write(tmp_path / "r", spec, "honest-outside-kernel", summary, None, recs)
    report, _ = run_report([str(tmp_path / "r")], tmp_path / "out", policy=str(policy_file(tmp_path, [])))
    (g,) = report["gpqa"]
    assert g["outcome"] == "UNJUDGED" and report["verdict"] == "SHIP"  # reported, never counted as a pass


def test_a_gpqa_run_the_backend_declined_is_listed_and_never_a_pass(tmp_path):
    """A GPT-OSS GPQA SKIP (the backend's own gate: on a GPU the sign-off's GPQA runs every backend
    that loads, before the kernel check says which decline) is a warning naming why; it neither
    blocks nor counts as the GPQA evidence of a production kernel."""
    record_cases(tmp_path / "r", backend("HonestOutside"))
    spec = gpqa_run.Spec("gpqa_diamond_mc", TINY_DIR / "task-test.csv", limit=8)
    summary = gpqa_run.summarize(spec, "honest-outside-kernel", None, model="tiny", bar=None, baseline=None,
                                 seconds=1.0, declined="cannot run here: refused on this host",
                                 extra={"arch": ARCH})  # fmt: skip
    assert summary["outcome"] == "SKIP" and summary["reason"] == "cannot run here: refused on this host"
    gpqa_run.write(tmp_path / "r", spec, "honest-outside-kernel", summary, None, None)
    report, _ = run_report([str(tmp_path / "r")], tmp_path / "out", policy=str(policy_file(tmp_path, [])))
    (g,) = report["gpqa"]
    assert g["outcome"] == "SKIP" and report["verdict"] == "SHIP"
    assert any(w["rule"] == "gpqa" and "did not run (cannot run here: refused on this host)" in w["text"]
               for w in report["warnings"])  # fmt: skip
    needs_gpqa = policy_file(tmp_path, [], waive=["catalogue", "padding", "model-check"])
    strict, _ = run_report([str(tmp_path / "r")], tmp_path / "strict", policy=str(needs_gpqa))
    assert strict["verdict"] != "SHIP"  # where the policy needs GPQA evidence, a SKIP is none
    assert strict["evidence"]["missing"] == ["GPQA with power"]
    assert any("honest-outside-kernel SKIP" in r["text"] for r in strict["reasons"])


def test_nothing_judged_never_ships(tmp_path):
    record_cases(tmp_path / "r", backend("NeedsVendor"))
    report, _ = run_report([str(tmp_path / "r")], tmp_path / "out", policy=str(policy_file(tmp_path, [])))
    assert report["verdict"] == "BLOCKED"
    assert [r["rule"] for r in report["reasons"]] == ["nothing-judged"]


def test_two_hosts_merge_without_loss_or_double_counting(tmp_path, monkeypatch):
    real = results_mod.host_fingerprint

    def on(host: str, arch: str) -> None:
        monkeypatch.setattr(results_mod, "host_fingerprint", lambda: {**real(), "hostname": host, "arch": arch})
        monkeypatch.setattr(results_mod.socket, "gethostname", lambda: host)

    on("cpu-runner-1", ARCH)
    record_cases(tmp_path / "a", backend("emulation"), CASES[:2])
    on("cpu-runner-2", ARCH)
    record_cases(tmp_path / "b", backend("emulation"), CASES[2:])
    record_cases(tmp_path / "b", backend("WrongSignAt7"), CASES[:1])
    shutil.copytree(tmp_path / "a", tmp_path / "artifact-copy-of-a")
    report, _ = run_report([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "artifact-copy-of-a")],
                           tmp_path / "out", policy=str(policy_file(tmp_path, ["emulation"])))  # fmt: skip
    inp = report["inputs"]
    assert inp["records"] == 4 and inp["duplicates"] == 2 and inp["reruns"] == 0
    assert sorted((h["hostname"], h["records"]) for h in inp["hosts"]) == [("cpu-runner-1", 2), ("cpu-runner-2", 2)]
    rows = {r["backend"]: r["counts"]["PASS"] for r in report["rows"]}
    assert rows == {"emulation": 3, "wrongsign-kernel": 1}


def test_a_truncated_or_foreign_file_or_a_bad_policy_is_an_error_naming_it(tmp_path, capsys):
    record_cases(tmp_path / "r", backend("emulation"), CASES[:2])
    path = next((tmp_path / "r").glob("results-*.jsonl"))
    path.write_text(path.read_text()[:-30])
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert f"{path}:2: truncated (the file ends mid-line)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written from half a file
    foreign = tmp_path / "f" / "gpqa-gpqa_diamond_mc-x.json"
    foreign.parent.mkdir()
    foreign.write_text(json.dumps({"task": "gpqa", "acc": 0.5}))
    with pytest.raises(ResultFileError, match=rf"{foreign}: no schema, kind, timestamp, host"):
        run_report([str(foreign.parent)], tmp_path / "out")
    bad = tmp_path / "bad.toml"
    bad.write_text("[required]\nbackend = ['triton']\n")
    with pytest.raises(PolicyError, match=r"unknown key required.backend; accepted in \[required\]: backends, archs"):
        load_policy(bad)
    bad.write_text("[gpqa]\nblock = 'yes'\n")
    with pytest.raises(PolicyError, match="gpqa.block must be true or false, got 'yes'"):
        load_policy(bad)


def test_against_a_baseline_new_and_fixed_failures_and_a_significant_accuracy_drop(tmp_path):
    before, now = tmp_path / "before", tmp_path / "now"
    for folder, broken in ((before, False), (now, True)):
        wrong, raising = backend("WrongSignAt7"), backend("RaisesAt3")
        wrong.backend.broken = broken  # the new release broke this kernel at T=7 ...
        raising.backend.broken = not broken  # ... and fixed that one at T=3
        record_cases(folder, wrong)
        record_cases(folder, raising)
        gpqa(folder, "wrongsign-kernel", wrong=set(range(0, QUESTIONS, 2)) if broken else {5})
    policy = policy_file(tmp_path, [])
    report, files = run_report([str(now)], tmp_path / "out", baseline=[str(before)], policy=str(policy))
    base = report["baseline"]
    assert [(n["test_id"], n["before"]) for n in base["new_failures"]] == [
        (f"wrongsign-kernel-{ARCH}-tiny-interleaved-t7", "PASS")]  # fmt: skip
    assert [(f["test_id"], f["before"]) for f in base["fixed"]] == [(f"raising-kernel-{ARCH}-tiny-interleaved-t3",
                                                                     "ERROR")]  # fmt: skip
    assert [c["test_id"] for c in base["ratio_changes"]][:1] == [f"wrongsign-kernel-{ARCH}-tiny-interleaved-t7"]
    (acc,) = base["accuracy"]
    assert acc["before"] == 199 / 200 and acc["now"] == 100 / 200 and acc["significant"] and acc["regression"]
    assert acc["test"].startswith("paired exact McNemar") and acc["p"] < 1e-4
    assert any(r["rule"] == "baseline-accuracy" for r in report["reasons"])
    assert "1 new failures, 1 fixed" in files["md"].read_text()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_renders_in_headless_chromium_with_every_plot_and_no_console_error(release, tmp_path):
    """Opens signoff.html in Debian's Chromium with every request other than the file itself refused
    (it must need no network), and checks the page ran clean and every plot is an image on screen."""
    if _chromium() is None and not os.environ.get("MXMOE_REQUIRE_CHROMIUM"):
        pytest.skip("needs Chromium (Debian: apt-get install chromium); CI installs it and sets MXMOE_REQUIRE_CHROMIUM")
    assert _chromium() is not None, "MXMOE_REQUIRE_CHROMIUM is set but no chromium is on PATH"
    playwright = pytest.importorskip("playwright.sync_api", reason="needs playwright (the test extra)")
    policy = policy_file(tmp_path, ["emulation", "needs-vendor-kernel"])
    _, files = run_report([str(release)], tmp_path / "out", policy=str(policy))
    page_url = files["html"].resolve().as_uri()
    console, errors, outside = [], [], []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])  # fmt: skip
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: errors.append(str(e)))

        def route(r: object) -> None:
            if r.request.url == page_url or r.request.url.startswith("data:"):
                r.continue_()
            else:
                outside.append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.goto(page_url)
        images = page.evaluate("""Array.from(document.images).map(i => ({alt: i.alt,
            ok: i.complete && i.naturalWidth > 0, h: i.getBoundingClientRect().height,
            fig: i.closest('figure').id}))""")
        verdict = page.inner_text("#verdict")
        shot = tmp_path / "signoff.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert console == [] and errors == [] and outside == []
    assert verdict == "BLOCKED"
    assert sorted(i["fig"] for i in images) == sorted(f"plot-{k}" for k in ("ratios", "heatmap", "gpqa", "layers",
                                                                             "padding"))  # fmt: skip
    assert all(i["ok"] and i["h"] > 100 for i in images), images
    assert shot.stat().st_size > 50_000  # a page with five plots, not a blank one
    keep = os.environ.get("MXMOE_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / "signoff.png")


def test_without_the_page_packages_the_other_files_are_written_and_the_error_says_what_to_install(
        tmp_path, monkeypatch, capsys):  # fmt: skip
    record_cases(tmp_path / "r", backend("emulation"), CASES[:1])
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 now raises ImportError
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "signoff.html needs matplotlib and jinja2" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["junit.xml", "signoff.json", "signoff.md"]
