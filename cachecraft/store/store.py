"""TieredStore: chunk-cache variants in GPU / CPU / disk tiers under byte budgets.

A put goes to the fastest tier whose budget can hold the entry; room is made by
demoting that tier's victims (chosen by the tier's eviction policy) to the next tier
down, recursively; only the last tier drops entries. A hit in a slower tier promotes
the entry to the fastest tier (a move between memory tiers; a copy from disk, which
other processes share). Entries are stored in ``config.kv_dtype`` and converted to the
requested dtype and device on the way out, always as a fresh copy.

GPU and CPU tiers are private to the process; the disk tier and the catalog are shared
by every process using the cache directory. Crash safety follows diskcache: a blob is
written to a new file first, the catalog row (``BEGIN IMMEDIATE``) is the commit point,
and replaced or evicted blobs are deleted only after COMMIT. :meth:`TieredStore.reconcile`
(run on open) drops rows whose bytes are gone and deletes bytes no row names.

Every disk read verifies checksums and the entry's identity (its key recomputed from
the stored tokens, fingerprint and prefix); a damaged entry is removed, logged as a
``corrupt`` tier event and counted as a miss. Memory tiers hold tensors this process
made and are not re-hashed on reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from cachecraft.catalog import TIERS, Catalog, ChunkRecord, EntryRecord, VariantRecord, catalog_path
from cachecraft.catalog.db import CatalogTx
from cachecraft.config import Config
from cachecraft.kv import AttentionStats, ChunkKV, chunk_key
from cachecraft.store.codec import BlobError, LazyBlob, copy_to, decode, encode
from cachecraft.store.errors import CacheDirError, StoreConfigError, StoreError
from cachecraft.store.eviction import EntryInfo, EvictionPolicy, estimate_cost_s, make_policy
from cachecraft.store.locks import FileLock, OwnerLock, owner_alive
from cachecraft.store.readers import DiskLayerReader, LayerReader, MemoryLayerReader
from cachecraft.store.recover import rebuild_from_disk
from cachecraft.store.tiers import DiskTier, MemEntry, MemoryTier, entry_nbytes

log = logging.getLogger(__name__)

STORE_DIR = "store"
DISK_DIR = "disk"
LOCKS_DIR = "locks"
MAINTENANCE_LOCK = "store.lock"


def store_paths(cache_dir: str | Path) -> tuple[Path, Path, Path]:
    """(store root, disk tier directory, locks directory) of a cache directory."""
    root = Path(cache_dir) / STORE_DIR
    return root, root / DISK_DIR, root / LOCKS_DIR


def ensure_writable(directory: Path) -> None:
    """Create ``directory`` if needed and check a file can be written in it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CacheDirError(f"cache directory {directory} is not writable ({exc.strerror or exc}); "
                            "set CACHECRAFT_CACHE_DIR (or cache_dir) to a writable directory") from None


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


@dataclass(frozen=True)
class TierState:
    """A tier's occupancy as this store sees it (the disk tier: all processes)."""

    tier: str
    entries: int
    bytes: int
    budget: int


@dataclass
class _Item:
    """A variant on its way into a tier."""

    key: str
    kv: ChunkKV  # stored dtype
    info: EntryInfo
    kind: str = "put"  # tier event kind: put | demote | promote
    from_tier: str | None = None
    remove_source: bool = False  # drop the source placement row in the same transaction
    disk_checksum: str | None = None


class _NoRoom(Exception):
    pass


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
        names = self._tier_names(tiers)
        limits = {"gpu": config.gpu_budget_bytes, "cpu": config.cpu_budget_bytes,
                  "disk": config.disk_budget_bytes, **dict(budgets or {})}
        for name in names:
            budget = limits[name]
            if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
                raise StoreConfigError(f"{name} tier budget must be a positive number of bytes, got "
                                       f"{budget!r}; set {name}_budget_bytes (CACHECRAFT_{name.upper()}"
                                       "_BUDGET_BYTES) or leave the tier out")
        policy_name = eviction or config.eviction
        try:
            make_policy(policy_name)
        except ValueError as exc:
            raise StoreConfigError(str(exc)) from None
        catalog_missing = not catalog_path(self.cache_dir).exists()
        self.catalog = Catalog(self.cache_dir)
        self.owner = uuid.uuid4().hex[:16]
        self._owner_lock: OwnerLock | None = None
        self._maintenance = FileLock(self.locks_dir / MAINTENANCE_LOCK)
        self._lock = threading.RLock()
        self.counters = StoreCounters()
        self._tiers: list[MemoryTier | DiskTier] = []
        try:
            self._owner_lock = OwnerLock(self.locks_dir, self.owner)
            cuda = torch.cuda.is_available()
            for name in names:
                if name == "gpu":
                    self._tiers.append(MemoryTier("gpu", "cuda", limits["gpu"]))
                elif name == "cpu":
                    self._tiers.append(MemoryTier("cpu", "cpu", limits["cpu"], pin=cuda))
                else:
                    self._tiers.append(DiskTier(disk_dir, limits["disk"]))
            self._policies: dict[str, EvictionPolicy] = {t.name: make_policy(policy_name) for t in self._tiers}
            disk = self._disk()
            if catalog_missing and disk is not None and disk.listing():
                # a catalog deleted by hand must not make the disk tier look like orphans
                with self._maintenance.exclusive(lock_timeout_s) as got:
                    if got:
                        log.warning("catalog %s was missing; rebuilt %d entries from the disk tier",
                                    self.catalog.path, rebuild_from_disk(self.catalog, disk))
                    else:
                        reconcile = False  # never treat un-rebuilt blobs as orphans
            if reconcile:
                self.reconcile()
        except BaseException:
            self._release()
            raise
        log.debug("store %s open at %s: tiers %s, eviction %s", self.owner, self.cache_dir,
                  [(t.name, t.budget) for t in self._tiers], policy_name)

    @staticmethod
    def _tier_names(tiers: Sequence[str] | None) -> list[str]:
        cuda = torch.cuda.is_available()
        if tiers is None:
            return [t for t in TIERS if t != "gpu" or cuda]
        unknown = [t for t in tiers if t not in TIERS]
        if unknown or not tiers or len(set(tiers)) != len(tiers):
            raise StoreConfigError(f"tiers must be distinct names from {TIERS}, got {list(tiers)}")
        if "gpu" in tiers and not cuda:
            raise StoreConfigError("the gpu tier needs CUDA, which is not available; leave it out")
        return [t for t in TIERS if t in tiers]

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
            source: str | None = None, preview: str | None = None) -> str | None:
        """Store a variant (replacing one with the same key); returns the tier it went to.

        ``cost_s``: measured prefill seconds a reuse saves (estimated from size if None);
        ``quality``: fraction of that a reuse avoids (1 - expected recompute fraction);
        ``cci``/``stats``: policy statistics recorded in the catalog; ``source``/``preview``:
        where the chunk came from, for the catalog. Returns None (and caches nothing)
        when the entry is larger than every tier's budget. Raises :class:`DiskFullError`
        and other :class:`StoreError` on I/O failure, leaving what was stored intact.
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
        stored = self._to_stored(kv)
        key = kv.variant
        nbytes = entry_nbytes(stored)
        cost = estimate_cost_s(kv.num_tokens, kv.num_layers) if cost_s is None else float(cost_s)
        info = EntryInfo(key, kv.chunk, nbytes, cost, 1.0 if quality is None else float(quality))
        with self._lock:
            with self.catalog.write() as tx:
                tx.upsert_chunk(ChunkRecord(kv.chunk, kv.fingerprint, kv.num_tokens, source, preview))
                tx.upsert_variant(VariantRecord(key, kv.chunk, kv.prefix, nbytes, self.config.kv_dtype,
                                                cci=cci, stats=stats, cost_s=cost_s, quality=quality))
            replaced = [(tier, tier.get(key)) for tier in self._memory_tiers() if key in tier]
            for tier, _ in replaced:  # the new bytes replace any we hold
                self._forget(tier, key, kind=None)
            item = _Item(key, stored, info)
            try:
                for i, tier in enumerate(self._tiers):
                    if self._place(i, item, frozenset()):
                        self.counters.puts += 1
                        if not tier.is_disk:
                            self._delete_disk_copy(key, kind=None)
                        return tier.name
            except BaseException:
                for tier, entry in replaced:  # the put failed: keep what we had
                    self._restore(tier, key, entry)
                raise
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
                    self._promote_memory(i, key)
                return out
            disk = self._disk()
            if disk is None:
                return self._miss(key)
            row = self._disk_row(key)
            if row is None:
                return self._miss(key)
            data = disk.read(row.blob)
            if data is None:
                self._drop_disk_row(row, "lost", "bytes are missing")
                return self._miss(key)
            try:
                kv = decode(data, row.checksum, key)
            except BlobError as exc:
                self._drop_disk_row(row, "corrupt", str(exc))
                return self._miss(key)
            if fingerprint is not None and kv.fingerprint != fingerprint:
                return self._miss(key, f"fingerprint {kv.fingerprint} is not {fingerprint}")
            self._hit("disk", key, None, count_hit)
            if promote:
                self._promote_from_disk(key, kv, row)
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
                    self._promote_memory(i, key)
                return reader
            opened = self._open_disk(key)
            if opened is None:
                return self._miss(key)
            row, blob = opened
            if fingerprint is not None and blob.metadata["fingerprint"] != fingerprint:
                blob.close()
                return self._miss(key, f"fingerprint {blob.metadata['fingerprint']} is not {fingerprint}")
            self._hit("disk", key, None, count_hit)

        def on_corrupt(exc: Exception) -> None:
            with self._lock:
                self._drop_disk_row(row, "corrupt", str(exc))

        def on_complete(kv: ChunkKV) -> None:
            with self._lock:
                self._promote_from_disk(key, kv, row)

        promotable = promote and bool(self._memory_tiers())
        return DiskLayerReader(key, blob, dtype, device, on_corrupt, on_complete if promotable else None)

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
            if self._disk() is not None and self._disk_row(key) is not None:
                return "disk"
            return None

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier this store can reach; whether anything was removed."""
        with self._lock:
            found = False
            for tier in self._memory_tiers():
                if key in tier:
                    self._forget(tier, key, kind="delete")
                    found = True
            return self._delete_disk_copy(key, kind="delete") or found

    def variants_of(self, chunk: str) -> list[VariantRecord]:
        """Variants of a chunk this store can read (tier = the fastest it can read from)."""
        with self.catalog.read() as tx:
            return tx.available_variants(chunk, self.owner)

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
            opened = self._open_disk(key)
        if opened is None:
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
                    rows = tx.entries(tier="disk")
                out["disk"] = TierState("disk", len(rows), sum(r.nbytes for r in rows), disk.budget)
            return out

    def keys(self, tier: str) -> list[str]:
        """Keys held by one tier (memory tiers: this process's; disk: everyone's)."""
        t = self._tier(tier)
        if t.is_disk:
            with self.catalog.read() as tx:
                return [r.variant_key for r in tx.entries(tier="disk")]
        with self._lock:
            return t.keys()

    def reconcile(self) -> dict[str, int]:
        """Make catalog and tiers agree after crashes (run on open); returns counts of fixes.

        Drops memory placements of stores whose process is gone, disk rows whose bytes
        are missing, and blobs or files no row names. The disk part needs the
        maintenance lock; when another process holds it too long it is skipped.
        """
        fixed = {"dead_owner_entries": 0, "lost_rows": 0, "orphan_blobs": 0, "orphan_files": 0}
        with self._lock:
            with self.catalog.read() as tx:
                owners = tx.memory_owners() - {self.owner}
            for owner in owners:
                if not owner_alive(self.locks_dir, owner):
                    with self.catalog.write() as tx:
                        fixed["dead_owner_entries"] += len(tx.remove_owner(owner, "lost"))
            disk = self._disk()
            if disk is not None:
                with self._maintenance.exclusive(self.lock_timeout_s) as got:
                    if got:
                        fixed.update(_reconcile_disk(self.catalog, disk, self.owner))
                    else:
                        log.info("another process is busy with the disk tier; reconcile skipped")
            with self.catalog.write() as tx:
                tx.prune_events()
        if any(fixed.values()):
            log.warning("reconciled cache %s: %s", self.cache_dir, fixed)
        return fixed

    def close(self, persist: bool = True) -> None:
        """Close the store; with ``persist``, first move memory-tier entries to disk."""
        with self._lock:
            if self._owner_lock is None:
                return
            try:
                if persist and self._disk() is not None:
                    disk_index = len(self._tiers) - 1
                    for i, tier in enumerate(self._memory_tiers()):
                        for key in self._policies[tier.name].candidates():
                            try:
                                self._demote(i, key, frozenset(), only=disk_index)
                            except StoreError as exc:
                                log.warning("could not persist %s to disk: %s", key, exc)
                for tier in self._memory_tiers():
                    for key in tier.keys():
                        self._forget(tier, key, kind="evict")
            finally:
                self._release()

    def _release(self) -> None:
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

    def _open_disk(self, key: str) -> tuple[EntryRecord, LazyBlob] | None:
        """The disk row of ``key`` and a verified lazy view of its blob, or None."""
        disk = self._disk()
        row = None if disk is None else self._disk_row(key)
        if row is None:
            return None
        with disk.open(row.blob) as opened:
            if opened is None:
                self._drop_disk_row(row, "lost", "bytes are missing")
                return None
            try:
                return row, LazyBlob(opened[0], opened[1], row.checksum, key)
            except FileNotFoundError:  # evicted by another process while we opened it
                return None
            except BlobError as exc:
                self._drop_disk_row(row, "corrupt", str(exc))
                return None

    def _disk_row(self, key: str) -> EntryRecord | None:
        with self.catalog.read() as tx:
            return tx.entry(key, "disk")

    def _to_stored(self, kv: ChunkKV) -> ChunkKV:
        """``kv`` in the stored dtype (same device), never sharing the caller's tensors."""
        keys = kv.keys.detach().to(dtype=self.stored_dtype).contiguous()
        values = kv.values.detach().to(dtype=self.stored_dtype).contiguous()
        if keys.data_ptr() == kv.keys.data_ptr():  # never keep the caller's tensors
            keys = keys.clone()
        if values.data_ptr() == kv.values.data_ptr():
            values = values.clone()
        stats = kv.stats
        if stats is not None:
            stats = AttentionStats(*(t.detach().to("cpu").contiguous().clone()
                                     for t in (stats.outside, stats.inter, stats.intra)))
        return dataclasses.replace(kv, keys=keys, values=values, stats=stats)

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
        with self.catalog.write() as tx:
            tx.touch(key)

    def _forget(self, tier: MemoryTier, key: str, kind: str | None) -> None:
        entry = tier.remove(key)
        if entry is None:
            return
        if kind == "evict":
            self._policies[tier.name].on_evict(key)
        else:
            self._policies[tier.name].discard(key)
        with self.catalog.write() as tx:
            tx.remove_entry(key, tier.name, self.owner)
            if kind is not None:
                tx.event(kind, key, tier.name, None, entry.info.nbytes, self.owner)

    def _restore(self, tier: MemoryTier, key: str, entry: MemEntry) -> None:
        """Put back an entry removed by a put that then failed (there is room: it only freed)."""
        if key in tier or tier.used + entry.info.nbytes > tier.budget:
            return
        with contextlib.suppress(Exception):
            with self.catalog.write() as tx:
                tx.add_entry(EntryRecord(key, tier.name, self.owner, entry.info.nbytes))
            tier.insert(key, entry)
            self._policies[tier.name].on_put(entry.info)

    def _delete_disk_copy(self, key: str, kind: str | None) -> bool:
        disk = self._disk()
        if disk is None:
            return False
        with self.catalog.write() as tx:
            row = tx.remove_entry(key, "disk")
            if row is not None and kind is not None:
                tx.event(kind, key, "disk", None, row.nbytes, self.owner)
        if row is None:
            return False
        disk.delete(row.blob)  # after COMMIT
        self._policies["disk"].discard(key)
        return True

    def _drop_disk_row(self, row: EntryRecord, kind: str, why: str) -> None:
        """Remove a disk entry found damaged or without bytes (if the row still names them)."""
        with self.catalog.write() as tx:
            removed = tx.remove_entry(row.variant_key, "disk", blob=row.blob)
            if removed is not None:
                tx.event(kind, row.variant_key, "disk", None, row.nbytes, self.owner)
        if removed is not None:
            if kind == "corrupt":
                self.counters.corrupt += 1
            else:
                self.counters.lost += 1
            log.warning("dropped %s disk entry %s: %s", kind, row.variant_key, why)
            self._disk().delete(row.blob)
            self._policies["disk"].discard(row.variant_key)

    def _place(self, i: int, item: _Item, exclude: frozenset[str]) -> bool:
        """Put ``item`` into tier ``i``, demoting victims; False if it cannot fit there."""
        tier = self._tiers[i]
        if tier.is_disk:
            return self._place_disk(tier, item, exclude)
        size = item.info.nbytes
        if size > tier.budget:
            return False
        policy = self._policies[tier.name]
        skip = exclude | {item.key}
        while tier.used + size > tier.budget:
            victim = policy.victim(skip)
            if victim is None:
                return False
            self._demote(i, victim, skip)
        stored = tier.adopt(item.kv)
        with self.catalog.write() as tx:
            tx.add_entry(EntryRecord(item.key, tier.name, self.owner, size))
            if item.remove_source:
                tx.remove_entry(item.key, item.from_tier, self.owner)
            tx.event(item.kind, item.key, item.from_tier, tier.name, size, self.owner)
        tier.insert(item.key, MemEntry(stored, item.info, item.info.hits, item.disk_checksum))
        policy.on_put(item.info)
        return True

    def _demote(self, i: int, key: str, exclude: frozenset[str], only: int | None = None) -> None:
        """Move ``key`` out of memory tier ``i`` to the next tier that takes it, or drop it."""
        tier = self._tiers[i]
        entry = tier.get(key)
        assert entry is not None, f"{key} not in tier {tier.name}"
        item = _Item(key, entry.kv, dataclasses.replace(entry.info, hits=entry.hits), "demote",
                     tier.name, True, entry.disk_checksum)
        targets = [only] if only is not None else range(i + 1, len(self._tiers))
        placed = any(self._place(j, item, exclude) for j in targets)  # stops at the first True
        tier.remove(key)
        self._policies[tier.name].on_evict(key)
        if placed:
            self.counters.demotions += 1
            return
        self.counters.evictions += 1
        with self.catalog.write() as tx:
            tx.remove_entry(key, tier.name, self.owner)
            tx.event("evict", key, tier.name, None, entry.info.nbytes, self.owner)

    def _place_disk(self, disk: DiskTier, item: _Item, exclude: frozenset[str]) -> bool:
        policy = self._policies["disk"]
        if item.disk_checksum is not None:  # an identical copy may already be on disk
            with self.catalog.write() as tx:
                row = tx.entry(item.key, "disk")
                if row is not None and row.checksum == item.disk_checksum:
                    if item.remove_source:
                        tx.remove_entry(item.key, item.from_tier, self.owner)
                    tx.event(item.kind, item.key, item.from_tier, "disk", row.nbytes, self.owner)
                    policy.on_hit(item.key)
                    return True
        blob = encode(item.kv)
        size = len(blob.data)
        if size > disk.budget:
            return False
        blob_id = f"{item.key}.{uuid.uuid4().hex[:12]}"
        victims: list[EntryRecord] = []
        with self._maintenance.shared():
            disk.write(blob_id, blob)  # the new file first ...
            try:
                with self.catalog.write() as tx:  # ... then the row: the commit point
                    old = tx.entry(item.key, "disk")
                    victims = self._disk_victims(tx, policy, size, old, exclude | {item.key}, disk.budget)
                    for v in victims:
                        tx.remove_entry(v.variant_key, "disk", blob=v.blob)
                        tx.event("evict", v.variant_key, "disk", None, v.nbytes, self.owner)
                    tx.add_entry(EntryRecord(item.key, "disk", "", size, blob_id, blob.checksum))
                    if item.remove_source:
                        tx.remove_entry(item.key, item.from_tier, self.owner)
                    tx.event(item.kind, item.key, item.from_tier, "disk", size, self.owner)
            except BaseException as exc:
                disk.delete(blob_id)
                if isinstance(exc, _NoRoom):
                    return False
                raise
        for v in victims:  # after COMMIT: drop the evicted files
            disk.delete(v.blob)
            policy.on_evict(v.variant_key)
            self.counters.evictions += 1
        if old is not None and old.blob != blob_id:
            disk.delete(old.blob)
        policy.on_put(dataclasses.replace(item.info, nbytes=size))
        return True

    def _disk_victims(self, tx: CatalogTx, policy: EvictionPolicy, size: int, old: EntryRecord | None,
                      skip: frozenset[str], budget: int) -> list[EntryRecord]:
        """Disk entries to evict so that ``size`` more bytes fit (inside the transaction)."""
        used = tx.tier_bytes("disk") - (old.nbytes if old is not None else 0)
        if used + size <= budget:
            return []
        placed = tx.placed_variants("disk")
        _sync_policy(policy, placed)  # other processes add and remove disk entries too
        rows = {e.variant_key: e for e, _ in placed}
        victims = []
        for key in policy.candidates():
            if used + size <= budget:
                break
            if key in skip or key not in rows:
                continue
            victims.append(rows[key])
            used -= rows[key].nbytes
        if used + size > budget:
            raise _NoRoom
        return victims

    def _promote_memory(self, i: int, key: str) -> None:
        """Move ``key`` from memory tier ``i`` to the fastest memory tier that takes it."""
        tier = self._tiers[i]
        entry = tier.get(key)
        item = _Item(key, entry.kv, dataclasses.replace(entry.info, hits=entry.hits), "promote",
                     tier.name, True, entry.disk_checksum)
        try:
            for j in range(i):
                if self._place(j, item, frozenset({key})):
                    tier.remove(key)
                    self._policies[tier.name].discard(key)
                    self.counters.promotions += 1
                    return
        except StoreError as exc:
            log.warning("could not promote %s from %s: %s", key, tier.name, exc)

    def _promote_from_disk(self, key: str, kv: ChunkKV, row: EntryRecord) -> None:
        """Copy a disk entry into the fastest memory tier that takes it (disk keeps it)."""
        if not self._memory_tiers() or any(key in t for t in self._memory_tiers()):
            return
        rec = self.info(key)
        info = EntryInfo(key, kv.chunk, entry_nbytes(kv),
                         rec.cost_s if rec and rec.cost_s is not None else estimate_cost_s(kv.num_tokens, kv.num_layers),
                         rec.quality if rec and rec.quality is not None else 1.0, rec.hits if rec else 0)
        item = _Item(key, kv, info, "promote", "disk", False, row.checksum)
        try:
            for j, tier in enumerate(self._memory_tiers()):
                if self._place(j, item, frozenset({key})):
                    self.counters.promotions += 1
                    return
        except StoreError as exc:
            log.warning("could not promote %s from disk: %s", key, exc)


def _convert(kv: ChunkKV, dtype: torch.dtype | None, device: torch.device | str) -> ChunkKV:
    """A fresh copy of ``kv`` in ``dtype`` on ``device`` (statistics shared, read-only)."""
    return dataclasses.replace(kv, keys=copy_to(kv.keys, dtype, device), values=copy_to(kv.values, dtype, device))


def _sync_policy(policy: EvictionPolicy, placed: Iterable[tuple[EntryRecord, VariantRecord]]) -> None:
    """Make a disk policy track exactly the disk entries the catalog lists."""
    placed = list(placed)
    present = {e.variant_key for e, _ in placed}
    for key in policy.keys() - present:
        policy.discard(key)
    known = policy.keys()
    for entry, variant in sorted(placed, key=lambda p: (p[1].last_used or p[0].stored_at)):
        if entry.variant_key not in known:
            policy.on_put(EntryInfo(entry.variant_key, variant.chunk_key, max(entry.nbytes, 1),
                                    variant.cost_s if variant.cost_s is not None else 1.0,
                                    variant.quality if variant.quality is not None else 1.0,
                                    variant.hits))


def _reconcile_disk(catalog: Catalog, disk: DiskTier, owner: str) -> dict[str, int]:
    """Disk rows without bytes are dropped; blobs and files without rows are deleted.

    The caller holds the maintenance lock exclusively.
    """
    listing = disk.listing()
    with catalog.read() as tx:
        rows = tx.entries(tier="disk")
    fixed = {"lost_rows": 0, "orphan_blobs": 0, "orphan_files": 0}
    referenced: set[str] = set()
    for row in rows:
        found = listing.get(row.blob)
        if found is not None and found.tag == row.checksum and disk.path_of(found.filename).is_file():
            referenced.add(row.blob)
            continue
        with catalog.write() as tx:
            if tx.remove_entry(row.variant_key, "disk", blob=row.blob) is not None:
                tx.event("lost", row.variant_key, "disk", None, row.nbytes, owner)
                fixed["lost_rows"] += 1
    for blob_id in set(listing) - referenced:
        disk.delete(blob_id)
        fixed["orphan_blobs"] += 1
    for path in disk.unknown_files(disk.listing()):
        with contextlib.suppress(OSError):
            path.unlink()
            fixed["orphan_files"] += 1
    disk.remove_empty_dirs()
    return fixed
