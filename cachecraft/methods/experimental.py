"""Experimental selectors, kept for comparisons: ``qguided``, ``inter``, ``firstk``, ``spread``.

Each recomputes a fixed ratio of the cached chunk tokens on top of ``reuse``."""

from __future__ import annotations

from cachecraft.engine import Segment
from cachecraft.selection import count_for, first_tokens, question_guided, spread_tokens, top_inter_attention
from cachecraft.methods.base import LoadPlan, Method, PrefillHooks, RequestContext


class QuestionGuided(Method):
    """The cached tokens the question attends to most at the policy's check layer, found
    by running only the uncached tokens that far over the cached KV first."""

    name = "qguided"
    summary = "the tokens the question looks at most, at a fixed ratio"
    experimental = True
    takes_ratio = True
    default_ratio = 0.15

    def prepare(self, request: RequestContext, segments: list[Segment], load: LoadPlan | None) -> PrefillHooks:
        layer = select_question_guided(request.adapter, segments, request.policy.check_layer, ratio=self.ratio)
        return PrefillHooks(lookahead_layer=layer if any(s.cached is not None for s in segments) else None)


class _Static(Method):
    """A selector that picks each cached chunk's tokens before the prefill."""

    experimental = True
    takes_ratio = True
    default_ratio = 0.15

    def prepare(self, request: RequestContext, segments: list[Segment], load: LoadPlan | None) -> PrefillHooks:
        for seg in segments[1:-1]:
            if seg.cached is not None:
                seg.recompute = self.pick(seg, count_for(self.ratio, len(seg.token_ids)))
        return PrefillHooks()

    def pick(self, segment: Segment, count: int):
        raise NotImplementedError


class Inter(_Static):
    """The tokens that put the most attention outside their chunk when it was cached."""

    name = "inter"
    summary = "the tokens with the highest stored inter-attention"

    def pick(self, segment: Segment, count: int):
        stats = getattr(segment.cached, "stats", None)
        if stats is None:
            raise ValueError(f"method 'inter' needs attention statistics, and the cache of chunk "
                             f"{segment.key} has none")
        return top_inter_attention(stats, count)


class FirstK(_Static):
    """The first tokens of every chunk (EPIC's link fixing)."""

    name = "firstk"
    summary = "the first tokens of every chunk (EPIC-like)"

    def pick(self, segment: Segment, count: int):
        return first_tokens(len(segment.token_ids), count)


class Spread(_Static):
    """Tokens spread evenly over every chunk, and the chunk's other tokens moved by the mean
    drift those show at each layer (the engine's drift shift at its full share)."""

    name = "spread"
    summary = "tokens spread evenly over every chunk; the others move by the drift those show"

    def prepare(self, request: RequestContext, segments: list[Segment], load: LoadPlan | None) -> PrefillHooks:
        hooks = super().prepare(request, segments, load)
        for seg in segments[1:-1]:
            if seg.cached is not None:
                seg.drift_shift = 1.0
        return hooks

    def pick(self, segment: Segment, count: int):
        return spread_tokens(len(segment.token_ids), count)


def select_question_guided(adapter, segments: list[Segment], check_layer: int, ratio: float | None = None,
                           total: int | None = None, chosen_before=None) -> int:
    """Set each fixable cached chunk's recompute tokens from the question's look-ahead
    at ``check_layer`` (cut to the model's depth; ``chosen_before``: tokens chosen another
    way, kept); returns the layer used."""
    layer = min(check_layer, adapter.num_layers - 1)
    for seg, picked in zip(segments, question_guided(adapter, segments, layer, ratio=ratio, total=total,
                                                     chosen_before=chosen_before)):
        if picked is not None:
            seg.recompute = picked
    return layer
