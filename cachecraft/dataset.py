"""Read question/passage files in CacheBlend's MuSiQue format.

A JSON list of ``{"ctxs": [{"title": str, "text": str}, ...], "question": str,
"answers": [str, ...]}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class DatasetError(ValueError):
    """The dataset file is missing or not in the expected format."""


@dataclass(frozen=True)
class QAItem:
    """One question with its passages and gold answers."""

    question: str
    passages: tuple[tuple[str, str], ...]  # (title, text)
    answers: tuple[str, ...]
    index: int = 0  # position in its file, so held-out runs name the items they used


def load_items(path: str | Path, limit: int | None = None, skip: int = 0) -> list[QAItem]:
    """Load and validate a MuSiQue-format file; ``skip`` drops the first items (held-out
    runs), then ``limit`` keeps the next N."""
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"the dataset {path} is a directory; give a MuSiQue-format JSON file")
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{path} is not a JSON file: {exc}") from None
    if not isinstance(data, list) or not data:
        raise DatasetError(f"{path}: expected a non-empty JSON list of items")
    if skip < 0 or skip >= len(data):
        raise DatasetError(f"{path}: cannot skip {skip} of its {len(data)} items")
    items = []
    for i, raw in enumerate(data[skip:skip + limit] if limit else data[skip:], start=skip):
        where = f"{path}: item {i}"
        if not isinstance(raw, dict):
            raise DatasetError(f"{where} is not an object")
        question, ctxs, answers = raw.get("question"), raw.get("ctxs"), raw.get("answers", [])
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{where}: 'question' must be a non-empty string")
        if not isinstance(ctxs, list) or not ctxs:
            raise DatasetError(f"{where}: 'ctxs' must be a non-empty list of {{title, text}}")
        passages = []
        for j, ctx in enumerate(ctxs):
            if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str) or not ctx["text"].strip():
                raise DatasetError(f"{where}: ctxs[{j}] needs a non-empty 'text' string")
            passages.append((str(ctx.get("title") or ""), ctx["text"]))
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise DatasetError(f"{where}: 'answers' must be a list of strings")
        items.append(QAItem(question.strip(), tuple(passages), tuple(answers), i))
    return items
