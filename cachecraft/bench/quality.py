"""``cachecraft bench quality``: every method on the same MuSiQue-format requests.

Prompt = system prefix + the item's passages as chunks + question. Chunk-caches are
made after the system prefix alone and put into a tiered store (in a scratch
directory, in the stored KV dtype); each method's time to first token includes
loading them from the store back into compute tensors.
Quality is measured against ``full`` on the same request (first-token KL, answer
agreement, exact match) and against the gold answers (token F1).
"""

from __future__ import annotations

import functools
import gc
import logging
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from cachecraft.bench.common import PeakRSS
from cachecraft.config import DEFAULT_QUESTION_TEMPLATE
from cachecraft.dataset import QAItem
from cachecraft.engine import Segment, blended_prefill, generate_from, sampled_layers
from cachecraft.methods import MethodSpec, build_segments, remember_prefix, segment_keys
from cachecraft.metrics import best_f1, exact_match, first_line, kl_divergence, token_f1
from cachecraft.model.loader import LoadedModel
from cachecraft.kv import ChunkKV, chunk_key
from cachecraft.prefix_cache import PrefixCache
from cachecraft.store import LayerStream, TieredStore
from cachecraft.prompt import PromptBuilder
from cachecraft.selection import create_chunk_cache
from cachecraft.warm_context import token_ids

log = logging.getLogger(__name__)


@dataclass
class MethodRun:
    """One method on one request."""

    logits: torch.Tensor
    answer: str
    ttft_s: float
    recompute_fraction: float
    peak_rss_mb: float
    rss_growth_mb: float
    kv_mb: float


def run_method(lm: LoadedModel, spec: MethodSpec, pieces, prefix_kv, chunk_kvs,
               max_new_tokens: int, prefix_cache: PrefixCache | None = None,
               load: Callable[[Sequence, ExitStack], list] | None = None) -> MethodRun:
    """Prefill ``pieces`` with ``spec``, time the first token, then decode greedily.
    ``load`` turns ``chunk_kvs`` (handles) into cached KV inside the timed region; what it
    opens, it registers with the ExitStack it is given, closed once the prefill is done."""
    gc.collect()
    with PeakRSS() as mem:
        start = time.perf_counter()
        with ExitStack() as loading:
            if load is not None and spec.uses_cache:
                prefix_kv, *chunk_kvs = load([prefix_kv, *chunk_kvs], loading)
            segments, check = build_segments(spec, pieces, prefix_kv, chunk_kvs, lm.adapter,
                                             prefix_cache=prefix_cache)
            result = blended_prefill(lm.adapter, segments, hooks=[check] if check is not None else [],
                                     fingerprint=lm.fingerprint)
            int(result.logits.argmax())
            ttft = time.perf_counter() - start
    kv_mb = sum(k.numel() * k.element_size() * 2 for k in result.keys) / 2**20
    if spec.name == "prefix" and prefix_cache is not None:
        remember_prefix(prefix_cache, lm.adapter, result)
    new_ids = generate_from(lm.model, lm.tokenizer, result, max_new_tokens=max_new_tokens)
    answer = lm.tokenizer.decode(new_ids, skip_special_tokens=True)
    return MethodRun(result.logits.float().cpu(), answer, ttft, result.recompute_fraction,
                     mem.peak_mb, mem.growth_mb, kv_mb)


def warm_chunks(lm: LoadedModel, pieces, prefix_kv, kv_dtype: torch.dtype, context: Segment | None = None,
                stats_layers: Sequence[int] | None = None) -> list:
    """Chunk-caches made after the system prefix alone (or after it and a cached
    ``context`` segment, as ``Pipeline.warm`` does), stored in ``kv_dtype``, with
    statistics at ``stats_layers`` (every layer when None)."""
    prefix_key, keys = segment_keys(lm.fingerprint, pieces)
    before = [Segment(pieces.prefix, "prefix", cached=prefix_kv, key=prefix_key)] + ([context] if context else [])
    return [create_chunk_cache(lm.adapter, before, ids, fingerprint=lm.fingerprint, key=key,
                               stats_layers=stats_layers).to(kv_dtype)
            for ids, key in zip(pieces.chunks, keys)]


def _load_all(store: TieredStore, lm: LoadedModel, kvs: Sequence[ChunkKV], loading: ExitStack) -> list:
    """The stored variants of ``kvs``, loaded as the pipeline does: streamed in layer by layer,
    or (``stream_kv`` off) read whole in the compute dtype."""
    if store.config.stream_kv:
        loaded = [store.iter_layers(kv.variant, device=lm.device, fingerprint=lm.fingerprint) for kv in kvs]
    else:
        loaded = [store.get(kv.variant, dtype=lm.dtype, device=lm.device, fingerprint=lm.fingerprint) for kv in kvs]
    assert all(x is not None for x in loaded), "a chunk-cache went missing from the store during the benchmark"
    return loading.enter_context(LayerStream(loaded)).kvs if store.config.stream_kv else loaded


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


def run_quality(lm: LoadedModel, items: Sequence[QAItem], specs: Sequence[MethodSpec], *,
                system_prompt: str, question_template: str = DEFAULT_QUESTION_TEMPLATE, kv_dtype: torch.dtype = torch.float16, max_new_tokens: int = 32,
                on_item: Callable[[int, int], None] | None = None, store: TieredStore | None = None,
                warm_context: str = "", warm_context_tokens: int = 1024, stats_layer_step: int = 1) -> dict:
    """Run every method on every item; returns ``{"items": [...], "methods": {...}}``.
    With a ``store``, chunk-caches are put there and loaded from it per request; an
    item's chunk-caches leave it once the item is done, so it holds one item's at a time.
    ``warm_context``: text the chunk-caches are made after, following the system prefix
    (empty: the system prefix alone), cut to ``warm_context_tokens``. ``stats_layer_step``:
    the chunk-caches' statistics are gathered at every that-many-th layer, as the
    pipeline's ``stats_layer_step`` does."""
    builder = PromptBuilder(lm.tokenizer, system_prompt, question_template)
    full_spec = MethodSpec("full")
    order = [full_spec] + [s for s in specs if s.name != "full"]
    prefix_kv = context = None
    context_ids = token_ids(warm_context, builder.encode, warm_context_tokens, lm.max_context)
    prefix_cache = PrefixCache(lm.fingerprint)
    stats_layers = sampled_layers(lm.adapter.num_layers, stats_layer_step)
    rows: list[dict] = []
    for index, item in enumerate(items):
        chunks = [PromptBuilder.chunk_text(text, title) for title, text in item.passages]
        pieces = builder.build(chunks, item.question, max_tokens=lm.max_context)
        if prefix_kv is None:
            prefix_kv = create_chunk_cache(lm.adapter, [], pieces.prefix, fingerprint=lm.fingerprint,
                                           collect_stats=False).to(kv_dtype)
            if context_ids:  # made once, like the system prefix: the same for every item
                context_key = chunk_key(lm.fingerprint, context_ids)
                prefix = Segment(pieces.prefix, "prefix", cached=prefix_kv, key=segment_keys(lm.fingerprint, pieces)[0])
                made = create_chunk_cache(lm.adapter, [prefix], context_ids, fingerprint=lm.fingerprint,
                                          key=context_key, collect_stats=False).to(kv_dtype)
                context = Segment(context_ids, "chunk", cached=made, key=context_key)
        start = time.perf_counter()
        chunk_kvs = warm_chunks(lm, pieces, prefix_kv, kv_dtype, context, stats_layers)
        warm_s = time.perf_counter() - start
        load = None
        if store is not None:
            for kv in (prefix_kv, *chunk_kvs):
                if not store.contains(kv.variant):
                    store.put(kv)
            load = functools.partial(_load_all, store, lm)
        reference = None
        for spec in order:
            run = run_method(lm, spec, pieces, prefix_kv, chunk_kvs, max_new_tokens, prefix_cache, load)
            reference = reference or run
            rows.append({
                "item": item.index, "method": spec.label, "tokens": pieces.num_tokens,
                "chunks": len(pieces.chunks), "ttft_s": run.ttft_s,
                "speedup_vs_full": reference.ttft_s / run.ttft_s,
                "recompute_fraction": run.recompute_fraction,
                "kl": kl_divergence(reference.logits, run.logits),
                "agreement_f1": token_f1(first_line(run.answer), first_line(reference.answer)),
                "exact_match": float(exact_match(run.answer, reference.answer)),
                "gold_f1": best_f1(run.answer, item.answers),
                "peak_rss_mb": run.peak_rss_mb, "rss_growth_mb": run.rss_growth_mb, "kv_mb": run.kv_mb,
                "warm_s": warm_s, "answer": run.answer,
            })
            log.info("item %d %s ttft %.2fs", item.index, spec.label, run.ttft_s)
        if store is not None:  # no later item reads them; left there, they would crowd its caches out
            for kv in chunk_kvs:
                store.delete(kv.variant)
        if on_item:
            on_item(index + 1, len(items))
    return {"items": rows, "methods": {s.label: aggregate(rows, s.label) for s in order}}
