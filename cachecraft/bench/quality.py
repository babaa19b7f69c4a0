"""``cachecraft bench quality``: every method on the same MuSiQue-format requests.

Prompt = system prefix + the item's passages as chunks + question. Every method
answers through the pipeline's one request path (:mod:`cachecraft.evaluation`): the
chunk-caches are made as ``warm`` makes them (after the system prefix, then the
configured warm context; ``--warm-context none`` for the papers' setting) into a
scratch CPU tier, and each method's time to first token includes loading them.
Quality is measured against ``full`` on the same request (first-token KL, answer
agreement, exact match) and against the gold answers (token F1).
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

from cachecraft.bench.common import PeakRSS
from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.evaluation import OnAnswer, evaluate_items, scratch_pipeline
from cachecraft.methods import Full, Method


def aggregate(rows: list[dict], label: str) -> dict:
    """The per-method summary written under ``methods``."""
    mine = [r for r in rows if r["method"] == label]
    if not mine:
        return {}
    mean = lambda key: statistics.fmean(r[key] for r in mine)  # noqa: E731
    return {
        "n": len(mine),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in mine),
        "ttft_s_mean": mean("ttft_s"),
        "speedup_vs_full_median": statistics.median(r["speedup_vs_full"] for r in mine),
        "recompute_fraction_mean": mean("recompute_fraction"),
        "kl_mean": mean("kl"),
        "agreement_f1_mean": mean("agreement_f1"),
        "exact_match_rate": mean("exact_match"),
        "gold_f1_mean": mean("gold_f1"),
        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in mine),
        "rss_growth_mb_max": max(r["rss_growth_mb"] for r in mine),
        "kv_mb_mean": mean("kv_mb"),
    }


def run_quality(lm, config: Config, items: Sequence[QAItem], methods: Sequence[Method], *,
                max_new_tokens: int = 32, on_item: Callable[[int, int], None] | None = None,
                on_answer: OnAnswer | None = None) -> dict:
    """Run every method on every item through a scratch pipeline built from ``config``
    (its system prompt, question template, warm context, KV dtype, policy settings);
    returns ``{"items": [...], "methods": {...}}``. ``on_answer`` sees every answer and
    its prefill trace (logits), as :func:`~cachecraft.evaluation.evaluate_items` says."""
    with scratch_pipeline(lm, config) as pipeline:
        rows = evaluate_items(pipeline, items, methods, max_new_tokens=max_new_tokens, on_item=on_item,
                              meter=PeakRSS, on_answer=on_answer)
    order = [Full()] + [m for m in methods if not isinstance(m, Full)]
    return {"items": rows, "methods": {m.label: aggregate(rows, m.label) for m in order}}
