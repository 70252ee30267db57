"""GPQA documents: OpenAI's permutations, the prompts, gpt-oss's answer extraction, and the data
file's errors. No GPQA content: the rows here are generated."""

import json
import random

import pytest

from mxmoe.harness.e2e import task
from mxmoe.harness.gpqa import data


def rows(n=12):
    return task.make_rows(7, n, prefix="gpqa-test")


def test_permutations_are_openais_draws():
    # gpt_oss/evals/gpqa_eval.py: Random(0); examples * n_repeats; one rng.sample(range(4), 4) each
    rs = rows(5)
    samples = data.openai_samples(rs, repeats=3)
    rng = random.Random(0)
    expected = [rng.sample(range(4), 4) for _ in range(15)]
    assert [perm for _, _, perm in samples] == expected
    assert [(row["Record ID"], r) for row, r, _ in samples] == [(row["Record ID"], r) for r in range(3) for row in rs]


def test_limit_samples_questions_first_as_openai_does():
    rs = rows(10)
    rng = random.Random(0)
    chosen = rng.sample(rs, 4)
    perms = [rng.sample(range(4), 4) for _ in range(4)]
    got = data.openai_samples(rs, repeats=1, limit=4)
    assert [row["Record ID"] for row, _, _ in got] == [row["Record ID"] for row in chosen]
    assert [p for _, _, p in got] == perms
    with pytest.raises(ValueError, match="limit must be in 1..10"):
        data.openai_samples(rs, 1, limit=11)
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        data.openai_samples(rs, 0)


def test_documents_put_the_correct_answer_where_the_permutation_says():
    for doc, row in zip(data.documents(rows(8), repeats=1), [r for r, _, _ in data.openai_samples(rows(8), 1)]):
        assert doc["choices"][doc["answer_index"]] == row["Correct Answer"]
        assert doc["answer"] == "ABCD"[doc["answer_index"]]
        assert sorted(doc["choices"]) == sorted(row[c] for c in data.ANSWER_COLUMNS)
        assert doc["question_id"] == data.question_id(row)


def test_question_id_hides_the_text():
    row = rows(1)[0]
    qid = data.question_id(row)
    assert len(qid) == 16 and row["Question"] not in qid
    assert data.question_id({**row, "Question": row["Question"] + "?"}) != qid


def test_prompts():
    shown = ["iron", "red", "owl", "saw"]
    assert data.mc_prompt("Which of these is a metal?", shown) == (
        "What is the correct answer to this question:Which of these is a metal?\nChoices:\n(A) iron\n(B) red\n"
        "(C) owl\n(D) saw\nAnswer:"
    )
    # the fixture was trained on this very prompt
    row = rows(1)[0]
    prompt, shown2, _ = task.format_prompt(row)
    assert prompt == data.mc_prompt(row["Question"], shown2)
    assert data.cot_prompt("Q?", shown) == (
        "Q?\n\n(A) iron\n(B) red\n(C) owl\n(D) saw\n\n"
        "Express your final answer as the corresponding option 'A', 'B', 'C', or 'D'."
    )


@pytest.mark.parametrize(
    "text,letter",
    [
        ("Reasoning...\nAnswer: C", "C"),
        ("**Answer:** B", "B"),
        ("answer - d", "D"),
        ("The answer is (A).", "A"),
        ("Final Answer: (B)", "B"),
        ("so \\boxed{C}", "C"),
        ("Option D is right", "D"),
        ("I pick **B**", "B"),
        ("B", "B"),
        ("b)", None),  # gpt-oss reads the first character, "b", which grades wrong
        ("Answer: A, though (B) is close", "A"),  # the Answer: pattern outranks a bare (B)
        ("no idea", None),
        ("", None),
        ("because ...", None),
    ],
)
def test_extract_answer_reads_as_gpt_oss_grader(text, letter):
    assert data.extract_answer(text) == letter


def test_final_text_takes_the_final_channel():
    raw = ("<|channel|>analysis<|message|>Answer: A is wrong<|end|><|start|>assistant<|channel|>final<|message|>"
           "Answer: C<|return|>")  # fmt: skip
    assert data.final_text(raw) == "Answer: C"
    assert data.extract_answer(data.final_text(raw)) == "C"
    assert data.final_text("plain Answer: B") == "plain Answer: B"


def test_read_rows_errors_name_the_file(tmp_path):
    with pytest.raises(data.DataError, match="no such file .*gpqa_diamond.csv"):
        data.read_rows(tmp_path / "gpqa_diamond.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("Question,Correct Answer\nq,a\n")
    with pytest.raises(data.DataError, match="lacks GPQA column"):
        data.read_rows(bad)
    empty = tmp_path / "empty.csv"
    task.write_csv([], empty)
    with pytest.raises(data.DataError, match="holds no question"):
        data.read_rows(empty)


def test_task_yamls_name_every_variant_and_form():
    from mxmoe.harness.gpqa.run import TASKS, TASKS_DIR

    names = {p.stem for p in TASKS_DIR.glob("mxmoe_gpqa_*.yaml")}
    assert names == {f"mxmoe_{t}" for t in TASKS}
    assert json.dumps(sorted(TASKS)) == json.dumps(sorted(f"gpqa_{v}_{f}" for v in ("main", "diamond", "extended")
                                                          for f in ("mc", "cot")))  # fmt: skip


def test_a_baseline_is_a_samples_file_or_a_folder_with_exactly_one(tmp_path):
    from mxmoe.harness.gpqa.run import read_baseline

    rec = {"question_id": "q0", "repeat": 0, "permutation": [0, 1, 2, 3], "answer": "A", "extracted": "A",
           "correct": True}  # fmt: skip
    one = tmp_path / "gpqa-gpqa_diamond_cot-server-triton-samples.jsonl"
    one.write_text(json.dumps(rec) + "\n")
    assert read_baseline(tmp_path, "gpqa_diamond_cot") == ("server-triton", [rec])
    assert read_baseline(one, "gpqa_diamond_cot") == ("server-triton", [rec])
    with pytest.raises(FileNotFoundError, match="exactly one gpqa-gpqa_diamond_mc-"):
        read_baseline(tmp_path, "gpqa_diamond_mc")
    (tmp_path / "gpqa-gpqa_diamond_cot-oracle-samples.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(FileNotFoundError, match="found gpqa-gpqa_diamond_cot-oracle-samples.jsonl, gpqa-"):
        read_baseline(tmp_path, "gpqa_diamond_cot")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        read_baseline(tmp_path / "missing.jsonl", "gpqa_diamond_cot")
