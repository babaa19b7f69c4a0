"""A PostgreSQL catalog lost mid-run (a real server, stopped as a crash would stop it):
requests are still answered as they would have been, what the catalog could not take
waits and is recorded when it is back, in this process or the next, and the cache stays
consistent."""

from __future__ import annotations

import contextvars
import json
import threading
import time

import pytest

pytest.importorskip("psycopg", reason="psycopg not installed (pip install cachecraft[shared])")

from cachecraft.catalog import Catalog, CatalogUnavailableError, ChunkRecord, RequestRecord  # noqa: E402
from cachecraft.catalog import db  # noqa: E402
from cachecraft.catalog.db import CONNECT_TIMEOUT_S, RETRY_FIRST_S, RETRY_MAX_S, CatalogOutage, CatalogTx  # noqa: E402
from cachecraft.catalog.pending import PENDING_DIR, PendingRequests  # noqa: E402
from cachecraft.config import Config  # noqa: E402
from cachecraft.pipeline import Pipeline  # noqa: E402
from cachecraft.policy.planner import PolicyParams  # noqa: E402
from cachecraft.store import TieredStore, verify  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.servers import PostgresCluster  # noqa: E402
from tests.test_pipeline import CHUNKS, QUESTION  # noqa: E402

OTHER = [" ".join(f"w{i}" for i in range(120 + 20 * j, 140 + 20 * j)) + "\n\n" for j in range(2)]


@pytest.fixture
def lost_pg():
    """A PostgreSQL cluster of this test's own, which the test may halt (as a crash would)
    and resume; durable, so a halt loses no committed row."""
    cluster = PostgresCluster(durable=True)
    try:
        cluster.start()
    except Exception as exc:  # noqa: BLE001 - a server that cannot start here is a skip
        cluster.stop()
        pytest.skip(f"could not start PostgreSQL: {exc}")
    yield cluster
    cluster.stop()


def node(cache_dir, url: str | None = None) -> Pipeline:
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32",
                                    "catalog_url": url or ""}, environ={})
    return Pipeline(config, lm=tiny_model("llama"), store=TieredStore(config, tiers=("cpu", "disk")),
                    policy=PolicyParams(alpha=0.5, check_layer=2))


def requests_in(url: str, tmp_path) -> list:
    with Catalog(tmp_path / "reader", url=url) as catalog:
        with catalog.read() as tx:
            return [tx.request(i) for i in reversed(tx.request_ids())]


def test_answers_go_on_while_the_catalog_is_lost_and_what_waited_is_recorded_when_it_is_back(tmp_path, lost_pg):
    url = lost_pg.create_database()
    pipeline = node(tmp_path / "node", url)
    control = node(tmp_path / "control")  # the same requests on an embedded catalog that stays
    history = [(CHUNKS, QUESTION), (CHUNKS, QUESTION), (OTHER, QUESTION), (CHUNKS, "w201 w202")]

    first = pipeline.answer(*history[0])
    assert first.request_id is not None
    lost_pg.halt()
    during = [pipeline.answer(*h) for h in history[1:3]]
    assert [a.request_id for a in during] == [None, None]
    assert pipeline.catalog.outage is not None
    # the chunk-caches this process holds in memory are still found and used ...
    assert [c.tier for c in during[0].chunks] == ["cpu"] * len(CHUNKS)
    # ... new chunks are computed, and their caches not kept locally (no rows for them)
    assert [c.tier for c in during[1].chunks] == ["miss"] * len(OTHER)
    assert len(pipeline.store.unrecorded.variants_not_kept) == len(OTHER)
    used = [c.variant for c in during[0].chunks]
    assert all(pipeline.store.unrecorded.hits[v] == 1 for v in used)  # hit counts wait
    lost_pg.resume()
    pipeline.catalog.outage.retry_at = 0.0  # the next retry is due now (the test need not wait)
    last = pipeline.answer(*history[3])
    assert last.request_id is not None and not pipeline.pending.rows and not pipeline.store.unrecorded.hits

    # every request answered as on a catalog that never went away
    expected = [control.answer(*h) for h in history]
    got = [first, *during, last]
    assert [a.text for a in got] == [a.text for a in expected]
    assert [a.recompute_fraction for a in got] == [a.recompute_fraction for a in expected]
    # every row recorded, in the order asked, the late ones included
    rows = requests_in(url, tmp_path)
    assert [r.ttft_s for r in rows] == [a.ttft_s for a in got]
    assert rows[-1].id == last.request_id
    # the hits counted while the catalog was away are in it now: during[0]'s (late) and last's
    assert [pipeline.catalog.variants(c.chunk)[0].hits for c in during[0].chunks] == [2] * len(CHUNKS)
    pipeline.close()
    control.close()
    assert verify(tmp_path / "node", catalog_url=url).ok


def test_rows_still_waiting_at_exit_are_kept_on_disk_and_recorded_by_the_next_process(tmp_path, lost_pg, caplog):
    url = lost_pg.create_database()
    pipeline = node(tmp_path / "node", url)
    pipeline.answer(CHUNKS, QUESTION)
    lost_pg.halt()
    waiting = pipeline.answer(CHUNKS, "w201 w202")
    assert waiting.request_id is None
    pipeline.catalog.outage.retry_at = 0.0  # close tries once more, fails, and keeps the row on disk
    pipeline.close()
    kept = list((tmp_path / "node" / PENDING_DIR).glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())[0]["ttft_s"] == waiting.ttft_s
    assert "is away: 1 request row(s) kept in" in caplog.text
    assert "not persisted to disk" in caplog.text  # memory tiers cannot be persisted without their rows

    lost_pg.resume()
    again = node(tmp_path / "node", url)
    newest = again.answer(CHUNKS, QUESTION)
    rows = requests_in(url, tmp_path)
    assert [r.ttft_s for r in rows][-2:] == [waiting.ttft_s, newest.ttft_s]
    assert not list((tmp_path / "node" / PENDING_DIR).iterdir())
    again.close()
    assert verify(tmp_path / "node", catalog_url=url).ok


def test_a_lost_catalog_fails_at_once_until_a_retry_is_due_then_waits_longer(tmp_path, lost_pg):
    url = lost_pg.create_database()
    catalog = Catalog(tmp_path / "c", url=url)
    lost_pg.halt()
    with pytest.raises(CatalogUnavailableError, match="catalog_url"):
        catalog.last_request_id()
    outage = catalog.outage
    assert outage is not None and outage.wait_s == RETRY_FIRST_S
    assert outage.retry_at > time.monotonic()
    outage.retry_at = time.monotonic() + 3600  # however long the restart takes here
    lost_pg.resume()
    with pytest.raises(CatalogUnavailableError):  # not due yet: no connection is tried
        catalog.last_request_id()
    outage.retry_at = 0.0
    assert catalog.last_request_id() is None and catalog.outage is None  # back
    catalog.close()


def test_retry_waits_double_up_to_a_limit():
    outage = CatalogOutage("gone")
    waits = []
    for _ in range(10):
        outage.failed_again()
        waits.append(outage.wait_s)
    assert waits[0] == 2 * RETRY_FIRST_S and waits[-1] == RETRY_MAX_S and waits == sorted(waits)


@pytest.mark.parametrize("error", ["DeadlockDetected", "SerializationFailure"])
def test_a_writer_rolled_back_by_the_server_loses_its_write_but_starts_no_outage(error, tmp_path, lost_pg):
    """PostgreSQL answered and rolled one transaction back: callers go on without that
    write as in an outage, but no outage starts (it would send every request row of the
    next second to the pending file)."""
    import psycopg.errors
    from sqlalchemy import exc as sa_exc

    from cachecraft.catalog import CatalogCollisionError
    from cachecraft.catalog.db import translate_server_error

    wrapped = sa_exc.OperationalError("UPDATE entries", {}, getattr(psycopg.errors, error)("two writers"))
    mapped = translate_server_error(wrapped, "postgresql+psycopg://u:secret@db:5432/c")
    assert isinstance(mapped, CatalogCollisionError) and isinstance(mapped, CatalogUnavailableError)
    assert "collided" in str(mapped) and "two writers" in str(mapped) and "secret" not in str(mapped)
    with Catalog(tmp_path, url=lost_pg.create_database()) as catalog:
        with pytest.raises(CatalogCollisionError):
            with catalog.write():
                raise wrapped
        assert catalog.outage is None  # the next transaction goes ahead
        assert catalog.available()
    lost = sa_exc.OperationalError("connect", {}, psycopg.errors.OperationalError("connection refused"))
    assert isinstance(translate_server_error(lost, "postgresql+psycopg://db/c"), CatalogUnavailableError)


def test_warm_stops_with_the_error_rather_than_make_caches_it_cannot_keep(tmp_path, lost_pg):
    url = lost_pg.create_database()
    pipeline = node(tmp_path / "node", url)
    pipeline.warm(CHUNKS[:1])
    lost_pg.halt()
    with pytest.raises(CatalogUnavailableError, match="catalog"):
        pipeline.warm(CHUNKS[1:])
    assert not pipeline.store.unrecorded.variants_not_kept
    lost_pg.resume()
    pipeline.catalog.outage.retry_at = 0.0
    assert pipeline.warm(CHUNKS[1:]) == len(CHUNKS) - 1
    pipeline.close()
    assert verify(tmp_path / "node", catalog_url=url).ok


def finishes_within(seconds: float, call):
    """``call()``'s result or exception and how long it took; fails the test, rather than
    hanging it, when the call has not returned after ``seconds``."""
    outcome: dict = {}
    context = contextvars.copy_context()  # as the caller's thread would run it

    def run() -> None:
        start = time.monotonic()
        try:
            outcome["value"] = context.run(call)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome["value"] = exc
        outcome["took"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert "took" in outcome, f"still waiting after {seconds} s"
    return outcome["value"], outcome["took"]


def test_a_server_that_stops_answering_is_given_up_on_and_counted_lost_until_it_answers(tmp_path, lost_pg):
    """Its processes stopped, the server's host still accepts connections and
    acknowledges data, so only a deadline on the answer ends the wait."""
    url = lost_pg.create_database()
    catalog = Catalog(tmp_path / "c", url=url, timeout_s=2, answer_timeout_s=1)
    catalog.upsert_chunk(ChunkRecord("k1", "fp", 7))
    with pytest.raises(CatalogUnavailableError, match="did not answer within 1 s; check the PostgreSQL"):
        with catalog.read() as tx:  # mid-transaction: the statement itself gets no answer
            assert tx.chunk("k1") is not None
            lost_pg.freeze()
            error, took = finishes_within(20, lambda: tx.chunk("k1"))
            assert 1 <= took < 5  # the answer deadline, not a new connection's (5 s more)
            raise error
    assert catalog.outage is not None
    error, took = finishes_within(5, lambda: catalog.chunk("k1"))
    assert isinstance(error, CatalogUnavailableError) and took < 1  # lost: at once until a retry
    catalog.outage.retry_at = 0.0
    error, took = finishes_within(20, lambda: catalog.chunk("k1"))  # a new connection is not answered either
    assert isinstance(error, CatalogUnavailableError) and took < 1 + CONNECT_TIMEOUT_S + 1
    lost_pg.thaw()
    catalog.outage.retry_at = 0.0
    assert catalog.chunk("k1").num_tokens == 7 and catalog.outage is None
    catalog.close()


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_pooled_connection_to_a_hung_server_is_given_up_on_within_the_ping_deadline(kind, tmp_path, lost_pg,
                                                                                    monkeypatch):
    """The pool checks a pooled connection before handing it out; that check, and the
    reconnect after it fails, take their own short deadlines, not the transaction's."""
    monkeypatch.setattr(db, "PING_TIMEOUT_S", 1.0)
    monkeypatch.setattr(db, "CONNECT_TIMEOUT_S", 1)
    url = lost_pg.create_database()
    catalog = Catalog(tmp_path / "c", url=url, timeout_s=10, answer_timeout_s=10)
    catalog.upsert_chunk(ChunkRecord("k1", "fp", 7))  # its connection goes back to the pool
    lost_pg.freeze()
    if kind == "read":
        error, took = finishes_within(40, lambda: catalog.chunk("k1"))
    else:
        error, took = finishes_within(40, lambda: catalog.upsert_chunk(ChunkRecord("k2", "fp", 9)))
    assert isinstance(error, CatalogUnavailableError), error
    assert took < 1 + 1 + 2  # the ping's and a reconnect's deadlines; the read's own is 10 s, the write's 20 s
    assert catalog.outage is not None
    lost_pg.thaw()
    catalog.outage.retry_at = 0.0
    assert catalog.chunk("k1").num_tokens == 7 and catalog.outage is None
    catalog.close()


def test_a_write_waiting_for_another_writers_lock_is_not_cut_by_the_answer_deadline(tmp_path, lost_pg):
    url = lost_pg.create_database()
    holder = Catalog(tmp_path / "a", url=url)
    waiter = Catalog(tmp_path / "b", url=url, timeout_s=10, answer_timeout_s=0.5)
    held = threading.Event()

    def hold() -> None:
        with holder.write() as tx:
            tx.upsert_chunk(ChunkRecord("k1", "fp", 7))
            held.set()
            time.sleep(2)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    start = time.monotonic()
    waiter.upsert_chunk(ChunkRecord("k2", "fp", 9))  # queues behind the holder's lock
    assert time.monotonic() - start > 1
    thread.join()
    assert waiter.outage is None and waiter.busy is None
    assert [waiter.chunk(k).num_tokens for k in ("k1", "k2")] == [7, 9]
    holder.close()
    waiter.close()


def test_requests_are_answered_while_the_server_is_hung_and_recorded_once_it_answers(tmp_path, lost_pg, monkeypatch):
    monkeypatch.setattr(db, "ANSWER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(db, "CONNECT_TIMEOUT_S", 1)
    url = lost_pg.create_database()
    pipeline = node(tmp_path / "node", url)
    control = node(tmp_path / "control")
    first = pipeline.answer(CHUNKS, QUESTION)
    lost_pg.freeze()
    during, took = finishes_within(30, lambda: pipeline.answer(CHUNKS, "w201 w202"))
    assert not isinstance(during, Exception), during
    assert during.request_id is None and took < 10
    lost_pg.thaw()
    pipeline.catalog.outage.retry_at = 0.0
    last = pipeline.answer(OTHER, QUESTION)
    assert last.request_id is not None and not pipeline.pending.rows
    expected = [control.answer(CHUNKS, QUESTION), control.answer(CHUNKS, "w201 w202"), control.answer(OTHER, QUESTION)]
    assert [a.text for a in (first, during, last)] == [a.text for a in expected]
    assert [r.ttft_s for r in requests_in(url, tmp_path)] == [first.ttft_s, during.ttft_s, last.ttft_s]
    pipeline.close()
    control.close()
    assert verify(tmp_path / "node", catalog_url=url).ok


def test_a_request_whose_commit_went_through_unanswered_is_recorded_once(tmp_path, lost_pg, monkeypatch):
    """The server hangs after taking the row, before answering COMMIT: the row waits as if
    lost, and when it is tried again the catalog finds that it has it already."""
    url = lost_pg.create_database()
    catalog = Catalog(tmp_path / "c", url=url, timeout_s=1, answer_timeout_s=1)
    pending = PendingRequests(tmp_path / "c")
    rec = RequestRecord("q", "full", (), 1.0, 2.0, 2.0)
    add_request = CatalogTx.add_request

    def add_then_hang(tx, row):
        row_id = add_request(tx, row)
        lost_pg.freeze()
        return row_id

    monkeypatch.setattr(CatalogTx, "add_request", add_then_hang)
    assert pending.record(catalog, rec) is None and pending.rows == [rec]  # waits, as if lost
    monkeypatch.undo()
    lost_pg.thaw()  # the server commits what it had taken
    catalog.outage.retry_at = 0.0
    assert pending.record(catalog, RequestRecord("q2", "full", (), 1.0, 3.0, 3.0)) is not None
    assert not pending.rows
    rows = requests_in(url, tmp_path)
    assert [(r.question_hash, r.uid) for r in rows] == [("q", rec.uid), ("q2", rows[1].uid)]
    catalog.close()
