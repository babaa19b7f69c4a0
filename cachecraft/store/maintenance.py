"""Keeping catalog and tiers in agreement: recover a catalog deleted by hand from the
disk tier, and reconcile after crashes (run when a store opens).

Reconcile drops memory placements of stores whose process is gone, disk rows whose
bytes are missing, and blobs or files no row names. Its disk part holds the
maintenance lock exclusively, so a blob in flight is never taken for an orphan.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from cachecraft.catalog import Catalog
from cachecraft.store.locks import owner_alive
from cachecraft.store.recover import rebuild_from_disk
from cachecraft.store.tiers import DiskTier

if TYPE_CHECKING:
    from cachecraft.store.store import TieredStore

log = logging.getLogger(__name__)


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
                        store.catalog.path, rebuild_from_disk(store.catalog, disk))
        return got


def reconcile(store: TieredStore) -> dict[str, int]:
    """Make ``store``'s catalog and tiers agree after crashes; returns counts of fixes.

    The disk part needs the maintenance lock; when another process holds it too long
    it is skipped.
    """
    fixed = {"dead_owner_entries": 0, "lost_rows": 0, "orphan_blobs": 0, "orphan_files": 0}
    with store._lock:
        with store.catalog.read() as tx:
            owners = tx.memory_owners() - {store.owner}
        for owner in owners:
            if not owner_alive(store.locks_dir, owner):
                with store.catalog.write() as tx:
                    fixed["dead_owner_entries"] += len(tx.remove_owner(owner, "lost"))
        disk = store._disk()
        if disk is not None:
            with store._maintenance.exclusive(store.lock_timeout_s) as got:
                if got:
                    fixed.update(reconcile_disk(store.catalog, disk, store.owner))
                else:
                    log.info("another process is busy with the disk tier; reconcile skipped")
        with store.catalog.write() as tx:
            tx.prune_events()
    if any(fixed.values()):
        log.warning("reconciled cache %s: %s", store.cache_dir, fixed)
    return fixed


def reconcile_disk(catalog: Catalog, disk: DiskTier, owner: str) -> dict[str, int]:
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
