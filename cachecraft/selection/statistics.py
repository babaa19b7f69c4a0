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

    def __init__(self, layers: Sequence[int] | None = None, stride: int = 1, deferred: bool = False):
        """``stride``: read the attention of every ``stride``-th token of a segment only (its
        first token, then every ``stride``-th): the extra attention pass costs ``1/stride``
        as much, and the sums are scaled back up (see :func:`stats_from_rows`).
        ``deferred``: keep the sampled tokens' queries during the prefill and measure their
        attention only when :meth:`BlendResult.complete` is called, so a request that makes
        chunk-caches reaches its first token as soon as a plain prefill would (the saved
        chunks carry no statistics until then)."""
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        self.layers = None if layers is None else tuple(int(x) for x in layers)
        self.stride = int(stride)
        self.deferred = bool(deferred)
        self._rows: dict[int, list[torch.Tensor]] = {}  # per collect_stats segment: [T / stride, S] per layer
        self._views: list[LayerView] = []  # deferred: the sampled tokens' view of each layer, to measure later
        self._bounds: list[tuple[int, int]] = []
        self._inside: torch.Tensor | None = None  # [N] bool: a sampled token of a collect_stats segment

    def start(self, layout: Layout) -> None:
        self._bounds = layout.bounds
        self._rows = {i: [] for i, s in enumerate(layout.segments) if s.collect_stats}
        self._views = []
        wanted = set(range(layout.num_layers)) if self.layers is None else set(self.layers)
        if self._rows and not wanted & set(range(layout.num_layers)):
            raise PromptError(f"statistics were asked for at layers {sorted(wanted)}, none of the "
                              f"model's {layout.num_layers}")
        self._inside = torch.zeros(layout.n_total, dtype=torch.bool, device=layout.token_ids.device)  # [N]
        for i in self._rows:
            lo, hi = layout.bounds[i]
            self._inside[lo:hi:self.stride] = True

    def observe(self, view: LayerView) -> None:
        if not self._rows:
            return None
        rows = self._inside[view.active]  # [n]
        if self.deferred:
            self._views.append(view.narrowed(rows))
        else:
            _gather(self._rows, self._bounds, view.segment_mass(rows), view.active[rows])
        return None

    def finish(self, result: BlendResult) -> None:
        gathered, bounds, views, stride = self._rows, self._bounds, self._views, self.stride
        self._rows, self._views = {}, []  # one prefill at a time: what is left belongs to this result

        def attach() -> None:
            for view in views:
                everything = torch.ones(view.active.numel(), dtype=torch.bool, device=view.active.device)
                _gather(gathered, bounds, view.segment_mass(everything), view.active)
            for i, rows in gathered.items():
                if i in result.saved:
                    lo, hi = bounds[i]
                    result.saved[i] = replace(result.saved[i], stats=stats_from_rows(rows, i, hi - lo, stride))

        if views:
            result.deferred.append(attach)
        else:
            attach()


def _gather(rows: dict[int, list[torch.Tensor]], bounds: Sequence[tuple[int, int]], mass: torch.Tensor,
            positions: torch.Tensor) -> None:
    """Append to each segment's list the rows of ``mass`` (``[r, S]``) its tokens own."""
    for i, gathered in rows.items():
        lo, hi = bounds[i]
        gathered.append(mass[(positions >= lo) & (positions < hi)])


def stats_from_rows(rows: list[torch.Tensor], index: int, tokens: int | None = None,
                    stride: int = 1) -> AttentionStats:
    """Turn the per-layer ``[T, S]`` masses of segment ``index`` into its :class:`AttentionStats`.

    With ``stride`` > 1 the rows are those of tokens 0, stride, 2*stride, ... of the
    segment's ``tokens``: each sampled token stands for the ``stride`` tokens from it on
    (its ``outside`` repeated over them), and the sums count it that many times, so a
    segment's ``inter`` and ``intra`` still add up to its ``tokens`` per layer."""
    assert rows, "statistics were requested but not gathered"
    mass = torch.stack(rows).float().cpu()  # [L, r, S]
    if stride > 1:
        assert tokens is not None and mass.shape[1] == -(-tokens // stride), "one row per sampled token"
        weight = torch.full((mass.shape[1],), float(stride))
        weight[-1] = tokens - stride * (mass.shape[1] - 1)  # the last sample stands for what is left
        outside = mass[:, :, :index].sum(dim=-1).repeat_interleave(weight.long(), dim=1)
        weighted = mass * weight[None, :, None]
        return AttentionStats(outside=outside, inter=weighted[:, :, :index].sum(dim=1),
                              intra=weighted[:, :, index].sum(dim=1))
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
