"""Where a variant's bytes go: placement into tiers under their budgets, demotion and
promotion between tiers, and removal, each with its catalog rows and tier events.

A new entry goes to the fastest tier whose budget can hold it; room is made by
demoting that tier's victims (chosen by the tier's eviction policy) to the next tier
down, recursively; only the last tier drops entries. A hit in a slower tier promotes
the entry to the fastest tier (a move between memory tiers; a copy from disk, which
other processes share).

Crash safety follows diskcache: a blob is written to a new file first, the catalog
row (``BEGIN IMMEDIATE``) is the commit point, and replaced or evicted blobs are
deleted only after COMMIT.

Plain functions over a :class:`~cachecraft.store.store.TieredStore`'s tiers, policies
and catalog; the caller holds the store's lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from cachecraft.catalog import CatalogError, EntryRecord, VariantRecord
from cachecraft.catalog.db import CatalogTx
from cachecraft.kv import AttentionStats, ChunkKV
from cachecraft.store.codec import encode
from cachecraft.store.errors import StoreError
from cachecraft.store.eviction import EntryInfo, EvictionPolicy, estimate_cost_s
from cachecraft.store.tiers import DiskTier, MemEntry, MemoryTier, entry_nbytes

if TYPE_CHECKING:
    from cachecraft.store.store import TieredStore

log = logging.getLogger(__name__)


@dataclass
class Move:
    """A variant on its way into a tier."""

    key: str
    kv: ChunkKV  # stored dtype
    info: EntryInfo
    kind: str = "put"  # tier event kind: put | demote | promote
    from_tier: str | None = None
    remove_source: bool = False  # drop the source placement row in the same transaction
    disk_checksum: str | None = None


class NoRoom(Exception):
    """The disk tier cannot make room for an entry (inside its catalog transaction)."""


def to_stored(kv: ChunkKV, dtype: torch.dtype) -> ChunkKV:
    """``kv`` in the stored ``dtype`` (same device), never sharing the caller's tensors."""
    keys = kv.keys.detach().to(dtype=dtype).contiguous()
    values = kv.values.detach().to(dtype=dtype).contiguous()
    if keys.data_ptr() == kv.keys.data_ptr():  # never keep the caller's tensors
        keys = keys.clone()
    if values.data_ptr() == kv.values.data_ptr():
        values = values.clone()
    stats = kv.stats
    if stats is not None:
        stats = AttentionStats(*(t.detach().to("cpu").contiguous().clone()
                                 for t in (stats.outside, stats.inter, stats.intra)))
    return dataclasses.replace(kv, keys=keys, values=values, stats=stats)


def place_new(store: TieredStore, move: Move) -> str | None:
    """Put a new variant into the fastest tier that takes it, replacing any copy this
    store holds; the tier's name, or None when no budget can hold it. On an error the
    replaced memory copies are put back."""
    replaced = [(tier, tier.get(move.key)) for tier in store._memory_tiers() if move.key in tier]
    for tier, _ in replaced:  # the new bytes replace any we hold
        forget(store, tier, move.key, kind=None)
    try:
        for i, tier in enumerate(store._tiers):
            if place(store, i, move, frozenset()):
                store.counters.puts += 1
                if not tier.is_disk:
                    delete_disk_copy(store, move.key, kind=None)
                return tier.name
    except BaseException:
        for tier, entry in replaced:  # the put failed: keep what we had
            _restore(store, tier, move.key, entry)
        raise
    return None


def place(store: TieredStore, i: int, move: Move, exclude: frozenset[str]) -> bool:
    """Put ``move`` into tier ``i``, demoting victims; False if it cannot fit there."""
    tier = store._tiers[i]
    if tier.is_disk:
        return _place_disk(store, tier, move, exclude)
    size = move.info.nbytes
    if size > tier.budget:
        return False
    policy = store._policies[tier.name]
    skip = exclude | {move.key}
    while tier.used + size > tier.budget:
        victim = policy.victim(skip)
        if victim is None:
            return False
        demote(store, i, victim, skip)
    held = tier.adopt(move.kv)
    with store.catalog.write() as tx:
        tx.add_entry(EntryRecord(move.key, tier.name, store.owner, size, node=store.node))
        if move.remove_source:
            tx.remove_entry(move.key, move.from_tier, store.owner)
        tx.event(move.kind, move.key, move.from_tier, tier.name, size, store.owner)
    tier.insert(move.key, MemEntry(held, move.info, move.info.hits, move.disk_checksum))
    policy.on_put(move.info)
    return True


def demote(store: TieredStore, i: int, key: str, exclude: frozenset[str], only: int | None = None) -> None:
    """Move ``key`` out of memory tier ``i`` to the next tier that takes it, or drop it."""
    tier = store._tiers[i]
    entry = tier.get(key)
    assert entry is not None, f"{key} not in tier {tier.name}"
    move = Move(key, entry.kv, dataclasses.replace(entry.info, hits=entry.hits), "demote",
                tier.name, True, entry.disk_checksum)
    targets = [only] if only is not None else range(i + 1, len(store._tiers))
    placed = any(place(store, j, move, exclude) for j in targets)  # stops at the first True
    tier.remove(key)
    store._policies[tier.name].on_evict(key)
    if placed:
        store.counters.demotions += 1
        return
    store.counters.evictions += 1
    with store.catalog.write() as tx:
        tx.remove_entry(key, tier.name, store.owner)
        tx.event("evict", key, tier.name, None, entry.info.nbytes, store.owner)


def empty_memory_tiers(store: TieredStore, persist: bool) -> None:
    """Drop every memory-tier entry; with ``persist``, first move each to the disk tier
    (best effort: one that cannot be written is logged and dropped)."""
    if persist and store._disk() is not None:
        disk_index = len(store._tiers) - 1
        for i, tier in enumerate(store._memory_tiers()):
            for key in store._policies[tier.name].candidates():
                try:
                    demote(store, i, key, frozenset(), only=disk_index)
                except (StoreError, CatalogError) as exc:
                    log.warning("could not persist %s to disk: %s", key, exc)
    for tier in store._memory_tiers():
        for key in tier.keys():
            try:
                forget(store, tier, key, kind="evict")
            except CatalogError:  # the catalog is away: the next open drops this process's rows
                pass


def _place_disk(store: TieredStore, disk: DiskTier, move: Move, exclude: frozenset[str]) -> bool:
    policy = store._policies["disk"]
    if move.disk_checksum is not None:  # an identical copy may already be on disk
        with store.catalog.write() as tx:
            row = tx.entry(move.key, "disk", store.node)
            if row is not None and row.checksum == move.disk_checksum:
                if move.remove_source:
                    tx.remove_entry(move.key, move.from_tier, store.owner)
                tx.event(move.kind, move.key, move.from_tier, "disk", row.nbytes, store.owner)
                policy.on_hit(move.key)
                return True
    blob = encode(move.kv)
    size = len(blob.data)
    if size > disk.budget:
        return False
    blob_id = f"{move.key}.{uuid.uuid4().hex[:12]}"
    victims: list[EntryRecord] = []
    with store._maintenance.shared():
        disk.write(blob_id, blob)  # the new file first ...
        try:
            with store.catalog.write() as tx:  # ... then the row: the commit point
                old = tx.entry(move.key, "disk", store.node)
                victims = disk_victims(tx, policy, size, old, exclude | {move.key}, disk.budget, store.node)
                for v in victims:
                    tx.remove_entry(v.variant_key, "disk", store.node, blob=v.blob)
                    tx.event("evict", v.variant_key, "disk", None, v.nbytes, store.owner)
                tx.add_entry(EntryRecord(move.key, "disk", store.node, size, blob_id, blob.checksum, node=store.node))
                if move.remove_source:
                    tx.remove_entry(move.key, move.from_tier, store.owner)
                tx.event(move.kind, move.key, move.from_tier, "disk", size, store.owner)
        except BaseException as exc:
            disk.delete(blob_id)
            if isinstance(exc, NoRoom):
                return False
            raise
    for v in victims:  # after COMMIT: drop the evicted files
        disk.delete(v.blob)
        policy.on_evict(v.variant_key)
        store.counters.evictions += 1
    if old is not None and old.blob != blob_id:
        disk.delete(old.blob)
    policy.on_put(dataclasses.replace(move.info, nbytes=size))
    return True


def disk_victims(tx: CatalogTx, policy: EvictionPolicy, size: int, old: EntryRecord | None,
                  skip: frozenset[str], budget: int, node: str) -> list[EntryRecord]:
    """Entries of ``node``'s disk tier to evict so that ``size`` more bytes fit (inside the
    transaction)."""
    used = tx.tier_bytes("disk", node) - (old.nbytes if old is not None else 0)
    if used + size <= budget:
        return []
    placed = tx.placed_variants("disk", node)
    sync_policy(policy, placed)  # other processes add and remove disk entries too
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
        raise NoRoom
    return victims


def sync_policy(policy: EvictionPolicy, placed: Iterable[tuple[EntryRecord, VariantRecord]]) -> None:
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


def promote_memory(store: TieredStore, i: int, key: str) -> None:
    """Move ``key`` from memory tier ``i`` to the fastest memory tier that takes it."""
    tier = store._tiers[i]
    entry = tier.get(key)
    move = Move(key, entry.kv, dataclasses.replace(entry.info, hits=entry.hits), "promote",
                tier.name, True, entry.disk_checksum)
    try:
        for j in range(i):
            if place(store, j, move, frozenset({key})):
                tier.remove(key)
                store._policies[tier.name].discard(key)
                store.counters.promotions += 1
                return
    except (StoreError, CatalogError) as exc:  # best effort: the read is served
        log.warning("could not promote %s from %s: %s", key, tier.name, exc)


def promote_from_disk(store: TieredStore, key: str, kv: ChunkKV, row: EntryRecord) -> None:
    """Copy a disk entry into the fastest memory tier that takes it (disk keeps it)."""
    if not store._memory_tiers() or any(key in t for t in store._memory_tiers()):
        return
    try:
        rec = store.info(key)
    except CatalogError:  # the catalog is away: no promotion this time
        return
    info = EntryInfo(key, kv.chunk, entry_nbytes(kv),
                     rec.cost_s if rec and rec.cost_s is not None else estimate_cost_s(kv.num_tokens, kv.num_layers),
                     rec.quality if rec and rec.quality is not None else 1.0, rec.hits if rec else 0)
    move = Move(key, kv, info, "promote", "disk", False, row.checksum)
    try:
        for j, _ in enumerate(store._memory_tiers()):
            if place(store, j, move, frozenset({key})):
                store.counters.promotions += 1
                return
    except (StoreError, CatalogError) as exc:  # best effort: the read is served
        log.warning("could not promote %s from disk: %s", key, exc)


def promote_from_shared(store: TieredStore, key: str, kv: ChunkKV, meta) -> None:
    """Copy a variant read from the shared tier into the fastest local tier that takes it
    (memory first, then disk); the shared tier keeps it. Best effort: a local failure is
    logged, the read still served."""
    if any(key in t for t in store._memory_tiers()) or store._disk_row(key) is not None:
        return
    info = EntryInfo(key, kv.chunk, entry_nbytes(kv),
                     meta.cost_s if meta.cost_s is not None else estimate_cost_s(kv.num_tokens, kv.num_layers),
                     meta.quality if meta.quality is not None else 1.0)
    move = Move(key, kv, info, "promote", "redis", False, None)
    try:
        for j in range(len(store._tiers)):
            if place(store, j, move, frozenset({key})):
                store.counters.promotions += 1
                return
    except (StoreError, CatalogError) as exc:  # best effort: the read is served
        log.warning("could not promote %s from the shared tier: %s", key, exc)


def forget(store: TieredStore, tier: MemoryTier, key: str, kind: str | None) -> None:
    """Drop ``key`` from a memory tier and its row (logging a ``kind`` event unless None)."""
    entry = tier.remove(key)
    if entry is None:
        return
    if kind == "evict":
        store._policies[tier.name].on_evict(key)
    else:
        store._policies[tier.name].discard(key)
    with store.catalog.write() as tx:
        tx.remove_entry(key, tier.name, store.owner)
        if kind is not None:
            tx.event(kind, key, tier.name, None, entry.info.nbytes, store.owner)


def _restore(store: TieredStore, tier: MemoryTier, key: str, entry: MemEntry) -> None:
    """Put back an entry removed by a put that then failed (there is room: it only freed)."""
    if key in tier or tier.used + entry.info.nbytes > tier.budget:
        return
    with contextlib.suppress(Exception):
        with store.catalog.write() as tx:
            tx.add_entry(EntryRecord(key, tier.name, store.owner, entry.info.nbytes, node=store.node))
        tier.insert(key, entry)
        store._policies[tier.name].on_put(entry.info)


def delete_disk_copy(store: TieredStore, key: str, kind: str | None) -> bool:
    """Remove ``key``'s disk row, then its blob; whether there was one."""
    disk = store._disk()
    if disk is None:
        return False
    with store.catalog.write() as tx:
        row = tx.remove_entry(key, "disk", store.node)
        if row is not None and kind is not None:
            tx.event(kind, key, "disk", None, row.nbytes, store.owner)
    if row is None:
        return False
    disk.delete(row.blob)  # after COMMIT
    store._policies["disk"].discard(key)
    return True


def drop_disk_row(store: TieredStore, row: EntryRecord, kind: str, why: str) -> None:
    """Remove a disk entry found damaged or without bytes (if the row still names them)."""
    with store.catalog.write() as tx:
        removed = tx.remove_entry(row.variant_key, "disk", store.node, blob=row.blob)
        if removed is not None:
            tx.event(kind, row.variant_key, "disk", None, row.nbytes, store.owner)
    if removed is not None:
        if kind == "corrupt":
            store.counters.corrupt += 1
        else:
            store.counters.lost += 1
        log.warning("dropped %s disk entry %s: %s", kind, row.variant_key, why)
        store._disk().delete(row.blob)
        store._policies["disk"].discard(row.variant_key)
