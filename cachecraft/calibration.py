"""``cachecraft calibrate``: measure candidate alphas through the pipeline and pick one.

Each candidate runs as ``cachecraft@alpha`` next to ``full`` on the same items, through
the one request path (:mod:`cachecraft.evaluation`) with the user's config, so the
policy's check layer, early termination and loading rules are the ones ``query`` uses;
:func:`cachecraft.policy.calibrate.choose_alpha` picks from the measured rows.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.evaluation import OnAnswer, evaluate_items, scratch_pipeline
from cachecraft.methods import CacheCraft, Full
from cachecraft.policy.calibrate import AlphaRow, CalibrationResult, check_alphas, check_target, choose_alpha


def calibrate(lm, config: Config, items: Sequence[QAItem], alphas: Sequence[float], target: float = 0.95, *,
              max_new_tokens: int = 32, on_item: Callable[[int, int], None] | None = None,
              on_answer: OnAnswer | None = None) -> CalibrationResult:
    """Run ``full`` and ``cachecraft@alpha`` for every candidate on ``items`` and choose alpha
    (``on_answer`` sees every answer, with its per-chunk plan in ``answer.chunks``)."""
    alphas, target = check_alphas(alphas), check_target(target)
    candidates = [CacheCraft(a) for a in alphas]
    with scratch_pipeline(lm, config) as pipeline:
        rows = evaluate_items(pipeline, items, [Full(), *candidates], max_new_tokens=max_new_tokens,
                              on_item=on_item, on_answer=on_answer)

    def mean(label: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows if r["method"] == label)

    measured = tuple(AlphaRow(c.ratio, mean(c.label, "recompute_fraction"), mean(c.label, "agreement_f1"),
                              mean(c.label, "kl"), statistics.median(r["ttft_s"] for r in rows
                                                                     if r["method"] == c.label))
                     for c in candidates)
    chosen, reached = choose_alpha(measured, target)
    full_ttft = statistics.median(r["ttft_s"] for r in rows if r["method"] == Full().label)
    return CalibrationResult(measured, chosen, target, reached, full_ttft)
