"""Looking after a cache directory: recover a catalog deleted by hand from the disk
tier, reconcile after crashes (run when a store opens), evict chosen variants, and
destroy the store and catalog altogether.

Reconcile drops memory placements of stores whose process is gone, disk rows whose
bytes are missing, and blobs or files no row names. Its disk part, like destroy, holds
the maintenance lock exclusively, so a blob in flight is never taken for an orphan.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from cachecraft.catalog import TIERS, Catalog, remove_catalog
from cachecraft.catalog.pending import PENDING_DIR
from cachecraft.store.errors import SelectorError, SharedTierError, StoreBusyError, StoreConfigError
from cachecraft.store.locks import FileLock, live_owners, owner_alive
from cachecraft.store.nodes import node_id
from cachecraft.store.placement import NoRoom, disk_victims
from cachecraft.store.paths import MAINTENANCE_LOCK, store_paths
from cachecraft.store.recover import rebuild_from_disk
from cachecraft.store.tiers import DiskTier

if TYPE_CHECKING:
    from cachecraft.store.store import TieredStore

log = logging.getLogger(__name__)

MIN_PREFIX = 6
"""Characters of a chunk key that :func:`evict` needs to pick a chunk."""


@dataclass(frozen=True)
class EvictReport:
    """Variant keys an eviction removed, a note when it could not remove what was asked,
    and the shared tier (as shown, password hidden) when it did not answer, so its copies
    of what was asked may stay."""

    removed: tuple[str, ...] = ()
    note: str | None = None
    unreached: str | None = None

    def to_dict(self) -> dict:
        """JSON-friendly report."""
        return {"removed": len(self.removed), "variants": list(self.removed), "note": self.note,
                "unreached": self.unreached}


@dataclass(frozen=True)
class DestroyReport:
    """What :func:`destroy` deleted: local paths (empty when there were none), rows of a
    shared catalog (per kind), and how many entries the shared tier held."""

    removed: tuple[str, ...] = ()
    catalog_rows: dict[str, int] = field(default_factory=dict)
    shared_entries: int = 0

    @property
    def anything(self) -> bool:
        """Whether anything at all was deleted."""
        return bool(self.removed or any(self.catalog_rows.values()) or self.shared_entries)


def recover_catalog(store: TieredStore) -> bool:
    """Rebuild the rows of a missing catalog from the disk tier's blobs.

    False when another process kept the maintenance lock: the blobs are then not
    rebuilt, and must not be treated as orphans.
    """
    disk = store._disk()
    if disk is None or not disk.listing():
        return True
    with store._maintenance.exclusive(store.lock_timeout_s) as got:
        if got:
            log.warning("catalog %s was missing; rebuilt %d entries from the disk tier",
                        store.catalog.path, rebuild_from_disk(store.catalog, disk, store.node))
        return got


def reconcile(store: TieredStore) -> dict[str, int]:
    """Make ``store``'s catalog and tiers agree after crashes; returns counts of fixes.

    The disk part needs the maintenance lock; when another process holds it too long
    it is skipped.
    """
    fixed = {"dead_owner_entries": 0, "lost_rows": 0, "orphan_blobs": 0, "orphan_files": 0}
    with store._lock:
        with store.catalog.read() as tx:
            owners = tx.memory_owners(store.node) - {store.owner}
        for owner in owners:
            if not owner_alive(store.locks_dir, owner):
                with store.catalog.write() as tx:
                    fixed["dead_owner_entries"] += len(tx.remove_owner(owner, "lost"))
        disk = store._disk()
        if disk is not None:
            with store._maintenance.exclusive(store.lock_timeout_s) as got:
                if got:
                    fixed.update(reconcile_disk(store.catalog, disk, store.owner, store.node))
                else:
                    log.info("another process is busy with the disk tier; reconcile skipped")
        with store.catalog.write() as tx:
            tx.prune_events()
    if any(fixed.values()):
        log.warning("reconciled cache %s: %s", store.cache_dir, fixed)
    return fixed


def fit_disk_budget(store: TieredStore) -> int:
    """Evict disk entries (by the disk policy) until the tier is within its budget, as a
    put would; a budget lowered since the entries were stored takes effect here, when a
    store opens. Returns how many entries were evicted."""
    disk = store._disk()
    if disk is None:
        return 0
    policy = store._policies["disk"]
    with store._lock:
        with store.catalog.write() as tx:
            used = tx.tier_bytes("disk", store.node)
            if used <= disk.budget:
                return 0
            try:
                victims = disk_victims(tx, policy, 0, None, frozenset(), disk.budget, store.node)
            except NoRoom:  # pragma: no cover - the policy lists every disk entry after the sync
                victims = []
            for v in victims:
                tx.remove_entry(v.variant_key, "disk", store.node, blob=v.blob)
                tx.event("evict", v.variant_key, "disk", None, v.nbytes, store.owner)
        for v in victims:  # after COMMIT: drop the evicted files
            disk.delete(v.blob)
            policy.on_evict(v.variant_key)
            store.counters.evictions += 1
    if victims:
        log.warning("disk tier held %d bytes over its budget of %d bytes: evicted %d entries (%d bytes)",
                    used - disk.budget, disk.budget, len(victims), sum(v.nbytes for v in victims))
    return len(victims)


def reconcile_disk(catalog: Catalog, disk: DiskTier, owner: str, node: str = "") -> dict[str, int]:
    """Rows of ``node``'s disk tier without bytes are dropped; blobs and files without rows
    are deleted.

    The caller holds the maintenance lock exclusively.
    """
    listing = disk.listing()
    with catalog.read() as tx:
        rows = tx.entries(tier="disk", owner=node)
    fixed = {"lost_rows": 0, "orphan_blobs": 0, "orphan_files": 0}
    referenced: set[str] = set()
    for row in rows:
        found = listing.get(row.blob)
        if found is not None and found.tag == row.checksum and disk.path_of(found.filename).is_file():
            referenced.add(row.blob)
            continue
        with catalog.write() as tx:
            if tx.remove_entry(row.variant_key, "disk", node, blob=row.blob) is not None:
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


def evict(store: TieredStore, *, chunk: str | None = None, variant: str | None = None,
          source: str | None = None, tier: str | None = None, everything: bool = False) -> EvictReport:
    """Delete, from every tier ``store`` reaches, the variants of one chunk, one variant,
    the variants of every chunk of one document, of one tier, or all of them; see
    :meth:`TieredStore.evict`."""
    if (chunk is not None) + (variant is not None) + (source is not None) + (tier is not None) \
            + bool(everything) != 1:
        raise ValueError("give exactly one of chunk, variant, source, tier or everything")
    if tier is not None and tier not in TIERS:
        raise StoreConfigError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    failures = _shared_failures(store)
    if chunk is not None:
        keys = _variants_of_chunk(store, chunk)
    elif variant is not None:
        keys = _one_variant(store, variant)
    elif source is not None:
        keys = _variants_of_source(store, source)
    elif tier is None:
        keys = sorted({key for name in store.tier_names for key in store.keys(name)})
    elif tier == "disk" or tier in store.tier_names:
        keys = store.keys(tier)
    else:
        keys = []  # a memory tier this store does not have holds nothing of ours
    removed = tuple(key for key in keys if store.delete(key))
    unreached = _unreached(store, failures)
    if tier is None or tier == "disk":
        return EvictReport(removed, unreached=unreached)
    with store.catalog.read() as tx:
        rows = [r for r in tx.entries(tier=tier, node=store.node) if r.owner != store.owner]
    owners = len({r.owner for r in rows})
    return EvictReport(removed, note=f"the {tier} tier lives inside each running cachecraft process ({len(rows)} "
                                     f"entries in {owners} process(es)); it moves to disk when they exit: evict "
                                     "with --tier disk then", unreached=unreached)


def _variants_of_chunk(store: TieredStore, prefix: str) -> list[str]:
    """Stored variant keys of the chunk whose key (or a variant's key) starts with ``prefix``."""
    prefix = _key_prefix(prefix, "chunk key", "see `cachecraft query` or `cachecraft explain`")
    keys = _cached_variants(store, prefix=prefix)
    _exactly_one({chunk for chunk, _ in keys}, prefix, "chunk")
    return [key for _, key in keys]


def _one_variant(store: TieredStore, prefix: str) -> list[str]:
    """The one stored variant key that starts with ``prefix`` (its chunk's others stay)."""
    prefix = _key_prefix(prefix, "variant key", "the variant column of `cachecraft explain`")
    keys = [key for _, key in _cached_variants(store, prefix=prefix) if key.startswith(prefix)]
    _exactly_one(set(keys), prefix, "variant")
    return keys


def _key_prefix(text: str, what: str, where: str) -> str:
    """``text`` as a key prefix (trimmed, lower case); :class:`SelectorError` if too short
    to name one ``what`` (``where``: where a user finds it)."""
    prefix = text.strip().lower()
    if len(prefix) < MIN_PREFIX:
        raise SelectorError(f"give at least {MIN_PREFIX} characters of the {what} ({where})")
    return prefix


def _exactly_one(matched: set, prefix: str, kind: str) -> None:
    """:class:`SelectorError` unless ``prefix`` matched exactly one ``kind``."""
    if not matched:
        raise SelectorError(f"no cached {kind} matches {prefix!r}")
    if len(matched) > 1:
        raise SelectorError(f"{prefix!r} matches {len(matched)} {kind}s; give more characters")


def _variants_of_source(store: TieredStore, source: str) -> list[str]:
    """Stored variant keys of every chunk the catalog says came from ``source``: the path
    as ingested (relative paths are resolved), or a file name that names one document."""
    wanted = source.strip()
    if not wanted:
        raise SelectorError("--source needs a document path or file name")
    with store.catalog.read() as tx:
        documents = tx.sources()
    exact = {s for s in documents if s in (wanted, str(Path(wanted).expanduser().resolve()))}
    named = exact or {s for s in documents if Path(s).name == wanted}
    if len(named) > 1:
        raise SelectorError(f"{wanted!r} names {len(named)} documents; give the path: "
                            + ", ".join(sorted(named)[:3]))
    keys = [key for _, key in _cached_variants(store, sources=named)]
    if not keys:
        raise SelectorError(f"no cached chunk comes from {wanted!r} (see the source column of `cachecraft stats`)")
    return keys


def evict_documents(store: TieredStore, sources: Iterable[str]) -> EvictReport:
    """Delete, from every tier ``store`` reaches, the variants of every chunk the catalog
    says came from one of ``sources`` (paths exactly as ingested); none is no error."""
    failures = _shared_failures(store)
    removed = tuple(key for _, key in _cached_variants(store, sources=sources) if store.delete(key))
    return EvictReport(removed, unreached=_unreached(store, failures))


def _cached_variants(store: TieredStore, *, sources: Iterable[str] = (),
                     prefix: str | None = None) -> list[tuple[str, str]]:
    """(chunk key, variant key), sorted, of every variant that a tier ``store`` reaches
    holds, of the chunks the catalog says came from one of ``sources`` or whose key (or a
    variant's key) starts with ``prefix``: those the catalog places in a tier (any owner),
    and those the shared tier holds, which the catalog need not place (put by another
    node, or gone from this node's tiers since)."""
    with store.catalog.read() as tx:
        chunks = tx.chunk_keys(sources=sources, prefix=prefix)
        found = {(r.chunk_key, r.key) for r in tx.stored_variants(chunks)} if chunks else set()
    if chunks and store.shared is not None:
        held = store.shared.variants_of_chunks(chunks)
        found.update((chunk, meta.variant) for chunk, metas in held.items() for meta in metas)
    return sorted(found)


def _shared_failures(store: TieredStore) -> int:
    """Calls the shared tier has failed or skipped (backing off) so far; 0 without one."""
    if store.shared is None:
        return 0
    return store.shared.counters.errors + store.shared.counters.skipped


def _unreached(store: TieredStore, failures_before: int) -> str | None:
    """The shared tier, as shown, when one of its calls failed since ``failures_before``."""
    return store.shared.where if _shared_failures(store) > failures_before else None


def destroy(cache_dir: str | Path, *, catalog_url: str | None = None, redis_url: str | None = None,
            shared: bool = False, lock_timeout_s: float = 10.0) -> DestroyReport:
    """Delete the store (every tier's files, the locks, requests waiting to be recorded)
    and the catalog of ``cache_dir``; whatever else the directory holds (corpus,
    converted models, config) stays.

    With ``catalog_url`` (a catalog several nodes share) only this node's rows go: its
    placements, the requests it answered and its membership; chunks, variants and their
    statistics stay for the other nodes. ``shared`` empties what the nodes share instead:
    every row of the catalog and, with ``redis_url``, every entry of the shared tier (the
    other nodes must be stopped; their own directories stay, and are recorded again when
    they next start).

    Works without opening a store. Raises :class:`StoreBusyError`, deleting nothing,
    while another process has a store open there or writes to the disk tier for longer
    than ``lock_timeout_s``; a catalog server that cannot be reached deletes nothing
    either. The catalog goes before the local files, so a failure between them leaves
    files that the directory records anew when next opened.
    """
    root, _, locks = store_paths(cache_dir)
    busy = live_owners(locks)
    if busy:
        raise StoreBusyError(f"{len(busy)} other cachecraft process(es) are using {cache_dir}; "
                             "stop them, then run clear again")
    rows: dict[str, int] = {}
    node = node_id(root)
    if catalog_url and (shared or node):
        catalog = Catalog(cache_dir, url=catalog_url)
        try:
            with catalog.write() as tx:
                rows = tx.empty() if shared else tx.forget_node(node)
        finally:
            catalog.close()
    entries = _empty_shared_tier(redis_url, emptied_catalog=bool(rows)) if shared and redis_url else 0
    removed = []
    exclusive = (FileLock(locks / MAINTENANCE_LOCK).exclusive(lock_timeout_s) if locks.is_dir()
                 else contextlib.nullcontext(True))  # no locks directory: no store to wait for
    with exclusive as got:
        if not got:
            raise StoreBusyError(f"another process is writing to {root}; stop it, then run clear again")
        if root.exists():
            shutil.rmtree(root)
            removed.append(str(root))
        removed += [str(path) for path in remove_catalog(cache_dir)]
        pending = Path(cache_dir) / PENDING_DIR
        if pending.exists():
            shutil.rmtree(pending)
            removed.append(str(pending))
    return DestroyReport(tuple(removed), rows, entries)


@dataclass(frozen=True)
class NodeActivity:
    """Signs that a node of a shared catalog is still running: its last request and the
    chunk-caches its processes hold in memory."""

    node: str
    last_request_age_s: float | None  # None: it never answered one
    in_memory: int

    def describe(self) -> str:
        """One phrase, e.g. ``node 3f9a…: last request 2 min ago, 12 chunk-cache(s) in memory``."""
        signs = []
        if self.last_request_age_s is not None:
            signs.append(f"last request {_age(self.last_request_age_s)} ago")
        if self.in_memory:
            signs.append(f"{self.in_memory} chunk-cache(s) in memory")
        return f"node {self.node}: " + ", ".join(signs)


ACTIVE_WITHIN_S = 600.0
"""A node that answered a request this recently may still be running."""


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def active_nodes(cache_dir: str | Path, catalog_url: str, *, within_s: float = ACTIVE_WITHIN_S,
                 now: float | None = None) -> list[NodeActivity]:
    """The nodes of the shared catalog at ``catalog_url``, other than this directory's own,
    that look alive: they answered a request in the last ``within_s`` seconds or their
    processes hold chunk-caches in memory (a process that closes its store drops those
    rows). What ``clear --shared`` and ``clear --node`` show before they delete, since no
    node can see another's processes."""
    own = node_id(store_paths(cache_dir)[0])
    now = time.time() if now is None else now
    catalog = Catalog(cache_dir, url=catalog_url)
    try:
        with catalog.read() as tx:
            activity = tx.node_activity()
    finally:
        catalog.close()
    found = []
    for node, (last, in_memory) in sorted(activity.items()):
        age = None if last is None else now - last
        if node != own and (in_memory or (age is not None and age < within_s)):
            found.append(NodeActivity(node, age, in_memory))
    return found


def forget_node(cache_dir: str | Path, catalog_url: str, prefix: str) -> tuple[str, dict[str, int]]:
    """Drop the rows of another node of the shared catalog at ``catalog_url`` (one gone for
    good): its placements, the requests it answered, its membership. ``prefix`` names it
    (the start of its id, as ``cachecraft stats`` shows it); this directory's
    own node is refused (``clear`` drops it with its files). Returns (node id, rows deleted
    per kind); :class:`SelectorError` when ``prefix`` names no node or several."""
    wanted = prefix.strip().lower()
    if len(wanted) < MIN_PREFIX:
        raise SelectorError(f"give at least {MIN_PREFIX} characters of the node id (the node column of "
                            "`cachecraft stats`)")
    own = node_id(store_paths(cache_dir)[0])
    catalog = Catalog(cache_dir, url=catalog_url)
    try:
        with catalog.write() as tx:
            known = tx.node_ids()
            matched = sorted(n for n in known if n.lower().startswith(wanted))
            if not matched:
                raise SelectorError(f"no node of the catalog at {catalog.where} has an id starting with "
                                    f"{wanted!r}; it names {len(known)}: {', '.join(sorted(known)) or 'none'}")
            if len(matched) > 1:
                raise SelectorError(f"{wanted!r} matches {len(matched)} nodes; give more characters")
            node = matched[0]
            if node == own:
                raise SelectorError(f"{node} is this cache directory's own node; run clear without --node "
                                    "to drop it with its files")
            return node, tx.forget_node(node)
    finally:
        catalog.close()


def _empty_shared_tier(url: str, *, emptied_catalog: bool) -> int:
    """Every entry of the shared tier deleted; how many there were. One line naming
    ``redis_url`` (and what was already done) when the server does not answer."""
    from cachecraft.store.shared import RedisTier
    tier = RedisTier(url, 0)
    try:
        return tier.clear()
    except tier._redis_errors as exc:
        done = "the shared catalog was emptied, but " if emptied_catalog else ""
        raise SharedTierError(f"{done}redis_url {tier.where} cannot be reached ({str(exc).splitlines()[0]}); "
                              "start the server, then run clear --shared again") from None
    finally:
        tier.close()
