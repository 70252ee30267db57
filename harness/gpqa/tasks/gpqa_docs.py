"""The functions the task YAMLs beside this file name (lm-eval loads this file by its path)."""

from __future__ import annotations

from mxmoe.harness.gpqa import data


def dataset(**metadata: object):  # noqa: ANN201 (datasets.DatasetDict, imported lazily)
    """The task's documents from ``metadata``: ``data`` (the CSV), ``repeats`` (default 1) and
    ``limit`` (default all questions), with OpenAI's permutations (``data.documents``)."""
    import datasets

    if not metadata.get("data"):
        raise data.DataError("the GPQA tasks read a local CSV: pass --metadata '{\"data\": \"PATH\"}'")
    limit = metadata.get("limit")
    docs = data.documents(data.read_rows(str(metadata["data"])), int(metadata.get("repeats") or 1),
                          int(limit) if limit else None)  # fmt: skip
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def mc_text(doc: dict) -> str:
    return data.mc_prompt(doc["question"], doc["choices"])


def mc_choices(doc: dict) -> list[str]:
    return [c.strip() for c in doc["choices"]]


def cot_text(doc: dict) -> str:
    return data.cot_prompt(doc["question"], doc["choices"])


def extract_letters(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Each response's declared letter (``[no answer]`` where it declares none)."""
    return [[data.extract_answer(data.final_text(r)) or data.NO_ANSWER for r in rs] for rs in resps]
