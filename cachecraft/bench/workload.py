"""``cachecraft bench workload``: a RAG trace with repeats and overlapping retrievals.

All passages of a MuSiQue-format file are pooled into one corpus and indexed. Items
are drawn with Zipf-skewed popularity; a request asks the item's question, focused on
the subject (title) of one of its passages, so related requests retrieve overlapping
chunks in different orders and popular ones repeat exactly. Top-k chunks are
retrieved for each request. Every method replays the same trace through its own
pipeline with store budgets far smaller than the corpus' KV, and its answers are
compared with ``full``'s on the same request.

Redundant compute is counted in token-layers (a token run through one layer); a
method's reduction against ``full`` and ``prefix`` is ``1 - work(method) / work(other)``.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.metrics import first_line, token_f1
from cachecraft.model.loader import LoadedModel
from cachecraft.prompt import PromptBuilder
from cachecraft.store import TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: the question asked and the retrieved chunks, in order."""

    question: str
    chunks: tuple[str, ...]
    item: int


def build_trace(items: Sequence[QAItem], requests: int, top_k: int, *, zipf_s: float = 1.2, seed: int = 0,
                embed: Callable[[list[str]], np.ndarray]) -> tuple[list[TraceRequest], int]:
    """The request trace and the corpus size; ``embed`` maps texts to unit vectors."""
    from cachecraft.retrieval.index import ChunkIndex

    corpus = list(dict.fromkeys(PromptBuilder.chunk_text(text, title) for item in items for title, text in item.passages))
    if top_k < 1 or top_k > len(corpus):
        raise ValueError(f"top_k must be within [1, {len(corpus)}] for this corpus, got {top_k}")
    vectors = embed(corpus)
    index = ChunkIndex(vectors.shape[1])
    index.add(vectors, corpus, [str(i) for i in range(len(corpus))])
    rng = np.random.default_rng(seed)
    ranks = rng.permutation(len(items)) + 1
    popularity = 1.0 / ranks.astype(float) ** zipf_s
    popularity /= popularity.sum()
    trace = []
    queries: dict[tuple[int, int], TraceRequest] = {}
    for _ in range(requests):
        item_index = int(rng.choice(len(items), p=popularity))
        item = items[item_index]
        subject = int(rng.integers(len(item.passages)))
        key = (item_index, subject)
        if key not in queries:
            title = item.passages[subject][0] or f"passage {subject + 1}"
            question = f"About {title}: {item.question}"
            hits = index.search(embed([question])[0], top_k)
            queries[key] = TraceRequest(question, tuple(h.text for h in hits), item_index)
        trace.append(queries[key])
    return trace, len(corpus)


def run_workload(lm: LoadedModel, config: Config, trace: Sequence[TraceRequest], methods: Sequence[str], *,
                 budgets: dict[str, int], max_new_tokens: int = 32,
                 on_request: Callable[[str, int, int], None] | None = None) -> dict:
    """Replay ``trace`` with each method (``full`` first); per-request rows and aggregates."""
    from cachecraft.pipeline import Pipeline

    order = ["full"] + [m for m in methods if m != "full"]
    rows: list[dict] = []
    usage: dict[str, dict] = {}
    reference: dict[int, str] = {}
    for method in order:
        scratch = Path(tempfile.mkdtemp(prefix=f"workload-{method}-", dir=config.cache_dir))
        method_config = config.replace(cache_dir=scratch, cpu_budget_bytes=budgets["cpu"],
                                       disk_budget_bytes=budgets["disk"], max_new_tokens=max_new_tokens)
        try:
            with TieredStore(method_config, tiers=("cpu", "disk")) as store:
                pipeline = Pipeline(method_config, lm=lm, store=store)
                for n, request in enumerate(trace):
                    start = time.perf_counter()
                    answer = pipeline.answer(list(request.chunks), request.question, method=method)
                    total = time.perf_counter() - start
                    reference.setdefault(n, answer.text)
                    tiers = [c.tier for c in answer.chunks]
                    rows.append({"method": method, "request": n, "item": request.item,
                                 "prompt_tokens": answer.prompt_tokens, "ttft_s": answer.ttft_s,
                                 "request_s": total, "recompute_fraction": answer.recompute_fraction,
                                 "token_layers": answer.token_layers, "hits": {t: tiers.count(t) for t in set(tiers)},
                                 "chunks": len(tiers),
                                 "agreement_f1": token_f1(first_line(answer.text), first_line(reference[n])),
                                 "answer": answer.text})
                    if on_request:
                        on_request(method, n + 1, len(trace))
                usage[method] = {tier: {"entries": state.entries, "bytes": state.bytes, "budget": state.budget}
                                 for tier, state in store.usage().items()}
                store.close(persist=False)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = {m: summarize([r for r in rows if r["method"] == m]) for m in order}
    for m in order:
        work = summary[m]["token_layers"]
        summary[m]["compute_reduction_vs_full"] = 1 - work / summary["full"]["token_layers"]
        if "prefix" in summary:
            summary[m]["compute_reduction_vs_prefix"] = 1 - work / summary["prefix"]["token_layers"]
        summary[m]["store_usage"] = usage.get(m, {})
    return {"requests": rows, "methods": summary}


def summarize(rows: list[dict]) -> dict:
    """Aggregates of one method over the trace."""
    ttft = sorted(r["ttft_s"] for r in rows)
    chunks = sum(r["chunks"] for r in rows)
    hits: dict[str, int] = {}
    for r in rows:
        for tier, count in r["hits"].items():
            hits[tier] = hits.get(tier, 0) + count
    return {
        "requests": len(rows),
        "ttft_s_mean": statistics.fmean(ttft),
        "ttft_s_median": statistics.median(ttft),
        "ttft_s_p95": ttft[min(len(ttft) - 1, int(round(0.95 * (len(ttft) - 1))))],
        "throughput_rps": len(rows) / sum(r["request_s"] for r in rows),
        "recompute_fraction_mean": statistics.fmean(r["recompute_fraction"] for r in rows),
        "token_layers": sum(r["token_layers"] for r in rows),
        "hit_rate": 1 - hits.get("miss", 0) / chunks if chunks else 0.0,
        "hit_rate_by_tier": {t: hits.get(t, 0) / chunks for t in ("gpu", "cpu", "disk")} if chunks else {},
        "agreement_f1_mean": statistics.fmean(r["agreement_f1"] for r in rows),
    }
