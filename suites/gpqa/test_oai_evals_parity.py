"""vLLM CI's GPQA gate (OpenAI's ``gpt_oss.evals``, its own eval class and sampler) and the
harness's ``cot`` task (through lm-eval and the harness's chat client) against one loopback server
whose response depends on the prompt alone: sample for sample, the same question, choice order and
correct letter, the same prompt, the same response, the same extracted letter, the same grade.
Only generated data: the tiny fixture's synthetic task and rows made here."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("transformers", reason="the GPQA runs need transformers (pip install transformers)")
pytest.importorskip("lm_eval", reason="the GPQA runs need lm-eval (pip install 'lm-eval[api]')")
pytest.importorskip("statsmodels", reason="the GPQA statistics need statsmodels (pip install statsmodels)")

from mxmoe.harness.e2e import task  # noqa: E402
from mxmoe.harness.e2e.checkpoint import TINY_DIR  # noqa: E402
from mxmoe.harness.gpqa import data, oai_evals  # noqa: E402

try:
    GPT_OSS = oai_evals.gpt_oss_modules()
except oai_evals.Unavailable as exc:
    pytest.skip(f"missing package gpt-oss: {exc}", allow_module_level=True)

TINY_TASK = TINY_DIR / "task-test.csv"


def both(path, answer, *, repeats=1, limit=None, sampler="responses", harness_max_tokens=32768):
    """gpt-oss's eval, then the harness's task, against one loopback server answering with ``answer``:
    (gpt-oss's records, the harness's, their comparison, the server's requests, seconds of each)."""
    with oai_evals.LoopbackServer(answer) as srv:
        start = time.perf_counter()
        theirs = oai_evals.gpt_oss_samples(path, srv.url, srv.model, repeats=repeats, limit=limit, sampler=sampler,
                                           threads=4)  # fmt: skip
        mid = time.perf_counter()
        ours = oai_evals.harness_samples(path, srv.url, srv.model, repeats=repeats, limit=limit,
                                         max_tokens=harness_max_tokens, concurrency=4)  # fmt: skip
        end = time.perf_counter()
    report = oai_evals.compare(theirs, ours, GPT_OSS.abcd_grader.extract_abcd)
    print(f"\n{path.name}: {json.dumps({k: v for k, v in report.items() if k != 'differences'})}; "
          f"gpt-oss {mid - start:.1f} s, harness {end - mid:.1f} s")  # fmt: skip
    return theirs, ours, report, srv.requests


def assert_agree(report, n):
    assert report["samples"] == [n, n]
    assert report["differences"] == [], report["differences"][:5]
    assert report["agree"] == dict.fromkeys(oai_evals.CHECKS, n) and report["all_agree"]
    assert report["accuracy"][0] == report["accuracy"][1]


@pytest.fixture(scope="module")
def canned_run():
    """All 200 questions of the tiny fixture's task, 2 repeats, answered in every form of the bank."""
    return both(TINY_TASK, oai_evals.canned_answer, repeats=2)


def test_every_sample_agrees_on_the_canned_answers(canned_run):
    theirs, ours, report, requests = canned_run
    assert_agree(report, 400)
    # the bank was exercised whole, the forms gpt-oss reads as no letter among them
    forms = {oai_evals.canned_form(r) for r in requests}
    assert forms == set(range(len(oai_evals.ANSWER_FORMS)))
    lowercase = [a for a, r in zip(theirs, ours) if a["response"][:1].islower() and len(a["response"]) <= 2]
    assert lowercase and all(a["extracted"] is None and not a["correct"] for a in lowercase)
    assert any(a["correct"] for a in theirs) and not all(a["correct"] for a in theirs)
    # nothing of the comparison carries text
    blob = json.dumps(report)
    assert not any(r["Question"] in blob for r in task.read_csv(TINY_TASK))


def test_both_send_the_same_messages_with_cis_settings(canned_run):
    _, _, _, requests = canned_run
    by = {"responses": [r for r in requests if r.endpoint == "responses"],
          "chat": [r for r in requests if r.endpoint == "chat"]}  # fmt: skip
    assert len(by["responses"]) == len(by["chat"]) == 400
    key = lambda r: json.dumps(r.messages)  # noqa: E731
    assert sorted(map(key, by["responses"])) == sorted(map(key, by["chat"]))  # on the wire too
    assert all(len(r.messages) == 1 and r.messages[0]["role"] == "user" for r in requests)  # no system message
    assert all(r.effort == "low" for r in requests)
    if GPT_OSS.version == oai_evals.GPT_OSS_PIN:
        # 0.0.5 (vLLM CI's): a reasoning model's request carries no temperature and no token budget
        assert {r.keys for r in by["responses"]} == {("input", "model", "reasoning")}
    assert {(r.temperature, r.max_tokens) for r in by["chat"]} == {(1.0, 32768)}
    assert all(r.seed is not None for r in by["chat"])


def test_cells_pandas_reads_differently_agree(tmp_path):
    """Cells where pandas' reading (gpt-oss's) and a plain CSV reader part: missing-value words,
    padding, line breaks and quotes, an incorrect answer with the correct one's text, no record id."""
    rows = task.make_rows(11, 12, prefix="edge")
    rows[0].update({"Correct Answer": "None", "Incorrect Answer 1": "NA"})
    rows[1].update({"Question": 'Two lines,\r\nthen "quotes", commas', "Incorrect Answer 2": "  padded  "})
    rows[2]["Incorrect Answer 3"] = rows[2]["Correct Answer"]
    rows[3].update({"Incorrect Answer 1": "nan", "Incorrect Answer 2": "null", "Incorrect Answer 3": "1.50"})
    rows[4]["Record ID"] = ""
    path = tmp_path / "edge.csv"
    task.write_csv(rows, path)
    theirs, ours, report, _ = both(path, oai_evals.canned_answer)
    assert_agree(report, 12)
    shown = {d["question_id"]: d for d in data.documents(data.read_rows(path), 1)}
    none_row = shown[data.question_id(rows[0])]
    assert none_row["choices"].count("nan") == 2  # "None" and "NA", shown as gpt-oss shows them
    assert none_row["answer"] == data.LETTERS[none_row["choices"].index("nan")]
    dup = shown[data.question_id(rows[2])]
    assert dup["choices"].count(rows[2]["Correct Answer"]) == 2
    assert dup["answer"] == data.LETTERS[dup["choices"].index(rows[2]["Correct Answer"])]  # the first, as gpt-oss


def test_the_tiny_model_served_gives_both_the_same_samples():
    """The tiny GPT-OSS sampling (a seed drawn from the prompt): a real model's responses, not a bank."""
    answer = oai_evals.TinyAnswerer("emulation", max_tokens=16)
    theirs, _, report, requests = both(TINY_TASK, answer, limit=8)
    assert_agree(report, 8)
    assert sum(bool(r["response"]) for r in theirs) >= 4


def test_the_chat_completions_sampler_sends_the_harness_messages():
    """gpt-oss's other sampler (not the one vLLM's CI uses) sends the very messages the harness
    sends; it resamples an empty answer instead of scoring it, so the bank here has none."""

    def answer(req):
        reasoning, text = oai_evals.canned_answer(req)
        return reasoning, text or "I have no answer."

    _, _, report, requests = both(TINY_TASK, answer, limit=40, sampler="chat_completions")
    assert_agree(report, 40)
    assert {r.endpoint for r in requests} == {"chat"}
    assert all(r.effort == "low" and r.temperature == 1.0 for r in requests)


def test_gpt_oss_chat_sampler_retries_an_empty_answer_where_the_harness_scores_it_wrong():
    with oai_evals.LoopbackServer(lambda req: ("", "")) as srv:
        with pytest.raises(oai_evals.OaiEvalsError, match="would retry forever"):
            oai_evals.gpt_oss_samples(TINY_TASK, srv.url, srv.model, limit=1, sampler="chat_completions", retries=0)
        theirs = oai_evals.gpt_oss_samples(TINY_TASK, srv.url, srv.model, limit=1)  # the responses sampler: wrong
        ours = oai_evals.harness_samples(TINY_TASK, srv.url, srv.model, limit=1)
    assert theirs[0]["response"] == ours[0]["response"] == ""
    assert not theirs[0]["correct"] and not ours[0]["correct"] and ours[0]["extracted"] is None


def test_the_eval_reads_only_the_local_file(tmp_path):
    local = oai_evals._LocalPandas(GPT_OSS.gpqa_eval.pandas, oai_evals.GPQA_URL.format(variant="diamond"),
                                   tmp_path / "x.csv")  # fmt: skip
    with pytest.raises(oai_evals.OaiEvalsError, match="data source changed"):
        local.read_csv("https://openaipublic.blob.core.windows.net/simple-evals/gpqa_main.csv")
