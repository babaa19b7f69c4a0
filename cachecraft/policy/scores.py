"""Reusability scores of a cached chunk variant (Cache-Craft), as pure functions.

A variant of chunk C was computed after an ordered prefix of chunks S_old (the system
prefix always came first and is always shared, so it is left out of every score: its
attention sink would otherwise dominate). Per layer its statistics give
``inter[j]``, the attention mass C's tokens put on prefix chunk j, and ``intra``, the
mass they keep inside C.

- ``a = sum_j inter[j] / (|C| |C_j|)`` and ``b = intra / |C|^2``, averaged over layers.
- CCI, how much the chunk leans on outside context: the paper's ``sigmoid(a/b)``
  never drops below 0.5, so we use ``2 * sigmoid(a/b) - 1``, which is 0 for a chunk
  that ignores its context and tends to 1 for one that lives on it.
- beta, prefix overlap with the request's prefix S_new: the share of C's inter mass
  that went to chunks also in S_new.
- gamma, order penalty: discordant pairs / all pairs among the shared chunks
  (Kendall tau distance), weighted by ``order_weight`` (fitted; 1.0 is the paper's).
- ``beta' = beta * (1 - order_weight * gamma)``; ``CFO = alpha * CCI * (1 - beta')``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

import torch


@dataclass(frozen=True)
class VariantScore:
    """Why a variant needs the fix it gets: the numbers the catalog records."""

    cci: float
    beta: float
    gamma: float
    beta_prime: float
    cfo: float
    exact: bool


def layer_ab(inter: torch.Tensor, intra: torch.Tensor, chunk_tokens: int,
             prefix_tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer ``a`` and ``b`` from inter ``[L, P]`` and intra ``[L]`` masses."""
    sizes = torch.as_tensor(list(prefix_tokens), dtype=torch.float32)
    assert inter.shape[-1] == sizes.numel(), f"{inter.shape[-1]} inter columns for {sizes.numel()} prefix chunks"
    if sizes.numel() == 0:
        a = torch.zeros(intra.shape[0])
    else:
        a = (inter.float() / (chunk_tokens * sizes)).sum(dim=-1)
    b = intra.float() / chunk_tokens ** 2
    return a, b


def cci(inter: torch.Tensor, intra: torch.Tensor, chunk_tokens: int, prefix_tokens: Sequence[int]) -> float:
    """Cache Context Impact in [0, 1): ``2 * sigmoid(mean(a) / mean(b)) - 1``."""
    a, b = layer_ab(inter, intra, chunk_tokens, prefix_tokens)
    b_bar = float(b.mean())
    if b_bar <= 0:
        return 1.0 if float(a.mean()) > 0 else 0.0
    return 2.0 / (1.0 + math.exp(-float(a.mean()) / b_bar)) - 1.0


def prefix_overlap(inter_per_chunk: Sequence[float], old_prefix: Sequence[str], new_prefix: Sequence[str]) -> float:
    """beta: share of the inter mass (per old prefix chunk) that went to chunks also in
    the new prefix. With no old prefix chunks it is 1 when the new prefix is empty too
    (same context) and 0 otherwise."""
    assert len(inter_per_chunk) == len(old_prefix), "one inter mass per old prefix chunk"
    if not old_prefix:
        return 1.0 if not new_prefix else 0.0
    shared = set(new_prefix)
    total = float(sum(inter_per_chunk))
    if total <= 0:
        return 1.0 if set(old_prefix) <= shared else 0.0
    return float(sum(m for m, key in zip(inter_per_chunk, old_prefix) if key in shared)) / total


def order_penalty(old_prefix: Sequence[str], new_prefix: Sequence[str]) -> float:
    """gamma: discordant pairs / C(m, 2) over the m chunks in both prefixes (0 if m < 2)."""
    new_pos = {key: i for i, key in enumerate(new_prefix)}
    shared = [key for key in old_prefix if key in new_pos]
    pairs = list(combinations(shared, 2))
    if not pairs:
        return 0.0
    discordant = sum(1 for x, y in pairs if new_pos[x] > new_pos[y])  # x precedes y in old
    return discordant / len(pairs)


def score_variant(*, inter: torch.Tensor, intra: torch.Tensor, chunk_tokens: int,
                  prefix_tokens: Sequence[int], old_prefix: Sequence[str], new_prefix: Sequence[str],
                  alpha: float, order_weight: float = 1.0, cci_prior: float | None = None) -> VariantScore:
    """All scores of one variant for one request; ``inter`` covers the old prefix chunks
    only (system prefix excluded). ``cci_prior`` stands in for CCI when the variant was
    made with no prefix chunks, where CCI cannot be measured."""
    exact = tuple(old_prefix) == tuple(new_prefix)
    if exact:
        return VariantScore(0.0, 1.0, 0.0, 1.0, 0.0, True)
    if not old_prefix and cci_prior is not None:
        value = cci_prior
    else:
        value = cci(inter, intra, chunk_tokens, prefix_tokens)
    per_chunk = inter.float().mean(dim=0).tolist() if len(old_prefix) else []
    beta = prefix_overlap(per_chunk, old_prefix, new_prefix)
    gamma = order_penalty(old_prefix, new_prefix)
    beta_prime = beta * (1.0 - order_weight * gamma)
    cfo = alpha * value * (1.0 - beta_prime)
    return VariantScore(value, beta, gamma, beta_prime, cfo, False)


def tokens_to_recompute(cfo: float, chunk_tokens: int, floor: float = 0.0, ceiling: float = 1.0) -> int:
    """A chunk's recompute count: ``ceil(min(CFO, ceiling) * |C|)``, raised to at least
    ``floor(min(floor, ceiling) * |C|)``. The CFO's need rounds up; the floor rounds down,
    so a floor of 5% never spends more than 5% of any chunk (rounding it up spent 5.1%)."""
    need = math.ceil(min(cfo, ceiling, 1.0) * chunk_tokens - 1e-9)
    base = math.floor(min(floor, ceiling, 1.0) * chunk_tokens + 1e-9)
    return min(chunk_tokens, max(need, base))
