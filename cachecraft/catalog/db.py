"""The catalog: an SQLite database (WAL mode) in the cache directory, or PostgreSQL.

Every write runs in one ``BEGIN IMMEDIATE`` transaction (:meth:`Catalog.write`), so
several processes can share a cache directory: writers queue on SQLite's lock (busy
timeout) instead of failing or losing rows, and a transaction that raises is rolled
back whole. Reads run in deferred transactions (:meth:`Catalog.read`) and see one
consistent snapshot without blocking writers.

With ``catalog_url`` = ``postgresql+psycopg://...`` the same models live in
PostgreSQL: a write transaction first takes a transaction-level advisory lock, which
plays the part of ``BEGIN IMMEDIATE`` (writers on every node queue instead of racing
on read-then-insert), and counters (hits) are ``SET hits = hits + 1`` in SQL, so
concurrent nodes lose no update even outside that lock.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from sqlalchemy import and_, create_engine, delete, event, func, inspect, or_, select, text, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from cachecraft.catalog.errors import (CatalogBusyError, CatalogCollisionError, CatalogCorruptError,
                                       CatalogError, CatalogUnavailableError, CatalogWriteError,
                                       SchemaVersionError)
from cachecraft.catalog.models import (NODE_PREFIX, SCHEMA_VERSION, UPGRADES, Base, Chunk, Entry, ModelProfile, Request,
                                       RequestChunkRow, SchemaInfo, TierEvent, Variant)
from cachecraft.catalog.records import (SHARED_TIER, TIERS, ChunkRecord, EntryRecord, RequestChunk,
                                        RequestRecord, TierEventRecord, VariantRecord,
                                        fastest_tier)

log = logging.getLogger(__name__)

CATALOG_FILE = "catalog.sqlite"
DEFAULT_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5
# A server host that dies or drops off the network while a connection is open: libpq
# gives up on data the server has not acknowledged after TCP_USER_TIMEOUT_MS, and TCP
# keepalives find an idle pooled connection dead, instead of the kernel's retransmissions
# holding a request for many minutes. Waiting on a lock sends nothing, so it is not cut.
TCP_USER_TIMEOUT_MS = 15_000
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
# A server process that hangs while its host still answers TCP (stopped, or stuck): the
# kernel acknowledges, so neither of the above notices. Each wait on the server then gives
# up after ANSWER_TIMEOUT_S (a read) or the lock timeout plus that (a write, which may
# wait its lock timeout for another writer, legitimately); the connection is closed and
# the catalog counted lost, so requests go on without it.
ANSWER_TIMEOUT_S = 15.0
# The pool's liveness check on a pooled connection (SELECT 1) gets no longer than a new
# connection would: a server that cannot answer it in that time is hung, and the pool's
# reconnect that follows fails within CONNECT_TIMEOUT_S too. Without it, the first call
# after a hang began waited a whole read or write deadline before the reconnect.
PING_TIMEOUT_S = 5.0
# After the catalog's server is lost mid-run, calls fail at once (no connect timeout
# each) until the next retry; the wait doubles from the first to the last value.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
# A write retried while another process held the lock waits this long for it, not the
# whole timeout again: a request answered meanwhile pays the timeout once.
RETRY_WAIT_MS = 250
MAX_EVENTS = 200_000
WRITE_LOCK_ID = 0x63616368  # the advisory lock PostgreSQL writers queue on ("cach")
# Keys per IN list in one query (SQLite allows 32766 bound parameters; a prompt of 500
# chunks stays one query).
_IN_BATCH = 500


def catalog_path(cache_dir: str | Path) -> Path:
    """Where the catalog of ``cache_dir`` lives."""
    return Path(cache_dir) / CATALOG_FILE


def remove_catalog(cache_dir: str | Path) -> list[Path]:
    """Delete the catalog of ``cache_dir`` with its WAL and shared-memory files; returns the
    paths deleted. No process may have it open (the caller makes sure)."""
    path = catalog_path(cache_dir)
    removed = []
    for side in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if side.exists():
            side.unlink()
            removed.append(side)
    return removed


def display_url(url: str) -> str:
    """``url`` with its password hidden, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return url


def _sqlite_error(exc: BaseException) -> BaseException | None:
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, sqlite3.Error) else (exc if isinstance(exc, sqlite3.Error) else None)


def translate_error(exc: BaseException, path: Path) -> CatalogError | None:
    """Map an SQLite/SQLAlchemy error to a one-line :class:`CatalogError`, or None."""
    err = _sqlite_error(exc)
    if err is None:
        return None
    text = str(err).lower()
    if "locked" in text or "busy" in text:
        return CatalogBusyError(f"catalog {path} stayed locked by another process; retry, or "
                                "stop the process that holds it")
    if "full" in text:
        return CatalogWriteError(f"no space left on device writing the catalog {path}; "
                                 "free disk space or lower disk_budget_bytes")
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return CatalogWriteError(f"cannot write the catalog {path}; make the cache directory "
                                 "writable or set CACHECRAFT_CACHE_DIR to another directory")
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return CatalogCorruptError(f"catalog {path} is damaged ({err}); run `cachecraft verify "
                                   "--repair` to rebuild it from the stored chunks")
    return None


ROLLED_BACK_STATES = ("40P01", "40001")  # PostgreSQL's deadlock_detected, serialization_failure


def translate_server_error(exc: BaseException, url: str) -> CatalogError | None:
    """Map a PostgreSQL error to a one-line :class:`CatalogError` naming ``catalog_url``, or None."""
    orig = getattr(exc, "orig", exc)
    first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    name = type(orig).__name__
    if name == "ServerSilent":
        return CatalogUnavailableError(f"the catalog at catalog_url {display_url(url)} {first}; "
                                       "check the PostgreSQL server there")
    if name in ("LockNotAvailable", "QueryCanceled") or "lock timeout" in first.lower():
        return CatalogBusyError(f"catalog at catalog_url {display_url(url)} stayed locked ({first}); retry")
    # a deadlock or a serialization failure: the server answered and rolled one writer back
    if getattr(orig, "sqlstate", None) in ROLLED_BACK_STATES:
        return CatalogCollisionError(f"catalog at catalog_url {display_url(url)}: a transaction collided "
                                     f"with another's ({first}); retry")
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
        return CatalogUnavailableError(f"cannot reach the catalog at catalog_url {display_url(url)} "
                                       f"({first}); check that PostgreSQL runs and answers there, or fix catalog_url")
    return None


def _ensure_wal(cur: sqlite3.Cursor, timeout_s: float) -> None:
    """Put the SQLite file in WAL mode (a setting the file keeps), waiting out other processes.

    Switching the journal mode needs the file to itself, and SQLite can answer "database is
    locked" at once, without its busy handler, while other processes open, write or close the
    same file (seen with four processes sharing one cache directory). The file keeps the mode, so
    read it first and only switch a file not yet in WAL; retry either step until the catalog's
    own lock timeout.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


# how long the wait on the server may last in this thread's current transaction
_ANSWER_WITHIN: ContextVar[float] = ContextVar("cachecraft_answer_within", default=ANSWER_TIMEOUT_S)


@cache
def _answering_connection() -> type:
    """psycopg's connection class, giving up on a server that stays silent longer than
    the current transaction allows (see :data:`ANSWER_TIMEOUT_S`)."""
    import psycopg
    from psycopg import errors

    class ServerSilent(psycopg.OperationalError):
        """The server accepted the connection but did not answer in time."""

    class AnsweringConnection(psycopg.Connection):
        def wait(self, gen, *args, timeout=None, **kwargs):
            if timeout is not None:  # psycopg's own bounded waits keep their bound
                return super().wait(gen, *args, timeout=timeout, **kwargs)
            within = _ANSWER_WITHIN.get()
            try:
                return super().wait(gen, *args, timeout=within, **kwargs)
            except errors._WaitTimeout:  # the wait functions' timeout, which callers convert
                # mid-statement, the connection's state is unknown: close it, so the pool
                # drops it instead of handing it out again
                self.pgconn.finish()
                raise ServerSilent(f"did not answer within {within:g} s") from None

    return AnsweringConnection


def _pinged_briefly(ping):
    """``ping`` (the dialect's liveness check of a pooled connection) under
    :data:`PING_TIMEOUT_S`, or the transaction's own deadline where that is shorter."""

    def ping_briefly(dbapi_connection) -> bool:
        within = _ANSWER_WITHIN.set(min(PING_TIMEOUT_S, _ANSWER_WITHIN.get()))
        try:
            return ping(dbapi_connection)
        finally:
            _ANSWER_WITHIN.reset(within)

    return ping_briefly


class CatalogOutage:
    """The catalog's server lost mid-run (or its write lock held past the timeout): when,
    why, and when to try it again."""

    def __init__(self, message: str) -> None:
        self.message, self.since = message, time.monotonic()
        self.wait_s = RETRY_FIRST_S
        self.retry_at = self.since + self.wait_s

    def due(self) -> bool:
        """Whether the next call may try the server again."""
        return time.monotonic() >= self.retry_at

    def failed_again(self) -> None:
        """A retry failed: wait twice as long (up to :data:`RETRY_MAX_S`) before the next."""
        self.wait_s = min(RETRY_MAX_S, self.wait_s * 2)
        self.retry_at = time.monotonic() + self.wait_s


def _failed_again(state: CatalogOutage | None, error: CatalogError, doing: str) -> CatalogOutage:
    """``state`` after one more failure: a new one (with a warning that says what goes on
    ``doing``) when there was none, else the same with its next retry further off."""
    if state is None:
        state = CatalogOutage(str(error))
        log.warning("%s; %s, retrying in %.0f s", error, doing, state.wait_s)
    else:
        state.failed_again()
    return state


class CatalogTx:
    """Operations inside one catalog transaction (from :meth:`Catalog.write`/:meth:`read`)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    # facts about the database ----------------------------------------------------------

    def info_value(self, key: str) -> str | None:
        """A value of the ``schema_info`` table, or None."""
        row = self.session.get(SchemaInfo, key)
        return None if row is None else row.value

    def set_info_value(self, key: str, value: str) -> None:
        """Set a value of the ``schema_info`` table."""
        row = self.session.get(SchemaInfo, key)
        if row is None:
            self.session.add(SchemaInfo(key=key, value=value))
        else:
            row.value = value

    # chunks and variants -------------------------------------------------------------

    def upsert_chunk(self, rec: ChunkRecord) -> None:
        """Insert a chunk, or fill in its source/preview when given."""
        row = self.session.get(Chunk, rec.key)
        if row is None:
            self.session.add(Chunk(key=rec.key, fingerprint=rec.fingerprint,
                                   num_tokens=rec.num_tokens, source=rec.source,
                                   preview=rec.preview, created_at=rec.created_at or time.time()))
            self.session.flush()
            return
        if rec.source is not None:
            row.source = rec.source
        if rec.preview is not None:
            row.preview = rec.preview

    def chunk(self, key: str) -> ChunkRecord | None:
        """The chunk with this key, or None."""
        row = self.session.get(Chunk, key)
        return None if row is None else _chunk_record(row)

    def sources(self) -> set[str]:
        """Every document some recorded chunk came from (evicted chunks' included)."""
        return set(self.session.scalars(select(Chunk.source).where(Chunk.source.is_not(None)).distinct()))

    def chunk_keys(self, *, sources: Iterable[str] = (), prefix: str | None = None) -> list[str]:
        """Keys of the recorded chunks that came from one of ``sources``, or whose key (or
        one of whose variants' keys) starts with ``prefix``, by key."""
        wanted = sorted(set(sources))
        keys: set[str] = set()
        for start in range(0, len(wanted), _IN_BATCH):  # bound the IN list a query carries
            batch = wanted[start:start + _IN_BATCH]
            keys.update(self.session.scalars(select(Chunk.key).where(Chunk.source.in_(batch))))
        if prefix:
            keys.update(self.session.scalars(select(Chunk.key).where(Chunk.key.startswith(prefix, autoescape=True))))
            keys.update(self.session.scalars(select(Variant.chunk_key)
                                             .where(Variant.key.startswith(prefix, autoescape=True))))
        return sorted(keys)

    def upsert_variant(self, rec: VariantRecord) -> None:
        """Insert a variant, or update its size and statistics (hits and history kept)."""
        row = self.session.get(Variant, rec.key)
        stats = None if rec.stats is None else json.dumps(dict(rec.stats), sort_keys=True)
        if row is None:
            self.session.add(Variant(
                key=rec.key, chunk_key=rec.chunk_key, prefix=json.dumps(list(rec.prefix)),
                prefix_len=len(rec.prefix), nbytes=rec.nbytes, dtype=rec.dtype, cci=rec.cci,
                stats=stats, cost_s=rec.cost_s, quality=rec.quality, tier=None,
                hits=rec.hits, last_used=rec.last_used, created_at=rec.created_at or time.time()))
            self.session.flush()
            return
        row.nbytes, row.dtype = rec.nbytes, rec.dtype
        for name, value in (("cci", rec.cci), ("stats", stats), ("cost_s", rec.cost_s),
                            ("quality", rec.quality)):
            if value is not None:
                setattr(row, name, value)

    def variant(self, key: str) -> VariantRecord | None:
        """The variant with this key (live or not), or None."""
        row = self.session.get(Variant, key)
        return None if row is None else _variant_record(row)

    def variants(self, chunk_key: str) -> list[VariantRecord]:
        """Every variant recorded for a chunk, evicted ones included."""
        rows = self.session.scalars(select(Variant).where(Variant.chunk_key == chunk_key)
                                    .order_by(Variant.created_at))
        return [_variant_record(r) for r in rows]

    def stored_variants(self, chunks: Iterable[str] | None = None) -> list[VariantRecord]:
        """Every variant whose bytes some tier holds (any owner), of ``chunks`` only when
        given, by key."""
        stored = select(Variant).where(Variant.key.in_(select(Entry.variant_key).distinct()))
        if chunks is None:
            return [_variant_record(r) for r in self.session.scalars(stored.order_by(Variant.key))]
        wanted = sorted(set(chunks))
        rows = [row for start in range(0, len(wanted), _IN_BATCH)  # bound the IN list a query carries
                for row in self.session.scalars(stored.where(Variant.chunk_key.in_(wanted[start:start + _IN_BATCH])))]
        return sorted((_variant_record(r) for r in rows), key=lambda r: r.key)

    def available_variants(self, chunk_key: str, owner: str, node: str = "") -> list[VariantRecord]:
        """Variants of a chunk that ``owner`` (a store on ``node``) can read: in its node's disk
        tier, or in its own memory tiers.

        ``tier`` in each record is the fastest such tier.
        """
        return self.available_variants_of([chunk_key], owner, node)[chunk_key]

    def available_variants_of(self, chunk_keys: Sequence[str], owner: str,
                              node: str = "") -> dict[str, list[VariantRecord]]:
        """:meth:`available_variants` of each chunk in ``chunk_keys``, in one query: per
        chunk key, its readable variants oldest first (an empty list for none)."""
        wanted = list(dict.fromkeys(chunk_keys))
        tiers: dict[str, set[str]] = {}
        found: dict[str, Variant] = {}
        for start in range(0, len(wanted), _IN_BATCH):  # bound the IN list a query carries
            rows = self.session.execute(
                select(Variant, Entry.tier).join(Entry, Entry.variant_key == Variant.key)
                .where(Variant.chunk_key.in_(wanted[start:start + _IN_BATCH]))
                .where(((Entry.tier == "disk") & (Entry.owner == node)) | (Entry.owner == owner))).all()
            for variant, tier in rows:
                found[variant.key] = variant
                tiers.setdefault(variant.key, set()).add(tier)
        out: dict[str, list[VariantRecord]] = {key: [] for key in wanted}
        for key, variant in found.items():
            out[variant.chunk_key].append(_variant_record(variant, tier=fastest_tier(tiers[key])))
        for records in out.values():
            records.sort(key=lambda r: (r.created_at, r.key))
        return out

    def touch(self, variant_key: str, now: float | None = None, hits: int = 1) -> None:
        """Count ``hits`` hits (default one) on a variant."""
        self.session.execute(update(Variant).where(Variant.key == variant_key)
                             .values(hits=Variant.hits + hits, last_used=now or time.time()))

    def set_quality(self, variant_key: str, quality: float) -> None:
        """Record a variant's measured quality (the share of its prefill a reuse saves)."""
        self.session.execute(update(Variant).where(Variant.key == variant_key).values(quality=quality))

    def refresh_tier(self, variant_key: str) -> str | None:
        """Set a variant's ``tier`` to the fastest tier holding it (None if none)."""
        tiers = self.session.scalars(select(Entry.tier).where(Entry.variant_key == variant_key))
        tier = fastest_tier(tiers)
        self.session.execute(update(Variant).where(Variant.key == variant_key).values(tier=tier))
        return tier

    # entries -------------------------------------------------------------------------

    def entry(self, variant_key: str, tier: str, owner: str = "") -> EntryRecord | None:
        """The placement of a variant in one tier (for one owner), or None."""
        row = self._entry_row(variant_key, tier, owner)
        return None if row is None else _entry_record(row)

    def _entry_row(self, variant_key: str, tier: str, owner: str) -> Entry | None:
        return self.session.scalars(select(Entry).where(
            Entry.variant_key == variant_key, Entry.tier == tier, Entry.owner == owner)).first()

    def add_entry(self, rec: EntryRecord) -> EntryRecord | None:
        """Record a placement (replacing the same variant/tier/owner); returns the replaced one."""
        assert rec.tier in TIERS, f"unknown tier {rec.tier!r}"
        row = self._entry_row(rec.variant_key, rec.tier, rec.owner)
        old = None if row is None else _entry_record(row)
        if row is None:
            self.session.add(Entry(variant_key=rec.variant_key, tier=rec.tier, owner=rec.owner,
                                   nbytes=rec.nbytes, blob=rec.blob, checksum=rec.checksum,
                                   stored_at=rec.stored_at or time.time(), node=rec.node))
            self.session.flush()
        else:
            row.nbytes, row.blob, row.checksum = rec.nbytes, rec.blob, rec.checksum
            row.stored_at = rec.stored_at or time.time()
        self.refresh_tier(rec.variant_key)
        return old

    def remove_entry(self, variant_key: str, tier: str, owner: str = "",
                     blob: str | None = None) -> EntryRecord | None:
        """Remove a placement (only if it still names ``blob``, when given); returns it."""
        row = self._entry_row(variant_key, tier, owner)
        if row is None or (blob is not None and row.blob != blob):
            return None
        old = _entry_record(row)
        self.session.delete(row)
        self.session.flush()
        self.refresh_tier(variant_key)
        return old

    def entries(self, tier: str | None = None, owner: str | None = None,
                node: str | None = None) -> list[EntryRecord]:
        """Placements, optionally of one tier, one owner and/or one node."""
        query = select(Entry)
        if tier is not None:
            query = query.where(Entry.tier == tier)
        if owner is not None:
            query = query.where(Entry.owner == owner)
        if node is not None:
            query = query.where(Entry.node == node)
        return [_entry_record(r) for r in self.session.scalars(query.order_by(Entry.id))]

    def tier_bytes(self, tier: str, owner: str = "") -> int:
        """Bytes recorded in one tier for one owner (a disk tier: its node's id, "" in the
        embedded catalog)."""
        total = self.session.scalar(select(func.coalesce(func.sum(Entry.nbytes), 0))
                                    .where(Entry.tier == tier, Entry.owner == owner))
        return int(total or 0)

    def placed_variants(self, tier: str, owner: str = "") -> list[tuple[EntryRecord, VariantRecord]]:
        """Each placement in a tier with its variant (what an eviction policy needs)."""
        rows = self.session.execute(select(Entry, Variant).join(Variant, Entry.variant_key == Variant.key)
                                    .where(Entry.tier == tier, Entry.owner == owner)).all()
        return [(_entry_record(e), _variant_record(v)) for e, v in rows]

    def memory_owners(self, node: str = "") -> set[str]:
        """Owners on ``node`` that hold GPU/CPU placements."""
        return set(self.session.scalars(select(Entry.owner).where(Entry.tier != "disk", Entry.node == node)
                                        .distinct()))

    def nodes(self) -> dict[str, dict]:
        """The nodes that joined this catalog (id -> what they recorded about themselves)."""
        rows = self.session.execute(select(SchemaInfo.key, SchemaInfo.value)
                                    .where(SchemaInfo.key.startswith(NODE_PREFIX))).all()
        return {key.removeprefix(NODE_PREFIX): _json_object(value) or {} for key, value in rows}

    def join_node(self, node: str, about: dict) -> bool:
        """Record that ``node`` uses this catalog; True when it had not joined before."""
        new = self.info_value(NODE_PREFIX + node) is None
        self.set_info_value(NODE_PREFIX + node, json.dumps(about, sort_keys=True))
        return new

    def remove_owner(self, owner: str, kind: str = "lost") -> list[EntryRecord]:
        """Drop every memory placement of ``owner`` (it is gone), logging ``kind`` events."""
        rows = list(self.session.scalars(select(Entry).where(Entry.owner == owner, Entry.tier != "disk")))
        removed = [_entry_record(r) for r in rows]
        for row in rows:
            self.session.delete(row)
        self.session.flush()
        for rec in removed:
            self.refresh_tier(rec.variant_key)
            self.event(kind, rec.variant_key, rec.tier, None, rec.nbytes, owner)
        return removed

    def node_ids(self) -> set[str]:
        """Every node id the catalog names: members, and nodes with placements or requests."""
        named = set(self.nodes())
        for column in (Entry.node, Request.node):
            named |= set(self.session.scalars(select(column).where(column != "").distinct()))
        return named

    def node_activity(self) -> dict[str, tuple[float | None, int]]:
        """Per node that answered a request or holds chunk-caches in memory: when it last
        answered one (epoch seconds; None: never) and how many chunk-caches its processes
        hold in memory, rows a process that closes its store drops, so a node that holds
        some is running (or crashed)."""
        last = dict(self.session.execute(select(Request.node, func.max(Request.created_at))
                                         .where(Request.node != "").group_by(Request.node)).all())
        held = dict(self.session.execute(select(Entry.node, func.count()).where(Entry.tier != "disk", Entry.node != "")
                                         .group_by(Entry.node)).all())
        return {node: (last.get(node), int(held.get(node, 0))) for node in set(last) | set(held)}

    def forget_node(self, node: str) -> dict[str, int]:
        """Drop what one node of a shared catalog holds: its placements (its disk tier's and
        its processes' memory rows, each logged as a ``clear`` event), the requests it
        answered, and its membership, so that the directory joins anew when next opened.
        Chunks, variants and their statistics stay: every node reads them. Returns the rows
        deleted (``entries``, ``requests``)."""
        rows = list(self.session.scalars(select(Entry).where(Entry.node == node)))
        for row in rows:
            self.session.delete(row)
        self.session.flush()
        for key in {row.variant_key for row in rows}:
            self.refresh_tier(key)
        for row in rows:
            self.event("clear", row.variant_key, row.tier, None, row.nbytes, row.owner)
        answered = select(Request.id).where(Request.node == node)
        self.session.execute(delete(RequestChunkRow).where(RequestChunkRow.request_id.in_(answered)))
        requests = self.session.execute(delete(Request).where(Request.node == node)).rowcount
        self.session.execute(delete(SchemaInfo).where(SchemaInfo.key == NODE_PREFIX + node))
        return {"entries": len(rows), "requests": int(requests or 0)}

    def empty(self) -> dict[str, int]:
        """Delete every row of every table (chunks, variants and their statistics,
        placements, requests, events, model profiles) and every node's membership; the
        schema and its version stay. Returns the rows deleted per table."""
        deleted = {}
        for model in (RequestChunkRow, Request, TierEvent, Entry, Variant, Chunk, ModelProfile):
            deleted[model.__tablename__] = int(self.session.execute(delete(model)).rowcount or 0)
        gone = self.session.execute(delete(SchemaInfo).where(SchemaInfo.key.startswith(NODE_PREFIX)))
        deleted["nodes"] = int(gone.rowcount or 0)
        return deleted

    def variant_tiers(self) -> dict[str, str | None]:
        """The recorded ``tier`` of every variant."""
        return dict(self.session.execute(select(Variant.key, Variant.tier)).all())

    def counts(self) -> dict[str, int]:
        """Rows per table and entries/bytes per tier."""
        out = {name: int(self.session.scalar(select(func.count()).select_from(model)) or 0)
               for name, model in (("chunks", Chunk), ("variants", Variant), ("requests", Request),
                                   ("tier_events", TierEvent))}
        for tier in TIERS:
            n, b = self.session.execute(select(func.count(Entry.id), func.coalesce(func.sum(Entry.nbytes), 0))
                                        .where(Entry.tier == tier)).one()
            out[f"{tier}_entries"], out[f"{tier}_bytes"] = int(n), int(b)
        return out

    # events and requests -------------------------------------------------------------

    def event(self, kind: str, variant_key: str, from_tier: str | None, to_tier: str | None,
              nbytes: int, owner: str = "") -> None:
        """Record a tier event."""
        self.session.add(TierEvent(at=time.time(), variant_key=variant_key, kind=kind,
                                   from_tier=from_tier, to_tier=to_tier, nbytes=int(nbytes),
                                   owner=owner))

    def events(self, variant_key: str | None = None, kind: str | None = None,
               since_id: int = 0, limit: int | None = None) -> list[TierEventRecord]:
        """Tier events in order, optionally filtered."""
        query = select(TierEvent).where(TierEvent.id > since_id)
        if variant_key is not None:
            query = query.where(TierEvent.variant_key == variant_key)
        if kind is not None:
            query = query.where(TierEvent.kind == kind)
        query = query.order_by(TierEvent.id)
        if limit is not None:
            query = query.limit(limit)
        return [TierEventRecord(r.id, r.at, r.variant_key, r.kind, r.from_tier, r.to_tier,
                                r.nbytes, r.owner) for r in self.session.scalars(query)]

    def last_event_id(self) -> int:
        """The id of the newest tier event (0 when there is none): a mark for ``events(since_id=...)``."""
        return int(self.session.scalar(select(func.max(TierEvent.id))) or 0)

    def prune_events(self, keep: int = MAX_EVENTS) -> int:
        """Keep only the newest ``keep`` tier events; returns how many were deleted."""
        last = self.session.scalar(select(func.max(TierEvent.id))) or 0
        result = self.session.execute(delete(TierEvent).where(TierEvent.id <= last - keep))
        return int(result.rowcount or 0)

    def add_request(self, rec: RequestRecord) -> int:
        """Store a request and its chunks; returns its id. A request whose ``uid`` is
        recorded already (an earlier try committed, though its answer was lost) is not
        added again: the id is the recorded one."""
        if rec.uid is not None:
            known = self.session.scalar(select(Request.id).where(Request.uid == rec.uid))
            if known is not None:
                return int(known)
        hits = rec.hits_by_tier
        row = Request(created_at=rec.created_at, question_hash=rec.question_hash, method=rec.method,
                      num_chunks=len(rec.chunks), hits_gpu=hits["gpu"], hits_cpu=hits["cpu"],
                      hits_disk=hits["disk"], hits_redis=hits[SHARED_TIER], misses=rec.misses, node=rec.node,
                      recompute_fraction=rec.recompute_fraction, ttft_s=rec.ttft_s,
                      full_prefill_s=rec.full_prefill_s, num_tokens=rec.num_tokens,
                      policy=None if rec.policy is None else json.dumps(rec.policy, sort_keys=True),
                      uid=rec.uid)
        self.session.add(row)
        self.session.flush()
        for c in rec.chunks:
            self.session.add(RequestChunkRow(
                request_id=row.id, position=c.position, chunk_key=c.chunk_key,
                variant_key=c.variant_key, tier=c.tier, cci=c.cci, beta_prime=c.beta_prime,
                cfo=c.cfo, fraction=c.fraction, stop_layer=c.stop_layer))
        self.session.flush()
        return int(row.id)

    def request(self, request_id: int) -> RequestRecord | None:
        """A stored request with its chunks in position order, or None."""
        row = self.session.get(Request, request_id)
        if row is None:
            return None
        chunks = self.session.scalars(select(RequestChunkRow).where(
            RequestChunkRow.request_id == request_id).order_by(RequestChunkRow.position))
        return RequestRecord(
            question_hash=row.question_hash, method=row.method,
            chunks=tuple(RequestChunk(c.position, c.chunk_key, c.variant_key, c.tier, c.cci,
                                      c.beta_prime, c.cfo, c.fraction, c.stop_layer) for c in chunks),
            recompute_fraction=row.recompute_fraction, ttft_s=row.ttft_s,
            full_prefill_s=row.full_prefill_s, created_at=row.created_at, id=row.id,
            num_tokens=row.num_tokens, policy=_json_object(row.policy), node=row.node, uid=row.uid)

    def order_history(self, chunk_keys: Sequence[str], limit: int) -> list[dict]:
        """The recorded policies (``{}`` where a request has none) of the newest ``limit``
        stored requests that had exactly ``chunk_keys`` as their chunks, in this order,
        newest first: what :func:`cachecraft.policy.rules.exact_wait` counts asks in."""
        if not chunk_keys or limit <= 0:
            return []
        wanted = or_(*(and_(RequestChunkRow.position == i, RequestChunkRow.chunk_key == key)
                       for i, key in enumerate(chunk_keys)))
        matches = (select(RequestChunkRow.request_id)
                   .join(Request, Request.id == RequestChunkRow.request_id)
                   .where(Request.num_chunks == len(chunk_keys), wanted)
                   .group_by(RequestChunkRow.request_id)
                   .having(func.count() == len(chunk_keys)))
        newest = self.session.scalars(select(Request.policy).where(Request.id.in_(matches))
                                      .order_by(Request.id.desc()).limit(limit)).all()
        return [_json_object(policy) or {} for policy in newest]

    # what was measured or fitted per model ----------------------------------------------

    def profile(self, fingerprint: str, device: str, kind: str) -> dict | None:
        """The ``kind`` profile (a JSON object) of model ``fingerprint`` on ``device``, or None."""
        row = self.session.get(ModelProfile, (fingerprint, device, kind))
        if row is None:
            return None
        try:
            value = json.loads(row.value)
        except ValueError:
            return None  # unreadable: as if never measured, and overwritten by the next save
        return value if isinstance(value, dict) else None

    def set_profile(self, fingerprint: str, device: str, kind: str, value: dict) -> None:
        """Store (or replace) the ``kind`` profile of model ``fingerprint`` on ``device``."""
        row = self.session.get(ModelProfile, (fingerprint, device, kind))
        text = json.dumps(value, sort_keys=True)
        if row is None:
            self.session.add(ModelProfile(fingerprint=fingerprint, device=device, kind=kind, value=text,
                                          updated_at=time.time()))
        else:
            row.value, row.updated_at = text, time.time()

    def profiles(self, fingerprint: str | None = None) -> list[tuple[str, str, str, dict]]:
        """Every stored profile as (fingerprint, device, kind, value), optionally of one model."""
        query = select(ModelProfile).order_by(ModelProfile.fingerprint, ModelProfile.device, ModelProfile.kind)
        if fingerprint is not None:
            query = query.where(ModelProfile.fingerprint == fingerprint)
        rows = []
        for row in self.session.scalars(query):
            try:
                rows.append((row.fingerprint, row.device, row.kind, json.loads(row.value)))
            except ValueError:
                continue
        return rows

    def request_ids(self, limit: int | None = None) -> list[int]:
        """Ids of stored requests, newest first."""
        query = select(Request.id).order_by(Request.id.desc())
        if limit is not None:
            query = query.limit(limit)
        return list(self.session.scalars(query))


def _json_object(text: str | None) -> dict | None:
    """A JSON object column's value (None when empty or unreadable)."""
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _chunk_record(row: Chunk) -> ChunkRecord:
    return ChunkRecord(row.key, row.fingerprint, row.num_tokens, row.source, row.preview, row.created_at)


def _variant_record(row: Variant, tier: str | None = ...) -> VariantRecord:  # type: ignore[assignment]
    return VariantRecord(
        key=row.key, chunk_key=row.chunk_key, prefix=tuple(json.loads(row.prefix)),
        nbytes=row.nbytes, dtype=row.dtype, cci=row.cci,
        stats=None if row.stats is None else json.loads(row.stats), cost_s=row.cost_s,
        quality=row.quality, tier=row.tier if tier is ... else tier, hits=row.hits,
        last_used=row.last_used, created_at=row.created_at)


def _entry_record(row: Entry) -> EntryRecord:
    return EntryRecord(row.variant_key, row.tier, row.owner, row.nbytes, row.blob, row.checksum,
                       row.stored_at, row.node)


class Catalog:
    """The catalog database of one cache directory (or of ``url``, when given).

    Opening creates the database (and the directory) when missing, switches it to WAL
    mode and checks the schema version. Raises :class:`SchemaVersionError` for a
    database written by an incompatible version, :class:`CatalogCorruptError` for a
    damaged file and :class:`CatalogWriteError` when the directory cannot be written.

    ``url`` (the config's ``catalog_url``): a SQLAlchemy URL; empty or None means the
    SQLite file in ``cache_dir``. ``postgresql+psycopg://user:pass@host:port/db`` puts
    the catalog in PostgreSQL (the same tables); an unreachable server raises
    :class:`CatalogUnavailableError`, one line naming ``catalog_url``.

    A writer waits ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`) for another's lock,
    then raises :class:`CatalogBusyError`; from then until a retry is due writes raise it
    at once, so what writes as it goes (a request) waits once and goes on without them.

    A PostgreSQL server that stops answering (its host still up) is given up on after
    ``answer_timeout_s`` (default :data:`ANSWER_TIMEOUT_S`) in a read, ``timeout_s`` more
    in a write: :class:`CatalogUnavailableError`, and the catalog counts as lost.
    """

    def __init__(self, cache_dir: str | Path, *, url: str | None = None,
                 timeout_s: float | None = None, answer_timeout_s: float | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.url = url or None
        self.created = False  # set when this open created the tables
        self.upgraded_from: int | None = None  # set when this open upgraded an older schema
        self.path = catalog_path(self.cache_dir)
        self.outage: CatalogOutage | None = None  # set while the server is lost (mid-run)
        # set while another process holds the write lock past the timeout: writes fail at
        # once until the next retry (reads go on), so a request waits for it once, not per write
        self.busy: CatalogOutage | None = None
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        # how long a read, and a write, may wait on a PostgreSQL server (SQLite: unused)
        self._read_within = ANSWER_TIMEOUT_S if answer_timeout_s is None else answer_timeout_s
        self._write_within = timeout_s + self._read_within
        if self.url is None:
            self.dialect = "sqlite"
            self._open_sqlite(timeout_s)
        else:
            try:
                self.dialect = make_url(self.url).get_backend_name()
            except sa_exc.ArgumentError:
                self.dialect = "?"
            if self.dialect != "postgresql":
                raise CatalogError(f"catalog_url {display_url(self.url)} is not supported; use "
                                   "postgresql+psycopg://user:password@host:port/database, or leave "
                                   "catalog_url empty for the SQLite file in the cache directory")
            self._open_postgres(timeout_s)
        try:
            self._init_schema()
        except BaseException:
            self._engine.dispose()
            raise
        self._opened = True

    @property
    def where(self) -> str:
        """The catalog's location for messages: the SQLite file, or the URL without password."""
        return str(self.path) if self.url is None else display_url(self.url)

    @property
    def shared(self) -> bool:
        """Whether the catalog lives in a server (PostgreSQL) rather than the cache directory."""
        return self.url is not None

    def _open_sqlite(self, timeout_s: float) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CatalogWriteError(f"cannot create the cache directory {self.cache_dir} ({exc.strerror}); "
                                    "set CACHECRAFT_CACHE_DIR to a writable directory") from None
        self._engine = create_engine(f"sqlite:///{self.path}",
                                     connect_args={"timeout": timeout_s, "check_same_thread": False})
        timeout_ms = int(timeout_s * 1000)

        @event.listens_for(self._engine, "connect")
        def _on_connect(dbapi_conn, _record) -> None:  # pragma: no cover - exercised by every test
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout={timeout_ms}")
            _ensure_wal(cur, timeout_s)
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(self._engine, "begin")
        def _on_begin(conn) -> None:
            options = conn.get_execution_options()
            conn.exec_driver_sql(f"PRAGMA busy_timeout={options.get('cachecraft_wait_ms', timeout_ms)}")
            conn.exec_driver_sql("BEGIN " + options.get("cachecraft_begin", "IMMEDIATE"))

        self._read_engine = self._engine.execution_options(cachecraft_begin="DEFERRED")

    def _open_postgres(self, timeout_s: float) -> None:
        lock_timeout_ms = int(timeout_s * 1000)
        url = make_url(self.url)
        if url.drivername == "postgresql":  # SQLAlchemy's default driver is psycopg2; ours is psycopg 3
            url = url.set(drivername="postgresql+psycopg")
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise CatalogError("catalog_url needs the psycopg package: pip install 'cachecraft[shared]'") from None
        self._engine = create_engine(
            url, pool_pre_ping=True,
            connect_args={"connect_timeout": CONNECT_TIMEOUT_S, "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
                          **KEEPALIVES, "options": f"-c lock_timeout={lock_timeout_ms}"})

        @event.listens_for(self._engine, "do_connect")
        def _connect(_dialect, _record, cargs, cparams):
            return _answering_connection().connect(*cargs, **cparams)

        self._engine.dialect.do_ping = _pinged_briefly(self._engine.dialect.do_ping)

        # reads: one REPEATABLE READ snapshot per transaction, as SQLite's deferred reads
        self._read_engine = self._engine.execution_options(isolation_level="REPEATABLE READ")

    def _schema_current(self) -> bool:
        """Whether the catalog holds this version's schema already: read, so that opening a
        catalog another process is writing (or holds locked) does not wait for its lock."""
        with self.read() as tx:
            tables = set(inspect(tx.session.connection()).get_table_names())
            if "schema_info" not in tables or set(Base.metadata.tables) - tables:
                return False
            row = tx.session.get(SchemaInfo, "schema_version")
            return row is not None and row.value == str(SCHEMA_VERSION)

    def _init_schema(self) -> None:
        if self._schema_current():
            return
        # schema changes live in one place: the models (cachecraft.catalog.models), with
        # SCHEMA_VERSION and the UPGRADES from older versions there
        with self.write() as tx:
            conn = tx.session.connection()
            tables = set(inspect(conn).get_table_names())
            if "schema_info" in tables:
                row = tx.session.get(SchemaInfo, "schema_version")
                found = None if row is None else row.value
                version = int(found) if found is not None and found.isdigit() else None
                if version != SCHEMA_VERSION and (version is None or version > SCHEMA_VERSION
                                                  or any(v not in UPGRADES for v in range(version, SCHEMA_VERSION))):
                    raise SchemaVersionError(
                        f"catalog {self.where} has schema version {found}, this cachecraft needs "
                        f"{SCHEMA_VERSION}; use the cachecraft version that wrote it, or move the "
                        "cache directory aside")
                for step in range(version, SCHEMA_VERSION):  # all or nothing: one transaction
                    UPGRADES[step](conn)
                    self.upgraded_from = self.upgraded_from or step
                row.value = str(SCHEMA_VERSION)
                missing = set(Base.metadata.tables) - set(inspect(conn).get_table_names())
                if missing:
                    raise SchemaVersionError(f"catalog {self.where} lacks tables {sorted(missing)}; "
                                             "move the cache directory aside")
            elif tables:
                raise SchemaVersionError(f"{self.where} is not a cachecraft catalog (tables "
                                         f"{sorted(tables)}); move it aside or pick another cache directory")
            else:
                Base.metadata.create_all(conn)
                self.created = True
                from cachecraft import __version__
                tx.session.add_all([SchemaInfo(key="schema_version", value=str(SCHEMA_VERSION)),
                                    SchemaInfo(key="created_by", value=f"cachecraft {__version__}")])

    @contextmanager
    def write(self, *, exclusive: bool = True) -> Iterator[CatalogTx]:
        """One write transaction (``BEGIN IMMEDIATE``); commits on success, rolls back on error.

        On PostgreSQL the transaction first takes the writers' advisory lock; with
        ``exclusive=False`` it does not (for statements that are atomic on their own, such
        as :meth:`CatalogTx.touch`). SQLite always takes its write lock.
        """
        busy = self.busy
        if busy is not None and not busy.due():  # still locked, most likely: fail at once
            raise CatalogBusyError(busy.message)
        # a retry of a held lock waits briefly for it (the timeout was paid once already)
        engine = self._engine if busy is None else self._engine.execution_options(cachecraft_wait_ms=RETRY_WAIT_MS)
        with self._translated(self._write_within):
            with Session(engine, expire_on_commit=False) as session, session.begin():
                conn = session.connection()  # BEGIN IMMEDIATE now: the write lock is held for the whole block
                if self.dialect == "postgresql":
                    if busy is not None:
                        conn.execute(text(f"SET LOCAL lock_timeout = {RETRY_WAIT_MS}"))
                    if exclusive:
                        conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": WRITE_LOCK_ID})
                yield CatalogTx(session)
        if busy is not None:
            self.busy = None
            log.warning("catalog at %s is writable again after %.0f s", self.where, time.monotonic() - busy.since)

    @contextmanager
    def read(self) -> Iterator[CatalogTx]:
        """One read transaction over a consistent snapshot."""
        with self._translated(self._read_within):
            with Session(self._read_engine) as session, session.begin():
                yield CatalogTx(session)

    @contextmanager
    def _translated(self, within_s: float) -> Iterator[None]:
        outage = self.outage
        if outage is not None and not outage.due():  # lost: fail at once until the next retry
            raise CatalogUnavailableError(outage.message)
        answer_within = _ANSWER_WITHIN.set(within_s)
        try:
            yield
        except (sa_exc.DBAPIError, sqlite3.Error) as exc:
            mapped = (translate_error(exc, self.path) if self.url is None
                      else translate_server_error(exc, self.url))
            if mapped is None:
                raise
            # a collision or a held lock loses its write as an outage does, but the server answered
            lost = (isinstance(mapped, CatalogUnavailableError)
                    and not isinstance(mapped, (CatalogCollisionError, CatalogBusyError)))
            if lost and self.opened:
                self._lost(mapped)
            elif isinstance(mapped, CatalogBusyError) and self.opened:
                self._locked(mapped)
            raise mapped from exc
        finally:
            _ANSWER_WITHIN.reset(answer_within)
        if outage is not None:
            self.outage = None
            log.warning("catalog at %s is reachable again after %.0f s", self.where, time.monotonic() - outage.since)

    @property
    def opened(self) -> bool:
        """Whether the schema was checked (a loss after that is an outage, not a failed open)."""
        return getattr(self, "_opened", False)

    def _lost(self, error: CatalogUnavailableError) -> None:
        self.outage = _failed_again(self.outage, error, "answering without it")

    def _locked(self, error: CatalogBusyError) -> None:
        self.busy = _failed_again(self.busy, error, "going on without writing it")

    @property
    def why_unwritten(self) -> str:
        """Why writes are failing now, for messages: "is locked by another process" while
        its write lock is held past the timeout, "is away" while its server is lost, and
        "could not take them" otherwise (a collision, a full disk)."""
        if self.busy is not None:
            return "is locked by another process"
        if self.outage is not None:
            return "is away"
        return "could not take them"

    def available(self) -> bool:
        """Whether the catalog answers now (after an outage, tried again only when a retry is due)."""
        try:
            with self.read() as tx:
                tx.session.execute(text("SELECT 1"))
        except CatalogUnavailableError:
            return False
        return True

    def integrity_problems(self) -> list[str]:
        """SQLite's own ``PRAGMA integrity_check`` findings (empty when sound; PostgreSQL
        keeps its own integrity, so always empty there)."""
        if self.dialect != "sqlite":
            return []
        with self.read() as tx:
            rows = [r[0] for r in tx.session.connection().exec_driver_sql("PRAGMA integrity_check")]
        return [] if rows == ["ok"] else rows

    # one-shot conveniences for the pipeline and the CLI ------------------------------

    def record_request(self, rec: RequestRecord) -> int:
        """Store a request and its per-chunk decisions; returns the request id."""
        with self.write() as tx:
            return tx.add_request(rec)

    def last_request_id(self) -> int | None:
        """Id of the newest stored request, or None when there is none."""
        with self.read() as tx:
            ids = tx.request_ids(limit=1)
        return ids[0] if ids else None

    def get_request(self, request_id: int) -> RequestRecord | None:
        """A stored request (for ``cachecraft explain``), or None."""
        with self.read() as tx:
            return tx.request(request_id)

    def order_history(self, chunk_keys: Sequence[str], limit: int) -> list[dict]:
        """The recorded policies of the newest ``limit`` requests of exactly ``chunk_keys``
        in this order, newest first (see :meth:`CatalogTx.order_history`)."""
        with self.read() as tx:
            return tx.order_history(chunk_keys, limit)

    def profile(self, fingerprint: str, device: str, kind: str) -> dict | None:
        """A stored model profile (see :meth:`CatalogTx.profile`), or None."""
        with self.read() as tx:
            return tx.profile(fingerprint, device, kind)

    def save_profile(self, fingerprint: str, device: str, kind: str, value: dict) -> None:
        """Store (or replace) a model profile."""
        with self.write() as tx:
            tx.set_profile(fingerprint, device, kind, value)

    def upsert_chunk(self, rec: ChunkRecord) -> None:
        """Insert a chunk or fill in its source/preview."""
        with self.write() as tx:
            tx.upsert_chunk(rec)

    def chunk(self, key: str) -> ChunkRecord | None:
        """A chunk by key, or None."""
        with self.read() as tx:
            return tx.chunk(key)

    def variants(self, chunk_key: str) -> list[VariantRecord]:
        """Every variant recorded for a chunk (evicted ones have ``tier`` None)."""
        with self.read() as tx:
            return tx.variants(chunk_key)

    def events(self, **filters) -> list[TierEventRecord]:
        """Tier events (see :meth:`CatalogTx.events` for filters)."""
        with self.read() as tx:
            return tx.events(**filters)

    def close(self) -> None:
        """Close every pooled connection."""
        self._engine.dispose()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

