"""A PostgreSQL catalog whose writers' lock another client holds past ``lock_timeout`` (a
real server, the lock taken with ``pg_advisory_xact_lock`` from another connection): as
on SQLite, writes fail at once until a retry is due, a retry waits only briefly (``SET
LOCAL lock_timeout``), requests are answered, and what waited is recorded once the lock
is released."""

from __future__ import annotations

import pytest
from sqlalchemy import event

psycopg = pytest.importorskip("psycopg", reason="psycopg not installed (pip install cachecraft[shared])")

from cachecraft.catalog import Catalog, CatalogBusyError  # noqa: E402
from cachecraft.catalog import db  # noqa: E402
from tests.servers import pg_url, postgres  # noqa: E402, F401  (fixtures)
from tests.test_catalog_outage import node  # noqa: E402
from tests.test_pipeline import CHUNKS, QUESTION  # noqa: E402


@pytest.fixture
def short_wait(monkeypatch):
    """Writers give up on a held lock after 0.3 s, not 30 s."""
    monkeypatch.setattr(db, "DEFAULT_TIMEOUT_S", 0.3)


def hold_writers_lock(url: str):
    """Another client that takes the writers' advisory lock and keeps it (until rollback)."""
    holder = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (db.WRITE_LOCK_ID,))  # in a transaction
    return holder


def lock_statements(catalog: Catalog) -> list[str]:
    """The statements ``catalog`` sends that set a lock timeout, in order (a live list)."""
    sent: list[str] = []
    event.listen(catalog._engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: sent.append(statement)
                 if "lock_timeout" in statement or "advisory" in statement else None)
    return sent


def test_a_held_lock_fails_writes_at_once_and_a_due_retry_waits_briefly(tmp_path, pg_url, short_wait):  # noqa: F811
    with Catalog(tmp_path, url=pg_url) as catalog:
        sent = lock_statements(catalog)
        holder = hold_writers_lock(pg_url)
        with pytest.raises(CatalogBusyError, match="catalog_url"):
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})  # waited lock_timeout (0.3 s)
        assert catalog.busy is not None and catalog.busy.wait_s == db.RETRY_FIRST_S
        assert catalog.why_unwritten == "is locked by another process"
        assert sent == ["SELECT pg_advisory_xact_lock(%(id)s)"]

        with pytest.raises(CatalogBusyError):  # not due: nothing is sent to the server
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        assert len(sent) == 1

        catalog.busy.retry_at = 0.0  # due: tried again, with the short wait
        with pytest.raises(CatalogBusyError):
            catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        assert sent[1:] == [f"SET LOCAL lock_timeout = {db.RETRY_WAIT_MS}", "SELECT pg_advisory_xact_lock(%(id)s)"]
        assert catalog.busy.wait_s == 2 * db.RETRY_FIRST_S

        holder.rollback()  # released
        holder.close()
        catalog.busy.retry_at = 0.0
        catalog.save_profile("fp", "cpu", "cost", {"a": 1})
        assert catalog.busy is None and catalog.profile("fp", "cpu", "cost") == {"a": 1}
        # the short wait was local to the retry's transaction: the next write has the full one
        with catalog.read() as tx:
            assert tx.session.connection().exec_driver_sql("SHOW lock_timeout").scalar() == "300ms"


def test_requests_are_answered_under_the_lock_and_their_rows_recorded_after_it(tmp_path, pg_url, short_wait):  # noqa: F811
    pipeline = node(tmp_path / "node", pg_url)
    control = node(tmp_path / "control")  # the same requests on a SQLite catalog nobody locks
    holder = hold_writers_lock(pg_url)
    during = pipeline.answer(CHUNKS, QUESTION)
    assert during.request_id is None and pipeline.catalog.busy is not None
    assert during.text == control.answer(CHUNKS, QUESTION).text
    holder.rollback()
    holder.close()
    pipeline.catalog.busy.retry_at = 0.0
    after = pipeline.answer(CHUNKS, QUESTION)
    assert after.request_id is not None and pipeline.catalog.busy is None
    with pipeline.catalog.read() as tx:
        rows = [tx.request(i) for i in reversed(tx.request_ids())]
    assert [r.ttft_s for r in rows] == [during.ttft_s, after.ttft_s]
    pipeline.close()
    control.close()
