"""Inter-process file locks (POSIX ``flock``) for the store.

- The *maintenance lock* (``store/locks/store.lock``): every writer of the disk tier
  holds it shared from writing a blob file until its catalog row commits; reconcile
  and ``verify`` take it exclusively, so they never mistake a blob in flight for an
  orphan.
- An *owner lock* per open store (``store/locks/owner-<id>.lock``), held exclusively
  for the store's life. The kernel releases it when the process dies, even by SIGKILL,
  so another process can tell whether the GPU/CPU entries a catalog lists under that
  owner still exist.

Without ``fcntl`` (Windows) the locks are no-ops and owners count as alive while
their process id runs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


class FileLock:
    """A shared/exclusive lock on one file; each acquisition uses its own descriptor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock shared (blocks while someone holds it exclusively)."""
        if fcntl is None:  # pragma: no cover
            yield
            return
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float) -> Iterator[bool]:
        """Try to hold the lock exclusively for up to ``timeout_s``; yields whether it did."""
        if fcntl is None:  # pragma: no cover
            yield True
            return
        fd = self._open()
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    time.sleep(0.01)
            yield True
        finally:
            os.close(fd)


class OwnerLock:
    """Marks one open store as alive for as long as this object (and its process) lives."""

    def __init__(self, directory: Path, owner: str) -> None:
        self.path = directory / f"owner-{owner}.lock"
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        """Stop marking the owner alive and remove the lock file."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def owner_alive(directory: Path, owner: str) -> bool:
    """Whether the store ``owner`` is still open in some live process.

    A dead owner's lock file is removed on the way.
    """
    path = directory / f"owner-{owner}.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        if fcntl is None:  # pragma: no cover
            try:
                os.kill(int(os.read(fd, 32) or b"0"), 0)
                return True
            except (OSError, ValueError):
                return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return True
            raise
        with contextlib.suppress(OSError):
            path.unlink()
        return False
    finally:
        os.close(fd)


def live_owners(directory: Path) -> list[str]:
    """Owners in ``directory`` whose store is open in some live process (dead owners'
    lock files are removed on the way); empty when the directory does not exist."""
    if not directory.is_dir():
        return []
    owners = sorted(p.stem.removeprefix("owner-") for p in directory.glob("owner-*.lock"))
    return [owner for owner in owners if owner_alive(directory, owner)]
