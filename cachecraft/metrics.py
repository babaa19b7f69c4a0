"""Quality measures: first-token KL, answer-level divergence, token F1 (SQuAD-style), exact match."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable, NamedTuple

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

# A line of at least this many letter-and-digit words said a second time, anywhere, is a
# loop that has come round once ("Question: How do I clone a repository?" after an
# answer, a block of lines starting over): found at its second copy, not its third.
LONG_LINE_SUBWORDS = 6

# Lines that differ only in their numbers, this many in a row, are one line said again:
# "* [rc~1] Merge refs/heads/master from ." counting up. Only lines of at least
# REPEATED_LINE_WORDS words of letters (numbers aside) count, so a list of versions or
# dates ("- git 2.39.1 (2023-01-17)") is not a loop; Markdown table rows never do.
NUMBERED_LINE_RUN = 3

# Code repeats by design ("}", "end", "</div>" on line after line, rows of zeros, the same
# statement in several functions), so inside a fenced code block only a line this many
# times in a row, or a block of two to eight lines three times in a row, is a loop.
CODE_LINE_RUN = 6

# So many runs of letters and digits in a row with at most so few different ones are
# garbage even when no run repeats back to back: "K7: K7: K7-CS-CS-K7-CS-CS-K7-CS-K7-".
# Only letters and digits count, so a Markdown table's "| --- | --- |" is not such a run.
FEW_WORDS_WINDOW, FEW_WORDS_MOST = 10, 2

# A Markdown table row with so many equal cells in a row does not end: "|---|---|---|..."
# or "| | | |..." long past any header. A real table's separator row holds one cell per
# column, and answers' tables keep to a handful of columns.
TABLE_CELL_RUN = 16


def _said_again(line: str | None, before: str | None) -> bool:
    """Whether ``line`` repeats the non-empty line ``before`` it and is long enough to count
    (None, for what a code block puts between two lines, is never said again)."""
    return line is not None and line == before and len(line.split()) >= REPEATED_LINE_WORDS


def _long_line(line: str) -> bool:
    """Whether ``line`` counts as a loop at its second copy (:data:`LONG_LINE_SUBWORDS`)."""
    return len(_subwords(line)) >= LONG_LINE_SUBWORDS


def _numbered_run_ends_at(lines: list[str | None], end: int) -> bool:
    """Whether the :data:`NUMBERED_LINE_RUN` lines of ``lines`` ending at ``end`` are one
    line but for their numbers (None, for a code block between, breaks the run)."""
    run = lines[max(0, end - NUMBERED_LINE_RUN):end]
    if len(run) < NUMBERED_LINE_RUN or any(line is None or line.startswith("|") for line in run):
        return False
    shapes = {re.sub(r"\d+", "#", line) for line in run}
    return (len(shapes) == 1
            and sum(1 for word in _subwords(run[0]) if not word.isdigit()) >= REPEATED_LINE_WORDS)


def _line_ends_loop(lines: list[str | None], i: int, before: int) -> bool:
    """Whether ``lines[i]``, a line said ``before`` times earlier, ends a loop of lines: its
    third copy, a long line's second, a line said again right after itself, or the last of
    :data:`NUMBERED_LINE_RUN` lines that differ only in their numbers."""
    line = lines[i]
    return (before >= 2 or (before >= 1 and _long_line(line)) or _said_again(line, lines[i - 1] if i else None)
            or _numbered_run_ends_at(lines, i + 1))


def _few_words_end_at(subwords: list[str], end: int) -> bool:
    """Whether the :data:`FEW_WORDS_WINDOW` subwords ending at ``end`` hold at most
    :data:`FEW_WORDS_MOST` different ones, none a number (addresses and versions
    repeat theirs: "0.0.0.0/0 and 0.0.0.0/0")."""
    window = subwords[max(0, end - FEW_WORDS_WINDOW):end]
    return (len(window) == FEW_WORDS_WINDOW and len(set(window)) <= FEW_WORDS_MOST
            and not any(word.isdigit() for word in window))


def _same_cells_end_at(cells: list[str | None], end: int) -> bool:
    """Whether the :data:`TABLE_CELL_RUN` cells of ``cells`` ending at ``end`` are one cell
    said again within one row (None, between rows, breaks the run)."""
    run = cells[max(0, end - TABLE_CELL_RUN):end]
    return len(run) == TABLE_CELL_RUN and run[0] is not None and run.count(run[0]) == TABLE_CELL_RUN


def _table_cells(row: str, growing: bool) -> list[str]:
    """The cells of a Markdown table row, stripped; a row still being written loses its
    last cell, which may yet grow."""
    cells = row.strip().removeprefix("|").split("|")
    if growing or not cells[-1].strip():
        cells.pop()  # what follows the last bar: still growing, or nothing
    return [cell.strip() for cell in cells]


def _subwords(text: str) -> list[str]:
    """The runs of letters and digits of ``text``: ``git-git-git`` is three of them, where
    whitespace alone sees one word."""
    return re.findall(r"[^\W_]+", text)


def _line_kinds(lines: list[str], inside: bool = False) -> tuple[list[str], bool]:
    """Per line, what the checks make of it: ``"fence"`` (a Markdown code fence, checked
    for nothing), ``"code"`` (inside a fenced block), ``"table"`` (a Markdown table row,
    whose separators and empty cells repeat by design: its whitespace words are not
    checked for runs) or ``"prose"``; and whether the lines end inside a code block
    (``inside``: whether they start in one)."""
    kinds = []
    for line in lines:
        head = line.lstrip()
        if head.startswith(("```", "~~~")):
            kinds.append("fence")
            inside = not inside
        else:
            kinds.append("code" if inside else "table" if head.startswith("|") else "prose")
    return kinds, inside


class _Parts(NamedTuple):
    words: list[str]  # split at whitespace, of prose lines
    subwords: list[str]  # runs of letters and digits, of prose lines and table rows
    lines: list[str | None]  # non-empty prose lines and table rows, stripped; None for code between
    code: list[str]  # non-empty lines of code blocks, stripped
    cells: list[str | None]  # table rows' cells, stripped; None after each row

    def sizes(self) -> tuple[int, ...]:
        """How long each list is (to cut back to with :meth:`cut`)."""
        return tuple(len(part) for part in self)

    def cut(self, sizes: tuple[int, ...]) -> None:
        """Drop what was added after :meth:`sizes` gave ``sizes``."""
        for part, size in zip(self, sizes):
            del part[size:]


def _add_lines(parts: _Parts, text: str, inside: bool, done: bool) -> bool:
    """Add what the repetition checks read in ``text`` (lines that follow those ``parts``
    holds; ``inside``: whether they start in a code block) to ``parts``; returns whether
    ``text`` ends inside a code block. Unless ``done``, what may yet grow is left out: the
    last word and subword when the text ends inside them, and the last line when no line
    break ends it."""
    lines = text.splitlines(keepends=True)
    open_line = bool(lines) and not done and lines[-1].splitlines()[0] == lines[-1]
    kinds, inside = _line_kinds(lines, inside)
    for i, (line, kind) in enumerate(zip(lines, kinds)):
        growing = open_line and i == len(lines) - 1
        if kind == "prose":
            words = line.split()
            if growing and words and not line[-1].isspace():
                words.pop()
            parts.words.extend(words)
        if kind in ("prose", "table"):
            subwords = _subwords(line)
            if growing and subwords and _subwords(line[-1]):
                subwords.pop()
            parts.subwords.extend(subwords)
        if kind == "table":
            parts.cells.extend(_table_cells(line, growing))
            if not growing:
                parts.cells.append(None)
        stripped = line.strip()
        if growing or not stripped:
            continue
        if kind == "code":
            parts.code.append(stripped)
        if kind in ("prose", "table"):
            parts.lines.append(stripped)
        elif parts.lines and parts.lines[-1] is not None:
            parts.lines.append(None)
    return inside


def _parts(text: str, done: bool) -> _Parts:
    """What the repetition checks read in ``text`` (:func:`_add_lines`)."""
    parts = _Parts([], [], [], [], [])
    _add_lines(parts, text, False, done)
    return parts


def degenerate_repetition(text: str) -> bool:
    """Whether an answer has degenerated into repetition: a non-empty line three times or
    more, or one of :data:`LONG_LINE_SUBWORDS` letter-and-digit words or more twice; a
    line of :data:`REPEATED_LINE_WORDS` words or more twice in a row (blank lines between
    aside); :data:`NUMBERED_LINE_RUN` lines in a row that differ only in their numbers
    (``* [rc~1] Merge ...``, ``* [rc~2] Merge ...``); a run of words repeated back to back
    (one word four times in a row, a number six times, a phrase of two to eight words
    three times), words split at whitespace outside Markdown table rows (``+ + + +``) or
    at every character that is not a letter or digit (``git-git-git-git``); ten runs of
    letters and digits in a row of at most two different ones, none a number (``K7: K7:
    K7-CS-CS-K7-CS-CS-K7-CS``); a Markdown table row with :data:`TABLE_CELL_RUN` equal
    cells in a row (``|---|---|---|...``). Inside a fenced code block only a line
    :data:`CODE_LINE_RUN` times in a row, or a block of two to eight lines three times in
    a row, counts."""
    parts = _parts(text, done=True)
    copies: Counter[str] = Counter()
    for i, line in enumerate(parts.lines):
        if line is not None:
            if _line_ends_loop(parts.lines, i, copies[line]):
                return True
            copies[line] += 1
    if any(_few_words_end_at(parts.subwords, end) for end in range(1, len(parts.subwords) + 1)):
        return True
    if any(_run_ends_at(parts.code, end, single=CODE_LINE_RUN) for end in range(1, len(parts.code) + 1)):
        return True
    if any(_same_cells_end_at(parts.cells, end) for end in range(1, len(parts.cells) + 1)):
        return True
    return any(any(_run_ends_at(words, end) for end in range(1, len(words) + 1))
               for words in (parts.words, parts.subwords))


def _run_ends_at(words: list[str], end: int, single: int | None = None) -> bool:
    """Whether ``words[:end]`` ends in a degenerate run (as :func:`degenerate_repetition`
    counts one); ``single``: how many copies one word needs (by default four, or six for
    a number)."""
    for n in range(1, 9):
        # a number four or five times is an address or a version ("0.0.0.0/0"), not a loop
        needed = 3 if n > 1 else single or (6 if end and words[end - 1].isdigit() else 4)
        start = end - n * needed
        if start >= 0 and all(words[start + k * n:start + (k + 1) * n] == words[start:start + n]
                              for k in range(1, needed)):
            return True
    return False


class RepetitionWatch:
    """:func:`degenerate_repetition` for an answer as it grows, one call per new token:
    given texts that each extend the last, true once the words and lines completed so far
    hold a degenerate run. Each call checks only the runs ending at words and lines
    completed since the last (a word or line still being written may yet grow), so no run
    is checked twice; once the answer is done, :func:`degenerate_repetition` also counts
    its last word and line.

    The text up to its last line break is read once, as it comes; each call reads only
    the line being written, so a call costs about as much at the thousandth line as at the
    first. A text that does not extend the one read (a decoder that rewrote what it had
    given) is read again from the start."""

    def __init__(self) -> None:
        self.words_checked = self.subwords_checked = self.lines_checked = self.code_checked = 0
        self.cells_checked = 0
        self._read = ""  # the text up to its last line break, read into _parts
        self._parts = _Parts([], [], [], [], [])
        self._inside = False  # whether _read ends inside a code block
        self._copies: Counter[str] = Counter()  # each checked line's copies so far

    def __call__(self, text: str) -> bool:
        if not text.startswith(self._read):
            self.__init__()
        end = text.rfind("\n") + 1
        if end > len(self._read):  # lines completed since the last call: read once
            self._inside = _add_lines(self._parts, text[len(self._read):end], self._inside, done=True)
            self._read = text[:end]
        parts = self._parts
        sizes = parts.sizes()
        _add_lines(parts, text[end:], self._inside, done=False)  # the line being written, for this call only
        try:
            return self._check(parts)
        finally:
            parts.cut(sizes)

    def _check(self, parts: _Parts) -> bool:
        words, subwords, lines, code, cells = parts
        if any(_run_ends_at(words, end) for end in range(self.words_checked + 1, len(words) + 1)):
            return True
        self.words_checked = len(words)
        if any(_run_ends_at(subwords, end) or _few_words_end_at(subwords, end)
               for end in range(self.subwords_checked + 1, len(subwords) + 1)):
            return True
        self.subwords_checked = len(subwords)
        if any(_run_ends_at(code, end, single=CODE_LINE_RUN) for end in range(self.code_checked + 1, len(code) + 1)):
            return True
        self.code_checked = len(code)
        if any(_same_cells_end_at(cells, end) for end in range(self.cells_checked + 1, len(cells) + 1)):
            return True
        self.cells_checked = len(cells)
        for i in range(self.lines_checked, len(lines)):
            line = lines[i]
            if line is None:
                continue
            if _line_ends_loop(lines, i, self._copies[line]):
                return True
            self._copies[line] += 1
        self.lines_checked = len(lines)
        return False
