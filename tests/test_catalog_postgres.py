"""The catalog on a real, throw-away PostgreSQL (``catalog_url``): the same models and
behaviour as on SQLite, atomic counters under concurrency, the schema-version check, and
a one-line error naming ``catalog_url`` when the server cannot be reached."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import create_engine, text

psycopg = pytest.importorskip("psycopg", reason="psycopg not installed (pip install cachecraft[shared])")

from cachecraft.catalog import (Catalog, CatalogError, CatalogUnavailableError, ChunkRecord,
                                SchemaVersionError, VariantRecord, catalog_path)
from cachecraft.config import Config, ConfigError
from cachecraft.store import TieredStore
from tests.servers import free_port, pg_url, postgres  # noqa: F401  (fixtures)
from tests.store_helpers import make_kv, same_kv
# the SQLite catalog's behavioural tests, run again against PostgreSQL (the `catalog`
# fixture below replaces theirs)
from tests.test_catalog import (add_variant,  # noqa: F401
                                test_asks_count_from_the_order_history_since_the_order_was_last_kept_exact,
                                test_chunks_variants_entries_and_tiers,
                                test_event_pruning_keeps_the_newest,
                                test_failed_transaction_rolls_back_whole,
                                test_order_history_holds_the_requests_of_exactly_these_chunks_in_this_order_newest_first,
                                test_request_round_trip_for_explain,
                                test_statistics_match_hand_computed_values,
                                test_statistics_on_an_empty_catalog,
                                test_stored_variants_are_those_some_tier_holds)


@pytest.fixture
def catalog(tmp_path, pg_url):  # noqa: F811
    cat = Catalog(tmp_path, url=pg_url)
    yield cat
    cat.close()


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def test_creates_the_tables_and_schema_version_in_postgres(tmp_path, catalog, pg_url):  # noqa: F811
    assert catalog.dialect == "postgresql" and catalog.created and catalog.shared
    assert not catalog_path(tmp_path).exists()  # no SQLite file next to it
    with psycopg.connect(_plain(pg_url)) as conn:
        version = conn.execute("SELECT value FROM schema_info WHERE key='schema_version'").fetchone()[0]
        tables = {r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname='public'")}
        nbytes_type = conn.execute("SELECT data_type FROM information_schema.columns WHERE "
                                   "table_name='variants' AND column_name='nbytes'").fetchone()[0]
    assert version == "3" and nbytes_type == "bigint"
    assert {"chunks", "variants", "entries", "requests", "request_chunks", "tier_events"} <= tables
    again = Catalog(tmp_path, url=_plain(pg_url))  # reopening is fine and creates nothing; plain
    assert not again.created                       # postgresql:// also means psycopg 3
    again.close()


def test_its_connections_give_up_on_a_host_that_stops_acknowledging(catalog):
    """The socket libpq opened carries the TCP user timeout and keepalives, so a server host
    that dies or drops off the network fails a request in seconds (the kernel's own
    retransmissions would hold it for many minutes)."""
    import socket

    from cachecraft.catalog import db

    with catalog.read() as tx:
        raw = tx.session.connection().connection.dbapi_connection
        sock = socket.fromfd(raw.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM)  # a duplicate
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == db.TCP_USER_TIMEOUT_MS == 15_000
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert [sock.getsockopt(socket.IPPROTO_TCP, opt) for opt in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL,
                                                                     socket.TCP_KEEPCNT)] == [10, 5, 3]
    finally:
        sock.close()


def test_byte_counts_past_two_gib(catalog):
    add_variant(catalog, "big", "c1", nbytes=5 * 2**30)
    with catalog.read() as tx:
        assert tx.tier_bytes("disk") == 5 * 2**30


def test_incompatible_schema_version_is_refused(tmp_path, pg_url):  # noqa: F811
    Catalog(tmp_path, url=pg_url).close()
    with psycopg.connect(_plain(pg_url)) as conn:
        conn.execute("UPDATE schema_info SET value='999' WHERE key='schema_version'")
    with pytest.raises(SchemaVersionError, match="schema version 999.*needs 3"):
        Catalog(tmp_path, url=pg_url)


def test_foreign_database_is_refused(tmp_path, pg_url):  # noqa: F811
    with psycopg.connect(_plain(pg_url)) as conn:
        conn.execute("CREATE TABLE stuff (x int)")
    with pytest.raises(SchemaVersionError, match="not a cachecraft catalog"):
        Catalog(tmp_path, url=pg_url)


def test_unreachable_server_is_one_line_naming_catalog_url(tmp_path):
    url = f"postgresql+psycopg://me:secret@127.0.0.1:{free_port()}/nothing"
    with pytest.raises(CatalogUnavailableError) as info:
        Catalog(tmp_path, url=url)
    message = str(info.value)
    assert "catalog_url" in message and "\n" not in message and "secret" not in message
    with pytest.raises(CatalogError, match="not supported"):
        Catalog(tmp_path, url="mysql://x@localhost/db")


def test_concurrent_hit_counters_lose_no_update(tmp_path, pg_url):  # noqa: F811
    """Eight 'nodes' (own engines) count hits at once, outside the writers' lock."""
    with Catalog(tmp_path, url=pg_url) as cat:
        add_variant(cat, "v1", "c1")
    nodes, touches = 8, 25
    barrier = threading.Barrier(nodes)
    errors: list[BaseException] = []

    def node() -> None:
        try:
            with Catalog(tmp_path, url=pg_url) as mine:
                barrier.wait(timeout=120)  # a failed sibling must not leave the rest waiting
                for _ in range(touches):
                    with mine.write(exclusive=False) as tx:
                        tx.touch("v1")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=node, daemon=True) for _ in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors and not any(t.is_alive() for t in threads)
    with Catalog(tmp_path, url=pg_url) as cat:
        assert cat.variants("c1")[0].hits == nodes * touches


def test_concurrent_writers_queue_instead_of_racing(tmp_path, pg_url):  # noqa: F811
    """Read-then-insert (upsert) of the same rows from several nodes: no duplicate-key errors."""
    Catalog(tmp_path, url=pg_url).close()
    errors: list[BaseException] = []

    def node(i: int) -> None:
        try:
            with Catalog(tmp_path, url=pg_url) as mine:
                for j in range(10):
                    with mine.write() as tx:
                        tx.upsert_chunk(ChunkRecord(f"c{j}", "fp", 3, source=f"node{i}"))
                        tx.upsert_variant(VariantRecord(f"v{j}", f"c{j}", (), 10, "float16"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with Catalog(tmp_path, url=pg_url) as cat, cat.read() as tx:
        assert tx.counts()["chunks"] == 10 and tx.counts()["variants"] == 10


def test_store_on_a_postgres_catalog_round_trips_bit_identical(tmp_path, pg_url):  # noqa: F811
    cfg = Config(cache_dir=tmp_path / "cache", catalog_url=pg_url)
    kv = make_kv(1)
    with TieredStore(cfg, tiers=("cpu", "disk")) as store:
        assert store.put(kv) == "cpu"
        assert store.catalog.dialect == "postgresql"
    assert not catalog_path(cfg.cache_dir).exists()
    with TieredStore(cfg, tiers=("cpu", "disk")) as store:  # closed: persisted to disk
        got = store.get(kv.variant)
        assert got is not None and same_kv(got, kv, store.stored_dtype)
        assert store.info(kv.variant).hits == 1
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM entries WHERE tier='disk'")).scalar() == 1
    engine.dispose()


def test_catalog_url_is_validated_and_its_password_hidden(tmp_path):
    with pytest.raises(ConfigError, match="catalog_url"):
        Config(cache_dir=tmp_path, catalog_url="sqlite:///x.db")
    cfg = Config(cache_dir=tmp_path, catalog_url="postgresql+psycopg://u:pw@h:5432/d")
    assert cfg.to_dict()["catalog_url"] == "postgresql+psycopg://u:***@h:5432/d"
    assert "catalog_url" not in cfg.settings_changed()


def test_cli_stats_and_verify_read_the_postgres_catalog(cache_dir, pg_url, monkeypatch):  # noqa: F811
    from typer.testing import CliRunner

    from cli.app import app
    monkeypatch.setenv("CACHECRAFT_CATALOG_URL", pg_url)
    with Catalog(cache_dir, url=pg_url) as cat:
        add_variant(cat, "v1", "c1", hits=3)
    runner = CliRunner()
    result = runner.invoke(app, ["stats", "--json"])
    assert result.exit_code == 0, result.output
    assert '"variants": 1' in result.output
    result = runner.invoke(app, ["verify", "--json"])
    assert result.exit_code == 0, result.output
    assert '"variants": 1' in result.output and '"consistent": true' in result.output
    assert not catalog_path(cache_dir).exists()


def test_cli_with_an_unreachable_catalog_is_one_line(cache_dir, monkeypatch):
    from typer.testing import CliRunner

    from cli.app import app
    monkeypatch.setenv("CACHECRAFT_CATALOG_URL", f"postgresql+psycopg://u:pw@127.0.0.1:{free_port()}/db")
    result = CliRunner().invoke(app, ["stats"])
    assert result.exit_code == 1 and "catalog_url" in result.output
    assert "Traceback" not in result.output and "pw@" not in result.output


def test_several_cache_directories_share_one_database_each_owning_its_disk_rows(tmp_path, pg_url):  # noqa: F811
    """Two nodes (cache directories) on one catalog: each keeps its own disk rows (never
    taken for the other's lost bytes), and each sees the other's variants and requests."""
    first, second = make_kv(1), make_kv(2)
    a = Config(cache_dir=tmp_path / "a", catalog_url=pg_url)
    b = Config(cache_dir=tmp_path / "b", catalog_url=pg_url)
    with TieredStore(a, tiers=("disk",)) as store:
        store.put(first)
        node_a = store.node
    with TieredStore(b, tiers=("disk",)) as store:  # opening reconciles: a's rows must survive
        node_b = store.node
        assert node_b != node_a and node_b
        assert store.locate(first.variant) is None  # a's disk is not b's to read ...
        assert [v.key for v in store.catalog.variants(first.chunk)] == [first.variant]  # ... but b sees it
        store.put(second)
        with store.catalog.read() as tx:
            assert set(tx.nodes()) == {node_a, node_b}
            assert {(e.variant_key, e.owner, e.node) for e in tx.entries(tier="disk")} == {
                (first.variant, node_a, node_a), (second.variant, node_b, node_b)}
    with TieredStore(a, tiers=("disk",)) as store:  # a is intact and still does not hold b's
        assert store.node == node_a
        assert same_kv(store.get(first.variant), first, store.stored_dtype)
        assert store.locate(second.variant) is None
        assert store.keys("disk") == [first.variant]
    assert (tmp_path / "a" / "store" / "node-id").read_text().strip() == node_a


def test_a_node_joining_with_a_filled_disk_tier_records_its_blobs(tmp_path, pg_url):  # noqa: F811
    """A cache directory used with its own SQLite catalog, then pointed at a shared one:
    its disk tier's blobs are recorded under its node, not deleted as orphans."""
    kv = make_kv(3)
    local = Config(cache_dir=tmp_path / "c")
    with TieredStore(local, tiers=("disk",)) as store:
        store.put(kv)
    with TieredStore(Config(cache_dir=tmp_path / "c", catalog_url=pg_url), tiers=("disk",)) as store:
        assert store.locate(kv.variant) == "disk"
        assert same_kv(store.get(kv.variant), kv, store.stored_dtype)
        with store.catalog.read() as tx:
            assert [(e.owner, e.node) for e in tx.entries(tier="disk")] == [(store.node, store.node)]


def test_a_schema_1_server_catalog_hands_its_disk_rows_to_its_node(tmp_path, pg_url):  # noqa: F811
    """Schema 1 let one cache directory use a server catalog (``disk_tier_id``, disk rows
    owned by ""); the upgrade makes them that node's, and the directory keeps its id."""
    kv = make_kv(4)
    cfg = Config(cache_dir=tmp_path / "d", catalog_url=pg_url)
    with TieredStore(cfg, tiers=("disk",)) as store:
        store.put(kv)
        node = store.node
    root = tmp_path / "d" / "store"
    (root / "node-id").rename(root / "catalog-id")  # as schema 1 left it
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE entries DROP COLUMN node"))
        conn.execute(text("ALTER TABLE requests DROP COLUMN uid"))  # its index goes with it
        conn.execute(text("ALTER TABLE requests DROP COLUMN hits_redis"))
        conn.execute(text("ALTER TABLE requests DROP COLUMN node"))
        conn.execute(text("ALTER TABLE requests DROP COLUMN num_tokens"))
        conn.execute(text("ALTER TABLE requests DROP COLUMN policy"))
        conn.execute(text("DROP TABLE model_profiles"))
        conn.execute(text("UPDATE entries SET owner = ''"))
        conn.execute(text("DELETE FROM schema_info WHERE key LIKE 'node:%'"))
        conn.execute(text("INSERT INTO schema_info (key, value) VALUES ('disk_tier_id', :n)"), {"n": node})
        conn.execute(text("UPDATE schema_info SET value = '1' WHERE key = 'schema_version'"))
    engine.dispose()
    with TieredStore(cfg, tiers=("disk",)) as store:
        assert store.catalog.upgraded_from == 1 and store.node == node
        assert same_kv(store.get(kv.variant), kv, store.stored_dtype)
        with store.catalog.read() as tx:
            assert [(e.owner, e.node) for e in tx.entries(tier="disk")] == [(node, node)]
            assert tx.info_value("disk_tier_id") is None and node in tx.nodes()
    assert (root / "node-id").read_text().strip() == node and not (root / "catalog-id").exists()
