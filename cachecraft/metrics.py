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


def degenerate_repetition(text: str) -> bool:
    """Whether an answer has degenerated into repetition: a non-empty line three times or
    more, or a run of words repeated back to back (one word four times in a row, a phrase
    of two to eight words three times)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any(lines.count(line) >= 3 for line in set(lines)):
        return True
    words = text.split()
    for n in range(1, 9):
        needed = 4 if n == 1 else 3
        for start in range(0, len(words) - n * needed + 1):
            unit = words[start:start + n]
            if all(words[start + k * n:start + (k + 1) * n] == unit for k in range(1, needed)):
                return True
    return False
