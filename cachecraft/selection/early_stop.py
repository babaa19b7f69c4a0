"""The question's attention per segment, for adaptive early termination."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from cachecraft.engine import LayerHook, LayerView

OnMass = Callable[[int, torch.Tensor], dict[int, int]]


class QuestionAttention(LayerHook):
    """Records, at ``layers``, the attention mass the question (last segment) puts on
    each segment (``mass[layer]``: ``[S]``, summed over its tokens). ``on_mass(layer,
    mass)`` may return ``{segment index: stop layer}``: those cached segments stop
    being recomputed there (never below the next layer)."""

    def __init__(self, layers: Sequence[int], on_mass: OnMass | None = None):
        self.layers = tuple(int(x) for x in layers)
        self.on_mass = on_mass
        self.mass: dict[int, torch.Tensor] = {}

    def start(self, layout) -> None:
        self.mass = {}

    def observe(self, view: LayerView) -> dict[int, int] | None:
        mass = view.mass_per_segment(view.rows_of(-1)).sum(dim=0)  # [S]
        self.mass[view.layer] = mass
        return self.on_mass(view.layer, mass) if self.on_mass is not None else None
