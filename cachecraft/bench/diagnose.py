"""``cachecraft bench diagnose``: where and why reused chunk-caches drift from a full prefill.

For each MuSiQue-format item the full prefill's greedy answer is the reference (answered
through :meth:`Pipeline.answer`, the one request path). Then, for each *cache context*,
the setting a chunk's cache was made after:

- ``system``: the system prompt alone (the chunk's cache knows nothing before it);
- ``warm``: the system prompt and the warm context (what ``warm`` does by default);
- ``previous``: the system prompt and the chunk that comes right before it in this
  request (a variant made after a real neighbour: one chunk of prefix overlap);
- ``other``: the system prompt and another chunk of the same request that does not come
  right before it (the one after it; the first chunk for the last): a related passage
  of the same kind, but not the real prefix;
- ``foreign``: the system prompt and a passage of another item of the dataset (the next
  item's chunk at the same place): a passage of the same kind on an unrelated topic;
- ``related``: the system prompt and three other chunks of the same request, none of
  them right before it (the three after it, wrapping round): a variant made after
  several related passages, as one made after a chunk's nearest neighbours would be;
- ``corpus``: the system prompt and five passages of another item, one prefill shared by
  every chunk: a warm context cut from the corpus, several passages long, in place of
  neutral prose;

the caches are reused untouched and with token selections at each budget, and we
record, against the full prefill of the same prompt:

- which layers: per layer, the relative deviation ``|X_reuse - X_full| / |X_full|`` of
  the chunk tokens' keys (after RoPE, at the same positions) and values;
- which tokens: the same deviation (values, mean over layers) by position inside the
  chunk (first token, 2-4, 5-16, 17-64, the rest);
- how many and chosen how: answer KL (full's greedy answer teacher-forced through each
  prefill), token agreement and first-token KL for reuse and for each selector at each
  budget: ``firstk`` (each chunk's first tokens), ``cacheblend`` (deviation of V at
  layer 1), ``qguided`` (where the question looks at the check layer), ``sink+q``
  (half first tokens, half question-guided), and ``oracle`` (the tokens whose values
  deviate most over all layers, known only after the fact: what "which tokens" can
  buy at best by deviation).

The prefills here are the engine's (:func:`blended_prefill`) with caches kept in the
compute dtype; they diagnose, the yardstick (``bench quality``) judges.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Callable, Sequence

import torch

from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.engine import Segment, blended_prefill, teacher_forced_logits
from cachecraft.evaluation import answer_traced, item_chunks, scratch_pipeline
from cachecraft.kv import ChunkKV
from cachecraft.metrics import answer_divergence, kl_divergence
from cachecraft.selection import DeviationCheck, count_for, first_tokens, question_guided

CONTEXTS = ("system", "warm", "previous", "other", "foreign", "related", "corpus")
RELATED_CHUNKS, CORPUS_PASSAGES = 3, 5
SELECTORS = ("firstk", "cacheblend", "qguided", "sink+q", "oracle")
POSITION_BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, None))  # [lo, hi) inside a chunk


def bucket_name(lo: int, hi: int | None) -> str:
    """A position bucket as people count: ``1``, ``2-4``, ``65+``."""
    if hi is None:
        return f"{lo + 1}+"
    return str(lo + 1) if hi == lo + 1 else f"{lo + 1}-{hi}"


def relative_deviation(reused: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Per token, ``|reused - full| / |full|`` over heads and head dims: ``[H, N, D]`` -> ``[N]``."""
    diff = (reused.float() - full.float()).pow(2).sum(dim=(0, 2)).sqrt()
    return diff / full.float().pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-12)


def position_profile(per_token: torch.Tensor, spans: Sequence[tuple[int, int]]) -> dict[str, float]:
    """Mean of ``per_token`` ``[N]`` over the chunk tokens in each position bucket."""
    out = {}
    for lo, hi in POSITION_BUCKETS:
        picked = [per_token[a + lo:(b if hi is None else min(b, a + hi))] for a, b in spans if a + lo < b]
        values = torch.cat(picked) if picked else torch.empty(0)
        out[bucket_name(lo, hi)] = float(values.mean()) if values.numel() else float("nan")
    return out


def split_budget(count: int) -> tuple[int, int]:
    """``sink+q``: how many of ``count`` tokens go to a chunk's first tokens and how many to
    the question's choice (half each, the odd one to the question)."""
    return count // 2, count - count // 2


def top_per_chunk(score: torch.Tensor, spans: Sequence[tuple[int, int]], ratio: float) -> list[torch.Tensor]:
    """Per chunk span, the local indices of its ``ratio`` highest-scoring tokens, sorted."""
    picks = []
    for a, b in spans:
        count = count_for(ratio, b - a)
        picks.append(score[a:b].topk(count).indices.sort().values if count else torch.empty(0, dtype=torch.long))
    return picks


class _Item:
    """One item's prompt, its full prefill and the reference answer."""

    def __init__(self, pipeline, item: QAItem):
        self.pipeline, self.adapter = pipeline, pipeline.lm.adapter
        chunks = item_chunks(item)
        answer, trace = answer_traced(pipeline, chunks, item.question, "full", max_new_tokens=32)
        self.pieces = pipeline.builder.build(chunks, item.question, max_tokens=pipeline.lm.max_context)
        self.answer_text, self.answer_ids = answer.text, trace.answer_ids
        self.full_logits, self.full_keys, self.full_values = trace.logits, trace.keys, trace.values
        self.token_ids = trace.token_ids
        self.forced_full = self.forced(trace.keys, trace.values)
        spans, start = [], len(self.pieces.prefix)
        for ids in self.pieces.chunks:
            spans.append((start, start + len(ids)))
            start += len(ids)
        self.spans = spans
        prefix_run = blended_prefill(self.adapter, [Segment(self.pieces.prefix, "prefix", save=True),
                                                    Segment(self.pieces.question, "question")])
        self.prefix_kv = prefix_run.saved[0]

    def forced(self, keys, values) -> torch.Tensor:
        return teacher_forced_logits(self.pipeline.lm.model, keys, values, self.token_ids, self.answer_ids)

    def prefix(self) -> Segment:
        return Segment(self.pieces.prefix, "prefix", cached=self.prefix_kv)

    def make_caches(self, context: str, warm_kv=None, warm_ids=None, system=None, foreign=None) -> list:
        """Each chunk's KV made after ``context`` (see the module doc). ``warm_kv`` and
        ``warm_ids`` are the shared context of ``warm`` or ``corpus``; ``system`` holds the
        chunks' own caches made after the system prompt alone; ``foreign`` the (token ids,
        cache) pairs of another item's chunks, made the same way."""
        caches = []
        count = len(self.pieces.chunks)
        for i, ids in enumerate(self.pieces.chunks):
            before = []
            if context in ("warm", "corpus") and warm_kv is not None:
                before = [Segment(warm_ids, "chunk", cached=warm_kv, fixable=False)]
            elif context == "previous" and i > 0:
                before = [Segment(self.pieces.chunks[i - 1], "chunk", cached=system[i - 1], fixable=False)]
            elif context == "other" and count > 1:
                j = (i + 1) % count
                before = [Segment(self.pieces.chunks[j], "chunk", cached=system[j], fixable=False)]
            elif context == "foreign" and foreign:
                other_ids, other_kv = foreign[i % len(foreign)]
                before = [Segment(other_ids, "chunk", cached=other_kv, fixable=False)]
            elif context == "related" and count > 1:
                others = [(i + step) % count for step in range(1, min(RELATED_CHUNKS, count - 1) + 1)]
                before = [Segment(self.pieces.chunks[j], "chunk", cached=system[j], fixable=False) for j in others]
            run = blended_prefill(self.adapter, [self.prefix(), *before, Segment(ids, "chunk", save=True)])
            caches.append(run.saved[len(before) + 1])
        return caches

    def made_alone(self, ids) -> ChunkKV:
        """The cache of the tokens ``ids`` made right after the system prompt."""
        return blended_prefill(self.adapter, [self.prefix(), Segment(ids, "chunk", save=True)]).saved[1]

    def foreign(self, other_item: QAItem) -> list:
        """The (token ids, cache) pair of each of ``other_item``'s passages, made after the
        system prompt alone: the ``foreign`` context's passages."""
        encode = self.pipeline.builder.encode
        return [(ids, self.made_alone(ids)) for ids in (encode(text) for text in item_chunks(other_item))]

    def segments(self, caches, picks: Sequence[torch.Tensor | None] | None = None) -> list[Segment]:
        picks = picks or [None] * len(caches)
        return [self.prefix(), *(Segment(ids, "chunk", cached=kv, recompute=p)
                                 for ids, kv, p in zip(self.pieces.chunks, caches, picks)),
                Segment(self.pieces.question, "question")]

    def judge(self, result) -> dict[str, float]:
        answer_kl, agreement = answer_divergence(self.forced_full, self.forced(result.keys, result.values))
        return {"answer_kl": answer_kl, "token_agreement": agreement,
                "kl": kl_divergence(self.full_logits, result.logits),
                "recompute_fraction": result.recompute_fraction}


def diagnose_item(pipeline, item: QAItem, budgets: Sequence[float], check_layer: int,
                  contexts: Sequence[str] = CONTEXTS, other_item: QAItem | None = None) -> dict:
    """Every figure of the module doc for one item; ``other_item`` gives the ``foreign``
    context its passages (without it that context is the system prompt alone)."""
    it = _Item(pipeline, item)
    adapter = it.adapter
    warm_ids, _ = pipeline._warm_context()
    warm_kv = it.made_alone(warm_ids) if warm_ids else None
    row: dict = {"item": item.index, "chunk_tokens": sum(b - a for a, b in it.spans),
                 "answer": it.answer_text, "contexts": {}}
    system, foreign, corpus = None, None, (None, None)
    if "foreign" in contexts and other_item is not None:
        foreign = it.foreign(other_item)
    if "corpus" in contexts and other_item is not None:
        corpus_ids = [t for text in item_chunks(other_item)[:CORPUS_PASSAGES] for t in pipeline.builder.encode(text)]
        corpus = (it.made_alone(corpus_ids), corpus_ids)
    for context in contexts:
        if context in ("previous", "other", "related") and system is None:
            system = it.make_caches("system")
        made_after = corpus if context == "corpus" else (warm_kv, warm_ids)
        caches = it.make_caches(context, *made_after, system, foreign)
        if context == "system":
            system = caches
        reuse = blended_prefill(adapter, it.segments(caches))
        mask = torch.zeros(reuse.num_tokens, dtype=torch.bool)
        for a, b in it.spans:
            mask[a:b] = True
        dev_k = [float(relative_deviation(k[:, mask], f[:, mask]).mean()) for k, f in zip(reuse.keys, it.full_keys)]
        per_layer_v = [relative_deviation(v, f) for v, f in zip(reuse.values, it.full_values)]
        dev_v = [float(d[mask].mean()) for d in per_layer_v]
        v_mean = torch.stack(per_layer_v[1:]).mean(dim=0)  # layer 0 is exact for every token
        entry = {"layers_k": dev_k, "layers_v": dev_v, "positions_v": position_profile(v_mean, it.spans),
                 "reuse": it.judge(reuse), "selectors": {}}
        for budget in budgets:
            for name in SELECTORS:
                entry["selectors"][f"{name}@{budget:g}"] = it.judge(
                    select_and_run(it, caches, name, budget, check_layer, v_mean))
        row["contexts"][context] = entry
    return row


def select_and_run(it: _Item, caches, name: str, budget: float, check_layer: int, v_mean: torch.Tensor | None):
    """The blended prefill of ``caches`` with ``budget`` of each chunk recomputed as
    selector ``name`` (of :data:`SELECTORS`) picks; ``v_mean``, the V deviation per token,
    is read by ``oracle`` alone."""
    adapter = it.adapter
    if name == "cacheblend":
        return blended_prefill(adapter, it.segments(caches), hooks=[DeviationCheck(layer=1, ratio=budget)])
    if name == "firstk":
        picks = [first_tokens(b - a, count_for(budget, b - a)) for a, b in it.spans]
    elif name == "oracle":
        picks = top_per_chunk(v_mean, it.spans, budget)
    else:
        segments = it.segments(caches)
        if name == "qguided":
            chosen = question_guided(adapter, segments, check_layer, ratio=budget)
            picks = chosen[1:-1]
        else:  # sink+q: the first tokens of each chunk, then the question's choice over the rest
            sinks = [first_tokens(b - a, split_budget(count_for(budget, b - a))[0]) for a, b in it.spans]
            rest = sum(split_budget(count_for(budget, b - a))[1] for a, b in it.spans)
            probe = [replace(s, recompute=p) for s, p in zip(segments, [None, *sinks, None])]
            chosen = question_guided(adapter, probe, check_layer, total=rest + sum(len(s) for s in sinks))
            picks = [_merge(s, c, count_for(budget, b - a))
                     for s, c, (a, b) in zip(sinks, chosen[1:-1], it.spans)]
    return blended_prefill(adapter, it.segments(caches, picks))


def _merge(sinks: torch.Tensor, chosen: torch.Tensor | None, count: int) -> torch.Tensor:
    """The sink tokens, then the question's picks not among them, ``count`` in all."""
    extra = [int(t) for t in (chosen if chosen is not None else []) if int(t) not in set(sinks.tolist())]
    return torch.tensor(sorted(sinks.tolist() + extra[:max(0, count - sinks.numel())]), dtype=torch.long)


def summarize(rows: Sequence[dict]) -> dict:
    """Means over items, per context: layer and position profiles, and each selection's figures."""
    out: dict = {}
    contexts = rows[0]["contexts"].keys() if rows else ()
    for context in contexts:
        entries = [r["contexts"][context] for r in rows]
        mean = lambda values: statistics.fmean(values) if values else math.nan  # noqa: E731
        layers = len(entries[0]["layers_v"])
        runs = {"reuse": [e["reuse"] for e in entries]}
        for label in entries[0]["selectors"]:
            runs[label] = [e["selectors"][label] for e in entries]
        out[context] = {
            "layers_k": [mean([e["layers_k"][i] for e in entries]) for i in range(layers)],
            "layers_v": [mean([e["layers_v"][i] for e in entries]) for i in range(layers)],
            "positions_v": {b: mean([e["positions_v"][b] for e in entries]) for b in entries[0]["positions_v"]},
            "runs": {label: {key: mean([r[key] for r in figures]) for key in figures[0]}
                     for label, figures in runs.items()},
        }
    return out


def run_diagnose(lm, config: Config, items: Sequence[QAItem], budgets: Sequence[float],
                 contexts: Sequence[str] = CONTEXTS,
                 on_item: Callable[[int, int], None] | None = None) -> dict:
    """:func:`diagnose_item` over ``items`` on a scratch pipeline; rows and their summary."""
    from cachecraft.policy.planner import layer_at

    check_layer = layer_at(config.policy_check_layer, lm.adapter.num_layers)
    rows = []
    with scratch_pipeline(lm, config) as pipeline:
        for i, item in enumerate(items):
            other = items[(i + 1) % len(items)] if len(items) > 1 else None
            rows.append(diagnose_item(pipeline, item, budgets, check_layer, contexts, other))
            if on_item:
                on_item(i + 1, len(items))
    return {"check_layer": check_layer, "budgets": list(budgets), "contexts": list(contexts),
            "rows": rows, "summary": summarize(rows)}
