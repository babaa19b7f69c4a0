"""Static selectors: tokens to recompute chosen before the prefill, from stored
statistics or by position."""

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


def spread_tokens(num_tokens: int, count: int, start: int = 0) -> torch.Tensor:
    """``count`` tokens spread evenly over ``[start, num_tokens)``, each in the middle of its
    share: token ``start + (2i + 1) * span // (2 * count)`` for ``i < count``. An even sample
    of the chunk, which the drift shift measures the whole chunk's drift by."""
    span = max(0, num_tokens - start)
    count = min(count, span)
    if count <= 0:
        return torch.empty(0, dtype=torch.long)
    return start + (2 * torch.arange(count) + 1) * span // (2 * count)
