"""Request rows waiting for a lost catalog: in order, on disk while they wait, picked up
by the next process when this one ends or dies, never recorded twice."""

from __future__ import annotations

import subprocess
import sys

from cachecraft.catalog import (CatalogCollisionError, CatalogUnavailableError, CatalogWriteError, RequestChunk,
                                RequestRecord)
from cachecraft.catalog.pending import PENDING_DIR, PendingRequests, request_from_json, request_to_json


class Away:
    def record_request(self, rec):
        raise CatalogUnavailableError("cannot reach the catalog at catalog_url postgresql://x")


class Collided:
    def record_request(self, rec):
        raise CatalogCollisionError("catalog at catalog_url postgresql://x: a transaction collided with another's")


class Here:
    def __init__(self):
        self.rows = []

    def record_request(self, rec):
        self.rows.append(rec)
        return len(self.rows)


def row(n: int) -> RequestRecord:
    chunks = (RequestChunk(0, "c0", "v0", "cpu", 0.5, 0.1, 0.2, 0.25, 3), RequestChunk(1, "c1"))
    return RequestRecord(f"q{n}", "cachecraft@0.08", chunks, 0.1, 0.01 * n, 1.0, created_at=100.0 + n,
                         num_tokens=50, policy={"alpha": 0.08}, node="n1")


def test_a_row_survives_json_unchanged():
    rec = row(1)
    assert request_from_json(request_to_json(rec)) == rec  # its uid too: a retry finds it recorded


def test_rows_wait_on_disk_and_are_recorded_in_order_with_the_next_one(tmp_path):
    pending = PendingRequests(tmp_path)
    assert pending.record(Away(), row(1)) is None and pending.record(Away(), row(2)) is None
    files = list((tmp_path / PENDING_DIR).iterdir())
    assert len(files) == 1 and files[0].name.endswith(".claimed")  # this (live) process's file
    here = Here()
    assert pending.record(here, row(3)) == 3
    assert [r.question_hash for r in here.rows] == ["q1", "q2", "q3"]
    assert not list((tmp_path / PENDING_DIR).iterdir())  # nothing waits: no file


def test_a_row_rolled_back_in_a_collision_waits_for_the_next_request(tmp_path):
    pending = PendingRequests(tmp_path)
    assert pending.record(Collided(), row(1)) is None
    here = Here()
    assert pending.record(here, row(2)) == 2
    assert [r.question_hash for r in here.rows] == ["q1", "q2"]


def test_rows_of_a_process_that_ended_or_died_are_recorded_once_by_the_next(tmp_path):
    alive = PendingRequests(tmp_path)
    alive.record(Away(), row(9))  # a live process's waiting rows are not taken by others
    ended = PendingRequests(tmp_path)
    ended.record(Away(), row(1))
    kept = ended.keep_on_disk()
    assert kept.suffix == ".json"
    died = PendingRequests(tmp_path)
    died.record(Away(), row(2))
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
    own = died._own
    own.rename(own.with_name(f"{own.name.split('.')[0]}.{dead_pid}.claimed"))  # as if it was killed

    nxt, here = PendingRequests(tmp_path), Here()
    assert nxt.record(here, row(3)) == 3
    assert sorted(r.question_hash for r in here.rows[:2]) == ["q1", "q2"] and here.rows[2].question_hash == "q3"
    again = Here()
    assert PendingRequests(tmp_path).record(again, row(4)) == 1  # nothing recorded twice
    assert [r.question_hash for r in again.rows] == ["q4"]
    left = list((tmp_path / PENDING_DIR).iterdir())
    assert left == [alive._own]


def test_an_unreadable_file_is_set_aside_with_a_warning(tmp_path, caplog):
    (tmp_path / PENDING_DIR).mkdir()
    (tmp_path / PENDING_DIR / "abc.json").write_text("{not json")
    here = Here()
    assert PendingRequests(tmp_path).record(here, row(1)) == 1
    assert "could not read kept request rows" in caplog.text
    assert [p.suffix for p in (tmp_path / PENDING_DIR).iterdir()] == [".unreadable"]


class FullAfterOne(Here):
    """Takes one row, then its disk is full."""

    def record_request(self, rec):
        if self.rows:
            raise CatalogWriteError("no space left on device writing the catalog x; free disk space")
        return super().record_request(rec)


def test_on_a_full_disk_rows_wait_in_memory_and_are_recorded_once_there_is_room(tmp_path, monkeypatch, caplog):
    from pathlib import Path

    pending = PendingRequests(tmp_path)
    assert pending.record(Away(), row(1)) is None  # q1 waits in this process's file
    assert len(list((tmp_path / PENDING_DIR).iterdir())) == 1

    def no_space(self, data, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", no_space)
    filling = FullAfterOne()
    assert pending.record(filling, row(2)) is None  # q1 recorded, then neither the catalog nor the file takes q2
    assert [r.question_hash for r in filling.rows] == ["q1"]
    assert [r.question_hash for r in pending.rows] == ["q2"]
    assert "1 request row(s) wait in memory only" in caplog.text
    assert not list((tmp_path / PENDING_DIR).iterdir())  # not the old file, which still named q1
    monkeypatch.undo()
    here = Here()
    assert pending.record(here, row(3)) == 2
    assert [r.question_hash for r in here.rows] == ["q2", "q3"]
