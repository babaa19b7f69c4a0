"""CacheBlend's deviation check (HKVD): recompute the tokens whose KV moved most."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cachecraft.engine.hooks import LayerHook, LayerView


@dataclass(frozen=True)
class DeviationCheck(LayerHook):
    """At ``layer`` compute fresh K/V for every token and keep running the ``ratio`` of
    fixable cached chunk tokens whose ``kind`` ("v" or "k") deviates most from the cache."""

    layer: int = 1
    ratio: float = 0.15
    kind: str = "v"
    needs_every_token = True  # layers below the check run for every token

    def __post_init__(self) -> None:
        assert self.layer >= 1, "the deviation check needs layer >= 1 (layer 0 KV is context-free)"
        assert 0.0 <= self.ratio <= 1.0, f"ratio must be within [0, 1], got {self.ratio}"
        assert self.kind in ("k", "v"), f"kind must be 'k' or 'v', got {self.kind!r}"

    @property
    def layers(self) -> tuple[int, ...]:
        return (self.layer,)

    def select(self, view: LayerView) -> torch.Tensor:
        """Uncached and forced tokens, plus the most deviating candidates: ``[n]`` bool."""
        candidates = (view.fixable & ~view.forced & ~view.must)[view.active]  # [n]
        cand_idx = candidates.nonzero().squeeze(1)
        fresh, cached = (view.v, view.values) if self.kind == "v" else (view.k, view.keys)
        picked = top_deviation(fresh[:, cand_idx], cached[:, view.active[cand_idx]], self.ratio)
        keep = (view.must | view.forced)[view.active]
        keep[cand_idx[picked]] = True
        return keep


def top_deviation(fresh: torch.Tensor, cached: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices of the ``ratio`` of rows (``fresh``/``cached``: ``[H_kv, c, D]``) with the
    largest squared deviation, rounded up."""
    if fresh.shape[1] == 0 or ratio <= 0:
        return torch.empty(0, dtype=torch.long, device=fresh.device)
    deviation = (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))  # [c]
    count = min(deviation.numel(), math.ceil(ratio * deviation.numel()))
    return deviation.topk(count).indices
