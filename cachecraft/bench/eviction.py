"""``cachecraft bench eviction``: the eviction policies on a long trace, without the model.

``bench workload --evictions`` compares the policies on the real model, so its traces
are short (each request is a prefill) and mostly first-time lookups. This replay asks
only what eviction decides: the same kind of trace (Zipf popularity over a MuSiQue-format
file's items, top-k retrieval over the pooled passages, see
:func:`cachecraft.bench.workload.build_trace`) but thousands of requests long, replayed
chunk by chunk through each policy with a byte budget. Sizes are the chunks' KV bytes
(their token counts under the model's tokenizer and shape), costs the prefill seconds
the store assigns them, each chunk one variant, and a chunk re-entering after eviction
is put with no carried hits, as a put into the store is (a policy that remembers the
keys it evicted, like ``decay``, brings back its own count). A request's own chunks
are never evicted to make room for each other.

Hit rate counts chunk lookups served from the cache; compute saved is the prefill cost
of those lookups over the cost of all lookups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from cachecraft.kv import kv_bytes_per_token
from cachecraft.store.eviction import EntryInfo, estimate_cost_s, make_policy

DEFAULT_BUDGETS = (0.05, 0.1, 0.25)
DEFAULT_POLICIES = ("lru", "lfu", "pgdsf", "decay", "cachecraft")


@dataclass(frozen=True)
class ReplayResult:
    """How one policy did on the trace under one budget."""

    policy: str
    budget_bytes: int
    lookups: int
    hits: int
    compute_saved: float
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy, "budget_bytes": self.budget_bytes, "lookups": self.lookups,
                "hits": self.hits, "hit_rate": self.hit_rate, "compute_saved": self.compute_saved,
                "evictions": self.evictions}


def replay(requests: Sequence[Sequence[str]], sizes: Mapping[str, int], costs: Mapping[str, float],
           budget_bytes: int, policy: str) -> ReplayResult:
    """Replay ``requests`` (each its chunks' keys, in order) through a fresh ``policy``
    holding at most ``budget_bytes``; a chunk larger than the budget is never kept."""
    assert budget_bytes > 0, f"budget must be positive, got {budget_bytes}"
    tier = make_policy(policy)
    used = hits = evictions = 0
    saved = total = 0.0
    for chunks in requests:
        for key in chunks:
            total += costs[key]
            if key in tier:
                tier.on_hit(key)
                hits += 1
                saved += costs[key]
                continue
            size = sizes[key]
            if size > budget_bytes:
                continue
            while used + size > budget_bytes:
                victim = tier.victim(exclude=chunks)
                if victim is None:  # only this request's chunks are left: do not keep this one
                    break
                tier.on_evict(victim)
                used -= sizes[victim]
                evictions += 1
            if used + size <= budget_bytes:
                tier.on_put(EntryInfo(key, key, size, costs[key]))
                used += size
    lookups = sum(len(chunks) for chunks in requests)
    return ReplayResult(policy, budget_bytes, lookups, hits, saved / total if total else 0.0, evictions)


def run_eviction(requests: Sequence[Sequence[str]], sizes: Mapping[str, int], costs: Mapping[str, float],
                 policies: Sequence[str], budget_fractions: Sequence[float]) -> dict:
    """Every policy at every budget (a fraction of the distinct chunks' total bytes);
    returns ``{"rows": [...], "summary": {...}}``."""
    distinct = {key for chunks in requests for key in chunks}
    corpus_bytes = sum(sizes[k] for k in distinct)
    rows = []
    for fraction in budget_fractions:
        budget = max(1, int(fraction * corpus_bytes))
        for policy in policies:
            rows.append({"budget_fraction": fraction, **replay(requests, sizes, costs, budget, policy).to_dict()})
    best = {}
    for fraction in budget_fractions:
        mine = [r for r in rows if r["budget_fraction"] == fraction]
        top = max(mine, key=lambda r: (r["compute_saved"], r["hit_rate"]))
        best[str(fraction)] = top["policy"]
    return {"rows": rows, "summary": {"distinct_chunks": len(distinct), "corpus_bytes": corpus_bytes,
                                      "lookups": sum(len(c) for c in requests),
                                      "best_policy_by_budget": best}}


def chunk_sizes_and_costs(lm, texts, kv_dtype: str) -> tuple[dict[str, int], dict[str, float]]:
    """Each chunk text's KV bytes under ``lm``'s tokenizer and shape (stored as ``kv_dtype``),
    and the prefill seconds the store would credit it with."""
    adapter = lm.adapter
    per_token = kv_bytes_per_token(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, kv_dtype)
    tokens = {t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts}
    return ({t: max(1, n * per_token) for t, n in tokens.items()},
            {t: estimate_cost_s(n, adapter.num_layers) for t, n in tokens.items()})


def run_replay(lm, items, *, requests: int, top_k: int, zipf_s: float, seed: int, kv_dtype: str,
               policies: Sequence[str] = DEFAULT_POLICIES, budget_fractions: Sequence[float] = DEFAULT_BUDGETS,
               embed: Callable, shift_every: int = 0) -> dict:
    """Build the trace (as ``bench workload`` does) and replay it under every policy and
    budget; the result's payload fields, ``corpus_chunks`` included."""
    from cachecraft.bench.workload import build_trace

    trace, corpus = build_trace(items, requests, top_k, zipf_s=zipf_s, seed=seed, embed=embed,
                                shift_every=shift_every)
    sizes, costs = chunk_sizes_and_costs(lm, {t for r in trace for t in r.chunks}, kv_dtype)
    result = run_eviction([r.chunks for r in trace], sizes, costs, policies, budget_fractions)
    return {"items": len(items), "corpus_chunks": corpus, "requests": requests, "top_k": top_k, "zipf": zipf_s,
            "seed": seed, "shift_every": shift_every, **result}
