"""Token selectors: which cached tokens of a chunk to recompute.

Static selectors pick tokens before the prefill (from stored statistics or by
position); CacheBlend's deviation check runs inside the prefill instead
(:class:`cachecraft.engine.blend.DeviationCheck`).
"""

from __future__ import annotations

import math

import torch

from cachecraft.kv import AttentionStats


def count_for(ratio: float, num_tokens: int) -> int:
    """Tokens to recompute for a fraction ``ratio`` of ``num_tokens`` (rounded up)."""
    assert 0.0 <= ratio <= 1.0, f"ratio must be within [0, 1], got {ratio}"
    return min(num_tokens, math.ceil(ratio * num_tokens - 1e-9))


def top_inter_attention(stats: AttentionStats, count: int) -> torch.Tensor:
    """The ``count`` tokens that put the most attention outside their chunk when the
    cache was made (averaged over layers); sorted local indices."""
    assert stats is not None, "top_inter_attention needs a ChunkKV made with collect_stats=True"
    outside = stats.outside.float().mean(dim=0)  # [T]
    count = min(count, outside.numel())
    return outside.topk(count).indices.sort().values


def first_tokens(num_tokens: int, count: int) -> torch.Tensor:
    """The first ``count`` tokens of a chunk (EPIC-style link fixing)."""
    return torch.arange(min(count, num_tokens))


def question_guided(adapter, segments, check_layer: int, ratio: float | None = None,
                    total: int | None = None) -> list[torch.Tensor | None]:
    """Local indices to recompute per segment, chosen by where the question looks.

    Runs only the uncached tokens (the question, and any uncached chunk) up to
    ``check_layer`` over the cached KV, takes the attention mass the question puts on
    every cached chunk token there, and returns the top tokens over all fixable chunks
    together: ``ratio`` of them, or ``total`` tokens. Cheap: a few dozen queries, a few
    layers. Segments with ``fixable=False`` are neither probed for nor given tokens.
    """
    assert (ratio is None) != (total is None), "give either ratio or total"
    from dataclasses import replace

    from cachecraft.engine.blend import blended_prefill

    probe_segments = [replace(s, recompute=None, stop_layer=None, save=False, collect_stats=False)
                      for s in segments]
    probe = blended_prefill(adapter, probe_segments, token_attention_layers=[check_layer],
                            until_layer=check_layer + 1)
    mass = probe.token_attention[check_layer]
    spans, start = [], 0
    for seg in segments:
        end = start + len(seg.token_ids)
        if seg.cached is not None and seg.role == "chunk" and seg.fixable:
            spans.append((start, end))
        start = end
    picks: list[torch.Tensor | None] = [None] * len(segments)
    if not spans or (ratio is not None and ratio <= 0) or total == 0:
        return picks
    candidates = torch.cat([torch.arange(a, b) for a, b in spans])
    count = count_for(ratio, candidates.numel()) if ratio is not None else min(total, candidates.numel())
    chosen = candidates[mass[candidates].topk(count).indices]
    start = 0
    for i, seg in enumerate(segments):
        end = start + len(seg.token_ids)
        local = chosen[(chosen >= start) & (chosen < end)] - start
        if seg.cached is not None and seg.role == "chunk" and seg.fixable:
            picks[i] = local.sort().values
        start = end
    return picks
