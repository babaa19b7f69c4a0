"""The prompt as the engine sees it: segments, where they sit, what each token needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from cachecraft.config import DRIFT_ESTIMATORS
from cachecraft.engine.attention import _AttentionPlan, _SegmentMass

ROLES = ("prefix", "chunk", "question")


class LayerSource(Protocol):
    """Anything that can hand the engine one layer of cached KV at a time."""

    num_tokens: int

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PromptError(ValueError):
    """The prompt cannot be prefilled as given (empty, too long, inconsistent)."""


@dataclass
class Segment:
    """One run of the prompt: the system prefix, a chunk, or the question.

    ``cached``: stored KV for these tokens (None: compute them). ``recompute``: local
    indices of cached tokens to recompute anyway. ``stop_layer``: layers at or above
    it keep the cached KV even for recomputed tokens. ``fixable``: whether a selector
    may pick tokens here (chunks only). ``save``: return this (uncached) segment's KV
    as a :class:`ChunkKV`; ``collect_stats``: a hook must attach its attention
    statistics to it (``cachecraft.selection.ChunkStatistics``). ``drift_shift``
    (cached segments): at each layer, the cached tokens that are not recomputed move by
    this share of the mean change its recomputed tokens show there (fresh minus cached,
    K before RoPE and V); 0 keeps them as stored. ``drift_from``: recomputed tokens
    before this local index (a chunk's first tokens, which drift more than the rest) are
    fixed for their own sake and left out of that mean. ``drift_estimator``: how those
    tokens' changes make the move, per KV head and dimension (one of ``DRIFT_ESTIMATORS``;
    every shifting segment of a prompt takes the same): ``mean``; ``median``, so one token
    that drifted far does not move the whole chunk; ``shrunk``, the mean shrunk toward no
    move as far as the tokens disagree with each other; ``pooled``, the mean shrunk toward
    the prompt's mean change, as far as the chunks' means differ by no more than their
    tokens' disagreement explains.
    """

    token_ids: Sequence[int]
    role: str = "chunk"
    cached: LayerSource | None = None
    recompute: Sequence[int] | torch.Tensor | None = None
    stop_layer: int | None = None
    fixable: bool = True
    save: bool = False
    collect_stats: bool = False
    key: str = ""
    drift_shift: float = 0.0
    drift_from: int = 0
    drift_estimator: str = "mean"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PromptError(f"segment role must be one of {ROLES}, got {self.role!r}")
        if len(self.token_ids) == 0:
            raise PromptError(f"empty {self.role} segment")
        if self.cached is not None and self.cached.num_tokens != len(self.token_ids):
            raise PromptError(
                f"cached KV has {self.cached.num_tokens} tokens but the {self.role} segment has "
                f"{len(self.token_ids)}")
        if self.drift_estimator not in DRIFT_ESTIMATORS:
            raise PromptError(f"drift_estimator must be one of {DRIFT_ESTIMATORS}, got {self.drift_estimator!r}")
        if (self.save or self.collect_stats) and self.cached is not None:
            raise PromptError("save/collect_stats need a segment that is computed in full (not cached)")
        if not self.drift_shift >= 0.0:
            raise PromptError(f"drift_shift must be >= 0, got {self.drift_shift}")
        if self.drift_from < 0:
            raise PromptError(f"drift_from must be >= 0, got {self.drift_from}")


@dataclass
class Layout:
    """Where each segment sits and what each of the ``N`` prompt tokens needs; one per
    prefill. ``stop_at`` and ``recomputed`` change as the layers run (observers stop
    segments, selectors pick tokens); everything else is fixed."""

    segments: Sequence[Segment]
    bounds: list[tuple[int, int]]  # [lo, hi) of each segment
    starts: torch.Tensor  # [S] first position of each segment
    token_ids: torch.Tensor  # [N]
    num_layers: int
    must: torch.Tensor  # [N] bool: nothing cached, computed at every layer
    forced: torch.Tensor  # [N] bool: cached, but listed in its segment's ``recompute``
    fixable: torch.Tensor  # [N] bool: in a cached fixable chunk (a selector may pick it)
    context: torch.Tensor  # [N] bool: in a chunk (what recompute fractions count)
    stop_at: torch.Tensor  # [N] long: layer at which the token stops being recomputed
    recomputed: torch.Tensor  # [N] bool: computed fresh at layer 1 or above
    earliest_stop: int = 0  # no token's ``stop_at`` is below it (kept on the host, lowered by observers)
    # drift shift (None: no segment asks for it): each segment's share [S], the segment of
    # every token [N], the positions of the tokens in segments that shift [M], and which
    # tokens may measure the drift when recomputed [N] (those from each segment's drift_from)
    shift: torch.Tensor | None = None
    segment_of: torch.Tensor | None = None
    shifted: torch.Tensor | None = None
    samples_drift: torch.Tensor | None = None
    shift_estimator: str = "mean"  # how the shifting segments' samples make their move (Segment.drift_estimator)
    # made on first use by LayerView.segment_mass: the segment indicators, and the plan last
    # made for a subset of the running tokens, as (active, rows, plan)
    segment_mass: _SegmentMass | None = field(default=None, repr=False)
    sub_plan: tuple[torch.Tensor, torch.Tensor, _AttentionPlan] | None = field(default=None, repr=False)

    @property
    def n_total(self) -> int:
        return self.bounds[-1][1]


def make_layout(segments: Sequence[Segment], num_layers: int, limit: int, device: torch.device) -> Layout:
    """Check the prompt and lay it out: bounds, token masks, the layer each token stops at.

    The masks are built on the host and moved once: built on a GPU, each segment's slices
    cost a few kernel launches and each range check a wait for the device."""
    if not segments:
        raise PromptError("nothing to prefill: no segments")
    if segments[-1].cached is not None:
        raise PromptError("the last segment (the question) must be computed, not cached")
    bounds, start = [], 0
    for seg in segments:
        bounds.append((start, start + len(seg.token_ids)))
        start += len(seg.token_ids)
    n_total = bounds[-1][1]
    if n_total > limit:
        raise PromptError(f"prompt has {n_total} tokens, more than the model's context window of {limit}")
    token_ids = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long)
    must, forced, fixable, context = (torch.zeros(n_total, dtype=torch.bool) for _ in range(4))
    stop_at = torch.full((n_total,), num_layers, dtype=torch.long)
    for seg, (lo, hi) in zip(segments, bounds):
        context[lo:hi] = seg.role == "chunk"
        if seg.cached is None:
            must[lo:hi] = True
            continue
        if seg.stop_layer is not None:
            stop_at[lo:hi] = max(0, min(num_layers, int(seg.stop_layer)))
        if seg.fixable and seg.role == "chunk":
            fixable[lo:hi] = True
        if seg.recompute is not None:
            local = torch.as_tensor(seg.recompute, dtype=torch.long).cpu()
            if local.numel() and (int(local.min()) < 0 or int(local.max()) >= hi - lo):
                raise PromptError(f"recompute index out of range for a segment of {hi - lo} tokens")
            forced[lo + local] = True
    stop_at[must] = num_layers
    starts = torch.tensor([b[0] for b in bounds])
    earliest = min([num_layers] + [max(0, min(num_layers, int(s.stop_layer))) for s in segments
                                   if s.cached is not None and s.stop_layer is not None])
    shift = segment_of = shifted = samples_drift = None
    shares = [float(s.drift_shift) if s.cached is not None else 0.0 for s in segments]
    estimators = {s.drift_estimator for s, share in zip(segments, shares) if share}
    if len(estimators) > 1:
        raise PromptError(f"the shifting segments of one prompt must all take one drift estimator, "
                          f"got {sorted(estimators)}")
    if any(shares):
        shift = torch.tensor(shares)
        segment_of = torch.repeat_interleave(torch.arange(len(segments)),
                                             torch.tensor([hi - lo for lo, hi in bounds]))
        shifted = (shift[segment_of] > 0).nonzero().squeeze(1)
        samples_drift = torch.ones(n_total, dtype=torch.bool)
        for seg, (lo, hi) in zip(segments, bounds):
            samples_drift[lo:min(hi, lo + seg.drift_from)] = False

    def moved(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return Layout(segments, bounds, moved(starts), moved(token_ids), num_layers, moved(must), moved(forced),
                  moved(fixable), moved(context), moved(stop_at), moved(must | forced), earliest,
                  moved(shift), moved(segment_of), moved(shifted), moved(samples_drift),
                  estimators.pop() if estimators else "mean")
