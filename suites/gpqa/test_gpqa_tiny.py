"""GPQA through lm-eval on the tiny GPT-OSS and its generated GPQA-format task: the oracle's
accuracy and interval, honest backends not different from it, catalogue faults flagged by the
paired test, and the server route (a server that is unreachable, answers garbage or dies is an
error, never an accuracy)."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("transformers", reason="the GPQA runs need transformers (pip install transformers)")
pytest.importorskip("lm_eval", reason="the GPQA runs need lm-eval (pip install 'lm-eval[api]')")
pytest.importorskip("statsmodels", reason="the GPQA statistics need statsmodels (pip install statsmodels)")

from mxmoe.harness.cli.app import main  # noqa: E402
from mxmoe.harness.e2e import task  # noqa: E402
from mxmoe.harness.e2e.checkpoint import TINY_DIR  # noqa: E402

TASK = "gpqa_diamond_mc"
FAULTS = ("mutant-rows-unwritten", "mutant-nibble-order")


def summary(out, label, task_name=TASK):
    return json.loads((out / f"gpqa-{task_name}-{label}.json").read_text())


def no_question_text_in(folder):
    """No question or answer text of the task appears in any file written."""
    rows = task.read_csv(TINY_DIR / "task-test.csv")
    texts = {r["Question"] for r in rows}
    blob = "\n".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())
    return not any(t in blob for t in texts)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """All 200 questions: the oracle first, then emulation and two catalogue faults against it."""
    out = tmp_path_factory.mktemp("gpqa-full")
    argv = ["gpqa", "--model", "tiny", "--task", TASK, "--baseline", "oracle", "--backend", "emulation",
            *(a for f in FAULTS for a in ("--backend", f)), "--results", str(out)]  # fmt: skip
    return main(argv), out


def test_oracle_accuracy_and_interval(full_run):
    status, out = full_run
    s = summary(out, "oracle")
    a = s["accuracy"]
    assert s["outcome"] == "PASS" and s["threshold"]["value"] == pytest.approx(0.94)
    assert a["samples"] == 200 and a["accuracy"] > 0.95
    assert a["low"] < a["accuracy"] < a["high"] <= 1.0 and a["low"] > 0.9  # chance is 0.25
    # lm-eval's own result file says the same accuracy
    lm_eval = json.loads((out / f"gpqa-{TASK}-oracle-results.json").read_text())
    assert lm_eval["results"][f"mxmoe_{TASK}"]["acc,none"] == pytest.approx(a["accuracy"])
    assert "samples" not in lm_eval


def test_emulation_is_not_different_from_the_oracle(full_run):
    _, out = full_run
    s = summary(out, "emulation")
    assert s["outcome"] == "PASS" and s["baseline"] == "oracle"
    assert not s["paired"]["differs"] and s["paired"]["agreement"] > 0.97


@pytest.mark.parametrize("fault", FAULTS)
def test_catalogue_faults_are_flagged_by_the_paired_test(full_run, fault):
    status, out = full_run
    s = summary(out, fault)
    assert status == 1
    assert s["outcome"] == "FAIL" and s["paired"]["differs"] and s["paired"]["mcnemar_p"] < 1e-6
    assert s["paired"]["baseline_only"] > 10 * max(1, s["paired"]["backend_only"])
    assert "McNemar" in s["reason"]


def test_samples_carry_no_text_and_pair_across_runs(full_run, tmp_path):
    _, out = full_run
    recs = [json.loads(line) for line in (out / f"gpqa-{TASK}-emulation-samples.jsonl").read_text().splitlines()]
    assert len(recs) == 200
    assert set(recs[0]) == {"question_id", "repeat", "permutation", "answer", "extracted", "correct"}
    assert no_question_text_in(out)
    # a previous run's per-sample file as the baseline: the same samples, judged alike
    previous = out / f"gpqa-{TASK}-oracle-samples.jsonl"
    status = main(["gpqa", "--model", "tiny", "--task", TASK, "--backend", "mutant-nibble-order",
                   "--baseline", str(previous), "--results", str(tmp_path)])  # fmt: skip
    s = summary(tmp_path, "mutant-nibble-order")
    assert status == 1 and s["baseline"] == "oracle" and s["paired"]["differs"]


@pytest.mark.long(60)
def test_portable_triton_is_not_different_from_the_oracle(tmp_path, profile):
    # Under Triton's interpreter (a CPU) a question takes about 15 s: the pr profile samples 4
    # (OpenAI's draw), nightly runs all 200.
    limit = ["--limit", "4"] if profile == "pr" else []
    status = main(["gpqa", "--model", "tiny", "--task", TASK, *limit, "--batch", "32", "--baseline", "oracle",
                   "--backend", "portable-triton", "--results", str(tmp_path)])  # fmt: skip
    s = summary(tmp_path, "portable-triton")
    if s["outcome"] == "SKIP":  # the backend's own gate (Triton cannot run here), with its reason
        pytest.skip(s["reason"])
    assert status == 0 and not s["paired"]["differs"]
    assert s["paired"]["agreement"] > 0.97 and s["accuracy"]["samples"] == (4 if limit else 200)
    # 4 questions cannot see a 5-point drop: the pr profile's run is UNJUDGED, never PASS
    assert s["outcome"] == ("UNJUDGED" if limit else "PASS"), s["reason"]


DECLINES = """
import dataclasses

from mxmoe.harness.contract.backend import BackendUnavailable
from mxmoe.kernels.emulation import Emulation


class Declines(Emulation):
    declaration = dataclasses.replace(Emulation.declaration, id="declines-here")

    def convert(self, inputs):
        raise BackendUnavailable("vLLM's oracle refuses this deployment here")
"""


def test_a_backend_that_declines_to_run_here_is_a_skip_with_its_reason_never_a_verdict(tmp_path):
    """A backend's own gate (BackendUnavailable, as vLLM's oracle refusing a deployment) is a SKIP
    naming why, as in a kernel check: no accuracy, not an ERROR that blocks, never a PASS."""
    path = tmp_path / "declines.py"
    path.write_text(DECLINES)
    status = main(["gpqa", "--model", "tiny", "--task", TASK, "--limit", "4", "--backend-file", f"{path}:Declines",
                   "--backend", "declines-here", "--results", str(tmp_path / "out")])  # fmt: skip
    s = summary(tmp_path / "out", "declines-here")
    assert status == 0
    assert s["outcome"] == "SKIP" and s["accuracy"] is None
    assert s["reason"] == "cannot run here: vLLM's oracle refuses this deployment here"


def test_missing_data_file_fails_clearly_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as exc:
        main(["gpqa", "--model", "tiny", "--backend", "oracle", "--data", str(tmp_path / "gpqa_diamond.csv"),
              "--results", str(out)])  # fmt: skip
    assert exc.value.code == 2
    assert "--data: no such file" in capsys.readouterr().err
    assert not out.exists()


def _closed_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_clearly_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "results"
    status = main(["gpqa", "--base-url", f"http://127.0.0.1:{_closed_port()}/v1", "--backend", "triton",
                   "--data", str(TINY_DIR / "task-test.csv"), "--results", str(out)])  # fmt: skip
    assert status == 2
    assert "unreachable" in capsys.readouterr().err
    assert not out.exists()


class _Server:
    """An OpenAI-compatible server on loopback, its chat answers from ``answer(payload)``."""

    def __init__(self, answer, model_id="tiny-gpt-oss"):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": model_id, "object": "model"}]})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.payloads.append(payload)
                reply = answer(payload)
                self._send(reply or {"error": "overloaded"}, 200 if reply else 503)

        self.payloads = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_server_answering_garbage_is_an_error_not_an_accuracy(tmp_path, capsys):
    srv = _Server(lambda payload: {"oops": "not a completion"})
    try:
        status = main(["gpqa", "--base-url", srv.url, "--backend", "triton", "--data",
                       str(TINY_DIR / "task-test.csv"), "--limit", "4", "--max-tokens", "8", "--concurrency", "1",
                       "--results", str(tmp_path)])  # fmt: skip
    finally:
        srv.close()
    s = summary(tmp_path, "server-triton", "gpqa_diamond_cot")
    assert status == 1 and s["outcome"] == "ERROR" and s["accuracy"] is None
    assert "not a chat completion" in s["reason"]
    assert not (tmp_path / "gpqa-gpqa_diamond_cot-server-triton-samples.jsonl").exists()


def test_a_retried_request_keeps_its_samples_seed(tmp_path):
    calls = []

    def answer(payload):  # the first request fails once (503), as an overloaded server does
        calls.append(payload["seed"])
        if len(calls) == 1:
            return None
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Answer: A"}}]}

    srv = _Server(answer)
    try:
        status = main(["gpqa", "--base-url", srv.url, "--backend", "echo", "--data", str(TINY_DIR / "task-test.csv"),
                       "--limit", "3", "--concurrency", "1", "--results", str(tmp_path)])  # fmt: skip
    finally:
        srv.close()
    lines = (tmp_path / "gpqa-gpqa_diamond_cot-server-echo-samples.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert status == 0 and len(calls) == 4 and calls[0] == calls[1]
    assert sorted(calls[1:]) == sorted(r["seed"] for r in recs)
    assert all(r["extracted"] == "A" for r in recs)


FAKE_VLLM = """\
#!{python}
# A stand-in for the `vllm` command line, for the harness's server lifecycle: it logs, then dies.
import sys
print("INFO starting vLLM API server for", sys.argv[2], "with", " ".join(sys.argv[3:]), flush=True)
print("ERROR CUDA error: an illegal memory access was encountered", flush=True)
sys.exit(3)
"""


def test_a_server_that_dies_is_an_error_with_its_log_tail(tmp_path, monkeypatch, capsys):
    _fake_vllm(tmp_path, monkeypatch, FAKE_VLLM)
    out = tmp_path / "results"
    status = main(["gpqa", "--serve", "vllm", "--model", "/models/gpt-oss-20b", "--backend", "triton", "--data",
                   str(TINY_DIR / "task-test.csv"), "--results", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert "exited with code 3" in err and "illegal memory access" in err and "--moe-backend triton" in err
    assert not list(out.glob("gpqa-*"))


FAKE_VLLM_SERVING = """\
#!{python}
# A stand-in for `vllm serve`: it answers every chat request with "Answer: A"; with
# FAKE_VLLM_DIE_AFTER=N it dies at request N + 1, as a server whose engine crashes mid-run.
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
die_after = int(os.environ.get("FAKE_VLLM_DIE_AFTER", "0"))
answered = 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({{"data": [{{"id": "fake-model"}}]}})

    def do_POST(self):
        global answered
        self.rfile.read(int(self.headers["Content-Length"]))
        answered += 1
        if die_after and answered > die_after:
            print("ERROR EngineCore died unexpectedly", flush=True)
            os._exit(7)
        self._send({{"choices": [{{"index": 0, "message": {{"role": "assistant", "content": "Answer: A"}}}}]}})


print("INFO serving", sys.argv[2], "on port", port, flush=True)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_vllm(tmp_path, monkeypatch, script):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "vllm"
    exe.write_text(script.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_the_harness_starts_the_server_runs_and_stops_it(tmp_path, monkeypatch):
    import socket

    _fake_vllm(tmp_path, monkeypatch, FAKE_VLLM_SERVING)
    out = tmp_path / "results"
    status = main(["gpqa", "--serve", "vllm", "--model", "/models/gpt-oss-20b", "--backend", "triton_unfused",
                   "--data", str(TINY_DIR / "task-test.csv"), "--limit", "3", "--concurrency", "1",
                   "--results", str(out)])  # fmt: skip
    s = summary(out, "server-triton_unfused", "gpqa_diamond_cot")
    assert status == 0 and s["route"] == "server" and s["accuracy"]["samples"] == 3
    assert s["command"][1:5] == ["serve", "/models/gpt-oss-20b", "--moe-backend", "triton_unfused"]
    port = int(s["base_url"].rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock, pytest.raises(OSError):  # stopped: nothing listens there any more
        sock.connect(("127.0.0.1", port))


def test_a_server_that_dies_mid_run_is_an_error_with_its_log_tail(tmp_path, monkeypatch):
    _fake_vllm(tmp_path, monkeypatch, FAKE_VLLM_SERVING)
    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "1")
    out = tmp_path / "results"
    status = main(["gpqa", "--serve", "vllm", "--model", "/models/gpt-oss-20b", "--backend", "triton", "--data",
                   str(TINY_DIR / "task-test.csv"), "--limit", "3", "--concurrency", "1",
                   "--results", str(out)])  # fmt: skip
    s = summary(out, "server-triton", "gpqa_diamond_cot")
    assert status == 1 and s["outcome"] == "ERROR" and s["accuracy"] is None
    assert "exited with code 7" in s["reason"] and "EngineCore died" in s["reason"]
    assert not (out / "gpqa-gpqa_diamond_cot-server-triton-samples.jsonl").exists()


def test_serve_refuses_an_unknown_moe_backend(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["gpqa", "--serve", "vllm", "--model", "/models/gpt-oss-20b", "--backend", "tritn", "--data",
              str(TINY_DIR / "task-test.csv"), "--results", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "tritn" in err and "triton_unfused" in err


def test_the_server_route_gives_the_in_process_samples(tmp_path):
    """The tiny model served over loopback (its generation, its chat template, the seed of each
    request) gives, sample for sample, what the in-process run gives: the client sends each
    sample's own seed and parses what comes back exactly."""
    from tokenizers import Tokenizer

    from mxmoe.harness.contract.platforms import host_arch
    from mxmoe.harness.e2e.checkpoint import open_checkpoint
    from mxmoe.harness.e2e.model import MoEModel
    from mxmoe.harness.gpqa.lm import MoELM, chat_template_of
    from mxmoe.harness.run.registry import discover, select

    common = ["--task", "gpqa_diamond_cot", "--limit", "3", "--repeats", "2", "--max-tokens", "12"]
    local = tmp_path / "local"
    argv = ["gpqa", "--model", "tiny", "--backend", "oracle", "--batch", "1", *common, "--results", str(local)]
    assert main(argv) == 0

    model = MoEModel(open_checkpoint("tiny"), host_arch())
    model.use(select(discover(), ("oracle",))[0])
    lm = MoELM(model, Tokenizer.from_file(str(TINY_DIR / "tokenizer.json")), chat_template_of(TINY_DIR), "low")
    lock = threading.Lock()

    def answer(payload):
        with lock:
            context = lm.apply_chat_template(payload["messages"])
            text = lm._generate([context], [payload["seed"]], max_gen_toks=payload["max_tokens"],
                                temperature=payload["temperature"], do_sample=True)[0]  # fmt: skip
        message = {"role": "assistant", "content": text}
        return {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}

    srv = _Server(answer)
    remote = tmp_path / "remote"
    try:
        status = main(["gpqa", "--base-url", srv.url, "--backend", "oracle", "--data", str(TINY_DIR / "task-test.csv"),
                       "--concurrency", "2", *common, "--results", str(remote)])  # fmt: skip
    finally:
        srv.close()
    assert status == 0
    assert all(p["reasoning_effort"] == "low" and p["temperature"] == 1.0 for p in srv.payloads)
    got = (remote / "gpqa-gpqa_diamond_cot-server-oracle-samples.jsonl").read_text()
    want = (local / "gpqa-gpqa_diamond_cot-oracle-samples.jsonl").read_text()
    assert got == want and len(got.splitlines()) == 6
    assert len({json.loads(line)["seed"] for line in got.splitlines()}) == 6


def test_lm_eval_runs_the_registered_model_on_the_project_tasks():
    """lm-eval's own API: the model registered as ``mxmoe`` and the task YAMLs, no project CLI."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import mxmoe.harness.gpqa.lm  # noqa: F401 (registers "mxmoe" with lm-eval)
    from mxmoe.harness.gpqa.run import TASKS_DIR

    meta = {"data": str(TINY_DIR / "task-test.csv"), "limit": 12}
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=meta)
    out = lm_eval.simple_evaluate(model="mxmoe", model_args="model=tiny,backend=emulation,batch_size=16",
                                  tasks=[f"mxmoe_{TASK}"], task_manager=manager, bootstrap_iters=0)  # fmt: skip
    assert out["results"][f"mxmoe_{TASK}"]["acc,none"] > 0.8
    assert len(out["samples"][f"mxmoe_{TASK}"]) == 12
    with pytest.raises(ValueError, match="model=PATH"):
        lm_eval.simple_evaluate(model="mxmoe", model_args="checkpoint=tiny", tasks=[f"mxmoe_{TASK}"],
                                task_manager=manager)  # fmt: skip


@pytest.mark.parametrize("task_name", ["gpqa_diamond_mc", "gpqa_diamond_cot"])
def test_no_question_text_in_the_output(tmp_path, capfd, task_name):
    """What the run prints (lm-eval's logging included) and writes holds no question text."""
    status = main(["gpqa", "--model", "tiny", "--task", task_name, "--limit", "4", "--max-tokens", "8",
                   "--backend", "emulation", "--results", str(tmp_path)])  # fmt: skip
    printed = capfd.readouterr()
    rows = task.read_csv(TINY_DIR / "task-test.csv")
    assert status == 0 and "emulation" in printed.out
    assert not any(r["Question"] in printed.out + printed.err for r in rows)
    assert no_question_text_in(tmp_path)
