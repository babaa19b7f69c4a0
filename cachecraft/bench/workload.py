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

With a warm-up (``WarmUp``), each chunk-cache method's store is first filled the way
``cachecraft warm`` fills one: every passage after the warm context and, with
neighbours, after each of its nearest passages too (in-context variants), all under
the run's budgets, so the eviction policy decides which variants of a chunk to keep
before and during the trace. Each run then reports how many chunks hold several
variants and how often a request reused one whose whole old prefix it contained.
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
class WarmUp:
    """What each chunk-cache method's store is filled with before the trace: ``texts`` (every
    passage) and ``pairs`` (``(before, chunk)``: the in-context variants)."""

    texts: tuple[str, ...] = ()
    pairs: tuple[tuple[str, str], ...] = ()


def pooled_corpus(items: Sequence[QAItem]) -> list[str]:
    """Every passage of ``items`` as a chunk text, once, in order."""
    return list(dict.fromkeys(PromptBuilder.chunk_text(text, title) for item in items for title, text in item.passages))


def warm_up(items: Sequence[QAItem], neighbours: int, *, embed: Callable[[list[str]], np.ndarray]) -> WarmUp:
    """The warm-up ``cachecraft warm --neighbours N`` would do on the pooled corpus: every
    passage, and each passage after each of its ``neighbours`` nearest ones."""
    from cachecraft.retrieval.index import ChunkIndex

    corpus = pooled_corpus(items)
    pairs: list[tuple[str, str]] = []
    if neighbours > 0:
        vectors = embed(corpus)
        index = ChunkIndex(vectors.shape[1])
        index.add(vectors, corpus, [str(i) for i in range(len(corpus))])
        pairs = [(corpus[j], corpus[i]) for i, near in enumerate(index.neighbours(neighbours)) for j in near]
    return WarmUp(tuple(corpus), tuple(pairs))


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: the question asked and the retrieved chunks, in order."""

    question: str
    chunks: tuple[str, ...]
    item: int


def build_trace(items: Sequence[QAItem], requests: int, top_k: int, *, zipf_s: float = 1.2, seed: int = 0,
                embed: Callable[[list[str]], np.ndarray],
                shift_every: int = 0) -> tuple[list[TraceRequest], int]:
    """The request trace and the corpus size; ``embed`` maps texts to unit vectors.
    ``shift_every`` > 0 draws the items' popularity ranks anew every that many requests
    (interests that move on); 0 keeps one popularity for the whole trace."""
    if shift_every < 0:
        raise ValueError(f"shift_every must be 0 or more, got {shift_every}")
    from cachecraft.retrieval.index import ChunkIndex

    corpus = pooled_corpus(items)
    if top_k < 1 or top_k > len(corpus):
        raise ValueError(f"top_k must be within [1, {len(corpus)}] for this corpus, got {top_k}")
    vectors = embed(corpus)
    index = ChunkIndex(vectors.shape[1])
    index.add(vectors, corpus, [str(i) for i in range(len(corpus))])
    rng = np.random.default_rng(seed)

    def draw_popularity() -> np.ndarray:
        """Zipf shares over the items, in a random order of ranks."""
        ranks = rng.permutation(len(items)) + 1
        shares = 1.0 / ranks.astype(float) ** zipf_s
        return shares / shares.sum()

    popularity = draw_popularity()
    trace = []
    queries: dict[tuple[int, int], TraceRequest] = {}
    for n in range(requests):
        if shift_every and n and n % shift_every == 0:
            popularity = draw_popularity()
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
                 budgets: dict[str, int], max_new_tokens: int = 32, evictions: Sequence[str] = (),
                 exact_after: Sequence[int] = (),
                 on_request: Callable[[str, int, int], None] | None = None, warm: WarmUp | None = None) -> dict:
    """Replay ``trace`` with each method (``full`` first); per-request rows and aggregates.
    ``warm``: what each chunk-cache method's store is filled with first (``full`` and
    ``prefix`` use no chunk-caches and start empty).

    ``evictions`` adds a ``cachecraft`` run per eviction policy, labelled ``cachecraft[policy]``;
    ``exact_after`` one per setting of ``exact_after_asks``, labelled ``cachecraft[asks=N]``.
    ``on_request(label, n, total)`` follows the replay (``n`` 0: a warm-up begins).
    A full prefill does not depend on what came before, so ``full`` runs each distinct
    request once and repeats its measured row for the trace's repeats (``replayed``)."""
    runs: list[tuple[str, str, dict]] = [(m, m, {}) for m in ["full"] + [m for m in methods if m != "full"]]
    runs += [(f"cachecraft[{e}]", "cachecraft", {"eviction": e}) for e in evictions]
    runs += [(f"cachecraft[asks={n}]", "cachecraft", {"exact_after_asks": n}) for n in exact_after]
    rows: list[dict] = []
    usage: dict[str, dict] = {}
    reference: dict[int, str] = {}
    for label, method, setting in runs:
        method_config = config.replace(cpu_budget_bytes=budgets["cpu"], disk_budget_bytes=budgets["disk"],
                                       max_new_tokens=max_new_tokens, **setting)
        method_rows, usage[label] = _replay(lm, method_config, trace, label, method, reference, on_request,
                                            None if method in ("full", "prefix") else warm)
        rows += method_rows
    labels = [label for label, _, _ in runs]
    summary = {m: summarize([r for r in rows if r["method"] == m]) for m in labels}
    for m in labels:
        work = summary[m]["token_layers"]
        summary[m]["compute_reduction_vs_full"] = 1 - work / summary["full"]["token_layers"]
        if "prefix" in summary:
            summary[m]["compute_reduction_vs_prefix"] = 1 - work / summary["prefix"]["token_layers"]
        summary[m]["store_usage"] = {t: u for t, u in usage.get(m, {}).items() if t in ("gpu", "cpu", "disk")}
        summary[m]["variants"] = usage.get(m, {}).get("variants", {})
        summary[m]["warm"] = usage.get(m, {}).get("warm", {})
    return {"requests": rows, "methods": summary}


def _replay(lm: LoadedModel, config: Config, trace: Sequence[TraceRequest], label: str, method: str,
            reference: dict[int, str], on_request: Callable[[str, int, int], None] | None,
            warm: WarmUp | None = None) -> tuple[list[dict], dict]:
    """One method's pass over the trace in a scratch store (filled by ``warm`` first); its
    rows, and its final tier usage with the variant census and the warm-up's cost."""
    from cachecraft.pipeline import Pipeline

    scratch = Path(tempfile.mkdtemp(prefix=f"workload-{method}-", dir=config.cache_dir))
    rows: list[dict] = []
    first_row: dict[TraceRequest, dict] = {}
    orders: dict[tuple[str, ...], int] = {}  # each chunk order's number, by first ask
    try:
        with TieredStore(config.replace(cache_dir=scratch), tiers=("cpu", "disk")) as store:
            pipeline = Pipeline(config.replace(cache_dir=scratch), lm=lm, store=store)
            if warm is not None and on_request:
                on_request(f"{label}: warm-up", 0, len(trace))  # request 0: nothing answered yet
            warmed = _warm(pipeline, warm) if warm is not None else {}
            for n, request in enumerate(trace):
                if method == "full" and request in first_row:
                    row = {**first_row[request], "request": n, "replayed": True}
                else:
                    row = _measure(pipeline, request, method)
                    first_row.setdefault(request, row)
                reference.setdefault(n, row["answer"])
                row.update(method=label, request=n, item=request.item,
                           order=orders.setdefault(request.chunks, len(orders)),
                           agreement_f1=token_f1(first_line(row["answer"]), first_line(reference[n])),
                           store_bytes={tier: state.bytes for tier, state in store.usage().items()})
                rows.append(row)
                if on_request:
                    on_request(label, n + 1, len(trace))
            usage = {tier: {"entries": state.entries, "bytes": state.bytes, "budget": state.budget}
                     for tier, state in store.usage().items()}
            usage["variants"] = variant_census(store)
            usage["warm"] = warmed
            store.close(persist=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows, usage


def _warm(pipeline, warm: WarmUp) -> dict:
    """Fill the pipeline's store as ``cachecraft warm`` would; what was made, in how long."""
    start = time.perf_counter()
    made = pipeline.warm(list(warm.texts))
    in_context = pipeline.warm_after(list(warm.pairs))
    return {"made": made, "in_context": in_context, "seconds": time.perf_counter() - start,
            "variants_after": variant_census(pipeline.store)}


def variant_census(store: TieredStore) -> dict:
    """How many variants of the corpus' chunks the store holds, of how many chunks, and how
    many chunks hold more than one (the system prefix and the warm context are no chunks)."""
    from cachecraft import warm_context

    with store.catalog.read() as tx:
        records = tx.stored_variants()
        sources = {key: tx.chunk(key) for key in {r.chunk_key for r in records}}
    context = {key for key, chunk in sources.items() if chunk is not None and chunk.source == warm_context.SOURCE}
    per_chunk: dict[str, int] = {}
    for record in records:
        if record.prefix and record.chunk_key not in context:
            per_chunk[record.chunk_key] = per_chunk.get(record.chunk_key, 0) + 1
    return {"variants": sum(per_chunk.values()), "chunks": len(per_chunk),
            "chunks_with_several": sum(1 for n in per_chunk.values() if n > 1)}


def _measure(pipeline, request: TraceRequest, method: str) -> dict:
    """Answer one request; the measured part of its row."""
    from cachecraft.evaluation import answer_traced

    start = time.perf_counter()
    answer, trace = answer_traced(pipeline, list(request.chunks), request.question, method)
    total = time.perf_counter() - start
    tiers = [c.tier for c in answer.chunks]
    # a reused variant whose old prefix the request holds entirely (CFO 0): an in-context or
    # exact variant, never the warm-context one (its context is no chunk of the request)
    whole_prefix = sum(1 for c in answer.chunks if c.variant is not None and c.cfo == 0 and c.fraction < 1)
    return {"whole_prefix_reuses": whole_prefix, "prompt_tokens": answer.prompt_tokens, "ttft_s": answer.ttft_s,
            "request_s": total, "recompute_fraction": answer.recompute_fraction, "token_layers": trace.token_layers,
            "hits": {t: tiers.count(t) for t in set(tiers)}, "chunks": len(tiers), "answer": answer.text,
            "kept_exact": answer.kept_exact, "reused_exact": answer.reused_exact}


def compare_runs(pairs: Sequence[tuple[Sequence[dict], Sequence[dict]]]) -> dict:
    """Two settings over the same traces, request by request: ``pairs`` holds, per trace,
    the base setting's rows and the other's (the same requests, in the same chunk orders).
    Per trace its means and counts; pooled over the traces, the other's agreement F1 minus
    the base's and the ratio of their total TTFTs (other over base), each with a 95%
    interval that resamples whole chunk orders of a trace (one order's asks move together:
    a keep serves them all)."""
    from cachecraft.intervals import clustered

    traces, diffs, clusters, base_ttft, other_ttft = [], [], [], [], []
    for n, (base_rows, other_rows) in enumerate(pairs):
        base = {r["request"]: r for r in base_rows}
        other = {r["request"]: r for r in other_rows}
        if base.keys() != other.keys() or any(base[k].get("order") != other[k].get("order") for k in base):
            raise ValueError(f"trace {n + 1}: the two runs did not replay the same requests in the same chunk orders")
        if not base:
            raise ValueError(f"trace {n + 1}: no requests")
        for k in sorted(base):
            diffs.append(other[k]["agreement_f1"] - base[k]["agreement_f1"])
            clusters.append((n, base[k].get("order")))
            base_ttft.append(base[k]["ttft_s"])
            other_ttft.append(other[k]["ttft_s"])
        traces.append({side: {"requests": len(rows), "agreement_f1": statistics.fmean(r["agreement_f1"] for r in rows),
                              "ttft_s_mean": statistics.fmean(r["ttft_s"] for r in rows),
                              "kept_exact": sum(bool(r.get("kept_exact")) for r in rows),
                              "reused_exact": sum(bool(r.get("reused_exact")) for r in rows)}
                       for side, rows in (("base", base_rows), ("other", other_rows))})
    return {"traces": traces, "requests": len(diffs), "clusters": len(set(clusters)),
            "agreement_f1_difference": clustered(diffs, clusters).to_dict(),
            "ttft_ratio": clustered(other_ttft, clusters, weights=base_ttft).to_dict(),
            "requests_better": sum(d > 0 for d in diffs), "requests_worse": sum(d < 0 for d in diffs)}


def comparison_verdicts(result: dict) -> str:
    """A :func:`compare_runs` result's pooled figures in words: the agreement F1 difference
    and its verdict, the requests it moved, the ratio of total TTFTs."""
    from cachecraft.intervals import Interval, verdict

    f1, ttft = result["agreement_f1_difference"], result["ttft_ratio"]
    return (f"agreement F1, other - base, {f1['mean']:+.4f} [{f1['low']:+.4f}, {f1['high']:+.4f}] "
            f"({verdict(Interval(**f1), lower_is_better=False)}; {result['requests_better']} requests better, "
            f"{result['requests_worse']} worse); total TTFT, other / base, {ttft['mean']:.3f} "
            f"[{ttft['low']:.3f}, {ttft['high']:.3f}]")


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
        "whole_prefix_reuse_rate": sum(r.get("whole_prefix_reuses", 0) for r in rows) / chunks if chunks else 0.0,
        "kept_exact_requests": sum(1 for r in rows if r.get("kept_exact")),
        **keep_worth(rows),
    }


def keep_worth(rows: Sequence[dict]) -> dict:
    """What the keeps of one method's run bought (a keep: a request that computed its chunk
    order in full to keep it exact). Per keep (``keeps``): its request, its order, how many
    later asks of that order reused every chunk exactly before the order's next keep
    (``served``: each answers as full does, for nothing recomputed), and the mean agreement
    with full of the order's asks since its previous keep that did not (``f1_before``, None
    where there were none). Also the asks served in all and the keeps that served none.
    Rows in trace order; rows without an ``order`` (results made before it) count nothing."""
    keeps: list[dict] = []
    current: dict[int, dict] = {}  # per order, its latest keep
    before: dict[int, list[float]] = {}  # per order, the F1 of its inexact asks since that keep
    for row in rows:
        order = row.get("order")
        if order is None:
            continue
        if row.get("kept_exact"):
            f1 = before.pop(order, [])
            current[order] = {"request": row["request"], "order": order, "served": 0,
                              "f1_before": statistics.fmean(f1) if f1 else None}
            keeps.append(current[order])
        elif not row.get("reused_exact"):
            before.setdefault(order, []).append(row["agreement_f1"])
        elif order in current:  # an exact reuse before any keep (a cold miss's caches) is no keep's
            current[order]["served"] += 1
    return {"keeps": keeps, "keep_asks_served": sum(k["served"] for k in keeps),
            "keeps_serving_none": sum(1 for k in keeps if k["served"] == 0)}
