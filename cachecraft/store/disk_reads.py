"""Reads of the disk tier for a store: the entry's catalog row and its verified bytes,
whole or lazily (a layer reader). An entry found damaged or without bytes is dropped on
the way (a ``corrupt`` or ``lost`` tier event) and the read is a miss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cachecraft.catalog import EntryRecord
from cachecraft.kv import ChunkKV
from cachecraft.store.codec import BlobError, LazyBlob, decode
from cachecraft.store.placement import drop_disk_row, promote_from_disk
from cachecraft.store.readers import DiskLayerReader

if TYPE_CHECKING:
    from cachecraft.store.store import TieredStore


def read_disk(store: TieredStore, key: str) -> tuple[EntryRecord, ChunkKV] | None:
    """The disk row of ``key`` and its verified bytes, or None (a damaged or lost entry
    is dropped on the way)."""
    disk = store._disk()
    row = None if disk is None else store._disk_row(key)
    if row is None:
        return None
    data = disk.read(row.blob)
    if data is None:
        drop_disk_row(store, row, "lost", "bytes are missing")
        return None
    try:
        return row, decode(data, row.checksum, key)
    except BlobError as exc:
        drop_disk_row(store, row, "corrupt", str(exc))
        return None


def open_disk(store: TieredStore, key: str) -> tuple[EntryRecord, LazyBlob] | None:
    """The disk row of ``key`` and a verified lazy view of its blob, or None."""
    disk = store._disk()
    row = None if disk is None else store._disk_row(key)
    if row is None:
        return None
    with disk.open(row.blob) as opened:
        if opened is None:
            drop_disk_row(store, row, "lost", "bytes are missing")
            return None
        try:
            return row, LazyBlob(opened[0], opened[1], row.checksum, key)
        except FileNotFoundError:  # evicted by another process while we opened it
            return None
        except BlobError as exc:
            drop_disk_row(store, row, "corrupt", str(exc))
            return None


def disk_reader(store: TieredStore, key: str, row: EntryRecord, blob: LazyBlob, dtype: torch.dtype | None,
                device: torch.device | str, promote: bool) -> DiskLayerReader:
    """A layer reader over an opened disk entry: a damaged layer drops the entry; with
    ``promote``, the entry read to the end is copied into the fastest memory tier."""

    def on_corrupt(exc: Exception) -> None:
        with store._lock:
            drop_disk_row(store, row, "corrupt", str(exc))

    def on_complete(kv: ChunkKV) -> None:
        with store._lock:
            promote_from_disk(store, key, kv, row)

    promotable = promote and bool(store._memory_tiers())
    return DiskLayerReader(key, blob, dtype, device, on_corrupt, on_complete if promotable else None)
