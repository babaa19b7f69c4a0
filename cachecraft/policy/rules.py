"""The policy's rules around a plan (pure decisions, no model, no store).

- :func:`hide_loading`: CacheBlend's loading controller applied to a plan: a chunk
  whose cache comes from a slow tier recomputes at least the fraction that hides
  loading it (``r = max(r*, r_hide)``; see :mod:`cachecraft.policy.loading`).
- :func:`worth_loading`: a variant whose load takes longer than recomputing its whole
  chunk (``r_load >= 1``) is not loaded, nor planned with: its chunk is computed in full.
- :func:`room_for_variant`: a chunk keeps a new variant while it has fewer than
  :data:`MAX_VARIANTS_PER_CHUNK` under the request's system prompt.
- :func:`variant_to_replace`: at the cap, a variant made exactly (a looping answer's
  second try, a repeated order's keep) replaces the variant requests used least among
  those that may give way (:func:`may_give_way`): never ``warm``'s, an exact one only
  where requests reused it fewer times than the new one's order was asked.
- :func:`keep_in_full`: a chunk the plan would recompute mostly is computed in full
  instead, nothing loaded, while it has room for another variant; made in this
  request's context, it is then kept as a new variant.
- :func:`early_stop_decision`: adaptive early termination from the question's
  attention per chunk.
- :func:`share_by_attention`: a request's spread tokens given out again, part in
  proportion to the question's attention per chunk.
- :func:`pool_by_need`: a plan's counts given out again, part in proportion to each
  chunk's expected fix (its CFO), so that chunks whose variant was made in their real
  context pass their floor on.
- :func:`exact_from`: a chunk order asked often enough is computed in full once, from
  its first chunk not stored exactly on, so that every later ask reuses it exactly;
  :func:`exact_wait` says how often is enough (twice as often after a keep that served no
  ask; :func:`exact_history_limit`: how far back to look) and :func:`can_keep_exact`
  whether a chunk computed so can be kept.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Collection, Sequence

import torch

from cachecraft.policy.planner import RecomputePlan

MAX_VARIANTS_PER_CHUNK = 4
KEEP_FIXED_FRACTION = 0.5  # a chunk planned to be at least this much recomputed is computed in full
# a chunk order whose keeps keep being evicted unused waits at most 2**3 times the setting
EXACT_WAIT_DOUBLINGS = 3


def worth_loading(r_load: float | None) -> bool:
    """Whether a variant is worth loading: its tier's ``r_load`` (the fraction whose
    recompute hides its load; None where it is not stored) is under 1. At 1 or more,
    recomputing the whole chunk is done before its bytes would be (on an H100, Llama-3.1-8B's
    caches from disk take 3x a full prefill)."""
    return r_load is not None and r_load < 1.0


def room_for_variant(stored: int, cap: int = MAX_VARIANTS_PER_CHUNK) -> bool:
    """Whether a chunk with ``stored`` variants (under this system prompt) may keep
    another one made in this request: while it has fewer than ``cap``."""
    return stored < cap


def may_give_way(made_exactly: bool, hits: int, asked: int) -> bool:
    """Whether a chunk's variant (other than ``warm``'s, the fallback for every order) may
    give way at the chunk's cap to a new exact one whose order was ``asked`` times since
    it was last kept exact, or ever (0: a looping answer's second try): an inexact one
    always; one made exactly while requests reused it (``hits``) fewer times than that,
    since it then served fewer asks than the new one's order made. Without this, the
    first orders kept exact would hold a popular chunk's cap for good, however seldom
    they came back; an order kept out keeps counting, so it wins in the end."""
    return not made_exactly or hits < asked


def variant_to_replace(candidates: Sequence, exact: Collection[str] = ()) -> str | None:
    """The key of the variant a new exact one replaces at the cap, of ``candidates``
    (variant records the caller may replace; ``exact``: the keys of those made exactly):
    an inexact one before an exact one, then the one with the fewest hits, then the one
    used longest ago (never used: the oldest made); None without candidates."""
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.key in exact, r.hits,
                                          r.last_used if r.last_used is not None else r.created_at)).key


def hide_loading(plan: RecomputePlan, r_loads: Sequence[float | None]) -> RecomputePlan:
    """Raise each planned chunk's count to ``ceil(r * tokens)`` where it recomputes
    anything at all (``r_loads``: per chunk, the fraction ``r`` that hides loading its
    variant from its tier; None where nothing is loaded)."""
    assert len(r_loads) == len(plan.chunks), f"{len(r_loads)} load fractions for {len(plan.chunks)} chunks"
    chunks = []
    for chunk_plan, r_load in zip(plan.chunks, r_loads):
        if r_load is not None and chunk_plan.variant is not None and chunk_plan.count > 0:
            floor = math.ceil(r_load * chunk_plan.tokens)
            chunk_plan = replace(chunk_plan, count=min(chunk_plan.tokens, max(chunk_plan.count, floor)))
        chunks.append(chunk_plan)
    return replace(plan, chunks=tuple(chunks))


def keep_in_full(plan: RecomputePlan, variant_counts: Sequence[int],
                 threshold: float = KEEP_FIXED_FRACTION, cap: int = MAX_VARIANTS_PER_CHUNK) -> RecomputePlan:
    """Compute in full (variant None, every token counted) each chunk planned at
    ``threshold`` or more of recompute whose stored variants (``variant_counts``, per
    chunk) number fewer than ``cap``."""
    assert len(variant_counts) == len(plan.chunks), "one variant count per chunk"
    chunks = []
    for chunk_plan, stored in zip(plan.chunks, variant_counts):
        if chunk_plan.variant is not None and chunk_plan.fraction >= threshold and room_for_variant(stored, cap):
            chunk_plan = replace(chunk_plan, variant=None, count=chunk_plan.tokens)
        chunks.append(chunk_plan)
    return replace(plan, chunks=tuple(chunks))


def pool_by_need(plan: RecomputePlan, weight: float) -> RecomputePlan:
    """The plan with its reused, inexact chunks' counts given out again by
    :func:`share_by_attention`, ``weight`` of them in proportion to each chunk's CFO times
    its tokens: the total stays, a chunk whose variant needs no fix (CFO 0: made after the
    chunks it follows) gives its floor to those that do. Exact matches and chunks computed
    in full keep their counts; ``weight`` 0 or no CFO above 0: the plan as it is."""
    open_ = [i for i, p in enumerate(plan.chunks) if p.variant is not None and not p.score.exact]
    if weight == 0 or not open_:
        return plan
    chunks = list(plan.chunks)
    shared = share_by_attention([chunks[i].count for i in open_], [chunks[i].tokens for i in open_],
                                [chunks[i].score.cfo * chunks[i].tokens for i in open_], weight)
    for i, count in zip(open_, shared):
        chunks[i] = replace(chunks[i], count=count)
    return replace(plan, chunks=tuple(chunks))


def early_stop_decision(layer: int, question_mass: torch.Tensor, chunk_segments: Sequence[int],
                        share: float) -> dict[int, int]:
    """Adaptive early termination: chunks whose share of the question's attention
    (among chunks) is below ``share`` of an even split stop recomputing after ``layer``."""
    if not chunk_segments:
        return {}
    mass = question_mass[list(chunk_segments)].float()
    total = float(mass.sum())
    if total <= 0:
        return {}
    even = total / len(chunk_segments)
    return {seg: layer + 1 for seg, m in zip(chunk_segments, mass.tolist()) if m < share * even}


def share_by_attention(counts: Sequence[int], rooms: Sequence[int], mass: Sequence[float],
                       weight: float) -> list[int]:
    """The same total of tokens as ``counts`` (per chunk), given out again: each chunk
    wants ``(1 - weight) * count + weight * total * mass / sum(mass)`` (``mass``: the
    question's attention to it), never more than its ``rooms`` (tokens it can take).
    Whole tokens go first by the wanted amount rounded down, then one at a time to the
    chunk furthest below what it wants (the earlier on a tie), so a chunk at its room
    passes its excess on. ``weight`` 0, no total or no mass: ``counts`` as they are."""
    assert len(counts) == len(rooms) == len(mass), "one count, room and mass per chunk"
    assert 0.0 <= weight <= 1.0, f"weight must be within [0, 1], got {weight}"
    total, attention = sum(counts), float(sum(mass))
    if weight == 0 or total == 0 or attention <= 0:
        return list(counts)
    wanted = [(1 - weight) * c + weight * total * m / attention for c, m in zip(counts, mass)]
    given = [min(room, math.floor(w)) for room, w in zip(rooms, wanted)]
    left = min(total, sum(rooms)) - sum(given)
    while left > 0:
        open_ = [i for i in range(len(given)) if given[i] < rooms[i]]
        best = max(open_, key=lambda i: (wanted[i] - given[i], -i))
        given[best] += 1
        left -= 1
    return given


def exact_from(asked_before: int, after_asks: int, stored_exactly: Sequence[bool]) -> int | None:
    """The chunk from which a request computes its chunks in full, to keep them as a full
    prefill's KV under their exact prefixes, or None. ``stored_exactly``: per chunk (in
    prompt order), whether a variant made after exactly the chunks before it, in a prefill
    where those were a full prefill's, is stored and worth loading. Where ``after_asks`` is
    above 0 and this chunk order was asked at least that many times before
    (``asked_before``: since it was last kept exact, where it was; ``after_asks``: the wait
    :func:`exact_wait` gives), the first chunk without one; None where a chunk order is
    still rare, or where every chunk has one (the plan reuses them as they are, nothing
    recomputed). A reused chunk is never exact after one that is not, so every chunk from
    that one on is computed. One full prefill, paid where an order repeats, makes each
    later ask answer as full prefill does; an order asked fewer times never pays it, and
    one whose kept variants were evicted before its next ask pays again only once it has
    been asked as often since (twice as often, where no ask reused that keep)."""
    if after_asks <= 0 or asked_before < after_asks:
        return None
    return next((i for i, exact in enumerate(stored_exactly) if not exact), None)


def exact_history_limit(after_asks: int, doublings: int = EXACT_WAIT_DOUBLINGS) -> int:
    """How many of an order's newest requests :func:`exact_wait` must read: one past the
    longest wait, so that a keep that waited that long is still seen, with its wait."""
    return (after_asks << doublings) + 1


def exact_wait(history: Sequence[dict], after_asks: int,
               doublings: int = EXACT_WAIT_DOUBLINGS) -> tuple[int, int]:
    """How many times a chunk order was asked since it was last kept exact (ever, where it
    never was), and how many asks the next keep must wait for: ``(asked, due)``.
    ``history``: the recorded policies of the order's newest requests, newest first (see
    :meth:`cachecraft.catalog.CatalogTx.order_history`). A keep is one whose policy says
    ``kept_exact``, with the asks it waited for as ``exact_wait``; an ask that
    ``reused_exact`` found every chunk stored exactly. Where the last keep served such an
    ask, or there was none, the next waits ``after_asks``; where its variants were evicted
    before any ask reused them, it waits twice as long as that keep did, up to
    ``after_asks * 2**doublings``: under a budget that cannot hold an order's variants,
    it stops paying a full prefill at every few asks. ``history`` is read as far as it goes
    (:func:`exact_history_limit` rows are enough), so ``asked`` counts up to its length."""
    for asked, policy in enumerate(history):
        if policy.get("kept_exact"):
            served = any(later.get("reused_exact") for later in history[:asked])
            waited = policy.get("exact_wait")
            if served or not waited:  # a keep recorded before waits were: as the setting
                return asked, after_asks
            return asked, min(2 * waited, after_asks << doublings)
    return len(history), after_asks


def can_keep_exact(same_prefix_stored: bool, stored: int, replaceable: int,
                   cap: int = MAX_VARIANTS_PER_CHUNK) -> bool:
    """Whether a chunk computed in full after exactly the chunks before it can be kept: its
    variant of that prefix is stored (it is replaced in place), it has room for another
    (``stored`` variants under the request's system prompt, fewer than ``cap``), or one of
    its variants may give way to it (``replaceable``: those :func:`may_give_way` lets). A
    chunk order one of whose chunks cannot keep its exact variant is not worth computing in
    full: the next ask would find it inexact again and pay once more."""
    return same_prefix_stored or room_for_variant(stored, cap) or replaceable > 0
