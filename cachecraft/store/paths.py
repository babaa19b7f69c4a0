"""Where the store keeps its files inside a cache directory.

    <cache_dir>/store/disk/    the disk tier (a diskcache directory)
    <cache_dir>/store/locks/   the maintenance lock and one owner lock per open store
    <cache_dir>/store/node-id  this cache directory's id in a catalog several nodes share
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cachecraft.store.errors import CacheDirError

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
