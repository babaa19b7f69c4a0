"""TieredStore: chunk-cache variants in GPU / CPU / disk tiers under byte budgets.

The public API. Entries are stored in ``config.kv_dtype`` and handed out as fresh
copies in the requested dtype and device. GPU and CPU tiers are private to the
process; the disk tier and the catalog are shared by every process using the cache
directory. Where entries go and how they move: :mod:`~cachecraft.store.placement`;
disk reads, which verify checksums and the entry's identity and drop damaged entries:
:mod:`~cachecraft.store.disk_reads` (memory tiers hold tensors this process made and
are not re-hashed); reconcile, recovery and eviction on demand:
:mod:`~cachecraft.store.maintenance`.

With ``redis_url`` set, a shared tier (:mod:`~cachecraft.store.shared`) comes after the
memory tiers: every put is also written there, a memory miss is looked up there (reads
verified like disk reads, layer by layer for :meth:`TieredStore.iter_layers`), and a
hit is promoted into this node's local tiers. It is looked up after the disk tier, or
before it with ``tier_order = "gpu,cpu,redis,disk"`` (a fast network and a slow local
disk). The shared tier failing is a miss, never an error.

A catalog on a server (PostgreSQL) lost mid-run is not an error for reads either: while
it is away the disk tier, whose index it is, counts as a miss, variants are found in
the memory and shared tiers, a new variant is not kept locally (it still goes to the
shared tier), and hit counts wait in :attr:`TieredStore.unrecorded` until it is back
(:meth:`TieredStore.record_pending`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from cachecraft.catalog import (TIERS, Catalog, CatalogBusyError, CatalogUnavailableError, ChunkRecord, EntryRecord,
                                VariantRecord, catalog_path)
from cachecraft.config import Config
from cachecraft.kv import AttentionStats, ChunkKV, chunk_key
from cachecraft.store import disk_reads, maintenance, placement
from cachecraft.store.codec import copy_to, encode
from cachecraft.store.errors import StoreConfigError
from cachecraft.store.eviction import EntryInfo, EvictionPolicy, estimate_cost_s, make_policy, measured_quality
from cachecraft.store.locks import FileLock, OwnerLock
from cachecraft.store.maintenance import EvictReport
from cachecraft.store.nodes import join_catalog
from cachecraft.store.paths import MAINTENANCE_LOCK, ensure_writable, store_paths
from cachecraft.store.readers import LayerReader, MemoryLayerReader, SharedLayerReader
from cachecraft.store.shared import SharedMeta
from cachecraft.store.tiers import (DiskTier, MemEntry, MemoryTier, TierState, build_tiers, entry_nbytes,
                                    select_tiers, tier_budgets)

log = logging.getLogger(__name__)


@dataclass
class StoreCounters:
    """What this store instance did since it was opened."""

    puts: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    misses: int = 0
    corrupt: int = 0
    lost: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    not_cached: int = 0

    def to_dict(self) -> dict:
        """JSON-friendly copy."""
        return dataclasses.asdict(self)


@dataclass
class Unrecorded:
    """What a store could not write to its catalog while the catalog's server was away:
    hit counts (kept, and written by :meth:`TieredStore.record_pending`) and new variants
    not kept locally (their bytes are not held, so nothing is left to record)."""

    hits: Counter = field(default_factory=Counter)  # variant key -> hits not counted yet
    variants_not_kept: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.hits) or bool(self.variants_not_kept)

    def describe(self) -> str:
        """One phrase for a warning, e.g. ``3 hit counts and 1 new chunk-cache``."""
        parts = []
        if self.hits:
            n = sum(self.hits.values())
            parts.append(f"{n} hit count{'s' * (n != 1)}")
        if self.variants_not_kept:
            n = len(self.variants_not_kept)
            parts.append(f"{n} new chunk-cache{'s' * (n != 1)} (not kept locally)")
        return " and ".join(parts) or "nothing"


class TieredStore:
    """Chunk-cache variants in tiers, keyed by variant key (see the module docstring).

    ``tiers`` picks a subset of ``("gpu", "cpu", "disk")`` (default: all available; the
    GPU tier only with CUDA); ``budgets`` overrides the config's byte budgets per tier;
    ``eviction`` overrides ``config.eviction``. Use as a context manager or call
    :meth:`close`, which moves what the memory tiers hold to disk.
    """

    def __init__(self, config: Config, *, tiers: Sequence[str] | None = None,
                 budgets: Mapping[str, int] | None = None, eviction: str | None = None,
                 reconcile: bool = True, lock_timeout_s: float = 2.0) -> None:
        self.config = config
        self.cache_dir = Path(config.cache_dir)
        self.root, disk_dir, self.locks_dir = store_paths(self.cache_dir)
        for directory in (self.cache_dir, self.root, self.locks_dir):
            ensure_writable(directory)
        self.stored_dtype: torch.dtype = getattr(torch, config.kv_dtype)
        self.lock_timeout_s = lock_timeout_s
        names = select_tiers(tiers)
        limits = tier_budgets(config, names, budgets)
        policy_name = eviction or config.eviction
        try:
            make_policy(policy_name)
        except ValueError as exc:
            raise StoreConfigError(str(exc)) from None
        catalog_missing = not config.catalog_url and not catalog_path(self.cache_dir).exists()
        self.catalog = Catalog(self.cache_dir, url=config.catalog_url or None)
        self.node = ""  # this cache directory in a catalog several nodes share ("" in its own)
        self.owner = uuid.uuid4().hex[:16]
        self._owner_lock: OwnerLock | None = None
        self._maintenance = FileLock(self.locks_dir / MAINTENANCE_LOCK)
        self._lock = threading.RLock()
        self.counters = StoreCounters()
        self.unrecorded = Unrecorded()
        self.shared = None  # the shared (Redis) tier, when redis_url is set
        self.shared_first = False
        self._tiers: list[MemoryTier | DiskTier] = []
        try:
            self._owner_lock = OwnerLock(self.locks_dir, self.owner)
            self._tiers = build_tiers(names, limits, disk_dir)
            self._policies: dict[str, EvictionPolicy] = {t.name: make_policy(policy_name) for t in self._tiers}
            if self.catalog.shared:  # a node new to the catalog records what its disk tier holds
                self.node, catalog_missing = join_catalog(self.catalog, self.root)
            if config.redis_url:
                self.shared = _connect_shared(config)
            # look the shared tier up before the disk tier (tier_order), when there is one
            order = config.tier_order.replace(" ", "").split(",")
            self.shared_first = self.shared is not None and order.index("redis") < order.index("disk")
            # a catalog deleted by hand must not make the disk tier look like orphans
            if catalog_missing and not maintenance.recover_catalog(self):
                reconcile = False  # never treat un-rebuilt blobs as orphans
            try:
                if reconcile:
                    self.reconcile()
                maintenance.fit_disk_budget(self)  # a budget lowered since the last run takes effect now
            except CatalogBusyError as exc:  # upkeep the next open does again: no reason to fail this one
                log.warning("%s; the cache's upkeep on open is left to the next open", exc)
        except BaseException:
            self._release()
            raise
        log.debug("store %s open at %s: tiers %s, eviction %s", self.owner, self.cache_dir,
                  [(t.name, t.budget) for t in self._tiers], policy_name)

    # ------------------------------------------------------------------ public API

    @property
    def tier_names(self) -> list[str]:
        """Tiers of this store, fastest first."""
        return [t.name for t in self._tiers]

    @property
    def policy_name(self) -> str:
        """The eviction policy in use."""
        return next(iter(self._policies.values())).name

    def budget(self, tier: str) -> int:
        """Byte budget of a tier."""
        return self._tier(tier).budget

    def put(self, kv: ChunkKV, *, cost_s: float | None = None, quality: float | None = None,
            cci: float | None = None, stats: Mapping[str, float] | None = None,
            source: str | None = None, preview: str | None = None, lost_ok: bool = True,
            prior_uses: int = 0) -> str | None:
        """Store a variant (replacing one with the same key); returns the tier it went to.

        ``cost_s``: measured prefill seconds a reuse saves (estimated from size if None);
        ``quality``: fraction of that a reuse avoids (1 - expected recompute fraction);
        ``cci``/``stats``: policy statistics recorded in the catalog; ``source``/``preview``:
        where the chunk came from, for the catalog. Returns None (and caches nothing)
        when the entry is larger than every tier's budget. Raises :class:`DiskFullError`
        and other :class:`StoreError` on I/O failure, leaving what was stored intact.
        A catalog that cannot take the row (away, or locked by another process: see
        :class:`CatalogUnavailableError`) leaves the variant out of the local tiers, noted
        in ``unrecorded``; without ``lost_ok`` its error is raised instead (for a job whose
        point is to keep it, such as ``warm``). ``prior_uses``: uses the tiers' eviction
        orders credit the entry with from the start (an exact variant kept for a chunk order
        asked that often before), so that a new entry with evidence of reuse is not the first
        to go; they are not hits, and the catalog does not count them.
        """
        if kv.chunk != chunk_key(kv.fingerprint, kv.token_ids):
            raise ValueError("ChunkKV.chunk does not match its fingerprint and tokens; build it "
                             "without an explicit chunk key")
        if kv.num_tokens == 0 or kv.num_layers == 0:
            raise ValueError("cannot store an empty ChunkKV (no tokens or no layers)")
        if quality is not None and not 0.0 <= quality <= 1.0:
            raise ValueError(f"quality must be within [0, 1], got {quality}")
        if cost_s is not None and not cost_s >= 0.0:
            raise ValueError(f"cost_s must be >= 0, got {cost_s}")
        if prior_uses < 0:
            raise ValueError(f"prior_uses must be >= 0, got {prior_uses}")
        stored = placement.to_stored(kv, self.stored_dtype)
        key = kv.variant
        nbytes = entry_nbytes(stored)
        cost = estimate_cost_s(kv.num_tokens, kv.num_layers) if cost_s is None else float(cost_s)
        info = EntryInfo(key, kv.chunk, nbytes, cost, 1.0 if quality is None else float(quality), hits=prior_uses)
        with self._lock:
            try:
                with self.catalog.write() as tx:
                    tx.upsert_chunk(ChunkRecord(kv.chunk, kv.fingerprint, kv.num_tokens, source, preview))
                    tx.upsert_variant(VariantRecord(key, kv.chunk, kv.prefix, nbytes, self.config.kv_dtype,
                                                    cci=cci, stats=stats, cost_s=cost_s, quality=quality))
                tier = placement.place_new(self, placement.Move(key, stored, info))
            except CatalogUnavailableError:  # local tiers need their rows; the shared tier does not
                if not lost_ok:
                    raise
                self.unrecorded.variants_not_kept.append(key)
                lost = True
                tier = None
            else:
                lost = False
            if self.shared is not None:
                meta = SharedMeta(key, kv.chunk, "", 0, kv.fingerprint, kv.num_tokens, tuple(kv.prefix),
                                  self.config.kv_dtype, cci, None if stats is None else dict(stats), cost_s,
                                  quality, source)
                if self.shared.put(meta, encode(stored)) and tier is None:
                    tier = self.shared.name
            if tier is not None or lost:
                return tier
            self.counters.not_cached += 1
            log.warning("variant %s (%d bytes) does not fit any tier budget %s; not cached",
                        key, nbytes, {t.name: t.budget for t in self._tiers})
            return None

    def get(self, key: str, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
            fingerprint: str | None = None, promote: bool = True, count_hit: bool = True) -> ChunkKV | None:
        """The variant ``key`` as a fresh ChunkKV in ``dtype`` (default: stored) on ``device``.

        None on a miss, a damaged entry (removed) or a ``fingerprint`` mismatch. Without
        ``count_hit`` a hit is served but not counted (a request read again after a retry).
        """
        with self._lock:
            for i, tier in enumerate(self._memory_tiers()):
                entry = tier.get(key)
                if entry is None:
                    continue
                if fingerprint is not None and entry.kv.fingerprint != fingerprint:
                    return self._miss(key, f"fingerprint {entry.kv.fingerprint} is not {fingerprint}")
                out = _convert(entry.kv, dtype, device)
                self._hit(tier.name, key, entry, count_hit)
                if promote and i > 0:
                    placement.promote_memory(self, i, key)
                return out
            if self.shared_first:
                kv = self._get_shared(key, dtype, device, fingerprint, promote, count_hit, miss=False)
                if kv is not None:
                    return kv
            found = disk_reads.read_disk(self, key)
            if found is None:
                if self.shared is not None and not self.shared_first:
                    return self._get_shared(key, dtype, device, fingerprint, promote, count_hit)
                return self._miss(key)
            row, kv = found
            if fingerprint is not None and kv.fingerprint != fingerprint:
                return self._miss(key, f"fingerprint {kv.fingerprint} is not {fingerprint}")
            self._hit("disk", key, None, count_hit)
            if promote:
                placement.promote_from_disk(self, key, kv, row)
            return _convert(kv, dtype, device)

    def iter_layers(self, key: str, *, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu", fingerprint: str | None = None,
                    promote: bool = True, count_hit: bool = True) -> LayerReader | None:
        """A :class:`LayerReader` over the variant ``key`` (layer by layer), or None on a miss.

        From disk, each layer is read and verified only when reached; a damaged layer
        raises :class:`CorruptEntryError` during iteration (the entry is removed). With
        ``promote``, a disk entry read to the end is copied into the fastest memory tier.
        ``count_hit`` as in :meth:`get`.
        """
        with self._lock:
            for i, tier in enumerate(self._memory_tiers()):
                entry = tier.get(key)
                if entry is None:
                    continue
                if fingerprint is not None and entry.kv.fingerprint != fingerprint:
                    return self._miss(key, f"fingerprint {entry.kv.fingerprint} is not {fingerprint}")
                self._hit(tier.name, key, entry, count_hit)
                reader = MemoryLayerReader(tier.name, key, entry.kv, dtype, device)
                if promote and i > 0:
                    placement.promote_memory(self, i, key)
                return reader
            if self.shared_first:
                reader = self._open_shared(key, dtype, device, fingerprint, promote, count_hit, miss=False)
                if reader is not None:
                    return reader
            opened = disk_reads.open_disk(self, key)
            if opened is None:
                if self.shared is not None and not self.shared_first:
                    return self._open_shared(key, dtype, device, fingerprint, promote, count_hit)
                return self._miss(key)
            row, blob = opened
            if fingerprint is not None and blob.metadata["fingerprint"] != fingerprint:
                blob.close()
                return self._miss(key, f"fingerprint {blob.metadata['fingerprint']} is not {fingerprint}")
            self._hit("disk", key, None, count_hit)
        return disk_reads.disk_reader(self, key, row, blob, dtype, device, promote)

    def contains(self, key: str) -> bool:
        """Whether a get would find ``key`` (bytes not verified)."""
        return self.locate(key) is not None

    __contains__ = contains

    def tiers_on(self, device: torch.device | str) -> list[str]:
        """Names of the memory tiers whose tensors live on ``device`` (its type): their
        variants can be handed to compute there as stored, with no copy."""
        wanted = torch.device(device).type
        return [t.name for t in self._memory_tiers() if torch.device(t.device).type == wanted]

    def locate(self, key: str) -> str | None:
        """The tier a get of ``key`` would read from, or None."""
        with self._lock:
            for tier in self._memory_tiers():
                if key in tier:
                    return tier.name
            if self.shared_first and self.shared.contains(key):
                return self.shared.name
            if self._disk() is not None and self._disk_row(key) is not None:
                return "disk"
            if self.shared is not None and not self.shared_first and self.shared.contains(key):
                return self.shared.name
            return None

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier this store can reach; whether anything was removed."""
        with self._lock:
            found = False
            for tier in self._memory_tiers():
                if key in tier:
                    placement.forget(self, tier, key, kind="delete")
                    found = True
            found = placement.delete_disk_copy(self, key, kind="delete") or found
            if self.shared is not None:
                found = bool(self.shared.delete(key)) or found
            return found

    def evict(self, *, chunk: str | None = None, variant: str | None = None, source: str | None = None,
              tier: str | None = None, everything: bool = False) -> EvictReport:
        """Delete from every tier this store reaches the variants of one chunk (``chunk``: 6 or
        more first characters of its key or a variant's), one variant (``variant``: 6 or more
        first characters of its key; its chunk's other variants stay), the variants of every
        chunk of one document (``source``: its path as ingested, or a file name naming one),
        of one ``tier`` (a memory tier: this store's entries; the note counts other
        processes'), or all; give exactly one. Catalog rows stay. :class:`SelectorError` if
        nothing or too much matches.
        """
        return maintenance.evict(self, chunk=chunk, variant=variant, source=source, tier=tier,
                                 everything=everything)

    def evict_documents(self, sources: Iterable[str]) -> EvictReport:
        """Delete from every tier this store reaches the variants of every chunk that came
        from one of ``sources`` (paths exactly as ingested, as :meth:`Corpus.forget` reports
        them); catalog rows stay, and a source with nothing cached is no error."""
        return maintenance.evict_documents(self, sources)

    def variants_of(self, chunk: str) -> list[VariantRecord]:
        """Variants of a chunk this store can read (tier = the fastest it can read from)."""
        return self.variants_of_chunks([chunk])[chunk]

    def variants_of_chunks(self, chunks: Sequence[str]) -> dict[str, list[VariantRecord]]:
        """:meth:`variants_of` for each of ``chunks``, the catalog asked once."""
        try:
            with self.catalog.read() as tx:
                local = tx.available_variants_of(chunks, self.owner, self.node)
        except CatalogUnavailableError:  # what this process holds in memory is still usable
            local = {chunk: self._memory_variants(chunk) for chunk in chunks}
        if self.shared is None:
            return local
        shared = self.shared.variants_of_chunks(list(local))
        for chunk, records in local.items():
            have = {r.key for r in records}
            records += [_shared_record(m, self.shared.name) for m in shared[chunk]
                        if m.variant not in have and m.dtype == self.config.kv_dtype]
        return local

    def info(self, key: str) -> VariantRecord | None:
        """What the catalog records about a variant (live or evicted), or None."""
        with self.catalog.read() as tx:
            return tx.variant(key)

    def stats_of(self, key: str) -> AttentionStats | None:
        """The attention statistics stored with a variant (None if absent or not stored)."""
        with self._lock:
            for tier in self._memory_tiers():
                entry = tier.get(key)
                if entry is not None:
                    return entry.kv.stats
            opened = disk_reads.open_disk(self, key)
        if opened is None:
            if self.shared is not None:
                blob = self.shared.open(key, count=False)
                if blob is not None:
                    blob.close()
                    return blob.stats
            return None
        _, blob = opened
        blob.close()
        return blob.stats

    def usage(self) -> dict[str, TierState]:
        """Entries and bytes per tier (memory tiers: this process; disk: all processes)."""
        with self._lock:
            out = {t.name: TierState(t.name, len(t), t.used, t.budget) for t in self._memory_tiers()}
            disk = self._disk()
            if disk is not None:
                with self.catalog.read() as tx:
                    rows = tx.entries(tier="disk", owner=self.node)
                out["disk"] = TierState("disk", len(rows), sum(r.nbytes for r in rows), disk.budget)
            if self.shared is not None:
                out[self.shared.name] = TierState(self.shared.name, self.shared.count(), self.shared.used(),
                                                  self.shared.budget)
            return out

    def keys(self, tier: str) -> list[str]:
        """Keys held by one tier (memory tiers: this process's; disk: every process's on this node)."""
        t = self._tier(tier)
        if t.is_disk:
            with self.catalog.read() as tx:
                return [r.variant_key for r in tx.entries(tier="disk", owner=self.node)]
        with self._lock:
            return t.keys()

    def reconcile(self) -> dict[str, int]:
        """Make catalog and tiers agree after crashes (run on open); returns counts of fixes.

        Drops memory placements of stores whose process is gone, disk rows whose bytes
        are missing, and blobs or files no row names. The disk part needs the
        maintenance lock; when another process holds it too long it is skipped.
        """
        return maintenance.reconcile(self)

    def close(self, persist: bool = True) -> None:
        """Close the store; with ``persist``, first move memory-tier entries to disk."""
        with self._lock:
            if self._owner_lock is None:
                return
            try:
                self.record_pending()
                if persist and self.catalog.outage is not None and not self.catalog.available():
                    held = sum(len(t) for t in self._memory_tiers())
                    if held:
                        log.warning("the catalog is away: %d chunk-cache(s) held in memory were not persisted "
                                    "to disk", held)
                    persist = False
                placement.empty_memory_tiers(self, persist)
                if self.unrecorded:
                    log.warning("not recorded in the catalog at %s: %s", self.catalog.where,
                                self.unrecorded.describe())
            finally:
                self._release()

    def _release(self) -> None:
        if self.shared is not None:
            self.shared.close()
        for tier in self._tiers:
            if tier.is_disk:
                tier.close()
        if self._owner_lock is not None:
            self._owner_lock.release()
            self._owner_lock = None
        self.catalog.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _tier(self, name: str) -> MemoryTier | DiskTier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise StoreConfigError(f"this store has no {name} tier (tiers: {self.tier_names})")

    def _memory_tiers(self) -> list[MemoryTier]:
        return [t for t in self._tiers if not t.is_disk]

    def _disk(self) -> DiskTier | None:
        last = self._tiers[-1]
        return last if last.is_disk else None

    def _disk_row(self, key: str) -> EntryRecord | None:
        try:
            with self.catalog.read() as tx:
                return tx.entry(key, "disk", self.node)
        except CatalogUnavailableError:  # the catalog is the disk tier's index: a miss until it is back
            return None

    def _memory_variants(self, chunk: str) -> list[VariantRecord]:
        """Variants of ``chunk`` this process holds in memory, as records (without the catalog)."""
        out: dict[str, VariantRecord] = {}
        for tier in self._memory_tiers():
            for key in tier.keys():
                entry = tier.get(key)
                if entry is not None and entry.kv.chunk == chunk and key not in out:
                    out[key] = VariantRecord(key, chunk, tuple(entry.kv.prefix), entry.info.nbytes,
                                             self.config.kv_dtype, cost_s=entry.info.cost_s,
                                             quality=entry.info.quality, tier=tier.name, hits=entry.hits)
        return list(out.values())

    def _count_hit(self, key: str) -> None:
        """One more hit on ``key`` in the catalog (hits + 1 in SQL: no lock needed); kept for
        later while the catalog is away."""
        try:
            with self.catalog.write(exclusive=False) as tx:
                tx.touch(key)
        except CatalogUnavailableError:
            self.unrecorded.hits[key] += 1

    def record_use(self, saved: Mapping[str, float]) -> dict[str, float]:
        """Measured reuse: for each variant key, the share of its chunk's prefill a request
        saved by reusing it. Each one's quality (the eviction policy's estimate of that share)
        moves halfway there, in the memory tiers, their policies and the catalog (where the
        disk tier's policy reads it). Returns the new qualities. Advice only: while the catalog
        is away a variant only in the disk tier keeps its old value."""
        new: dict[str, float] = {}
        with self._lock:
            for key, share in saved.items():
                entries = [(t, t.get(key)) for t in self._memory_tiers() if key in t]
                if entries:
                    new[key] = measured_quality(entries[0][1].info.quality, share)
                    for tier, entry in entries:
                        entry.info = dataclasses.replace(entry.info, quality=new[key])
                        self._policies[tier.name].on_measure(key, new[key])
            try:
                with self.catalog.write(exclusive=False) as tx:
                    for key, share in saved.items():
                        if key not in new:
                            row = tx.variant(key)
                            if row is None:
                                continue
                            new[key] = measured_quality(1.0 if row.quality is None else row.quality, share)
                        tx.set_quality(key, new[key])
            except CatalogUnavailableError:
                pass
            disk = self._disk()
            if disk is not None:
                for key, quality in new.items():
                    self._policies[disk.name].on_measure(key, quality)
        return new

    def record_pending(self) -> bool:
        """Write the hit counts kept while the catalog was away; whether none is left
        (the catalog may still be away: then they stay kept)."""
        with self._lock:
            if not self.unrecorded.hits:
                return True
            try:
                with self.catalog.write(exclusive=False) as tx:
                    for key, n in self.unrecorded.hits.items():
                        tx.touch(key, hits=n)
            except CatalogUnavailableError:
                return False
            self.unrecorded.hits.clear()
            return True

    def _get_shared(self, key: str, dtype: torch.dtype | None, device: torch.device | str,
                    fingerprint: str | None, promote: bool, count_hit: bool, miss: bool = True) -> ChunkKV | None:
        """A local miss looked up in the shared tier; a hit is promoted into the local tiers.
        Without ``miss`` a miss here is not counted (the disk tier is looked up next)."""
        found = self.shared.get(key)
        if found is None:
            return self._miss(key) if miss else None
        meta, kv = found
        if meta.dtype != self.config.kv_dtype:
            return self._miss(key, f"shared copy is {meta.dtype}, this store keeps {self.config.kv_dtype}")
        if fingerprint is not None and kv.fingerprint != fingerprint:
            return self._miss(key, f"fingerprint {kv.fingerprint} is not {fingerprint}")
        self._record_shared(meta, entry_nbytes(kv))
        if count_hit:
            self._count_hit(key)
        if promote:
            placement.promote_from_shared(self, key, kv, meta)
        return _convert(kv, dtype, device)

    def _open_shared(self, key: str, dtype: torch.dtype | None, device: torch.device | str,
                     fingerprint: str | None, promote: bool, count_hit: bool,
                     miss: bool = True) -> LayerReader | None:
        """A layer reader over the shared tier's copy; read to the end, it is promoted.
        ``miss`` as in :meth:`_get_shared`."""
        blob = self.shared.open(key)
        if blob is None:
            return self._miss(key) if miss else None
        meta = blob.meta
        if meta.dtype != self.config.kv_dtype:
            return self._miss(key, f"shared copy is {meta.dtype}, this store keeps {self.config.kv_dtype}")
        if fingerprint is not None and blob.metadata["fingerprint"] != fingerprint:
            return self._miss(key, f"fingerprint {blob.metadata['fingerprint']} is not {fingerprint}")
        self._record_shared(meta, meta.nbytes)
        if count_hit:
            self._count_hit(key)
        shared = self.shared

        def on_corrupt(exc: Exception) -> None:
            shared.drop(key, exc)

        def on_complete(kv: ChunkKV) -> None:
            with self._lock:
                placement.promote_from_shared(self, key, kv, meta)

        promotable = promote and bool(self._tiers)
        return SharedLayerReader(shared.name, key, blob, dtype, device, on_corrupt,
                                 on_complete if promotable else None)

    def _record_shared(self, meta: SharedMeta, nbytes: int) -> None:
        """Chunk and variant rows for a variant found in the shared tier (a promotion's
        placement rows need them; while the catalog is away there is no promotion)."""
        try:
            with self.catalog.write() as tx:
                tx.upsert_chunk(ChunkRecord(meta.chunk, meta.fingerprint, meta.num_tokens, meta.source))
                if tx.variant(meta.variant) is None:
                    tx.upsert_variant(VariantRecord(meta.variant, meta.chunk, meta.prefix, nbytes, meta.dtype,
                                                    cci=meta.cci, stats=meta.stats, cost_s=meta.cost_s,
                                                    quality=meta.quality))
        except CatalogUnavailableError:
            pass

    def _miss(self, key: str, why: str | None = None) -> None:
        self.counters.misses += 1
        if why:
            log.info("miss on %s: %s", key, why)
        return None

    def _hit(self, tier: str, key: str, entry: MemEntry | None, count: bool = True) -> None:
        if not count:
            return
        self.counters.hits[tier] += 1
        self._policies[tier].on_hit(key)
        if entry is not None:
            entry.hits += 1
        self._count_hit(key)


def _connect_shared(config: Config):
    """The shared tier of ``config.redis_url``."""
    try:
        from cachecraft.store.shared import RedisTier
        return RedisTier(config.redis_url, config.redis_budget_bytes)
    except ImportError:
        raise StoreConfigError("redis_url needs the redis package: pip install 'cachecraft[shared]'") from None
    except ValueError as exc:  # a malformed URL
        raise StoreConfigError(f"redis_url is not usable ({exc}); use redis://host:port/db") from None


def _shared_record(meta: SharedMeta, tier: str) -> VariantRecord:
    return VariantRecord(meta.variant, meta.chunk, meta.prefix, meta.nbytes, meta.dtype, cci=meta.cci,
                         stats=meta.stats, cost_s=meta.cost_s, quality=meta.quality, tier=tier)


def _convert(kv: ChunkKV, dtype: torch.dtype | None, device: torch.device | str) -> ChunkKV:
    """A fresh copy of ``kv`` in ``dtype`` on ``device`` (statistics shared, read-only)."""
    return dataclasses.replace(kv, keys=copy_to(kv.keys, dtype, device), values=copy_to(kv.values, dtype, device))
