"""SQLAlchemy ORM models of the catalog (SQLite, WAL mode, ``<cache_dir>/catalog.sqlite``;
or PostgreSQL from ``catalog_url``: the same tables).

Schema changes live here and only here, with :data:`SCHEMA_VERSION`: the catalog
creates these tables in an empty database, brings an older one up to date with the
steps of :data:`UPGRADES` (one per version, run in one transaction) and refuses one of
a newer or unknown version.

These classes are internal to :mod:`cachecraft.catalog`; what crosses the package
boundary are the frozen records in :mod:`cachecraft.catalog.records`.

Tables:

- ``schema_info``: key/value pairs, ``schema_version`` among them;
- ``chunks``: one row per chunk (token ids under one model fingerprint);
- ``variants``: one row per variant (a chunk computed after an ordered prefix), with
  its statistics, size, fastest live tier, hits and last use; kept after eviction
  (``tier`` NULL) so that history and statistics survive;
- ``entries``: where the bytes of a variant live: one row per (variant, tier, owner),
  with the ``node`` (cache directory) that holds them. A disk tier belongs to one node
  and is shared by its processes (``owner`` = the node's id, ``""`` in the embedded
  SQLite catalog, which one cache directory owns); GPU/CPU entries belong to one process
  (``owner`` = that store's id) and vanish with it. Several nodes share one catalog
  (``catalog_url``), each seeing the others' variants and statistics;
- ``requests`` and ``request_chunks``: what each request did, chunk by chunk;
- ``tier_events``: puts, promotions, demotions, evictions, deletions, damaged or
  lost entries;
- ``model_profiles``: what was measured or fitted for one model (fingerprint) on one
  device, by kind: the prefill cost model, the calibrated policy parameters.
"""

from __future__ import annotations

from typing import Callable

from sqlalchemy import BigInteger, Connection, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 3

# Byte counts may pass 2**31 in PostgreSQL; SQLite's INTEGER is already 64-bit (and its
# DDL for these columns stays plain INTEGER).
Bytes = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    """Declarative base of the catalog models."""


class SchemaInfo(Base):
    """Key/value facts about the database; ``schema_version`` among them."""

    __tablename__ = "schema_info"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Chunk(Base):
    """A chunk: token ids under one model fingerprint."""

    __tablename__ = "chunks"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(Text, index=True)
    num_tokens: Mapped[int] = mapped_column(Integer)
    source: Mapped[str | None] = mapped_column(Text, nullable=True)
    preview: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class Variant(Base):
    """A chunk computed after one ordered prefix; kept after eviction (``tier`` NULL)."""

    __tablename__ = "variants"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    chunk_key: Mapped[str] = mapped_column(ForeignKey("chunks.key"), index=True)
    prefix: Mapped[str] = mapped_column(Text)  # JSON list of segment keys, in order
    prefix_len: Mapped[int] = mapped_column(Integer)
    nbytes: Mapped[int] = mapped_column(Bytes)
    dtype: Mapped[str] = mapped_column(String(16))
    cci: Mapped[float | None] = mapped_column(Float, nullable=True)
    stats: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON object of floats
    cost_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    quality: Mapped[float | None] = mapped_column(Float, nullable=True)
    tier: Mapped[str | None] = mapped_column(String(8), nullable=True, index=True)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    last_used: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class Entry(Base):
    """Where a variant's bytes live: one (variant, tier, owner) placement."""

    __tablename__ = "entries"
    __table_args__ = (UniqueConstraint("variant_key", "tier", "owner"),
                      Index("ix_entries_tier_owner", "tier", "owner"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    variant_key: Mapped[str] = mapped_column(ForeignKey("variants.key"), index=True)
    tier: Mapped[str] = mapped_column(String(8))
    owner: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(Bytes)
    blob: Mapped[str | None] = mapped_column(Text, nullable=True)  # disk tier: diskcache key
    checksum: Mapped[str | None] = mapped_column(String(64), nullable=True)
    stored_at: Mapped[float] = mapped_column(Float)
    node: Mapped[str] = mapped_column(String(64), default="", server_default="")  # schema 2


class Request(Base):
    """One request: method, hits per tier, misses, recompute fraction, timings."""

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    question_hash: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(32))
    num_chunks: Mapped[int] = mapped_column(Integer)
    hits_gpu: Mapped[int] = mapped_column(Integer, default=0)
    hits_cpu: Mapped[int] = mapped_column(Integer, default=0)
    hits_disk: Mapped[int] = mapped_column(Integer, default=0)
    hits_redis: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # schema 2
    misses: Mapped[int] = mapped_column(Integer, default=0)
    recompute_fraction: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    full_prefill_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    num_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)  # prompt tokens (schema 2)
    policy: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: the policy's settings (schema 2)
    node: Mapped[str] = mapped_column(String(64), default="", server_default="")  # who answered (schema 2)
    # names the request across retries of its write (schema 3): see RequestRecord.uid
    uid: Mapped[str | None] = mapped_column(String(32), nullable=True, unique=True, index=True)


class RequestChunkRow(Base):
    """One chunk position of a request and the policy's decision for it."""

    __tablename__ = "request_chunks"

    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    chunk_key: Mapped[str] = mapped_column(String(64), index=True)
    variant_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    tier: Mapped[str] = mapped_column(String(8))  # gpu | cpu | disk | miss
    cci: Mapped[float | None] = mapped_column(Float, nullable=True)
    beta_prime: Mapped[float | None] = mapped_column(Float, nullable=True)
    cfo: Mapped[float | None] = mapped_column(Float, nullable=True)
    fraction: Mapped[float | None] = mapped_column(Float, nullable=True)
    stop_layer: Mapped[int | None] = mapped_column(Integer, nullable=True)


class TierEvent(Base):
    """A put, promotion, demotion, eviction, deletion, or a damaged or lost entry."""

    __tablename__ = "tier_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float)
    variant_key: Mapped[str] = mapped_column(String(64), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    from_tier: Mapped[str | None] = mapped_column(String(8), nullable=True)
    to_tier: Mapped[str | None] = mapped_column(String(8), nullable=True)
    nbytes: Mapped[int] = mapped_column(Bytes)
    owner: Mapped[str] = mapped_column(String(64))


class ModelProfile(Base):
    """What was measured or fitted for one model on one device: a JSON document per kind
    (``cost_model``: the prefill cost; ``policy``: parameters fitted by ``calibrate``)."""

    __tablename__ = "model_profiles"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    device: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[str] = mapped_column(Text)  # JSON object
    updated_at: Mapped[float] = mapped_column(Float)


NODE_PREFIX = "node:"
"""``schema_info`` keys of the nodes that joined a shared catalog: ``node:<id>``."""


def _upgrade_1_to_2(conn: Connection) -> None:
    """Schema 2: ``model_profiles``; the prompt's token count, the policy's settings, shared-tier
    hits and the answering node on ``requests``; the node of every entry.

    A schema-1 server catalog served one cache directory, recorded as ``disk_tier_id``; its
    disk rows (owner ``""``) become that node's."""
    ModelProfile.__table__.create(conn)
    conn.exec_driver_sql("ALTER TABLE requests ADD COLUMN num_tokens INTEGER")
    conn.exec_driver_sql("ALTER TABLE requests ADD COLUMN policy TEXT")
    conn.exec_driver_sql("ALTER TABLE requests ADD COLUMN hits_redis INTEGER NOT NULL DEFAULT 0")
    conn.exec_driver_sql("ALTER TABLE requests ADD COLUMN node VARCHAR(64) NOT NULL DEFAULT ''")
    conn.exec_driver_sql("ALTER TABLE entries ADD COLUMN node VARCHAR(64) NOT NULL DEFAULT ''")
    node = conn.execute(text("SELECT value FROM schema_info WHERE key = 'disk_tier_id'")).scalar()
    if node:
        conn.execute(text("UPDATE entries SET node = :n"), {"n": node})
        conn.execute(text("UPDATE entries SET owner = :n WHERE tier = 'disk' AND owner = ''"), {"n": node})
        conn.execute(text("DELETE FROM schema_info WHERE key = 'disk_tier_id'"))
        conn.execute(text("INSERT INTO schema_info (key, value) VALUES (:k, '{}')"), {"k": NODE_PREFIX + node})


def _upgrade_2_to_3(conn: Connection) -> None:
    """Schema 3: each request's ``uid``, unique, so that a write retried after its answer
    was lost records the request once (rows of earlier versions have none)."""
    conn.exec_driver_sql("ALTER TABLE requests ADD COLUMN uid VARCHAR(32)")
    conn.exec_driver_sql("CREATE UNIQUE INDEX ix_requests_uid ON requests (uid)")


# version -> the step that brings a catalog of that version to the next one
UPGRADES: dict[int, Callable[[Connection], None]] = {1: _upgrade_1_to_2, 2: _upgrade_2_to_3}
