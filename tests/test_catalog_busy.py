"""A catalog whose write lock another process holds past the timeout (a real SQLite lock,
taken with ``BEGIN IMMEDIATE`` from another connection): requests are still answered as
they would have been, the writes they could not make wait or are skipped as in an
outage, writes fail at once instead of waiting again, and once the lock is released
what waited is recorded."""

from __future__ import annotations

import sqlite3

import pytest

from cachecraft.catalog import Catalog, CatalogBusyError, CatalogUnavailableError, catalog_path
from cachecraft.catalog import db
from cachecraft.config import Config
from cachecraft.pipeline import Pipeline
from cachecraft.policy.planner import PolicyParams
from cachecraft.store import TieredStore, verify
from tests.conftest import tiny_model
from tests.test_pipeline import CHUNKS, QUESTION

OTHER = [" ".join(f"w{i}" for i in range(120 + 20 * j, 140 + 20 * j)) + "\n\n" for j in range(2)]


def node(cache_dir) -> Pipeline:
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32"},
                         environ={})
    return Pipeline(config, lm=tiny_model("llama"), store=TieredStore(config, tiers=("cpu", "disk")),
                    policy=PolicyParams(alpha=0.5, check_layer=2))


@pytest.fixture
def short_wait(monkeypatch):
    """Writers give up on a held lock after 0.3 s, not 30 s; counts the errors SQLite raised."""
    monkeypatch.setattr(db, "DEFAULT_TIMEOUT_S", 0.3)
    raised = []
    translate = db.translate_error

    def counting(exc, path):
        raised.append(exc)
        return translate(exc, path)

    monkeypatch.setattr(db, "translate_error", counting)
    return raised


def hold_write_lock(cache_dir) -> sqlite3.Connection:
    """Another connection that takes the catalog's write lock and keeps it."""
    holder = sqlite3.connect(catalog_path(cache_dir), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_a_busy_catalog_is_an_outage_for_writers_that_go_on_without_it():
    assert issubclass(CatalogBusyError, CatalogUnavailableError)


def test_a_held_lock_costs_no_answer_and_what_waited_is_recorded_once_it_is_released(tmp_path, short_wait):
    pipeline = node(tmp_path / "node")
    control = node(tmp_path / "control")  # the same requests on a catalog nobody locks
    history = [(CHUNKS, QUESTION), (CHUNKS, QUESTION), (OTHER, QUESTION), (CHUNKS, "w201 w202")]
    first = pipeline.answer(*history[0])
    assert first.request_id is not None and not short_wait

    holder = hold_write_lock(tmp_path / "node")
    during = [pipeline.answer(history[1][0], history[1][1])]
    busy = pipeline.catalog.busy
    assert busy is not None and pipeline.catalog.outage is None  # reads go on
    assert len(short_wait) == 1  # the first write waited and failed; the rest failed at once
    busy.retry_at = float("inf")  # no retry is due during the next request
    during.append(pipeline.answer(*history[2]))
    assert len(short_wait) == 1
    assert [a.request_id for a in during] == [None, None]
    assert len(pipeline.pending.rows) == 2
    # stored chunk-caches are still read (from memory, and the disk tier's index) ...
    assert [c.tier for c in during[0].chunks] == ["cpu"] * len(CHUNKS)
    used = [c.variant for c in during[0].chunks]
    assert all(pipeline.store.unrecorded.hits[v] == 1 for v in used)  # hit counts wait
    # ... and new ones are computed, not kept (no rows for them)
    assert [c.tier for c in during[1].chunks] == ["miss"] * len(OTHER)
    assert len(pipeline.store.unrecorded.variants_not_kept) == len(OTHER)

    holder.rollback()
    holder.close()
    busy.retry_at = 0.0
    last = pipeline.answer(*history[3])
    assert pipeline.catalog.busy is None
    assert last.request_id is not None and not pipeline.pending.rows and not pipeline.store.unrecorded.hits

    expected = [control.answer(*h) for h in history]
    got = [first, *during, last]
    assert [a.text for a in got] == [a.text for a in expected]
    assert [a.recompute_fraction for a in got] == [a.recompute_fraction for a in expected]
    with Catalog(tmp_path / "node") as catalog:
        with catalog.read() as tx:
            rows = [tx.request(i) for i in reversed(tx.request_ids())]
        assert [r.ttft_s for r in rows] == [a.ttft_s for a in got]  # every row, in the order asked
        # the hits counted while the lock was held are in: during[0]'s (late) and last's
        assert [catalog.variants(c.chunk)[0].hits for c in during[0].chunks] == [2] * len(CHUNKS)
        assert all(catalog.variants(c.chunk) == [] for c in during[1].chunks)
    pipeline.close()
    control.close()
    assert verify(tmp_path / "node").ok


def test_a_write_outside_a_request_still_says_the_lock_is_held(tmp_path, short_wait):
    with Catalog(tmp_path) as catalog:
        holder = hold_write_lock(tmp_path)
        with pytest.raises(CatalogBusyError, match="stayed locked by another process"):
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        with pytest.raises(CatalogBusyError, match="stayed locked by another process"):  # at once
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        assert len(short_wait) == 1
        assert catalog.profile("fp", "cpu", "cost") is None  # reads go on
        holder.rollback()
        holder.close()
        catalog.busy.retry_at = 0.0
        catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        assert catalog.busy is None and catalog.profile("fp", "cpu", "cost") == {"a": 1}


def test_warm_stops_with_the_error_rather_than_make_caches_it_cannot_keep(tmp_path, short_wait):
    pipeline = node(tmp_path / "node")
    pipeline.warm(CHUNKS[:1])  # the system prompt's and the warm context's caches are stored
    holder = hold_write_lock(tmp_path / "node")
    with pytest.raises(CatalogBusyError, match="stayed locked by another process"):
        pipeline.warm(CHUNKS[1:])
    assert not pipeline.store.unrecorded.variants_not_kept  # nothing computed and silently dropped
    holder.rollback()
    holder.close()
    pipeline.catalog.busy.retry_at = 0.0
    assert pipeline.warm(CHUNKS[1:]) == len(CHUNKS) - 1
    assert all(pipeline.store.variants_of(c.chunk) for c in pipeline.answer(CHUNKS, QUESTION).chunks)
    pipeline.close()


def test_a_catalog_is_opened_while_another_process_holds_its_lock(tmp_path, short_wait):
    Catalog(tmp_path).close()  # made, and at this version
    holder = hold_write_lock(tmp_path)
    with Catalog(tmp_path) as catalog:  # the schema is read, not written: no wait, no error
        assert catalog.last_request_id() is None
    assert not short_wait
    holder.rollback()
    holder.close()


def test_a_new_process_answers_while_another_holds_the_lock_and_the_next_one_records_its_row(tmp_path, short_wait,
                                                                                             caplog):
    first = node(tmp_path / "node")
    first.warm(CHUNKS)
    first.close()
    holder = hold_write_lock(tmp_path / "node")
    late = node(tmp_path / "node")  # opened under the lock, as `cachecraft query` would be
    answer = late.answer(CHUNKS, QUESTION)
    assert answer.request_id is None and all(c.tier == "disk" for c in answer.chunks)
    late.close()  # the row is left in pending-requests/ for a later process
    assert "is locked by another process: 1 request row(s) kept in" in caplog.text  # not "away"
    holder.rollback()
    holder.close()
    after = node(tmp_path / "node")
    newest = after.answer(CHUNKS, QUESTION)
    with after.catalog.read() as tx:
        rows = [tx.request(i) for i in reversed(tx.request_ids())]
    assert [r.ttft_s for r in rows] == [answer.ttft_s, newest.ttft_s]
    after.close()
    assert verify(tmp_path / "node").ok


def test_a_retry_waits_briefly_for_a_lock_still_held_not_the_whole_timeout_again(tmp_path, short_wait):
    from sqlalchemy import event

    with Catalog(tmp_path) as catalog:
        waits = []
        event.listen(catalog._engine, "before_cursor_execute",
                     lambda conn, cursor, statement, *rest: waits.append(statement)
                     if statement.startswith("PRAGMA busy_timeout") else None)
        holder = hold_write_lock(tmp_path)
        with pytest.raises(CatalogBusyError):
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        catalog.busy.retry_at = 0.0  # due: tried again
        with pytest.raises(CatalogBusyError):
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        assert waits == ["PRAGMA busy_timeout=300", f"PRAGMA busy_timeout={db.RETRY_WAIT_MS}"]
        assert catalog.busy.wait_s == 2 * db.RETRY_FIRST_S  # and the next retry is further off
        holder.rollback()
        holder.close()


def test_messages_say_why_the_catalog_took_no_writes(tmp_path, short_wait):
    with Catalog(tmp_path) as catalog:
        assert catalog.why_unwritten == "could not take them"  # a collision or a full disk
        holder = hold_write_lock(tmp_path)
        with pytest.raises(CatalogBusyError):
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        assert catalog.why_unwritten == "is locked by another process"
        holder.rollback()
        holder.close()
        catalog.busy.retry_at = 0.0
        catalog.save_profile("fp", "cpu", "cost", {"a": 1})  # released: written, and no longer locked
        assert catalog.why_unwritten == "could not take them"
        catalog.outage = db.CatalogOutage("the server is gone")
        assert catalog.why_unwritten == "is away"
