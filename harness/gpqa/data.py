"""GPQA documents from a local CSV: OpenAI's choice permutations, both prompt forms, answer
extraction, and the identity of a sample that results carry instead of its text.

The order of the choices is drawn exactly as OpenAI's GPQA eval (``gpt_oss/evals/gpqa_eval.py``,
from simple-evals) draws it: one ``random.Random(0)`` per run; with ``limit`` it first samples that
many questions; then the question list is repeated ``repeats`` times and every (question, repeat)
draws ``rng.sample(range(4), 4)`` in that order, a permutation of [correct, incorrect 1..3]. The
same CSV therefore gives, sample for sample, the prompts gpt-oss's own eval and vLLM's CI send, and
every backend of a run, and every run, sees the same prompts. The CSV is read as that eval reads it
(``pandas.read_csv`` with its defaults: a cell pandas takes for missing, such as ``None`` or ``NA``,
is shown as ``nan``), and the correct letter is the first choice whose text is the correct answer's,
as there; ``oai_evals`` runs that eval beside this task and checks, sample by sample, that both agree.

Nothing here writes question text anywhere: a sample is known in results by ``question_id`` (a
hash of the record id and the question), its repeat and its permutation.
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

# GPQA's letters and its log-likelihood prompt live with the synthetic task, which is written in the
# same format (gpqa sits above e2e); this module is where the GPQA tasks read them.
from mxmoe.harness.e2e.task import LETTERS, mc_prompt  # noqa: F401 (mc_prompt: for tasks/gpqa_docs.py)

ANSWER_COLUMNS = ("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
COLUMNS = ("Question", *ANSWER_COLUMNS)


class DataError(ValueError):
    """A data file that cannot serve as GPQA: missing, unreadable, or without GPQA's columns."""


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a GPQA-format CSV (the official ``gpqa_{main,diamond,extended}.csv`` or one the
    project generates), every cell as the text gpt-oss's eval puts in its prompt. A missing file or
    column is a ``DataError`` naming it.

    The file is read with ``pandas.read_csv`` and its defaults, the very call of
    ``gpt_oss/evals/gpqa_eval.py``, because that reader is not neutral: a cell pandas takes for
    missing (``None``, ``NA``, ``null``, an empty cell, ...) becomes NaN, which that eval's template
    shows as ``nan``, and a column of numbers becomes numbers (``1.50`` is shown as ``1.5``). A
    reader of its own (``csv``) would show the model other text than vLLM's CI shows it."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--data: no such file {p} (a GPQA CSV: gpqa_diamond.csv, gpqa_main.csv or gpqa_extended.csv)")
    try:
        import pandas
    except ImportError as exc:  # a dependency of lm-eval's datasets and of statsmodels, so of every GPQA run
        raise DataError(f"--data: reading a GPQA CSV as gpt-oss's eval reads it needs pandas: {exc}") from None
    try:
        frame = pandas.read_csv(p)
    except (ValueError, OSError) as exc:  # pandas' EmptyDataError and ParserError are ValueErrors
        raise DataError(f"--data: {p} is not a readable CSV: {exc}") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise DataError(f"--data: {p} lacks GPQA column(s) {missing}; a GPQA CSV has {', '.join(COLUMNS)}")
    if frame.empty:
        raise DataError(f"--data: {p} holds no question")
    rows = [{str(k): v if isinstance(v, str) else str(v) for k, v in rec.items()} for rec in frame.to_dict("records")]
    ids = frame["Record ID"] if "Record ID" in frame.columns else [None] * len(rows)
    for i, (row, rid) in enumerate(zip(rows, ids)):
        if rid is None or pandas.isna(rid) or not str(rid):
            row["Record ID"] = f"row-{i:05d}"
    return rows


def question_id(row: dict) -> str:
    """What identifies a question in results without its text: 16 hex digits of the SHA-256 of
    its record id and question."""
    return hashlib.sha256(f"{row['Record ID']}\n{row['Question']}".encode()).hexdigest()[:16]


def openai_samples(rows: list[dict], repeats: int, limit: int | None = None) -> list[tuple[dict, int, list[int]]]:
    """(row, repeat, permutation) for every sample, in OpenAI's order and with OpenAI's draws."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rng = random.Random(0)
    if limit is not None:
        if not 0 < limit <= len(rows):
            raise ValueError(f"limit must be in 1..{len(rows)} (the questions in the file), got {limit}")
        rows = rng.sample(rows, limit)
    return [(row, r, rng.sample(range(4), 4)) for r in range(repeats) for row in rows]


def documents(rows: list[dict], repeats: int, limit: int | None = None) -> list[dict]:
    """One lm-eval document per sample: the question, the choices in the order shown, the correct
    letter and its index, and the sample's identity (question id, repeat, permutation)."""
    docs = []
    for row, repeat, perm in openai_samples(rows, repeats, limit):
        shown = [row[ANSWER_COLUMNS[i]] for i in perm]
        # gpt-oss's rule: the first choice whose text is the correct answer's (``perm.index(0)`` but
        # where an incorrect answer has the same text, which that eval then takes as the correct one)
        correct = shown.index(row["Correct Answer"])
        docs.append(
            {
                "question_id": question_id(row),
                "repeat": repeat,
                "permutation": perm,
                "question": row["Question"],
                "choices": shown,
                "answer": LETTERS[correct],
                "answer_index": correct,
            }
        )
    return docs


def cot_prompt(question: str, shown: list[str]) -> str:
    """The chain-of-thought form's user message: gpt-oss's GPQA template (the question, the four
    options, then the instruction to answer with a letter), the texts as they are in the CSV."""
    options = "\n".join(f"({LETTERS[i]}) {a}" for i, a in enumerate(shown))
    return f"{question}\n\n{options}\n\nExpress your final answer as the corresponding option 'A', 'B', 'C', or 'D'."


# The answer patterns of gpt-oss's grader (gpt_oss/evals/abcd_grader.py), most trusted first;
# among the patterns that match, the first in this list wins, and within it the shortest match.
_WRAP = r"(?:\*{1,2}|_{1,2})"
_ANSWER_PATTERNS = [
    re.compile(rf"{_WRAP}Answers?\s*[:\-–]?{_WRAP}\s*([ABCD])\b", re.I),
    re.compile(rf"^\s*{_WRAP}?Answer:?{_WRAP}?\s*:?\s*{_WRAP}?([ABCD]){_WRAP}?\s*", re.I | re.M),
    re.compile(r"\bAnswers?\b\s*[:\-–]?\s*\(\s*([ABCD])\s*\)", re.I),
    re.compile(r"\bAnswers?\b\s*[:\-–]?\s*([ABCD])\b", re.I),
    re.compile(r"\b(?:Option|Choice)\b\s*[:\-–]?\s*([ABCD])\b", re.I),
    re.compile(r"\\boxed\{[^}]*?([ABCD])[^}]*\}", re.M),
    re.compile(r"\\boxed\{[^}]*?\\textbf\{[^}]*?([ABCD])[^}]*\}[^}]*\}", re.M),
    re.compile(r"\\boxed\{[^}]*?\\text\{[^}]*?([ABCD])[^}]*\}[^}]*\}", re.M),
    re.compile(r"(?<![A-Za-z0-9])[\(\[]\s*([ABCD])\s*[\)\]](?![A-Za-z0-9])"),
    re.compile(rf"(?<![A-Za-z0-9]){_WRAP}([ABCD]){_WRAP}(?![A-Za-z0-9])"),
    re.compile(r"\\textbf\{[^}]*?([ABCD])[^}]*\}"),
    re.compile(rf"(?<![A-Za-z0-9]){_WRAP}\s*([ABCD])\)[^*_\n]+?{_WRAP}(?![A-Za-z0-9])"),
    re.compile(rf"^\s*{_WRAP}?([ABCD]){_WRAP}?\s*[\.\)\-–:]?\s*.*$", re.M),
]


def extract_answer(text: str) -> str | None:
    """The letter a response declares as its answer, read as gpt-oss's GPQA grader
    (``extract_abcd``) reads it; None when it declares none (scored wrong, as there).

    Where no pattern matches, ``extract_abcd`` returns the response's first character (after a
    leading ``**``): that is a letter only where the last pattern would have matched already, so a
    response such as ``b)`` (a lowercase letter, no pattern's) declares nothing there, and here."""
    found = []
    for priority, pattern in enumerate(_ANSWER_PATTERNS):
        m = pattern.search(text)
        if m and m.group(1).upper() in LETTERS:
            found.append((priority, len(m.group(0)), m.group(1).upper()))
    if found:
        return min(found)[2]
    first = text.removeprefix("**")[:1]
    return first if first and first in LETTERS else None


_FINAL = "<|channel|>final<|message|>"
_ENDS = ("<|return|>", "<|end|>", "<|call|>", "<|endoftext|>")


def final_text(generated: str) -> str:
    """The part of a generation the answer is read from. A server with a reasoning parser (vLLM's
    for gpt-oss) already returns only the final channel; a raw harmony generation (in-process)
    holds the analysis channel first, then ``<|channel|>final<|message|>`` and the answer. Text
    with no final channel is returned as it is (a model without harmony's channels)."""
    if _FINAL in generated:
        generated = generated.rsplit(_FINAL, 1)[1]
    for end in _ENDS:
        generated = generated.split(end, 1)[0]
    return generated


NO_ANSWER = "[no answer]"
"""What a response that declares no letter is recorded as (never equal to a letter)."""
