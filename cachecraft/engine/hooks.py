"""Layer hooks: how callers choose tokens and watch attention inside the layer loop.

A hook is called at the layers it names (``layers``; None: every layer):

- ``start(layout)``: once, before layer 0 (reset state, check the request);
- ``select(view)``: after the running tokens' fresh K/V are computed and the cached
  K/V assembled, before the fresh rows overwrite the cached ones. A selector returns
  a bool mask over ``view.active`` of the tokens that keep running from this layer
  on (they count as recomputed), or None for no change;
- ``observe(view)``: after the layer's attention and MLP. An observer may return
  ``{segment index: stop layer}`` to stop recomputing cached segments early;
- ``finish(result)``: once, with the :class:`BlendResult` (attach what was gathered).

A hook with ``needs_every_token`` (CacheBlend's check compares every token's fresh
K/V with its cached K/V) makes every token run from layer 0 until a selector narrows
the set. One hook instance serves one prefill at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Collection, Sequence

import torch

from cachecraft.engine.attention import _AttentionPlan, _mass_per_key, _mass_per_segment, _SegmentMass
from cachecraft.engine.layout import Layout, Segment

if TYPE_CHECKING:
    from cachecraft.engine.blend import BlendResult


@dataclass
class LayerView:
    """One layer as a hook sees it. ``N``: prompt tokens, ``n``: tokens running this layer.

    Select phase: ``keys``/``values`` are the cached K (before RoPE) and V, rows of
    uncached segments undefined; ``k``/``v`` the fresh ones of ``active``. Observe
    phase: ``keys`` (RoPE applied) and ``values`` hold the fresh rows too; ``q`` is
    the rotated queries of ``active`` and ``plan`` the attention plan used for them.
    """

    layer: int
    layout: Layout
    active: torch.Tensor  # [n] positions, sorted
    keys: torch.Tensor  # [H_kv, N, D]
    values: torch.Tensor  # [H_kv, N, D]
    k: torch.Tensor | None = None  # [H_kv, n, D] select phase
    v: torch.Tensor | None = None  # [H_kv, n, D] select phase
    q: torch.Tensor | None = None  # [H, n, D] observe phase
    plan: _AttentionPlan | None = None  # observe phase
    scaling: float = 1.0
    gqa: bool = False

    @property
    def segments(self) -> Sequence[Segment]:
        return self.layout.segments

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return self.layout.bounds

    @property
    def must(self) -> torch.Tensor:
        return self.layout.must

    @property
    def forced(self) -> torch.Tensor:
        return self.layout.forced

    @property
    def fixable(self) -> torch.Tensor:
        return self.layout.fixable

    @property
    def context(self) -> torch.Tensor:
        return self.layout.context

    def rows_of(self, index: int) -> torch.Tensor:
        """``[n]`` bool: which running tokens belong to segment ``index`` (-1: the question)."""
        lo, hi = self.layout.bounds[index]
        return (self.active >= lo) & (self.active < hi)

    def mass_per_segment(self, rows: torch.Tensor) -> torch.Tensor:
        """Attention mass of the running tokens ``rows`` on each segment: ``[r, S]``
        (explicit probabilities: for a few queries)."""
        return _mass_per_segment(self.q[:, rows], self.keys, self.active[rows], self.layout.starts, self.scaling)

    def mass_per_key(self, rows: torch.Tensor) -> torch.Tensor:
        """Attention mass the running tokens ``rows`` put on each key token, summed: ``[N]``."""
        return _mass_per_key(self.q[:, rows], self.keys, self.active[rows], self.scaling)

    def segment_mass(self, rows: torch.Tensor) -> torch.Tensor:
        """Like :meth:`mass_per_segment` through the fused attention kernel: for many queries."""
        if not bool(rows.all()):
            return self.narrowed(rows).segment_mass(torch.ones(int(rows.sum()), dtype=torch.bool,
                                                               device=rows.device))
        lay = self.layout
        if lay.segment_mass is None:
            lay.segment_mass = _SegmentMass(lay.bounds, self.values.shape[0], self.values.shape[2],
                                            self.values.device, self.values.dtype)
        return lay.segment_mass(self.q, self.keys, self.plan, self.scaling, self.gqa)

    def narrowed(self, rows: torch.Tensor) -> "LayerView":
        """This observe-phase view for the running tokens ``rows`` only: their queries
        (copied) and an attention plan for them; keys and values shared. Kept, it lets a
        hook measure attention after the prefill has returned (the engine never writes
        into a finished layer's keys and values)."""
        lay = self.layout
        if lay.sub_plan is None or lay.sub_plan[0] is not self.active or not torch.equal(lay.sub_plan[1], rows):
            lay.sub_plan = (self.active, rows, _AttentionPlan(self.active[rows], lay.n_total))
        return replace(self, active=self.active[rows], q=self.q[:, rows], plan=lay.sub_plan[2], k=None, v=None)


class LayerHook:
    """The hook protocol, with no-op defaults: subclass it and override what you need."""

    layers: Collection[int] | None = None  # the layers it is called at; None: every layer
    needs_every_token: bool = False

    def start(self, layout: Layout) -> None:
        """Called once before layer 0."""

    def select(self, view: LayerView) -> torch.Tensor | None:
        """``[n]`` bool: the running tokens that keep running from this layer on; None: no change."""
        return None

    def observe(self, view: LayerView) -> dict[int, int] | None:
        """``{segment index: stop layer}`` for cached segments to stop recomputing; None: none."""
        return None

    def finish(self, result: "BlendResult") -> None:
        """Called once with the result."""
