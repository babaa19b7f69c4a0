"""``cachecraft``: the policy as a method.

Plan: per chunk, the stored variant with the lowest Cache Fix Overhead and a token
count from it (an exact prefix match recomputes nothing; with a ``pool``, part of the
counts given out again by CFO), raised where loading must be hidden; variants slower to
load than their chunk is to recompute are left out; a chunk planned to be mostly
recomputed is computed in full and kept as a new variant. Select: the planned counts go,
in total, to the cached tokens the question looks at most at the check layer (with a
drift shift: evenly over each chunk, whose other tokens then move by the drift those
show). Observe: with early termination on, chunks the question ignores stop recomputing.
A chunk order asked often enough (``exact_after_asks``, twice as often after a keep no ask
reused) whose chunks are not all stored as a full prefill's KV is computed in full once
instead, from its first such chunk on, and kept so: every later ask reuses it exactly and
answers as a full prefill does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from cachecraft.engine import Segment
from cachecraft.kv import ChunkKV, variant_key
from cachecraft.methods.base import LoadPlan, Method, PrefillHooks, RequestContext
from cachecraft.methods.experimental import select_question_guided
from cachecraft.policy.planner import (ChunkPlan, PolicyParams, RecomputePlan, VariantInfo, layer_at,
                                       plan_request)
from cachecraft.policy.rules import (can_keep_exact, early_stop_decision, exact_from, exact_history_limit,
                                     exact_wait, hide_loading, keep_in_full, pool_by_need, share_by_attention,
                                     worth_loading)
from cachecraft.selection import QuestionAttention, chunk_attention, first_tokens, spread_tokens


class CacheCraft(Method):
    """The Cache-Craft policy; the ratio is alpha, the scale of the Cache Fix Overhead."""

    name = "cachecraft"
    summary = "the policy: per-chunk variant and recompute from attention statistics"
    takes_ratio = True
    default_ratio = PolicyParams.alpha

    def __init__(self, ratio: float | None = None, check_layer: int | None = None, floor: float | None = None,
                 sink_tokens: int | None = None, early_stop: tuple[float, ...] | None = None,
                 drift_shift: float | None = None, drift_estimator: str | None = None,
                 relevance: float | None = None, pool: float | None = None):
        super().__init__(ratio)
        # None: the pipeline's (calibration and the benchmarks try others)
        self.check_layer, self.floor, self.sink_tokens = check_layer, floor, sink_tokens
        self.drift_shift, self.drift_estimator, self.relevance = drift_shift, drift_estimator, relevance
        self.pool = pool
        self.early_stop = early_stop  # layers or depths (as config early_stop_layers); () turns it off

    @property
    def label(self) -> str:
        """``cachecraft@alpha``, with ``/L<layer>``, ``/F<floor>``, ``/S<sink tokens>``,
        ``/D<drift shift>`` (``/D<estimator><drift shift>`` for an estimator other than the
        mean, e.g. ``/Dmedian0.5``), ``/D<estimator>`` alone (the estimator set, not the
        shift), ``/R<relevance>``, ``/P<pool>`` and ``/E<early-stop layers>`` where the method
        sets its own."""
        return (super().label + ("" if self.check_layer is None else f"/L{self.check_layer}")
                + ("" if self.floor is None else f"/F{self.floor:g}")
                + ("" if self.sink_tokens is None else f"/S{self.sink_tokens}")
                + self._drift_label()
                + ("" if self.relevance is None else f"/R{self.relevance:g}")
                + ("" if self.pool is None else f"/P{self.pool:g}")
                + ("" if self.early_stop is None else "/E" + (",".join(f"{x:g}" for x in self.early_stop) or "off")))

    def _drift_label(self) -> str:
        estimator = self.drift_estimator or ""
        shift = "" if self.drift_shift is None else f"{self.drift_shift:g}"
        if estimator == "mean" and shift:  # the mean is what a bare /D<shift> has always meant
            estimator = ""
        return f"/D{estimator}{shift}" if estimator or shift else ""

    def params(self, request: RequestContext) -> PolicyParams:
        """The request's policy parameters with this method's alpha (and check layer, floor,
        sink tokens, drift shift and estimator, relevance, pool, early-stop layers where it
        sets them)."""
        own = {"check_layer": self.check_layer, "floor": self.floor, "sink_tokens": self.sink_tokens,
               "drift_shift": self.drift_shift, "drift_estimator": self.drift_estimator, "relevance": self.relevance,
               "pool": self.pool}
        if self.early_stop is not None:
            layers = request.adapter.num_layers
            own["early_stop_layers"] = tuple(sorted({layer_at(x, layers) for x in self.early_stop}))
        return replace(request.policy, alpha=self.ratio, **{k: v for k, v in own.items() if v is not None})

    def load_plan(self, request: RequestContext) -> LoadPlan:
        lookup, keys = request.lookup, request.keys
        # a variant slower to load than its chunk is to recompute is left out: its chunk is
        # computed in full (a miss), and its statistics are not read
        loadable = lambda variant: worth_loading(lookup.load_fraction(variant))  # noqa: E731
        params = self.params(request)
        exact = exact_plan(request, params.exact_after_asks, loadable)
        if exact is not None:
            return exact
        infos = {key: lookup.variant_infos(key, request.prefix_key, keep=loadable) for key in dict.fromkeys(keys)}
        planned = pool_by_need(plan_request(keys, [len(c) for c in request.pieces.chunks], infos, params),
                               params.pool)
        planned = hide_loading(planned, [lookup.hide_fraction(p.variant) if p.variant else None
                                         for p in planned.chunks])
        plan = keep_in_full(planned, [lookup.variant_count(p.chunk, request.prefix_key) for p in planned.chunks])
        return LoadPlan(tuple(p.variant for p in plan.chunks), plan, tuple(p.variant for p in planned.chunks))

    def prepare(self, request: RequestContext, segments: list[Segment], load: LoadPlan | None) -> PrefillHooks:
        assert load is not None and load.plan is not None, "cachecraft prepares a request it planned"
        params = self.params(request)
        looked = place_plan_tokens(request.adapter, segments, load.plan, params.check_layer, params.sink_tokens,
                                   params.drift_shift, params.drift_estimator, params.relevance)
        hooks = PrefillHooks(lookahead_layer=min(params.check_layer, request.adapter.num_layers - 1)
                             if looked else None)
        if params.early_stop_layers:
            _observe_for_early_stop(hooks, segments, params)
        return hooks


def exact_plan(request: RequestContext, after_asks: int, loadable: Callable[[str], bool]) -> LoadPlan | None:
    """The plan that keeps a repeated chunk order exact (:func:`exact_from`): the chunks
    before the first one not stored exactly reuse their exact variants, nothing recomputed,
    and the rest are computed in full and kept; None where the order is not due for it."""
    if after_asks <= 0:
        return None
    lookup, keys, prefix = request.lookup, request.keys, request.prefix_key
    chained = [variant_key(key, (prefix, *keys[:i])) for i, key in enumerate(keys)]
    stored = [lookup.made_exactly(key, variant) and loadable(variant) for key, variant in zip(keys, chained)]
    if all(stored):
        return None  # every chunk reused exactly: the policy's plan recomputes nothing (no ask counted)
    asked, due = exact_wait(lookup.order_history(keys, exact_history_limit(after_asks)), after_asks)
    start = exact_from(asked, due, stored)
    if start is None:
        return None
    if not all(can_keep_exact(lookup.has_variant(key, variant), lookup.variant_count(key, prefix),
                              len(lookup.replaceable_variants(key, prefix, asked)))
               for key, variant in zip(keys[start:], chained[start:])):
        return None  # a chunk at its cap of variants, none of which may give way
    tokens = [len(ids) for ids in request.pieces.chunks]
    wanted = tuple(chained[i] if i < start else None for i in range(len(keys)))
    # a chunk computed in full although a variant of it is stored is still a hit, at 1.0
    independent = [lookup.independent_variant(key, prefix) for key in keys]
    found = tuple(variant or (other if other and loadable(other) else None)
                  for variant, other in zip(wanted, independent))
    plan = RecomputePlan(tuple(ChunkPlan(key, variant, None, 0 if variant else n, n)
                               for key, variant, n in zip(keys, wanted, tokens)),
                         notes=(f"this chunk order was asked {due} time(s) or more before: chunks "
                                f"{start + 1}-{len(keys)} computed in full and kept exact",))
    return LoadPlan(wanted, plan, found, asked_before=asked, exact_wait=due)


def _observe_for_early_stop(hooks: PrefillHooks, segments: list[Segment], params: PolicyParams) -> None:
    """Stop recomputing the chunks the question ignores at the early-stop layers."""
    chunk_segments = [i for i, s in enumerate(segments) if s.role == "chunk" and s.recompute is not None]
    stops = hooks.stops

    def decide(layer: int, mass: torch.Tensor) -> dict[int, int]:
        decision = early_stop_decision(layer, mass, [i for i in chunk_segments if i not in stops],
                                       params.early_stop_share)
        stops.update(decision)
        return decision

    hooks.layer_hooks.append(QuestionAttention(params.early_stop_layers, on_mass=decide))


def sink_counts(counts: list[int], sink_tokens: int) -> list[int]:
    """Of each chunk's planned count, how many go to its first tokens: ``min(count, sink_tokens)``."""
    return [min(count, sink_tokens) for count in counts]


def place_plan_tokens(adapter, segments: list[Segment], plan: RecomputePlan, check_layer: int,
                      sink_tokens: int = 0, drift_shift: float = 0.0, drift_estimator: str = "mean",
                      relevance: float = 0.0) -> bool:
    """Give the plan's token counts to the chunks: each chunk's first ``sink_tokens`` of its
    count to its first tokens, the rest, in total, where the question looks; with a
    ``drift_shift``, the rest of each chunk's count evenly over the rest of the chunk
    instead (a fair sample of its drift) and the chunk shifts by the drift those show (its
    first tokens left out of it; ``drift_estimator`` says how: the engine's
    ``Segment.drift_estimator``); there, with a ``relevance`` above 0, that share of the
    spread counts is first given out again by the question's attention to each chunk at
    the check layer (:func:`~cachecraft.policy.rules.share_by_attention`). Chunks the
    plan leaves alone are not candidates. Returns
    whether the question's look-ahead ran (its work counts toward the request's)."""
    chunk_segments = segments[1:-1]
    for seg, chunk_plan in zip(chunk_segments, plan.chunks):
        seg.fixable = seg.cached is not None and chunk_plan.count > 0
    counts = [p.count if seg.fixable else 0 for p, seg in zip(plan.chunks, chunk_segments)]
    sinks = sink_counts(counts, sink_tokens)
    total = sum(counts) - sum(sinks)
    if not sum(counts):
        return False
    if drift_shift > 0:
        spreads = [count - sink for count, sink in zip(counts, sinks)]
        looked = relevance > 0 and sum(seg.fixable for seg in chunk_segments) > 1 and sum(spreads) > 0
        if looked:
            mass = chunk_attention(adapter, segments, min(check_layer, adapter.num_layers - 1),
                                   [0, *sinks, 0])[1:-1]
            fixable = [i for i, seg in enumerate(chunk_segments) if seg.fixable]
            shared = share_by_attention([spreads[i] for i in fixable],
                                        [len(chunk_segments[i].token_ids) - sinks[i] for i in fixable],
                                        [mass[i] for i in fixable], relevance)
            for i, count in zip(fixable, shared):
                spreads[i] = count
        for seg, spread, sink in zip(chunk_segments, spreads, sinks):
            if seg.fixable:
                seg.recompute = torch.cat([first_tokens(len(seg.token_ids), sink),
                                           spread_tokens(len(seg.token_ids), spread, start=sink)])
                seg.drift_shift, seg.drift_estimator = drift_shift, drift_estimator
                seg.drift_from = sink  # the first tokens drift more than the rest: not a fair sample
        return looked
    if not sum(sinks):
        select_question_guided(adapter, segments, check_layer, total=total)
        return True
    before = [None, *(torch.arange(n) if seg.fixable else None for n, seg in zip(sinks, chunk_segments)), None]
    if total:
        select_question_guided(adapter, segments, check_layer, total=total, chosen_before=before)
        return True
    for seg, picked in zip(segments, before):  # the counts are all sinks: no look-ahead needed
        if picked is not None:
            seg.recompute = picked
    return False


def variant_info(kv: ChunkKV) -> VariantInfo:
    """Describe a stored variant for the planner (its system prefix left out)."""
    prefix, sizes = list(kv.prefix), list(kv.prefix_tokens) or [0] * len(kv.prefix)
    inter = kv.stats.inter if kv.stats is not None else torch.zeros(kv.num_layers, len(prefix))
    intra = kv.stats.intra if kv.stats is not None else torch.full((kv.num_layers,), float(kv.num_tokens))
    if prefix:  # the first prefix segment is the system prefix, shared by every request
        prefix, sizes, inter = prefix[1:], sizes[1:], inter[:, 1:]
    return VariantInfo(kv.variant, tuple(prefix), inter, intra, kv.num_tokens, tuple(sizes))
