"""``cachecraft bench quality``: every method on the same MuSiQue-format requests.

Prompt = system prefix + the item's passages as chunks + question. Every method
answers through the pipeline's one request path (:mod:`cachecraft.evaluation`): the
chunk-caches are made as ``warm`` makes them (after the system prefix, then the
configured warm context; ``--warm-context none`` for the papers' setting) into a
scratch CPU tier, and each method's time to first token includes loading them.

Quality against ``full`` on the same request: first-token KL, the answer-level
divergence along full's greedy answer (mean per-token KL and token agreement, with
full's answer teacher-forced through the method's prefilled cache), answer agreement
(token F1) and exact match; against the gold answers, CacheBlend's token F1. Every mean
carries a 95% bootstrap interval, and each method is compared, item by item, with
``full`` and with ``cacheblend@0.15``: "better" or "worse" only where the paired
interval excludes zero.

Each item's rows are appended to a JSON-lines file as soon as the item is done, so a
long run can be resumed (``resume=True``) without redoing finished items.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from cachecraft.bench.common import PeakRSS
from cachecraft.intervals import bootstrap, paired, verdict
from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.evaluation import (CHAT_SUFFIX, InContext, OnAnswer, evaluate_items, method_order, row_labels,
                                   scratch_pipeline)
from cachecraft.methods import Method

# Quality figures per row, and whether lower is better.
QUALITY_METRICS = {"kl": True, "answer_kl": True, "token_agreement": False, "agreement_f1": False,
                   "exact_match": False, "gold_f1": False}
BASELINES = ("full", "cacheblend@0.15")


class RowsFileError(ValueError):
    """A rows file that cannot be resumed (other settings, not a rows file); the message says which."""


def aggregate(rows: list[dict], label: str) -> dict:
    """The per-method summary written under ``methods``: means (with ``intervals``)."""
    mine = [r for r in rows if r["method"] == label]
    if not mine:
        return {}
    mean = lambda key: statistics.fmean(r[key] for r in mine)  # noqa: E731
    summary = {
        "n": len(mine),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in mine),
        "ttft_s_mean": mean("ttft_s"),
        "speedup_vs_full_median": statistics.median(r["speedup_vs_full"] for r in mine),
        "recompute_fraction_mean": mean("recompute_fraction"),
        "kl_mean": mean("kl"),
        "answer_kl_mean": mean("answer_kl"),
        "token_agreement_mean": mean("token_agreement"),
        "agreement_f1_mean": mean("agreement_f1"),
        "exact_match_rate": mean("exact_match"),
        "gold_f1_mean": mean("gold_f1"),
        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in mine),
        "rss_growth_mb_max": max(r["rss_growth_mb"] for r in mine),
        "kv_mb_mean": mean("kv_mb"),
    }
    if all("repetition" in r for r in rows):  # rows of runs before repetition was detected lack it
        reference = "full" + (CHAT_SUFFIX if label.endswith(CHAT_SUFFIX) else "")  # the same turn's full
        full = {r["item"]: r["repetition"] for r in rows if r["method"] == reference}
        summary["repetitions"] = int(sum(r["repetition"] for r in mine))
        summary["repetitions_where_full_does_not"] = int(sum(
            1 for r in mine if r["repetition"] and not full.get(r["item"], 0.0)))
    if all("escalated" in r for r in mine):  # answered again from a full prefill after a loop
        summary["escalations"] = int(sum(r["escalated"] for r in mine))
        summary["loops_before_escalation"] = int(sum(r["first_try_repetition"] for r in mine))
    summary["intervals"] = {key: bootstrap([r[key] for r in mine]).to_dict()
                            for key in (*QUALITY_METRICS, "recompute_fraction", "speedup_vs_full")}
    return summary


def plain_label(label: str) -> str | None:
    """The run a variant of a method is paired with: ``method`` for ``method+nbN`` (in-context
    variants), for ``method+chat`` (the same method on the item's own question) and for
    ``cachecraft@a/E...`` (its own early-stop layers); None for others."""
    if label.endswith(CHAT_SUFFIX):
        return label.removesuffix(CHAT_SUFFIX)
    own = InContext.base_label(label)
    if own is None and "/E" in label:
        own = label.split("/E", 1)[0]
    return own


def compare_methods(rows: list[dict], labels: Sequence[str]) -> dict:
    """Per method, per baseline present (:data:`BASELINES`, and the plain run of
    :func:`plain_label`), per quality figure: the mean
    paired difference (method - baseline) over the items both answered, its interval and
    the verdict."""
    by = rows_by_method(rows)
    out: dict[str, dict] = {}
    for label in labels:
        own = plain_label(label)  # an in-context or early-stop run is also paired with its plain run
        _, sep, tail = label.rpartition(InContext.SUFFIX)
        if label.endswith(CHAT_SUFFIX):  # a follow-up: against the baselines' follow-ups and its own first turn
            bases: tuple[str, ...] = (*(f"{b}{CHAT_SUFFIX}" for b in BASELINES), *([own] if own != "full" else []))
        elif own == "full":  # full over the variants' order: its figures are against the given order's
            bases = ("full",)
        else:  # an in-context run also against the baselines run with the same variants (the same
            # prompt where the chunks' order follows them); full's is its reference
            alike = [f"{b}{InContext.SUFFIX}{tail}" for b in BASELINES if b != "full"] if sep and tail.isdigit() else []
            bases = (*BASELINES, *([own] if own and own not in BASELINES else []), *alike)
        for base in bases:
            if base not in by or base == label or label not in by:
                continue
            out.setdefault(label, {})[f"vs {base}"] = paired_figures(by, label, base)
    return out


def rows_by_method(rows: Sequence[dict]) -> dict[str, dict[int, dict]]:
    """The rows of a run as ``{method: {item: row}}``."""
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[r["item"]] = r
    return by


def paired_figures(by: dict[str, dict[int, dict]], label: str, base: str) -> dict:
    """Per quality figure, the mean paired difference (``label`` - ``base``) over the items
    both answered (``by``: :func:`rows_by_method`), its interval and the verdict."""
    items = [i for i in by[label] if i in by[base]]
    figures = {}
    for key, lower_is_better in QUALITY_METRICS.items():
        diff = paired([by[label][i][key] for i in items], [by[base][i][key] for i in items])
        figures[key] = {**diff.to_dict(), "verdict": verdict(diff, lower_is_better)}
    return figures


def run_quality(lm, config: Config, items: Sequence[QAItem], methods: Sequence[Method], *,
                max_new_tokens: int = 32, on_item: Callable[[int, int], None] | None = None,
                on_answer: OnAnswer | None = None, rows_path: str | Path | None = None, resume: bool = False,
                settings: dict[str, Any] | None = None, follow_up: str | None = None) -> dict:
    """Run every method on every item through a scratch pipeline built from ``config``
    (its system prompt, question template, warm context, KV dtype, policy settings);
    returns ``{"items": [...], "methods": {...}, "comparisons": {...}}``.

    ``rows_path``: each item's rows are appended there as the item finishes, after a
    first line holding ``settings``; with ``resume`` the items already there are not run
    again (the file must hold the same settings but for the items: a run can be extended to
    more items, or reported on fewer, and the file keeps every finished item's rows).
    ``on_answer`` sees every answer and its prefill trace, as
    :func:`~cachecraft.evaluation.evaluate_items` says. ``follow_up``: every plain method
    also answers this question as a chat's second turn (rows ``method+chat``)."""
    order = method_order(methods)
    labels = row_labels(order, config.chunk_order, follow_up=bool(follow_up))
    settings = {**(settings or {}), "methods": labels, "items": [item.index for item in items],
                "max_new_tokens": max_new_tokens, **({"follow_up": follow_up} if follow_up else {})}
    done: list[dict] = []
    if rows_path is not None:
        rows_path = Path(rows_path)
        done = read_rows(rows_path, settings, labels) if resume and rows_path.exists() else []
        write_rows(rows_path, settings, done)
    wanted = {item.index for item in items}
    done = [r for r in done if r["item"] in wanted]
    finished = {r["item"] for r in done}
    todo = [item for item in items if item.index not in finished]
    with scratch_pipeline(lm, config) as pipeline:
        rows = evaluate_items(pipeline, todo, order, max_new_tokens=max_new_tokens, meter=PeakRSS,
                              on_answer=on_answer, follow_up=follow_up,
                              on_rows=(lambda item, new: append_rows(rows_path, new)) if rows_path else None,
                              on_item=(lambda n, total: on_item(n + len(finished), len(items))) if on_item else None)
    position = {item.index: i for i, item in enumerate(items)}
    rows = sorted(done + rows, key=lambda r: (position[r["item"]], labels.index(r["method"])))
    return {"items": rows, "methods": {label: aggregate(rows, label) for label in labels},
            "comparisons": compare_methods(rows, labels)}


def read_rows(path: Path, settings: dict[str, Any], labels: Sequence[str]) -> list[dict]:
    """The rows of the items a run at ``path`` finished with every method of ``labels``,
    whichever items it was run on; a torn last line (a run killed while writing) is left out."""
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        header = json.loads(lines[0])["settings"] if lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        header = None
    if header is None:
        raise RowsFileError(f"{path} is not a rows file of bench quality; remove it or run without --resume")
    settings = json.loads(json.dumps(settings))
    changed = sorted(k for k in set(header) | set(settings) if k != "items" and header.get(k) != settings.get(k))
    if changed:
        raise RowsFileError(f"{path} was written with other settings ({', '.join(changed)}): "
                            "run without --resume to start again, or with the same settings")
    rows = []
    for line in lines[1:]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    per_item: dict[int, list[dict]] = {}
    for r in rows:
        per_item.setdefault(r["item"], []).append(r)
    return [r for item_rows in per_item.values() if sorted(r["method"] for r in item_rows) == sorted(labels)
            for r in item_rows]


def write_rows(path: Path, settings: dict[str, Any], rows: Sequence[dict]) -> None:
    """Start the rows file at ``path`` (atomically): the settings line, then ``rows``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps({"settings": settings}) + "\n")
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def append_rows(path: Path, rows: Sequence[dict]) -> None:
    """Append one item's rows and flush them to disk."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())


def verdict_phrase(comparison: dict, key: str) -> str:
    """``better (-0.031 [-0.05, -0.01])`` for one figure of one paired comparison."""
    figure = comparison[key]
    return f"{figure['verdict']} ({figure['mean']:+.3f} [{figure['low']:+.3f}, {figure['high']:+.3f}])"
