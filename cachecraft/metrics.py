"""Quality measures: first-token KL, answer-level divergence, token F1 (SQuAD-style), exact match."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable

import torch


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) between the next-token distributions of two logit vectors."""
    p = reference_logits.float().log_softmax(-1)
    q = logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))


def answer_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Along one answer (``[n, vocab]`` logits per position, both over the same forced
    tokens): the mean per-position KL(reference || other), and token agreement, the share
    of positions where the two most likely tokens are the same."""
    assert reference_logits.shape == logits.shape, f"{tuple(reference_logits.shape)} vs {tuple(logits.shape)}"
    p = reference_logits.float().log_softmax(-1)
    q = logits.float().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0.0)  # [n]
    agree = (reference_logits.argmax(-1) == logits.argmax(-1)).float()
    return float(kl.mean()), float(agree.mean())


def normalize_answer(text: str) -> str:
    """Lower-case, strip punctuation, articles and extra whitespace (SQuAD)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def first_line(text: str) -> str:
    """The answer's first non-empty line (CacheBlend scores only that)."""
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def token_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 of two answers after :func:`normalize_answer`."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred and not ref:
        return 1.0
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: Iterable[str]) -> float:
    """Max token F1 over gold answers, on the prediction's first line."""
    line = first_line(prediction)
    return max((token_f1(line, ref) for ref in references), default=0.0)


def exact_match(prediction: str, reference: str) -> bool:
    """Whether two answers are equal after normalisation (first lines)."""
    return normalize_answer(first_line(prediction)) == normalize_answer(first_line(reference))


# A line of at least this many words said again right after itself (blank lines between
# aside) is a loop's start: cut short by the answer length, such a loop never reaches a
# third copy. Shorter lines may repeat in a list ("Yes", "- [ ]").
REPEATED_LINE_WORDS = 4


def _said_again(line: str, before: str | None) -> bool:
    """Whether ``line`` repeats the non-empty line ``before`` it and is long enough to count."""
    return line == before and len(line.split()) >= REPEATED_LINE_WORDS


# So many runs of letters and digits in a row with at most so few different ones are
# garbage even when no run repeats back to back: "K7: K7: K7-CS-CS-K7-CS-CS-K7-CS-K7-".
# Only letters and digits count, so a Markdown table's "| --- | --- |" is not such a run.
FEW_WORDS_WINDOW, FEW_WORDS_MOST = 10, 2


def _few_words_end_at(subwords: list[str], end: int) -> bool:
    """Whether the :data:`FEW_WORDS_WINDOW` subwords ending at ``end`` hold at most
    :data:`FEW_WORDS_MOST` different ones, none a number (addresses and versions
    repeat theirs: "0.0.0.0/0 and 0.0.0.0/0")."""
    window = subwords[max(0, end - FEW_WORDS_WINDOW):end]
    return (len(window) == FEW_WORDS_WINDOW and len(set(window)) <= FEW_WORDS_MOST
            and not any(word.isdigit() for word in window))


def _table_row(line: str) -> bool:
    """Whether ``line`` is a Markdown table row: its cells ("| --- | --- | --- |", or
    empty ones) repeat by design, so its words are not checked for runs."""
    return line.lstrip().startswith("|")


def _prose_words(text: str) -> list[str]:
    """The words of ``text`` split at whitespace, outside Markdown table rows."""
    return [word for line in text.splitlines() if not _table_row(line) for word in line.split()]


def _subwords(text: str) -> list[str]:
    """The runs of letters and digits of ``text``: ``git-git-git`` is three of them, where
    whitespace alone sees one word."""
    return re.findall(r"[^\W_]+", text)


def degenerate_repetition(text: str) -> bool:
    """Whether an answer has degenerated into repetition: a non-empty line three times or
    more; a line of :data:`REPEATED_LINE_WORDS` words or more twice in a row (blank lines
    between aside); a run of words repeated back to back (one word four times in a row, a
    number six times, a phrase of two to eight words three times), words split at
    whitespace outside Markdown table rows (``+ + + +``) or at every character that is not
    a letter or digit (``git-git-git-git``); or ten runs of letters and digits in a row of
    at most two different ones, none a number (``K7: K7: K7-CS-CS-K7-CS-CS-K7-CS``)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any(lines.count(line) >= 3 for line in set(lines)):
        return True
    if any(_said_again(line, before) for before, line in zip(lines, lines[1:])):
        return True
    subwords = _subwords(text)
    if any(_few_words_end_at(subwords, end) for end in range(1, len(subwords) + 1)):
        return True
    return any(any(_run_ends_at(words, end) for end in range(1, len(words) + 1))
               for words in (_prose_words(text), subwords))


def _run_ends_at(words: list[str], end: int) -> bool:
    """Whether ``words[:end]`` ends in a degenerate run (as :func:`degenerate_repetition` counts one)."""
    for n in range(1, 9):
        # a number four or five times is an address or a version ("0.0.0.0/0"), not a loop
        needed = 3 if n > 1 else 6 if end and words[end - 1].isdigit() else 4
        start = end - n * needed
        if start >= 0 and all(words[start + k * n:start + (k + 1) * n] == words[start:start + n]
                              for k in range(1, needed)):
            return True
    return False


class RepetitionWatch:
    """:func:`degenerate_repetition` for an answer as it grows, one call per new token:
    given texts that each extend the last, true once the words and lines completed so far
    hold a degenerate run. Each call checks only the runs ending at words and lines
    completed since the last (a word or line still being written may yet grow), so a long
    answer costs no more per token than a short one; once the answer is done,
    :func:`degenerate_repetition` also counts its last word and line."""

    def __init__(self) -> None:
        self.words_checked = self.subwords_checked = self.lines_checked = 0
        self.last_line: str | None = None  # the last non-empty line checked

    def __call__(self, text: str) -> bool:
        words = _prose_words(text)
        if text and not text[-1].isspace() and not _table_row(text.splitlines()[-1]):
            words.pop()  # the last one may yet grow
        if any(_run_ends_at(words, end) for end in range(self.words_checked + 1, len(words) + 1)):
            return True
        self.words_checked = len(words)
        subwords = _subwords(text)
        if subwords and _subwords(text[-1]):  # the last one may yet grow
            subwords.pop()
        if any(_run_ends_at(subwords, end) or _few_words_end_at(subwords, end)
               for end in range(self.subwords_checked + 1, len(subwords) + 1)):
            return True
        self.subwords_checked = len(subwords)
        parts = text.splitlines(keepends=True)
        if parts and parts[-1].splitlines()[0] == parts[-1]:  # no line break after it yet
            parts.pop()
        lines = [part.strip() for part in parts]
        for i in range(self.lines_checked, len(lines)):
            if not lines[i]:
                continue
            if lines[:i + 1].count(lines[i]) >= 3 or _said_again(lines[i], self.last_line):
                return True
            self.last_line = lines[i]
        self.lines_checked = len(lines)
        return False
