"""Attention statistics of chunks as they are computed (for CCI), and chunk-cache creation."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from cachecraft.engine import BlendResult, LayerHook, LayerView, Layout, PromptError, Segment, blended_prefill
from cachecraft.kv import AttentionStats, ChunkKV
from cachecraft.model.adapter import ArchAdapter


class ChunkStatistics(LayerHook):
    """Gathers, at ``layers`` (every layer when None), the attention mass each token of a
    ``collect_stats`` segment puts on every segment, and attaches the resulting
    :class:`AttentionStats` to that segment's saved ChunkKV. Each layer costs about one
    more attention pass (through the fused kernel)."""

    def __init__(self, layers: Sequence[int] | None = None):
        self.layers = None if layers is None else tuple(int(x) for x in layers)
        self._rows: dict[int, list[torch.Tensor]] = {}  # per collect_stats segment: [T, S] per layer
        self._bounds: list[tuple[int, int]] = []
        self._inside: torch.Tensor | None = None  # [N] bool: in a collect_stats segment

    def start(self, layout: Layout) -> None:
        self._bounds = layout.bounds
        self._rows = {i: [] for i, s in enumerate(layout.segments) if s.collect_stats}
        wanted = set(range(layout.num_layers)) if self.layers is None else set(self.layers)
        if self._rows and not wanted & set(range(layout.num_layers)):
            raise PromptError(f"statistics were asked for at layers {sorted(wanted)}, none of the "
                              f"model's {layout.num_layers}")
        self._inside = torch.zeros(layout.n_total, dtype=torch.bool, device=layout.token_ids.device)  # [N]
        for i in self._rows:
            self._inside[slice(*layout.bounds[i])] = True

    def observe(self, view: LayerView) -> None:
        if not self._rows:
            return None
        rows = self._inside[view.active]  # [n]
        mass = view.segment_mass(rows)  # [r, S]
        pos = view.active[rows]  # [r]
        for i, gathered in self._rows.items():
            lo, hi = self._bounds[i]
            gathered.append(mass[(pos >= lo) & (pos < hi)])
        return None

    def finish(self, result: BlendResult) -> None:
        for i, rows in self._rows.items():
            if i in result.saved:
                result.saved[i] = replace(result.saved[i], stats=stats_from_rows(rows, i))
        self._rows = {}


def stats_from_rows(rows: list[torch.Tensor], index: int) -> AttentionStats:
    """Turn the per-layer ``[T, S]`` masses of segment ``index`` into its :class:`AttentionStats`."""
    assert rows, "statistics were requested but not gathered"
    mass = torch.stack(rows).float().cpu()  # [L, T, S]
    return AttentionStats(outside=mass[:, :, :index].sum(dim=-1), inter=mass[:, :, :index].sum(dim=1),
                          intra=mass[:, :, index].sum(dim=1))


def create_chunk_cache(adapter: ArchAdapter, before: Sequence[Segment], chunk_ids: Sequence[int], *,
                       fingerprint: str, key: str = "", collect_stats: bool = True,
                       stats_layers: Sequence[int] | None = None) -> ChunkKV:
    """The KV of ``chunk_ids`` computed after the segments ``before`` (system prefix,
    perhaps earlier chunks, cached or not), with those rows dropped, plus its
    attention statistics (at ``stats_layers``, every layer when None)."""
    chunk = Segment(chunk_ids, "chunk", save=True, collect_stats=collect_stats, key=key)
    hooks = [ChunkStatistics(stats_layers)] if collect_stats else []
    result = blended_prefill(adapter, [*before, chunk], hooks=hooks, fingerprint=fingerprint)
    return result.saved[len(before)]
