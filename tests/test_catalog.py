"""Catalog: schema, WAL, transactions, records, version and damage errors, statistics."""

from __future__ import annotations

import json
import sqlite3

import pytest

from cachecraft.catalog import (Catalog, CatalogCorruptError, CatalogWriteError, ChunkRecord,
                                EntryRecord, RequestChunk, RequestRecord, SchemaVersionError,
                                SCHEMA_VERSION, VariantRecord, catalog_path, question_hash, remove_catalog)
from cachecraft.catalog import stats
from cachecraft.policy.rules import exact_wait


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog(tmp_path)
    yield cat
    cat.close()


def add_variant(cat: Catalog, key: str, chunk: str, *, tier: str | None = "disk", owner: str = "",
                hits: int = 0, nbytes: int = 100) -> None:
    with cat.write() as tx:
        tx.upsert_chunk(ChunkRecord(chunk, "fp", 10, f"doc-{chunk}", f"text of {chunk}"))
        tx.upsert_variant(VariantRecord(key, chunk, ("sys", chunk), nbytes, "float16", cci=0.4))
        if tier is not None:
            tx.add_entry(EntryRecord(key, tier, owner, nbytes, blob=f"{key}.b" if tier == "disk" else None))
        for _ in range(hits):
            tx.touch(key)


def test_creates_wal_database_with_schema_version(tmp_path, catalog):
    assert catalog_path(tmp_path).is_file()
    con = sqlite3.connect(catalog_path(tmp_path))
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        version = con.execute("SELECT value FROM schema_info WHERE key='schema_version'").fetchone()[0]
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()
    assert version == "3"
    assert {"chunks", "variants", "entries", "requests", "request_chunks", "tier_events"} <= tables
    Catalog(tmp_path).close()  # reopening an existing catalog is fine


def test_write_transactions_take_the_write_lock_at_begin(tmp_path, catalog):
    other = sqlite3.connect(catalog_path(tmp_path), timeout=0, isolation_level=None)
    try:
        with catalog.write():
            # nothing written yet, but BEGIN IMMEDIATE already holds the write lock
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        with catalog.read():  # reads do not block writers
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
    finally:
        other.close()


def test_failed_transaction_rolls_back_whole(catalog):
    with pytest.raises(RuntimeError):
        with catalog.write() as tx:
            tx.upsert_chunk(ChunkRecord("c1", "fp", 3))
            raise RuntimeError("boom")
    assert catalog.chunk("c1") is None


def test_chunks_variants_entries_and_tiers(catalog):
    add_variant(catalog, "v1", "c1", tier="cpu", owner="me", hits=2)
    add_variant(catalog, "v2", "c1", tier="disk")
    add_variant(catalog, "v3", "c1", tier="gpu", owner="other")
    assert catalog.chunk("c1") == ChunkRecord("c1", "fp", 10, "doc-c1", "text of c1",
                                              catalog.chunk("c1").created_at)
    variants = {v.key: v for v in catalog.variants("c1")}
    assert variants["v1"].hits == 2 and variants["v1"].tier == "cpu" and variants["v1"].cci == 0.4
    assert variants["v1"].prefix == ("sys", "c1")
    with catalog.read() as tx:
        mine = {v.key: v.tier for v in tx.available_variants("c1", "me")}
        assert mine == {"v1": "cpu", "v2": "disk"}  # v3 lives in another process's GPU
        assert tx.tier_bytes("disk") == 100 and tx.tier_bytes("cpu", "me") == 100
        assert tx.memory_owners() == {"me", "other"}
    with catalog.write() as tx:
        tx.add_entry(EntryRecord("v2", "cpu", "me", 100))
        assert tx.refresh_tier("v2") == "cpu"
        assert tx.remove_entry("v2", "disk", blob="not-this-blob") is None
        assert tx.remove_entry("v2", "disk", blob="v2.b").blob == "v2.b"
        removed = tx.remove_owner("me")
    assert {r.variant_key for r in removed} == {"v1", "v2"}
    tiers = {v.key: v.tier for v in catalog.variants("c1")}
    assert tiers == {"v1": None, "v2": None, "v3": "gpu"}  # history kept, tier cleared
    assert [e.kind for e in catalog.events(kind="lost")] == ["lost", "lost"]


def test_available_variants_of_many_chunks_in_one_query_match_one_chunk_at_a_time(catalog, monkeypatch):
    add_variant(catalog, "v1", "c1", tier="cpu", owner="me")
    add_variant(catalog, "v2", "c1", tier="disk")
    add_variant(catalog, "v4", "c2", tier="disk")
    add_variant(catalog, "v3", "c1", tier="gpu", owner="other")  # not readable by "me"
    add_variant(catalog, "v5", "c3", tier=None)  # recorded, never stored
    monkeypatch.setattr("cachecraft.catalog.db._IN_BATCH", 2)  # c1, c2 in one query; c3, c9 in another
    with catalog.read() as tx:
        many = tx.available_variants_of(["c1", "c2", "c3", "c9", "c1"], "me")
        one = {c: tx.available_variants(c, "me") for c in ("c1", "c2", "c3", "c9")}
    assert list(many) == ["c1", "c2", "c3", "c9"]  # asked once each, in order
    assert {c: [(r.key, r.tier) for r in rs] for c, rs in many.items()} == {
        "c1": [("v1", "cpu"), ("v2", "disk")], "c2": [("v4", "disk")], "c3": [], "c9": []}
    assert many == one


def test_stored_variants_are_those_some_tier_holds(catalog, monkeypatch):
    add_variant(catalog, "v2", "c1", tier="disk")
    add_variant(catalog, "v1", "c1", tier="cpu", owner="other-process")
    add_variant(catalog, "v3", "c2", tier=None)  # recorded, never stored
    add_variant(catalog, "v0", "c4", tier="disk")
    monkeypatch.setattr("cachecraft.catalog.db._IN_BATCH", 1)  # one query per chunk asked
    with catalog.read() as tx:
        assert [v.key for v in tx.stored_variants()] == ["v0", "v1", "v2"]
        assert [v.key for v in tx.stored_variants(["c4", "c1", "c2", "c9"])] == ["v0", "v1", "v2"]
        assert [v.key for v in tx.stored_variants(["c1"])] == ["v1", "v2"]
        assert tx.stored_variants([]) == []
    with catalog.write() as tx:
        tx.remove_entry("v0", "disk")
    with catalog.write() as tx:
        tx.remove_entry("v2", "disk")
    with catalog.read() as tx:
        assert [v.key for v in tx.stored_variants()] == ["v1"]


def test_remove_catalog_deletes_the_database_and_its_side_files(tmp_path):
    with Catalog(tmp_path) as cat:
        add_variant(cat, "v1", "c1")
    assert catalog_path(tmp_path).exists()
    (tmp_path / "catalog.sqlite-wal").touch()  # as a process killed mid-write leaves it
    (tmp_path / "keep.txt").write_text("not the catalog's")
    removed = remove_catalog(tmp_path)
    assert catalog_path(tmp_path) in removed and tmp_path / "catalog.sqlite-wal" in removed
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    assert remove_catalog(tmp_path) == [] and remove_catalog(tmp_path / "missing") == []


def test_request_round_trip_for_explain(catalog):
    rec = RequestRecord(question_hash("who?"), "cachecraft", (
        RequestChunk(0, "c1", "v1", "cpu", cci=0.3, beta_prime=0.8, cfo=0.06, fraction=0.1, stop_layer=12),
        RequestChunk(1, "c2"),
        RequestChunk(2, "c3", "v9", "disk", fraction=0.0)), recompute_fraction=0.05, ttft_s=0.5,
        full_prefill_s=2.0, created_at=123.0)
    assert catalog.last_request_id() is None
    rid = catalog.record_request(rec)
    assert catalog.last_request_id() == rid
    got = catalog.get_request(rid)
    assert got == RequestRecord(**{**rec.__dict__, "id": rid})
    assert got.hits_by_tier == {"gpu": 0, "cpu": 1, "disk": 1, "redis": 0} and got.misses == 1
    assert catalog.get_request(rid + 1) is None
    with pytest.raises(AssertionError):
        RequestChunk(0, "c1", None, "cpu")  # a hit must name its variant


def test_a_request_written_twice_is_recorded_once(catalog):
    """A retry of a write whose commit went through (its answer lost) finds the row by
    ``uid``; a request that merely looks the same is another row."""
    rec = RequestRecord("q", "full", (RequestChunk(0, "c1"),), 1.0, 2.0, 2.0, created_at=5.0)
    first = catalog.record_request(rec)
    assert catalog.record_request(rec) == first
    twin = catalog.record_request(RequestRecord(**{**rec.__dict__, "uid": RequestRecord("q", "full").uid}))
    assert twin != first
    older = [catalog.record_request(RequestRecord(**{**rec.__dict__, "uid": None})) for _ in range(2)]
    assert len(set(older)) == 2  # rows of versions before uid: nothing to tell them apart by
    with catalog.read() as tx:
        assert sorted(tx.request_ids()) == sorted([first, twin, *older])
        assert tx.request(first).uid == rec.uid and tx.request(older[0]).uid is None


def test_order_history_holds_the_requests_of_exactly_these_chunks_in_this_order_newest_first(catalog):
    orders = (["a", "b", "c"], ["a", "b", "c"], ["b", "a", "c"], ["a", "b"], ["a", "b", "c", "d"], ["a", "b", "c"])
    for n, keys in enumerate(orders):
        catalog.record_request(RequestRecord("q", "cachecraft", tuple(RequestChunk(i, k) for i, k in enumerate(keys)),
                                             0.1, 1.0, 2.0, policy=None if n == 0 else {"n": n}))
    # the first request was recorded without a policy: an empty one
    assert catalog.order_history(["a", "b", "c"], limit=10) == [{"n": 5}, {"n": 1}, {}]
    assert catalog.order_history(["a", "b", "c"], limit=2) == [{"n": 5}, {"n": 1}]  # the newest, up to the limit
    assert catalog.order_history(["b", "a", "c"], limit=10) == [{"n": 2}]
    assert catalog.order_history(["a", "b"], limit=10) == [{"n": 3}]  # not the longer requests it starts
    assert catalog.order_history(["c", "b", "a"], limit=10) == []
    assert catalog.order_history(["a"], limit=10) == []
    assert catalog.order_history([], limit=10) == [] and catalog.order_history(["a", "b"], limit=0) == []


def test_asks_count_from_the_order_history_since_the_order_was_last_kept_exact(catalog):
    def ask(keys, kept=None, **more):
        policy = None if kept is None else {"alpha": 0.5, "kept_exact": kept, **more}
        catalog.record_request(RequestRecord("q", "cachecraft", tuple(RequestChunk(i, k) for i, k in enumerate(keys)),
                                             0.1, 1.0, 2.0, policy=policy))

    def asked(keys, limit=16):
        return exact_wait(catalog.order_history(keys, limit), 2)

    order = ["a", "b"]
    ask(order)  # recorded before policies were: not a keep
    ask(order, kept=False)
    assert asked(order) == (2, 2)
    ask(order, kept=True, exact_wait=2)
    assert asked(order) == (0, 4)  # the ask that kept it is not counted; no ask reused it yet
    ask(["b", "a"], kept=False)  # another order: no ask of this one
    ask(order, kept=False)
    assert asked(order) == (1, 4)
    ask(order, kept=False)
    ask(order, kept=False)
    assert asked(order) == (3, 4) and asked(order, limit=2) == (2, 2)  # the keep not read: as never kept
    ask(["b", "a"], kept=True, exact_wait=2)  # another order kept exact: this one's count goes on
    assert asked(order) == (3, 4) and asked(["b", "a"]) == (0, 4)
    ask(order, kept=True, exact_wait=4)
    ask(order, kept=False, reused_exact=True)  # this keep served an ask
    assert asked(order) == (1, 2)


# what each schema version added, undone: the way back to the one before it
DOWNGRADES = {
    3: ["DROP INDEX ix_requests_uid", "ALTER TABLE requests DROP COLUMN uid"],
    2: ["DROP TABLE model_profiles", "ALTER TABLE requests DROP COLUMN num_tokens",
        "ALTER TABLE requests DROP COLUMN policy", "ALTER TABLE requests DROP COLUMN hits_redis",
        "ALTER TABLE requests DROP COLUMN node", "ALTER TABLE entries DROP COLUMN node"],
}


def catalog_of_schema(tmp_path, version: int) -> None:
    """A catalog in ``tmp_path`` with one request (ttft 2.0), as schema ``version`` wrote it."""
    with Catalog(tmp_path) as catalog:
        catalog.record_request(RequestRecord("q", "full", (), 1.0, 2.0, 2.0))
    con = sqlite3.connect(catalog_path(tmp_path))
    for step in range(SCHEMA_VERSION, version, -1):
        for statement in DOWNGRADES[step]:
            con.execute(statement)
    con.execute("UPDATE schema_info SET value=? WHERE key='schema_version'", (str(version),))
    con.commit()
    con.close()


def test_a_schema_2_catalog_gains_request_uids_and_keeps_its_rows(tmp_path):
    catalog_of_schema(tmp_path, 2)
    with Catalog(tmp_path) as catalog:
        assert catalog.upgraded_from == 2
        old = catalog.get_request(1)
        assert old.ttft_s == 2.0 and old.uid is None
        rec = RequestRecord("q", "full", (), 1.0, 1.0, 1.0)
        assert catalog.record_request(rec) == catalog.record_request(rec) == 2
    con = sqlite3.connect(catalog_path(tmp_path))
    with pytest.raises(sqlite3.IntegrityError):  # the index is unique, as in a new catalog
        con.execute("INSERT INTO requests (created_at, question_hash, method, num_chunks, hits_gpu, hits_cpu, "
                    "hits_disk, misses, uid) VALUES (1, 'q', 'full', 0, 0, 0, 0, 0, ?)", (rec.uid,))
    con.close()


def test_incompatible_schema_version_is_a_clear_error(tmp_path):
    Catalog(tmp_path).close()
    con = sqlite3.connect(catalog_path(tmp_path))
    con.execute("UPDATE schema_info SET value='999' WHERE key='schema_version'")
    con.commit()
    con.close()
    with pytest.raises(SchemaVersionError, match="schema version 999.*needs 3"):
        Catalog(tmp_path)


def test_foreign_database_is_refused(tmp_path):
    con = sqlite3.connect(catalog_path(tmp_path))
    con.execute("CREATE TABLE stuff (x)")
    con.commit()
    con.close()
    with pytest.raises(SchemaVersionError, match="not a cachecraft catalog"):
        Catalog(tmp_path)


def test_corrupted_database_file_is_a_clear_error(tmp_path):
    catalog_path(tmp_path).write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(CatalogCorruptError, match="verify --repair"):
        Catalog(tmp_path)
    assert catalog_path(tmp_path).read_bytes().startswith(b"this is not")  # left untouched


def test_unwritable_cache_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CatalogWriteError, match="CACHECRAFT_CACHE_DIR"):
        Catalog(blocker / "cache")


def test_statistics_match_hand_computed_values(catalog):
    add_variant(catalog, "a1", "A", tier="cpu", owner="p", hits=5, nbytes=300)
    add_variant(catalog, "a2", "A", tier="disk", hits=1, nbytes=200)
    add_variant(catalog, "b1", "B", tier="disk", hits=2, nbytes=50)
    add_variant(catalog, "c1", "C", tier=None, hits=9)  # evicted: counts in history, not live
    for frac, ttft, full, chunks in (
            (0.1, 1.0, 4.0, (RequestChunk(0, "A", "a1", "cpu"), RequestChunk(1, "B", "b1", "disk"))),
            (0.3, 2.0, 4.0, (RequestChunk(0, "A", "a2", "disk"), RequestChunk(1, "D"))),
            (0.95, None, 4.0, (RequestChunk(0, "D"),))):
        catalog.record_request(RequestRecord("q", "cachecraft", chunks, frac, ttft, full))
    catalog.record_request(RequestRecord("q", "full", (RequestChunk(0, "D"),), 1.0, 3.0, 3.0))

    rates = stats.hit_rates(catalog)
    assert (rates.requests, rates.chunks, rates.hits, rates.misses) == (4, 6, 3, 3)
    assert rates.hits_by_tier == {"gpu": 0, "cpu": 1, "disk": 2, "redis": 0}
    assert rates.overall == pytest.approx(0.5)
    assert rates.per_tier["disk"] == pytest.approx(2 / 6)
    assert stats.hit_rates(catalog, method="full").overall == 0.0

    usage = stats.tier_usage(catalog)
    assert (usage["cpu"].entries, usage["cpu"].bytes) == (1, 300)
    assert (usage["disk"].entries, usage["disk"].bytes) == (2, 250)
    assert (usage["gpu"].entries, usage["gpu"].bytes) == (0, 0)

    top = stats.top_chunks(catalog, limit=2)
    assert [(c.chunk_key, c.hits, c.variants, c.live_variants) for c in top] == [("C", 9, 1, 0), ("A", 6, 2, 2)]
    assert top[1].source == "doc-A" and top[1].best_saving is None  # no saving measured or estimated yet
    with catalog.write() as tx:  # measured savings: the best stored variant's counts, an evicted one's not
        for key, quality in (("a1", 0.5), ("a2", 0.875), ("c1", 0.99)):
            tx.set_quality(key, quality)
    assert [c.best_saving for c in stats.top_chunks(catalog, limit=2)] == [None, 0.875]

    assert stats.variants_per_chunk(catalog) == {1: 1, 2: 1}  # B has one live, A two; C none
    assert stats.variants_per_chunk(catalog, live_only=False) == {1: 2, 2: 1}

    dist = stats.recompute_distribution(catalog, bins=4)
    assert dist.count == 4 and dist.minimum == 0.1 and dist.maximum == 1.0
    assert dist.mean == pytest.approx((0.1 + 0.3 + 0.95 + 1.0) / 4)
    assert dist.median == pytest.approx((0.3 + 0.95) / 2)
    assert [b[2] for b in dist.histogram] == [1, 1, 0, 2]  # 0.3 in [0.25, 0.5); 1.0 in the last bin
    assert stats.recompute_distribution(catalog, method="nope").count == 0

    saved = stats.prefill_time_saved(catalog)  # the request without a TTFT and the `full` one are left out
    assert (saved.requests, saved.full_prefill_s, saved.ttft_s, saved.saved_s) == (2, 8.0, 3.0, 5.0)
    assert stats.prefill_time_saved(catalog, method="cachecraft").saved_s == 5.0

    doc = stats.summary(catalog)
    json.dumps(doc)  # JSON-serialisable as is
    assert doc["counts"] == {"chunks": 3, "variants": 4, "live_variants": 3, "requests": 4}
    assert doc["hit_rates"]["hit_rate"] == pytest.approx(3 / 5)  # the `full` request looks up no cache
    assert stats.hit_rates(catalog, cached_only=True).requests == 3
    rows = {r["method"]: r for r in doc["by_method"]}
    assert [r["method"] for r in doc["by_method"]] == ["cachecraft", "full"]
    assert rows["cachecraft"]["requests"] == 3 and rows["cachecraft"]["hit_rate"] == pytest.approx(3 / 5)
    assert rows["cachecraft"]["recompute_mean"] == pytest.approx((0.1 + 0.3 + 0.95) / 3)
    assert rows["cachecraft"]["saved_s"] == pytest.approx(5.0) and rows["full"]["hit_rate"] is None
    assert rows["full"]["saved_s"] == 0.0


def test_statistics_on_an_empty_catalog(catalog):
    assert stats.hit_rates(catalog).overall == 0.0
    assert stats.recompute_distribution(catalog).mean is None
    assert stats.prefill_time_saved(catalog).saved_s == 0.0
    assert stats.top_chunks(catalog) == [] and stats.variants_per_chunk(catalog) == {}
    json.dumps(stats.summary(catalog))


def test_event_pruning_keeps_the_newest(catalog):
    with catalog.write() as tx:
        for i in range(10):
            tx.event("put", f"v{i}", None, "cpu", 1)
    with catalog.write() as tx:
        assert tx.prune_events(keep=3) == 7
    assert [e.variant_key for e in catalog.events()] == ["v7", "v8", "v9"]


def test_top_chunks_leave_out_the_system_prompt_and_the_warm_context(catalog):
    from cachecraft import warm_context

    add_variant(catalog, "a1", "A", hits=2)
    with catalog.write() as tx:
        tx.upsert_chunk(ChunkRecord("sys", "fp", 10, None, "You are a helpful assistant."))
        tx.upsert_variant(VariantRecord("s1", "sys", (), 100, "float16"))
        tx.upsert_chunk(ChunkRecord("W", "fp", 10, warm_context.SOURCE, "Lighthouses"))
        tx.upsert_variant(VariantRecord("w1", "W", ("sys",), 100, "float16"))
        for _ in range(5):
            tx.touch("s1")
            tx.touch("w1")
    assert [c.chunk_key for c in stats.top_chunks(catalog)] == ["A"]


def test_saved_seconds_is_never_positive_for_a_full_recompute():
    assert stats.saved_seconds(4.0, 1.0, 0.2) == 3.0
    assert stats.saved_seconds(1.0, 1.5, 0.2) == -0.5  # slower than a full prefill: a loss, shown as one
    assert stats.saved_seconds(48.0, 1.0, 1.0) == 0.0  # recomputed everything: saved nothing
    assert stats.saved_seconds(1.0, 3.0, 1.0) == -2.0
    assert stats.saved_seconds(None, 1.0, 0.5) is None and stats.saved_seconds(2.0, None, 0.5) is None


def test_saved_time_is_timed_by_the_recorded_full_prefills(catalog):
    # two full prefills: 3 s for 1000 tokens and 1 s for 1000 tokens -> 2 ms per token
    for ttft in (3.0, 1.0):
        catalog.record_request(RequestRecord("q", "full", (), 1.0, ttft, 50.0, num_tokens=1000))
    requests = ((0.1, 0.5, 2000, 99.0),  # 4 s of full prefill measured, 0.5 s spent: 3.5 s saved
                (1.0, 0.2, 1000, 99.0),  # recomputed everything: nothing saved, however fast
                (0.2, 3.0, 1000, 99.0))  # slower than full (2 s): 1 s lost
    for frac, ttft, tokens, estimate in requests:
        catalog.record_request(RequestRecord("q", "cachecraft", (), frac, ttft, estimate, num_tokens=tokens))
    saved = stats.prefill_time_saved(catalog)
    assert saved.basis == "measured" and saved.full_s_per_1k_tokens == pytest.approx(2.0)
    assert saved.requests == 3
    assert saved.full_prefill_s == pytest.approx(4.0 + 2.0 + 2.0)
    assert saved.saved_s == pytest.approx(3.5 + 0.0 - 1.0)
    rows = {r["method"]: r for r in stats.by_method(catalog)}
    assert rows["cachecraft"]["saved_s"] == pytest.approx(2.5) and rows["full"]["saved_s"] == 0.0


def test_model_profiles_are_kept_per_model_device_and_kind(tmp_path, catalog):
    assert catalog.profile("fp", "cpu:2t:x", "cost_model") is None
    catalog.save_profile("fp", "cpu:2t:x", "cost_model", {"rate": 1.5})
    catalog.save_profile("fp", "cpu:2t:x", "cost_model", {"rate": 2.5})  # replaced, not added
    catalog.save_profile("fp", "cuda:H100", "cost_model", {"rate": 0.1})
    catalog.save_profile("fp", "cpu:2t:x", "policy", {"alpha": 0.1})
    catalog.close()
    with Catalog(tmp_path) as again:  # kept across processes
        assert again.profile("fp", "cpu:2t:x", "cost_model") == {"rate": 2.5}
        assert again.profile("fp", "cuda:H100", "cost_model") == {"rate": 0.1}
        assert again.profile("other", "cpu:2t:x", "cost_model") is None
        with again.read() as tx:
            assert len(tx.profiles("fp")) == 3


def test_a_schema_1_catalog_is_upgraded_in_place(tmp_path):
    catalog_of_schema(tmp_path, 1)
    with Catalog(tmp_path) as catalog:
        assert catalog.upgraded_from == 1
        assert catalog.get_request(1).ttft_s == 2.0  # what was recorded is kept
        catalog.save_profile("fp", "cpu", "cost_model", {"rate": 1.0})
        request_id = catalog.record_request(RequestRecord("q", "full", (), 1.0, 1.0, 1.0, num_tokens=7))
        assert catalog.get_request(request_id).num_tokens == 7
    con = sqlite3.connect(catalog_path(tmp_path))
    assert con.execute("SELECT value FROM schema_info WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    con.close()
    with Catalog(tmp_path) as catalog:
        assert catalog.upgraded_from is None
