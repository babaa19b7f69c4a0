"""Frozen records that cross the catalog's boundary (the ORM rows stay inside)."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Mapping

TIERS = ("gpu", "cpu", "disk")
"""Tier names, fastest first."""

SHARED_TIER = "redis"
"""The shared tier (``redis_url``): after the local tiers; its placements are indexed in
Redis, not in the catalog, so it is not one of :data:`TIERS`."""

HIT_TIERS = TIERS + (SHARED_TIER,)
"""Every tier a request's chunk can be served from, fastest first by default."""

MISS = "miss"
EVENT_KINDS = ("put", "promote", "demote", "evict", "delete", "corrupt", "lost")
"""Tier event kinds: ``corrupt`` = damaged bytes dropped on read or verify; ``lost`` =
catalog row whose bytes were gone (a crash, a dead process's memory tier)."""


def fastest_tier(tiers) -> str | None:
    """The fastest of ``tiers`` (names from :data:`TIERS`), or None when empty."""
    present = set(tiers)
    return next((t for t in TIERS if t in present), None)


def question_hash(question: str) -> str:
    """Stable short hash of a question's text, for the ``requests`` table."""
    return hashlib.sha256(question.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class ChunkRecord:
    """A chunk: its key, the model fingerprint it belongs to and where it came from."""

    key: str
    fingerprint: str
    num_tokens: int
    source: str | None = None
    preview: str | None = None
    created_at: float = 0.0


@dataclass(frozen=True)
class VariantRecord:
    """One variant of a chunk and what the catalog knows about it.

    ``tier`` is the fastest tier holding it (NULL once evicted everywhere); in
    :meth:`TieredStore.variants_of` it is the fastest tier *this* store can read it from.
    """

    key: str
    chunk_key: str
    prefix: tuple[str, ...]
    nbytes: int
    dtype: str
    cci: float | None = None
    stats: Mapping[str, float] | None = None
    cost_s: float | None = None
    quality: float | None = None
    tier: str | None = None
    hits: int = 0
    last_used: float | None = None
    created_at: float = 0.0


@dataclass(frozen=True)
class EntryRecord:
    """Where the bytes of a variant live: a (variant, tier, owner) placement on one ``node``
    (a disk row's owner is its node)."""

    variant_key: str
    tier: str
    owner: str
    nbytes: int
    blob: str | None = None
    checksum: str | None = None
    stored_at: float = 0.0
    node: str = ""


@dataclass(frozen=True)
class RequestChunk:
    """One chunk position of a request: what was used and what the policy decided."""

    position: int
    chunk_key: str
    variant_key: str | None = None
    tier: str = MISS
    cci: float | None = None
    beta_prime: float | None = None
    cfo: float | None = None
    fraction: float | None = None
    stop_layer: int | None = None

    def __post_init__(self) -> None:
        known = TIERS + (SHARED_TIER, MISS)
        assert self.tier in known, f"tier must be one of {known}, got {self.tier!r}"
        assert (self.tier == MISS) == (self.variant_key is None), (
            "a hit names the variant used, a miss names none")


@dataclass(frozen=True)
class RequestRecord:
    """One request as recorded; ``id`` is set once stored."""

    question_hash: str
    method: str
    chunks: tuple[RequestChunk, ...] = ()
    recompute_fraction: float | None = None
    ttft_s: float | None = None
    full_prefill_s: float | None = None
    created_at: float = field(default_factory=time.time)
    id: int | None = None
    num_tokens: int | None = None  # the prompt's tokens
    policy: dict | None = None  # the policy's settings, where each came from, and whether it kept the order exact
    node: str = ""  # the node that answered ("" with the embedded catalog)
    # names the request across retries of its write: a write whose commit went through
    # while its answer was lost (the server hung, or the network dropped) is not recorded
    # twice when it waits and is tried again (None: recorded by a version without it)
    uid: str | None = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def hits_by_tier(self) -> dict[str, int]:
        """Number of chunk hits per tier, the shared tier included."""
        return {t: sum(1 for c in self.chunks if c.tier == t) for t in HIT_TIERS}

    @property
    def misses(self) -> int:
        """Number of chunks with no usable cache."""
        return sum(1 for c in self.chunks if c.tier == MISS)


@dataclass(frozen=True)
class TierEventRecord:
    """One move of a variant's bytes."""

    id: int
    at: float
    variant_key: str
    kind: str
    from_tier: str | None
    to_tier: str | None
    nbytes: int
    owner: str
