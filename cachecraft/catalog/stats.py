"""Statistics over the catalog, for ``cachecraft stats`` (plain functions, plain records)."""

from __future__ import annotations

import dataclasses
import statistics as pystats
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, case, cast, func, or_, select, type_coerce

from cachecraft.catalog.db import Catalog
from cachecraft.catalog.models import Chunk, Entry, Request, Variant
from cachecraft.catalog.records import HIT_TIERS, TIERS
from cachecraft.warm_context import SOURCE as WARM_CONTEXT_SOURCE


@dataclass(frozen=True)
class HitRates:
    """Chunk lookups of recorded requests: hits per tier and misses."""

    requests: int
    chunks: int
    hits_by_tier: dict[str, int]
    misses: int

    @property
    def hits(self) -> int:
        """Chunk lookups that found a usable cache, all tiers together."""
        return sum(self.hits_by_tier.values())

    @property
    def overall(self) -> float:
        """Fraction of chunk lookups that found a usable cache (0 when none recorded)."""
        return self.hits / self.chunks if self.chunks else 0.0

    @property
    def per_tier(self) -> dict[str, float]:
        """Fraction of chunk lookups served by each tier."""
        return {t: (n / self.chunks if self.chunks else 0.0) for t, n in self.hits_by_tier.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"requests": self.requests, "chunks": self.chunks, "hits": self.hits,
                "misses": self.misses, "hits_by_tier": dict(self.hits_by_tier),
                "hit_rate": self.overall, "hit_rate_by_tier": self.per_tier}


@dataclass(frozen=True)
class TierUsage:
    """Entries and bytes recorded in one tier (all processes together)."""

    tier: str
    entries: int
    bytes: int


@dataclass(frozen=True)
class ChunkHits:
    """A chunk and how often its variants were used."""

    chunk_key: str
    hits: int
    variants: int
    live_variants: int
    num_tokens: int
    source: str | None
    preview: str | None
    best_saving: float | None = None  # the highest measured share a stored variant saves per reuse


@dataclass(frozen=True)
class Distribution:
    """Summary and histogram of a set of fractions in [0, 1]."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    minimum: float | None
    maximum: float | None
    histogram: tuple[tuple[float, float, int], ...]  # (low, high, count); the last bin includes 1.0


# A request that recomputed this share of its prompt or more saved nothing by reusing caches.
RECOMPUTED_ALL = 1.0 - 1e-9


def saved_seconds(full_prefill_s: float | None, ttft_s: float | None,
                  recompute_fraction: float | None) -> float | None:
    """Prefill time one request saved: a full prefill's seconds minus its TTFT; negative
    when it took longer, and never positive when it recomputed everything (whatever it
    did, a full prefill's work was done). None without both times."""
    if full_prefill_s is None or ttft_s is None:
        return None
    saved = full_prefill_s - ttft_s
    if recompute_fraction is not None and recompute_fraction >= RECOMPUTED_ALL:
        return min(0.0, saved)
    return saved


@dataclass(frozen=True)
class PrefillSaved:
    """Prefill time saved, summed over requests: each request's full-prefill time minus its
    TTFT (:func:`saved_seconds`). Full prefill is timed where the catalog has plain
    ``full`` requests (their seconds per prompt token, ``basis`` "measured"), else the cost
    model's estimate recorded with each request (``basis`` "estimated")."""

    requests: int
    full_prefill_s: float
    ttft_s: float
    saved_s: float
    basis: str
    full_s_per_1k_tokens: float | None = None  # the measured rate, when ``basis`` is "measured"


CACHE_FREE_METHODS = ("full", "prefix")  # these never look up chunk-caches


def _full_rate(rows) -> float | None:
    """Seconds per prompt token of the recorded plain full prefills, or None."""
    timed = [(n, t) for m, n, t, _, _ in rows if m == "full" and n and t]
    tokens = sum(n for n, _ in timed)
    return sum(t for _, t in timed) / tokens if tokens else None


def _saved_by_method(catalog: Catalog, method: str | None = None) -> tuple[dict[str, PrefillSaved], float | None]:
    """Per method (``full`` left out: it is the yardstick), the prefill time saved."""
    query = select(Request.method, Request.num_tokens, Request.ttft_s, Request.full_prefill_s,
                   Request.recompute_fraction).where(Request.ttft_s.is_not(None))
    with catalog.read() as tx:
        rows = tx.session.execute(query).all()
    rate = _full_rate(rows)
    sums: dict[str, list[float]] = {}
    for m, tokens, ttft, estimate, recompute in rows:
        if m == "full" or (method is not None and m != method):
            continue
        full = rate * tokens if rate is not None and tokens else estimate
        saved = saved_seconds(full, ttft, recompute)
        if saved is None:
            continue
        acc = sums.setdefault(m, [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += full
        acc[2] += ttft
        acc[3] += saved
    basis = "measured" if rate is not None else "estimated"
    per_1k = None if rate is None else rate * 1000
    return {m: PrefillSaved(int(n), f, t, sv, basis, per_1k) for m, (n, f, t, sv) in sums.items()}, per_1k


CACHE_FREE_METHODS = ("full", "prefix")  # these never look up chunk-caches


def _method_filter(query, method: str | None):
    return query if method is None else query.where(Request.method == method)


def hit_rates(catalog: Catalog, *, method: str | None = None, cached_only: bool = False,
              node: str | None = None) -> HitRates:
    """Hit rate overall and per tier (the shared tier included) over recorded requests
    (optionally of one method, of one ``node``, or with ``cached_only`` of the methods that
    look up chunk-caches)."""
    query = _method_filter(select(func.count(Request.id), func.coalesce(func.sum(Request.num_chunks), 0),
                                  func.coalesce(func.sum(Request.hits_gpu), 0),
                                  func.coalesce(func.sum(Request.hits_cpu), 0),
                                  func.coalesce(func.sum(Request.hits_disk), 0),
                                  func.coalesce(func.sum(Request.hits_redis), 0),
                                  func.coalesce(func.sum(Request.misses), 0)), method)
    if cached_only:
        query = query.where(Request.method.not_in(CACHE_FREE_METHODS))
    if node is not None:
        query = query.where(Request.node == node)
    with catalog.read() as tx:
        n, chunks, *hits, misses = tx.session.execute(query).one()
    return HitRates(int(n), int(chunks), {t: int(h) for t, h in zip(HIT_TIERS, hits)}, int(misses))


def by_node(catalog: Catalog) -> list[dict[str, Any]]:
    """Per node of a shared catalog (empty with the embedded one): its cache directory,
    requests and hit rates (as :func:`hit_rates` with ``cached_only``)."""
    with catalog.read() as tx:
        nodes = tx.nodes()
    return [{"node": node, "cache_dir": about.get("cache_dir"), "host": about.get("host"),
             **hit_rates(catalog, cached_only=True, node=node).to_dict()} for node, about in sorted(nodes.items())]


def tier_usage(catalog: Catalog) -> dict[str, TierUsage]:
    """Entries and bytes per tier, every tier listed (zeros included)."""
    query = select(Entry.tier, func.count(Entry.id), func.coalesce(func.sum(Entry.nbytes), 0)).group_by(Entry.tier)
    with catalog.read() as tx:
        rows = {tier: (int(n), int(b)) for tier, n, b in tx.session.execute(query)}
    return {t: TierUsage(t, *rows.get(t, (0, 0))) for t in TIERS}


def top_chunks(catalog: Catalog, limit: int = 10) -> list[ChunkHits]:
    """Document chunks whose variants were hit most, most first. The system prompt (the
    first segment of every prefix) and the warm context are left out: every request and
    every warmed chunk uses them, so they would always top the list."""
    live = func.sum(case((Variant.tier.is_not(None), 1), else_=0))
    # The first key of every stored prefix. PostgreSQL reads the text column as JSON after a
    # cast; SQLite must not cast (its JSON type name has numeric affinity) and reads it as is.
    prefix = (cast if catalog.dialect == "postgresql" else type_coerce)(Variant.prefix, JSON)
    system = select(prefix[0].as_string()).where(Variant.prefix_len > 0).distinct()
    best = func.max(case((Variant.tier.is_not(None), Variant.quality), else_=None))
    query = (select(Chunk, func.sum(Variant.hits), func.count(Variant.key), live, best)
             .join(Variant, Variant.chunk_key == Chunk.key)
             .where(Chunk.key.not_in(system), or_(Chunk.source.is_(None), Chunk.source != WARM_CONTEXT_SOURCE))
             .group_by(Chunk.key)
             .order_by(func.sum(Variant.hits).desc(), Chunk.key).limit(limit))
    with catalog.read() as tx:
        return [ChunkHits(c.key, int(h or 0), int(n), int(lv or 0), c.num_tokens, c.source, c.preview,
                          None if q is None else float(q))
                for c, h, n, lv, q in tx.session.execute(query)]


def variants_per_chunk(catalog: Catalog, *, live_only: bool = True) -> dict[int, int]:
    """Histogram: number of variants a chunk has -> number of chunks with that many."""
    query = select(Variant.chunk_key, func.count(Variant.key)).group_by(Variant.chunk_key)
    if live_only:
        query = query.where(Variant.tier.is_not(None))
    with catalog.read() as tx:
        counts = [int(n) for _, n in tx.session.execute(query)]
    hist: dict[int, int] = {}
    for n in counts:
        hist[n] = hist.get(n, 0) + 1
    return dict(sorted(hist.items()))


def recompute_distribution(catalog: Catalog, *, bins: int = 10, method: str | None = None) -> Distribution:
    """Distribution of per-request recompute fractions (requests that recorded one)."""
    assert bins >= 1, f"bins must be >= 1, got {bins}"
    query = _method_filter(select(Request.recompute_fraction)
                           .where(Request.recompute_fraction.is_not(None)), method)
    with catalog.read() as tx:
        values = sorted(float(v) for v in tx.session.scalars(query))
    edges = [i / bins for i in range(bins + 1)]
    counts = [0] * bins
    for v in values:
        counts[min(max(int(v * bins), 0), bins - 1)] += 1
    hist = tuple((edges[i], edges[i + 1], counts[i]) for i in range(bins))
    if not values:
        return Distribution(0, None, None, None, None, None, hist)
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return Distribution(len(values), pystats.fmean(values), pystats.median(values), p90,
                        values[0], values[-1], hist)


def prefill_time_saved(catalog: Catalog, *, method: str | None = None) -> PrefillSaved:
    """Prefill time saved over every recorded request that has a TTFT (or those of one
    ``method``); ``full`` requests are left out: they are what the others are measured against."""
    per_method, per_1k = _saved_by_method(catalog, method)
    parts = per_method.values()
    return PrefillSaved(sum(p.requests for p in parts), sum(p.full_prefill_s for p in parts),
                        sum(p.ttft_s for p in parts), sum(p.saved_s for p in parts),
                        "measured" if per_1k is not None else "estimated", per_1k)


def by_method(catalog: Catalog) -> list[dict[str, Any]]:
    """Per method: requests, chunk hit rate (None for methods without chunk-caches), mean
    recompute fraction, mean TTFT and prefill time saved (as :func:`prefill_time_saved`);
    most requests first."""
    query = (select(Request.method, func.count(Request.id), func.sum(Request.num_chunks),
                    func.sum(Request.misses), func.avg(Request.recompute_fraction), func.avg(Request.ttft_s))
             .group_by(Request.method).order_by(func.count(Request.id).desc(), Request.method))
    with catalog.read() as tx:
        rows = tx.session.execute(query).all()
    saved, _ = _saved_by_method(catalog)
    return [{"method": m, "requests": int(n),
             "hit_rate": None if m in CACHE_FREE_METHODS or not chunks else 1 - int(misses or 0) / int(chunks),
             "recompute_mean": None if recompute is None else float(recompute),
             "ttft_s_mean": None if ttft is None else float(ttft),
             "saved_s": saved[m].saved_s if m in saved else 0.0}
            for m, n, chunks, misses, recompute, ttft in rows]


def summary(catalog: Catalog, *, top: int = 10) -> dict[str, Any]:
    """Every statistic above in one JSON-friendly document (``cachecraft stats --json``)."""
    with catalog.read() as tx:
        counts = {"chunks": tx.session.scalar(select(func.count(Chunk.key))),
                  "variants": tx.session.scalar(select(func.count(Variant.key))),
                  "live_variants": tx.session.scalar(select(func.count(Variant.key))
                                                     .where(Variant.tier.is_not(None))),
                  "requests": tx.session.scalar(select(func.count(Request.id)))}
    saved = prefill_time_saved(catalog)
    return {
        "counts": counts,
        "hit_rates": hit_rates(catalog, cached_only=True).to_dict(),
        "by_method": by_method(catalog),
        "by_node": by_node(catalog),
        "tiers": {t: dataclasses.asdict(u) for t, u in tier_usage(catalog).items()},
        "top_chunks": [dataclasses.asdict(c) for c in top_chunks(catalog, top)],
        "variants_per_chunk": {str(k): v for k, v in variants_per_chunk(catalog).items()},
        "recompute_fraction": dataclasses.asdict(recompute_distribution(catalog)),
        "prefill_time_saved": dataclasses.asdict(saved),
    }
