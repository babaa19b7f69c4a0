"""Rebuild catalog rows from the blobs of the disk tier (each blob describes itself)."""

from __future__ import annotations

import logging

from cachecraft.catalog import Catalog, ChunkRecord, EntryRecord, VariantRecord
from cachecraft.catalog.db import CatalogTx
from cachecraft.kv import ChunkKV
from cachecraft.store.codec import BlobError, decode, header_checksum
from cachecraft.store.tiers import DiskTier, entry_nbytes

log = logging.getLogger(__name__)


def record_blob(tx: CatalogTx, kv: ChunkKV, blob_id: str, checksum: str, size: int, node: str = "") -> None:
    """Chunk, variant and disk-entry rows for one sound blob in ``node``'s disk tier."""
    dtype = str(kv.keys.dtype).removeprefix("torch.")
    tx.upsert_chunk(ChunkRecord(kv.chunk, kv.fingerprint, kv.num_tokens))
    tx.upsert_variant(VariantRecord(kv.variant, kv.chunk, kv.prefix, entry_nbytes(kv), dtype))
    tx.add_entry(EntryRecord(kv.variant, "disk", node, size, blob_id, checksum, node=node))


def rebuild_from_disk(catalog: Catalog, disk: DiskTier, node: str = "") -> int:
    """Add rows for every sound blob of ``node``'s disk tier whose variant has no disk row
    there; returns how many.

    Damaged blobs and blobs whose tag disagrees with their contents are skipped (left
    for reconcile or verify to delete as orphans).
    """
    rebuilt = 0
    for blob in disk.listing().values():
        data = disk.read(blob.blob_id)
        try:
            if data is None:
                raise BlobError("unreadable")
            checksum = header_checksum(data)
            if checksum != blob.tag:
                raise BlobError("tag does not match the blob")
            kv = decode(data, checksum)
        except BlobError as exc:
            log.info("blob %s not recovered: %s", blob.blob_id, exc)
            continue
        with catalog.write() as tx:
            if tx.entry(kv.variant, "disk", node) is None:
                record_blob(tx, kv, blob.blob_id, checksum, len(data), node)
                rebuilt += 1
    return rebuilt
