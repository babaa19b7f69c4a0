"""The tiers that hold bytes: memory tiers (GPU, CPU) and the disk tier.

Tiers only hold and move bytes; budgets are enforced, victims chosen and the catalog
kept in step by :mod:`cachecraft.store.placement`. :func:`build_tiers` makes a store's
tiers, in one place and a fixed order (fastest first).

- :class:`MemoryTier`: a dict of ChunkKVs on one device, private to this process
  (CPU memory is pinned when CUDA is present, so copies to the GPU can be async).
- :class:`DiskTier`: a ``diskcache`` directory shared by every process using the
  cache directory. Values are safetensors bytes (see :mod:`cachecraft.store.codec`),
  always in their own file, written once under a fresh random name and never
  modified, so a reader never sees a torn value; the diskcache row's tag holds the
  checksum. Keys are ``<variant key>.<random>`` (*blob ids*), and the catalog row
  names the blob id of the current bytes. Nothing is pickled: the disk class refuses
  any key or value that is not a string or bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator, Mapping, Sequence

import diskcache
import torch
from diskcache.core import MODE_BINARY, UNKNOWN

from cachecraft.catalog import TIERS
from cachecraft.kv import ChunkKV
from cachecraft.store.codec import Blob
from cachecraft.store.eviction import EntryInfo
from cachecraft.store.errors import CacheDirError, DiskFullError, StoreBusyError, StoreConfigError, StoreError

if TYPE_CHECKING:
    from cachecraft.config import Config

log = logging.getLogger(__name__)

DISKCACHE_DB = "cache.db"
_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def entry_nbytes(kv: ChunkKV) -> int:
    """Bytes a memory tier charges for a ChunkKV: K, V, statistics and token ids."""
    stats = 0 if kv.stats is None else sum(t.numel() * t.element_size() for t in kv.stats.to_tensors().values())
    return kv.nbytes + stats + 8 * kv.num_tokens


@dataclass(frozen=True)
class TierState:
    """A tier's occupancy as a store sees it (the disk tier: all processes)."""

    tier: str
    entries: int
    bytes: int
    budget: int


@dataclass
class MemEntry:
    """One variant held by a memory tier."""

    kv: ChunkKV  # stored dtype, on the tier's device
    info: EntryInfo
    hits: int = 0
    disk_checksum: str | None = None  # checksum of an identical copy on disk, if known


class MemoryTier:
    """Variants kept as tensors on one device, under a byte budget."""

    is_disk = False

    def __init__(self, name: str, device: str, budget: int, pin: bool = False) -> None:
        self.name, self.device, self.budget, self.pin = name, device, budget, pin
        self._entries: dict[str, MemEntry] = {}
        self.used = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        """Keys held, in insertion order."""
        return list(self._entries)

    def get(self, key: str) -> MemEntry | None:
        """The entry for ``key`` or None (no copy)."""
        return self._entries.get(key)

    def adopt(self, kv: ChunkKV) -> ChunkKV:
        """``kv`` moved to this tier's device (a new copy unless already there)."""
        moved = kv
        if kv.keys.device.type != torch.device(self.device).type:
            moved = kv.to(device=self.device)
        if self.pin and not moved.keys.is_pinned():
            moved = dataclasses.replace(moved, keys=moved.keys.pin_memory(), values=moved.values.pin_memory())
        return moved

    def insert(self, key: str, entry: MemEntry) -> None:
        """Hold ``entry`` (the caller made room)."""
        assert key not in self._entries, f"{key} already in tier {self.name}"
        self._entries[key] = entry
        self.used += entry.info.nbytes
        assert self.used <= self.budget, f"tier {self.name}: {self.used} bytes > budget {self.budget}"

    def remove(self, key: str) -> MemEntry | None:
        """Drop ``key``; returns its entry or None."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry.info.nbytes
        return entry


class _BytesDisk(diskcache.Disk):
    """diskcache's Disk restricted to string keys and bytes values, every value in a file."""

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"disk tier keys are strings, got {type(key).__name__}")
        return super().put(key)

    def get(self, key, raw):
        if not raw:
            raise StoreError("disk tier holds a pickled key; run `cachecraft verify --repair`")
        return super().get(key, raw)

    def store(self, value, read, key=UNKNOWN):
        if type(value) is not bytes:
            raise TypeError(f"disk tier values are bytes, got {type(value).__name__}")
        filename, full_path = self.filename(key, value)
        try:
            self._write(full_path, io.BytesIO(value), "xb")
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(full_path)
            raise
        return len(value), MODE_BINARY, filename, None

    def fetch(self, mode, filename, value, read):
        if mode != MODE_BINARY:
            raise StoreError("disk tier holds a non-file value; run `cachecraft verify --repair`")
        return super().fetch(mode, filename, value, read)


@dataclass(frozen=True)
class BlobFile:
    """A blob as diskcache lists it."""

    blob_id: str
    filename: str
    tag: str | None
    size: int


def _disk_error(exc: OSError, where: Path) -> StoreError:
    if exc.errno in _FULL_ERRNOS:
        return DiskFullError(f"no space left on device writing {where}; free disk space or lower "
                             "disk_budget_bytes")
    return CacheDirError(f"cannot write {where} ({exc.strerror or exc}); make it writable or set "
                         "CACHECRAFT_CACHE_DIR to another directory")


class DiskTier:
    """The shared disk tier: blobs in a diskcache directory; the catalog indexes them."""

    is_disk = True
    name = "disk"

    def __init__(self, directory: Path, budget: int) -> None:
        self.directory, self.budget = Path(directory), budget
        try:
            self.cache = diskcache.Cache(
                str(self.directory), timeout=60, disk=_BytesDisk, size_limit=2**62, cull_limit=0,
                eviction_policy="none", disk_min_file_size=0, statistics=0, tag_index=0)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"disk tier database {self.directory / DISKCACHE_DB} is damaged ({exc}); "
                             "run `cachecraft verify --repair`") from None
        except OSError as exc:
            raise _disk_error(exc, self.directory) from None

    def write(self, blob_id: str, blob: Blob) -> None:
        """Write a new blob (its own file, then its diskcache row)."""
        try:
            self.cache.set(blob_id, blob.data, tag=blob.checksum)
        except OSError as exc:
            raise _disk_error(exc, self.directory) from None
        except sqlite3.OperationalError as exc:
            if "full" in str(exc).lower():
                raise DiskFullError(f"no space left on device writing {self.directory}; free disk "
                                    "space or lower disk_budget_bytes") from None
            raise
        except diskcache.Timeout:
            raise StoreBusyError(f"disk tier {self.directory} stayed locked; retry") from None

    @contextlib.contextmanager
    def open(self, blob_id: str) -> Iterator[tuple[str, BinaryIO] | None]:
        """An open handle on a blob's file and its path, or None if the blob is gone."""
        try:
            fh = self.cache.get(blob_id, read=True)
        except (OSError, diskcache.Timeout, StoreError) as exc:  # StoreError: a tampered row
            log.warning("cannot open blob %s: %s", blob_id, exc)
            fh = None
        if fh is None:
            yield None
            return
        with fh:
            yield fh.name, fh

    def read(self, blob_id: str) -> bytes | None:
        """A blob's bytes, or None if it is gone."""
        with self.open(blob_id) as opened:
            if opened is None:
                return None
            try:
                return opened[1].read()
            except OSError:
                return None

    def delete(self, blob_id: str | None) -> None:
        """Delete a blob if present (row first, then its file)."""
        if blob_id is None:
            return
        try:
            self.cache.delete(blob_id, retry=True)
        except OSError as exc:  # the row is gone; a leftover file is an orphan verify removes
            log.warning("could not remove blob %s: %s", blob_id, exc)

    def listing(self) -> dict[str, BlobFile]:
        """Every blob diskcache knows, by blob id."""
        con = sqlite3.connect(f"file:{self.directory / DISKCACHE_DB}?mode=ro", uri=True, timeout=60)
        try:
            rows = con.execute("SELECT key, raw, filename, tag, size FROM Cache").fetchall()
        finally:
            con.close()
        return {key: BlobFile(key, filename, tag, size) for key, raw, filename, tag, size in rows
                if raw and isinstance(key, str)}

    def path_of(self, filename: str) -> Path:
        """Full path of a diskcache file name."""
        return self.directory / filename

    def unknown_files(self, listing: dict[str, BlobFile]) -> list[Path]:
        """Files in the directory that no diskcache row names (left by a crash mid-write)."""
        known = {os.path.normpath(self.directory / b.filename) for b in listing.values() if b.filename}
        out = []
        for dirpath, _, files in os.walk(self.directory):
            for name in files:
                path = os.path.normpath(os.path.join(dirpath, name))
                if name.startswith(DISKCACHE_DB) and os.path.dirname(path) == os.path.normpath(self.directory):
                    continue
                if path not in known:
                    out.append(Path(path))
        return out

    def remove_empty_dirs(self) -> None:
        """Remove empty sub-directories left after deletions."""
        for dirpath, dirs, files in os.walk(self.directory, topdown=False):
            if dirpath != str(self.directory) and not dirs and not files:
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)

    def close(self) -> None:
        """Close diskcache's connections."""
        self.cache.close()


def select_tiers(tiers: Sequence[str] | None) -> list[str]:
    """The tiers a store opens, fastest first (default: all available; GPU only with CUDA)."""
    cuda = torch.cuda.is_available()
    if tiers is None:
        return [t for t in TIERS if t != "gpu" or cuda]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers or len(set(tiers)) != len(tiers):
        raise StoreConfigError(f"tiers must be distinct names from {TIERS}, got {list(tiers)}")
    if "gpu" in tiers and not cuda:
        raise StoreConfigError("the gpu tier needs CUDA, which is not available; leave it out")
    return [t for t in TIERS if t in tiers]


def tier_budgets(config: Config, names: Sequence[str], overrides: Mapping[str, int] | None) -> dict[str, int]:
    """Byte budget per tier (the config's, or ``overrides``), each checked positive."""
    limits = {"gpu": config.gpu_budget_bytes, "cpu": config.cpu_budget_bytes,
              "disk": config.disk_budget_bytes, **dict(overrides or {})}
    for name in names:
        budget = limits[name]
        if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
            raise StoreConfigError(f"{name} tier budget must be a positive number of bytes, got "
                                   f"{budget!r}; set {name}_budget_bytes (CACHECRAFT_{name.upper()}"
                                   "_BUDGET_BYTES) or leave the tier out")
    return limits


def build_tiers(names: Sequence[str], budgets: Mapping[str, int], disk_dir: Path) -> list[MemoryTier | DiskTier]:
    """The tiers ``names`` (from :func:`select_tiers`), fastest first."""
    cuda = torch.cuda.is_available()
    tiers: list[MemoryTier | DiskTier] = []
    for name in names:
        if name == "gpu":
            tiers.append(MemoryTier("gpu", "cuda", budgets["gpu"]))
        elif name == "cpu":
            tiers.append(MemoryTier("cpu", "cpu", budgets["cpu"], pin=cuda))
        else:
            tiers.append(DiskTier(disk_dir, budgets["disk"]))
    return tiers
