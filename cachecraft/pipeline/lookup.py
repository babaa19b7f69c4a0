"""What a method may ask about the stored chunk-caches during one request.

Planning a request asks, per chunk, for its variants, their statistics, how many there
are, and the tier each loads from. Asked one chunk at a time, that is several catalog
queries and a disk read per chunk: 0.1 s of host time for 16 chunks from the disk tier
on the development CPU, which a GPU's prefill of the same prompt does not hide. A
:class:`RequestLookup` asks the catalog once, for every chunk of the request, on the
first question; a variant's statistics are read once per pipeline (a variant's key names
its content, so what was read stays true while it is stored, unless the pipeline replaces it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch

from cachecraft.catalog import VariantRecord
from cachecraft.policy.planner import VariantInfo
from cachecraft.policy.rules import may_give_way

# Variants whose planner statistics a pipeline keeps: each is a few KB (layers x the
# chunks before it), so 8192 take tens of MB at most.
PLANNER_STATS_ENTRIES = 8192

# The catalog statistic a variant carries when it was computed after a full prefill's KV of
# its whole prefix: reused after exactly that prefix, it is a full prefill's KV too.
MADE_EXACTLY = "made_exactly"


def _made_exactly(record: VariantRecord) -> bool:
    return bool(record.stats and record.stats.get(MADE_EXACTLY))


# What the planner reads of a variant's statistics: inter-attention per earlier segment
# (the system prefix left out), intra-attention per layer, and the token count.
PlannerStats = tuple[torch.Tensor, torch.Tensor, int]


class PlannerStatsMemo:
    """A bounded memo of :data:`PlannerStats` by variant key, filled from ``read``
    (the store's statistics of a variant, None when it has none)."""

    def __init__(self, read: Callable[[str], object], capacity: int = PLANNER_STATS_ENTRIES):
        self._read, self._capacity = read, capacity
        self._memo: OrderedDict[str, PlannerStats] = OrderedDict()

    def get(self, variant: str) -> PlannerStats | None:
        """The planner's view of ``variant``'s statistics (None: it has none, or is gone)."""
        found = self._memo.get(variant)
        if found is not None:
            self._memo.move_to_end(variant)
            return found
        stats = self._read(variant)
        if stats is None:  # not remembered: the variant may gain statistics or a store later
            return None
        found = (stats.inter[:, 1:], stats.intra, int(stats.outside.shape[1]))
        self._memo[variant] = found
        if len(self._memo) > self._capacity:
            self._memo.popitem(last=False)
        return found

    def forget(self, variant: str) -> None:
        """Drop what was read of ``variant`` (it was replaced by one of the same key)."""
        self._memo.pop(variant, None)


class RequestLookup:
    """The :class:`cachecraft.methods.VariantLookup` of one request over ``keys`` (its
    chunks): the store's variant records of them all, read on the first question."""

    def __init__(self, store, keys: Sequence[str], stats: PlannerStatsMemo, warm_prefix: Callable,
                 chunk_tokens: Callable[[str], int], r_load: Callable[[str], float],
                 r_hide: Callable[[str], float] | None = None,
                 history: Callable[[Sequence[str], int], list[dict]] | None = None):
        """``warm_prefix(prefix_key)``: the prefix tuple of the variants ``warm`` makes (None
        when there is no warm context); ``chunk_tokens(key)``: a chunk's token count;
        ``r_load(tier)``: the recompute fraction that takes as long as loading from ``tier``;
        ``r_hide(tier)``: the one that hides that load beside the blend's own cost (default
        ``r_load``); ``history(keys, limit)``: the recorded policies of the newest ``limit``
        earlier requests of ``keys`` in that order, newest first (default: none)."""
        self._store, self._keys, self._stats = store, tuple(dict.fromkeys(keys)), stats
        self._warm_prefix, self._chunk_tokens, self._r_load = warm_prefix, chunk_tokens, r_load
        self._r_hide = r_hide or r_load
        self._history = history
        self._records: dict[str, list[VariantRecord]] | None = None
        self._tiers: dict[str, str] = {}  # variant -> the tier its record names

    def records(self, key: str) -> list[VariantRecord]:
        """The stored variants of chunk ``key`` this store can read, oldest first."""
        if self._records is None:
            self._records = {}
            for chunk, records in self._store.variants_of_chunks(self._keys).items():
                self._remember(chunk, records)
        if key not in self._records:  # a chunk outside the request: asked alone
            self._remember(key, self._store.variants_of(key))
        return self._records[key]

    def _remember(self, key: str, records: list[VariantRecord]) -> None:
        self._records[key] = records
        self._tiers.update((r.key, r.tier) for r in records if r.tier is not None)

    def independent_variant(self, key: str, prefix_key: str) -> str | None:
        """An independent variant: the one ``warm`` makes, else one made alone, else any."""
        records = self.records(key)
        for wanted in (self._warm_prefix(prefix_key), (prefix_key,)):
            match = [r for r in records if tuple(r.prefix) == wanted]
            if match:
                return match[0].key
        return records[0].key if records else None

    def variant_infos(self, key: str, prefix_key: str,
                      keep: Callable[[str], bool] | None = None) -> list[VariantInfo]:
        """Every stored variant of ``key`` made after the system prefix ``prefix_key`` (and
        passing ``keep``, asked before its statistics are read), with the statistics the
        planner reads."""
        infos = []
        for record in self.records(key):
            if not record.prefix or record.prefix[0] != prefix_key:
                continue  # made under another system prompt
            if keep is not None and not keep(record.key):
                continue
            stats = self._stats.get(record.key)
            if stats is None:
                continue
            inter, intra, tokens = stats
            chunks = tuple(record.prefix[1:])
            infos.append(VariantInfo(record.key, chunks, inter, intra, tokens,
                                     tuple(self._chunk_tokens(k) for k in chunks)))
        return infos

    def variant_count(self, key: str, prefix_key: str | None = None) -> int:
        """How many variants of chunk ``key`` are stored (made after the system prefix
        ``prefix_key`` where given: those of another system prompt are not this one's)."""
        records = self.records(key)
        if prefix_key is None:
            return len(records)
        return sum(1 for r in records if r.prefix and r.prefix[0] == prefix_key)

    def replaceable_variants(self, key: str, prefix_key: str, asked: int = 0) -> list[VariantRecord]:
        """The variants of chunk ``key`` made after the system prefix ``prefix_key`` that an
        exact one whose order earned it with ``asked`` asks may replace at the cap: all but
        the independent one (:meth:`independent_variant`, the fallback for any order) and
        those made exactly that requests reused ``asked`` times or more (:func:`may_give_way`)."""
        independent = self.independent_variant(key, prefix_key)
        return [r for r in self.records(key) if r.prefix and r.prefix[0] == prefix_key
                and r.key != independent and may_give_way(_made_exactly(r), r.hits, asked)]

    def links(self, keys: Sequence[str], prefix_key: str) -> tuple[list[set[int]], set[int]]:
        """What :func:`cachecraft.policy.ordering.cache_order` reads of the stored variants of
        ``keys`` (a request's chunks, as given) made after the system prefix ``prefix_key``:
        for each chunk, the positions of the chunks one of its variants was made right after,
        and the chunks with a variant made after the system prefix alone."""
        position = {key: i for i, key in enumerate(keys)}
        after: list[set[int]] = [set() for _ in keys]
        starts: set[int] = set()
        for j, key in enumerate(keys):
            for record in self.records(key):
                if not record.prefix or record.prefix[0] != prefix_key:
                    continue  # made under another system prompt
                if len(record.prefix) == 1:
                    starts.add(j)
                elif record.prefix[-1] in position:
                    after[j].add(position[record.prefix[-1]])
        return after, starts

    def made_exactly(self, key: str, variant: str) -> bool:
        """Whether ``variant`` of chunk ``key`` was computed after a full prefill's KV of its
        prefix (its catalog statistics say so)."""
        return any(record.key == variant and _made_exactly(record) for record in self.records(key))

    def has_variant(self, key: str, variant: str) -> bool:
        """Whether ``variant`` of chunk ``key`` is stored (and readable by this store)."""
        return any(record.key == variant for record in self.records(key))

    def order_history(self, keys: Sequence[str], limit: int) -> list[dict]:
        """The recorded policies of the newest ``limit`` earlier requests of the chunks
        ``keys`` in this order, newest first (none where the pipeline cannot tell)."""
        return [] if self._history is None else self._history(keys, limit)

    def tier_of(self, variant: str) -> str | None:
        """The tier ``variant`` would load from, or None: the one its record names where
        this request found it, else the store's answer (also for a disk record when the
        store reads a shared tier first, which the record does not say)."""
        if self._records is None and self._keys:
            self.records(self._keys[0])  # this request's records, which name most tiers
        tier = self._tiers.get(variant)
        if tier is None or (tier == "disk" and self._store.shared_first):
            return self._store.locate(variant)
        return tier

    def load_fraction(self, variant: str) -> float | None:
        """The recompute fraction that takes as long as loading ``variant`` from its tier
        (None: not stored)."""
        tier = self.tier_of(variant)
        return None if tier is None else self._r_load(tier)

    def hide_fraction(self, variant: str) -> float | None:
        """The recompute fraction that hides loading ``variant`` beside the blend's own
        cost (None: not stored)."""
        tier = self.tier_of(variant)
        return None if tier is None else self._r_hide(tier)
