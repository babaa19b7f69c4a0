"""The question-guided look-ahead: recompute the chunk tokens the question looks at.

Runs only the uncached tokens (the question, and any uncached chunk) up to the
check layer over the cached KV, takes the attention mass the question puts on every
cached chunk token there, and picks the top tokens. Cheap: a few dozen queries, a
few layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from cachecraft.engine import LayerHook, LayerView, blended_prefill
from cachecraft.selection.static import count_for


class TokenAttention(LayerHook):
    """At ``layer``, the attention mass the question (last segment) puts on each key
    token, summed over its tokens: ``mass`` ``[N]``."""

    def __init__(self, layer: int):
        self.layer = int(layer)
        self.layers = (self.layer,)
        self.mass: torch.Tensor | None = None

    def start(self, layout) -> None:
        self.mass = None

    def observe(self, view: LayerView) -> None:
        self.mass = view.mass_per_key(view.rows_of(-1))
        return None


def question_mass(adapter, segments, check_layer: int) -> torch.Tensor:
    """The attention mass ``[N]`` the question (last segment) puts on every token of the
    prompt at ``check_layer``, from the cached KV as stored: only the uncached tokens run,
    up to that layer, and nothing is recomputed or saved."""
    probe_segments = [replace(s, recompute=None, stop_layer=None, save=False, collect_stats=False)
                      for s in segments]
    look = TokenAttention(check_layer)
    blended_prefill(adapter, probe_segments, hooks=[look], until_layer=check_layer + 1)
    assert look.mass is not None, f"check layer {check_layer} is not below the model's {adapter.num_layers} layers"
    return look.mass


def chunk_attention(adapter, segments, check_layer: int, skip: Sequence[int]) -> list[float | None]:
    """Per segment, the attention mass the question puts at ``check_layer`` on a fixable
    cached chunk's tokens after its first ``skip[i]`` (None for every other segment)."""
    mass = question_mass(adapter, segments, check_layer).float().cpu()
    out: list[float | None] = []
    start = 0
    for seg, first in zip(segments, skip):
        end = start + len(seg.token_ids)
        fixable = seg.cached is not None and seg.role == "chunk" and seg.fixable
        out.append(float(mass[start + min(first, end - start):end].sum()) if fixable else None)
        start = end
    return out


def question_guided(adapter, segments, check_layer: int, ratio: float | None = None,
                    total: int | None = None,
                    chosen_before: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
    """Local indices to recompute per segment, chosen by where the question looks at
    ``check_layer``: the top tokens over all fixable cached chunks together, ``ratio``
    of them or ``total`` tokens. Segments with ``fixable=False`` are neither probed
    for nor given tokens (None). ``chosen_before`` (per segment, local indices or None):
    tokens already chosen another way; they are not candidates (``ratio`` and ``total``
    count the new picks), and each segment's result holds them as well as its new picks."""
    assert (ratio is None) != (total is None), "give either ratio or total"
    mass = question_mass(adapter, segments, check_layer)
    spans, start = [], 0
    for seg in segments:
        end = start + len(seg.token_ids)
        if seg.cached is not None and seg.role == "chunk" and seg.fixable:
            spans.append((start, end))
        start = end
    picks: list[torch.Tensor | None] = [None] * len(segments)
    if not spans:
        return picks
    taken = torch.zeros(mass.numel(), dtype=torch.bool, device=mass.device)
    start = 0
    for seg, before in zip(segments, chosen_before or [None] * len(segments)):
        if before is not None and len(before):
            taken[start + torch.as_tensor(before, dtype=torch.long, device=mass.device)] = True
        start += len(seg.token_ids)
    candidates = torch.cat([torch.arange(a, b, device=mass.device) for a, b in spans])
    count = count_for(ratio, candidates.numel()) if ratio is not None else min(total, candidates.numel())
    candidates = candidates[~taken[candidates]]
    count = max(0, min(count, candidates.numel()))
    chosen = torch.cat([candidates[mass[candidates].topk(count).indices], taken.nonzero().squeeze(1)])
    # Split on the host, after one copy: on a GPU, a mask per segment made the host wait for
    # the device once a chunk.
    chosen = chosen.sort().values.cpu()
    start = 0
    for i, seg in enumerate(segments):
        end = start + len(seg.token_ids)
        if seg.cached is not None and seg.role == "chunk" and seg.fixable:
            lo, hi = torch.searchsorted(chosen, torch.tensor([start, end])).tolist()
            picks[i] = chosen[lo:hi] - start
        start = end
    return picks
