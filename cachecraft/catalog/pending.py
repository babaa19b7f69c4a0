"""Request rows that could not reach the catalog: kept in memory, then on disk, and
recorded when the catalog answers again.

A catalog on a server can be lost while requests are answered. Their rows wait in a
:class:`PendingRequests`; :meth:`PendingRequests.record` writes them (oldest first) the
next time it is called with the catalog back. While rows wait they are also written as
JSON to ``<cache_dir>/pending-requests/`` (one file per process, written under a
temporary name and renamed, so a crash never leaves half a file); the next process that
records a request picks up the files of processes that ended (or died) with rows
waiting, and records them first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from pathlib import Path

from cachecraft.catalog.db import Catalog
from cachecraft.catalog.errors import CatalogUnavailableError, CatalogWriteError
from cachecraft.catalog.records import RequestChunk, RequestRecord

log = logging.getLogger(__name__)

PENDING_DIR = "pending-requests"


def request_to_json(rec: RequestRecord) -> dict:
    """A request row as JSON-friendly data (no id: the catalog gives one)."""
    data = dataclasses.asdict(rec)
    data.pop("id")
    return data


def request_from_json(data: dict) -> RequestRecord:
    """The inverse of :func:`request_to_json`."""
    chunks = tuple(RequestChunk(**c) for c in data.get("chunks", ()))
    return RequestRecord(**{**data, "chunks": chunks})


class PendingRequests:
    """Request rows waiting for the catalog (this process's and earlier processes' files)."""

    def __init__(self, cache_dir: str | Path) -> None:
        self.directory = Path(cache_dir) / PENDING_DIR
        self.rows: list[RequestRecord] = []
        self._files_checked = False
        # while rows wait, they are also in this file (a dead process's is picked up by the next)
        self._own = self.directory / f"{uuid.uuid4().hex}.{os.getpid()}.claimed"
        self._claimed: list[Path] = []  # earlier processes' files whose rows are in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def record(self, catalog: Catalog, rec: RequestRecord | None = None) -> int | None:
        """Record what waits, then ``rec``; the id of ``rec``, or None when the catalog is
        away or rolled the write back in a collision with another writer (``rec`` then
        waits too)."""
        if not self._files_checked:
            self._files_checked = True
            self.rows = self._claim_files() + self.rows
        if rec is not None:
            self.rows.append(rec)
        if not self.rows:
            return None
        recorded = 0
        rec_id = None
        try:
            for row in self.rows:
                row_id = catalog.record_request(row)
                recorded += 1
                if row is rec:
                    rec_id = row_id
        # away, locked, rolled back in a collision, or its disk full: the next request tries
        except (CatalogUnavailableError, CatalogWriteError):
            return None
        finally:
            late = recorded - (rec_id is not None)
            if late:
                log.warning("recorded %d request row(s) kept while the catalog could not take them", late)
            del self.rows[:recorded]
            self._save()
        return rec_id

    def keep_on_disk(self) -> Path | None:
        """Leave what still waits for a later process; the file (None if nothing waits)."""
        if not self.rows:
            return None
        self._save()
        kept = self._own.with_name(self._own.name.split(".")[0] + ".json")
        os.replace(self._own, kept)
        self.rows = []
        return kept

    def _save(self) -> None:
        """Make this process's file hold exactly the rows that wait (none: no file), written
        under a temporary name and renamed, so a crash leaves the old file or the new one."""
        if self.rows:
            tmp = self._own.with_suffix(".tmp")
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps([request_to_json(r) for r in self.rows]))
                os.replace(tmp, self._own)
            except OSError as exc:  # a full disk: they wait in memory, and the next save tries again
                tmp.unlink(missing_ok=True)
                self._own.unlink(missing_ok=True)  # it may hold rows recorded since
                log.warning("%d request row(s) wait in memory only: cannot write %s (%s)",
                            len(self.rows), self._own, exc)
                return  # earlier processes' files are kept: they hold rows that may still wait
        else:
            self._own.unlink(missing_ok=True)
        for path in self._claimed:  # their rows are in this process's file, or recorded
            path.unlink(missing_ok=True)
        self._claimed = []

    def _claim_files(self) -> list[RequestRecord]:
        """Rows of earlier processes' files, each file taken by renaming it (so two
        processes never record the same rows); an unreadable file is left with a warning."""
        if not self.directory.is_dir():
            return []
        rows: list[RequestRecord] = []
        # files kept by processes, and files of processes that died with rows waiting
        found = sorted(self.directory.glob("*.json")) + [p for p in sorted(self.directory.glob("*.claimed"))
                                                          if not _alive(p.suffixes[-2][1:])]
        for path in found:
            claimed = self.directory / f"{path.name.split('.')[0]}.{os.getpid()}.claimed"
            try:
                os.replace(path, claimed)
            except FileNotFoundError:  # another process took it
                continue
            try:
                rows += [request_from_json(d) for d in json.loads(claimed.read_text())]
            except (OSError, ValueError, TypeError) as exc:
                log.warning("could not read kept request rows %s (%s); left as %s", path, exc,
                            claimed.with_suffix(".unreadable"))
                os.replace(claimed, claimed.with_suffix(".unreadable"))
                continue
            self._claimed.append(claimed)
        return rows


def _alive(pid: str) -> bool:
    """Whether process ``pid`` (a string of digits) runs on this machine."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
