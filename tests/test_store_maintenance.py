"""Store maintenance: evict (by chunk, document, tier, all) and destroy, checked against
the files on disk and the rows of the catalog."""

from __future__ import annotations

import pytest

from cachecraft.catalog import Catalog, catalog_path
from cachecraft.store import (DestroyReport, SelectorError, StoreBusyError, StoreConfigError, TieredStore,
                              destroy, store_paths)
from cachecraft.store.locks import FileLock, live_owners
from cachecraft.store.paths import MAINTENANCE_LOCK

from tests.store_helpers import config, make_kv


@pytest.fixture
def open_store(cache_dir):
    opened = []

    def make(tiers=("cpu", "disk")):
        store = TieredStore(config(cache_dir), tiers=tiers)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close(persist=False)


def blob_files(cache_dir) -> list:
    """Value files in the disk tier's directory."""
    _, disk_dir, _ = store_paths(cache_dir)
    return sorted(disk_dir.rglob("*.val"))


def entry_rows(cache_dir, tier: str | None = None) -> list:
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        return tx.entries(tier=tier)


def test_evict_a_tier_empties_it_on_disk_and_in_the_catalog(open_store, cache_dir):
    store = open_store(tiers=("disk",))
    kvs = [make_kv(i) for i in range(3)]
    for kv in kvs:
        store.put(kv, source=f"doc{kv.token_ids[0]}.md")
    assert len(blob_files(cache_dir)) == 3
    report = store.evict(tier="disk")
    assert sorted(report.removed) == sorted(kv.variant for kv in kvs) and report.note is None
    assert report.to_dict() == {"removed": 3, "variants": list(report.removed), "note": None, "unreached": None}
    assert blob_files(cache_dir) == [] and entry_rows(cache_dir) == []
    with store.catalog.read() as tx:  # history stays: the variants are recorded, as evicted
        assert all(tx.variant(kv.variant).tier is None for kv in kvs)
    assert {e.variant_key for e in store.catalog.events(kind="delete")} == {kv.variant for kv in kvs}
    assert store.evict(tier="disk").removed == ()


def test_evict_everything_reaches_memory_and_disk(open_store, cache_dir):
    store = open_store()
    on_disk, in_memory = make_kv(1), make_kv(2)
    store.put(on_disk)
    store.put(in_memory)
    store.close()  # memory entries move to disk ...
    store = open_store()
    store.get(on_disk.variant)  # ... and a hit copies one back into this store's CPU tier
    assert store.locate(on_disk.variant) == "cpu"
    assert sorted(store.evict(everything=True).removed) == sorted([on_disk.variant, in_memory.variant])
    assert store.locate(on_disk.variant) is None and store.usage()["cpu"].entries == 0
    assert blob_files(cache_dir) == [] and entry_rows(cache_dir) == []


def test_evict_a_chunk_by_key_prefix_drops_all_its_variants(open_store, cache_dir):
    store = open_store(tiers=("disk",))
    other = make_kv(2)
    variants = [make_kv(1), make_kv(1, prefix=(other.chunk,))]  # one chunk, two variants
    assert variants[0].chunk == variants[1].chunk and variants[0].variant != variants[1].variant
    for kv in (*variants, other):
        store.put(kv)
    report = store.evict(chunk=" " + variants[0].chunk[:8].upper())  # case and spaces do not matter
    assert sorted(report.removed) == sorted(kv.variant for kv in variants)
    assert [r.variant_key for r in entry_rows(cache_dir)] == [other.variant]
    assert len(blob_files(cache_dir)) == 1
    assert store.evict(chunk=other.variant[:10]).removed == (other.variant,)  # a variant's key works too
    with pytest.raises(SelectorError, match="at least 6 characters"):
        store.evict(chunk=other.chunk[:5])
    with pytest.raises(SelectorError, match="no cached chunk matches"):
        store.evict(chunk=other.chunk)  # evicted already


def test_evict_one_variant_by_key_prefix_keeps_its_chunks_others(open_store, cache_dir):
    store = open_store(tiers=("disk",))
    other = make_kv(2)
    alone, after_other = make_kv(1), make_kv(1, prefix=(other.chunk,))  # one chunk, two variants
    for kv in (alone, after_other, other):
        store.put(kv)
    report = store.evict(variant=" " + after_other.variant[:8].upper())  # case and spaces do not matter
    assert report.removed == (after_other.variant,)
    assert sorted(r.variant_key for r in entry_rows(cache_dir)) == sorted([alone.variant, other.variant])
    assert len(blob_files(cache_dir)) == 2
    assert [r.key for r in store.variants_of(alone.chunk)] == [alone.variant]
    with pytest.raises(SelectorError, match="at least 6 characters of the variant key"):
        store.evict(variant=alone.variant[:5])
    with pytest.raises(SelectorError, match="no cached variant matches"):
        store.evict(variant=after_other.variant)  # evicted already
    with pytest.raises(SelectorError, match="no cached variant matches"):
        store.evict(variant=alone.chunk[:12])  # a chunk's key names no variant
    with pytest.raises(ValueError, match="exactly one"):
        store.evict(chunk=alone.chunk, variant=alone.variant)


def test_evict_a_document_by_path_or_file_name(open_store, cache_dir, tmp_path):
    store = open_store(tiers=("disk",))
    a, b, c, d = (make_kv(i) for i in range(4))
    store.put(a, source=str(tmp_path / "docs" / "a.md"))
    store.put(b, source=str(tmp_path / "docs" / "a.md"))
    store.put(c, source=str(tmp_path / "docs" / "c.md"))
    store.put(d, source=str(tmp_path / "more" / "c.md"))
    assert sorted(store.evict(source="a.md").removed) == sorted([a.variant, b.variant])
    with pytest.raises(SelectorError, match="'c.md' names 2 documents"):
        store.evict(source="c.md")
    assert store.evict(source=str(tmp_path / "more" / "c.md")).removed == (d.variant,)
    with pytest.raises(SelectorError, match="no cached chunk comes from"):
        store.evict(source="a.md")
    assert [r.variant_key for r in entry_rows(cache_dir)] == [c.variant]


def test_evict_the_documents_a_forget_dropped(open_store, cache_dir, tmp_path):
    store = open_store()
    a, b, c = (make_kv(i) for i in range(3))
    store.put(a, source=str(tmp_path / "docs" / "a.md"))
    store.put(b, source=str(tmp_path / "docs" / "b.md"))
    store.put(c, source=str(tmp_path / "more" / "a.md"))
    report = store.evict_documents([str(tmp_path / "docs" / "a.md"), str(tmp_path / "docs" / "b.md"),
                                    str(tmp_path / "never-cached.md")])
    assert sorted(report.removed) == sorted([a.variant, b.variant])
    assert {r.variant_key for r in entry_rows(cache_dir)} == {c.variant}  # memory entries too
    assert store.get(a.variant) is None and store.get(c.variant) is not None
    assert store.evict_documents([]).removed == ()


def test_evict_a_memory_tier_drops_only_this_stores_entries(open_store, cache_dir):
    mine, theirs = open_store(), open_store()
    kv_mine, kv_theirs = make_kv(1), make_kv(2)
    assert mine.put(kv_mine) == "cpu" and theirs.put(kv_theirs) == "cpu"
    report = mine.evict(tier="cpu")
    assert report.removed == (kv_mine.variant,)
    assert "cpu tier lives inside each running cachecraft process (1 entries in 1 process(es))" in report.note
    assert theirs.locate(kv_theirs.variant) == "cpu"
    assert [(r.variant_key, r.owner) for r in entry_rows(cache_dir)] == [(kv_theirs.variant, theirs.owner)]
    if "gpu" not in mine.tier_names:  # a tier this store lacks holds nothing of its own
        assert mine.evict(tier="gpu").removed == ()


def test_evict_needs_exactly_one_known_selector(open_store):
    store = open_store()
    with pytest.raises(ValueError, match="exactly one"):
        store.evict()
    with pytest.raises(ValueError, match="exactly one"):
        store.evict(tier="disk", everything=True)
    with pytest.raises(StoreConfigError, match="unknown tier 'tape'"):
        store.evict(tier="tape")


def test_destroy_deletes_store_and_catalog_and_keeps_the_rest(cache_dir):
    with TieredStore(config(cache_dir), tiers=("cpu", "disk")) as store:
        for i in range(3):
            store.put(make_kv(i))
    (cache_dir / "corpus").mkdir()
    (cache_dir / "corpus" / "chunks.json").write_text("[]")
    (cache_dir / "config.toml").write_text("")
    root, _, _ = store_paths(cache_dir)
    assert root.is_dir() and catalog_path(cache_dir).exists()

    report = destroy(cache_dir)
    assert str(root) in report.removed and str(catalog_path(cache_dir)) in report.removed
    assert sorted(p.name for p in cache_dir.iterdir()) == ["config.toml", "corpus"]
    assert (cache_dir / "corpus" / "chunks.json").read_text() == "[]"
    assert destroy(cache_dir) == DestroyReport()
    with TieredStore(config(cache_dir)) as store:  # a fresh, empty cache
        assert store.usage()["disk"].entries == 0 and entry_rows(cache_dir) == []


def test_destroy_of_a_missing_directory_creates_nothing(tmp_path):
    assert destroy(tmp_path / "none") == DestroyReport()
    assert not (tmp_path / "none").exists()


def test_destroy_refuses_while_a_store_is_open(open_store, cache_dir):
    store = open_store()
    store.put(make_kv(1))
    assert live_owners(store.locks_dir) == [store.owner]
    with pytest.raises(StoreBusyError, match="1 other cachecraft process"):
        destroy(cache_dir)
    assert store.locate(make_kv(1).variant) == "cpu" and catalog_path(cache_dir).exists()
    store.close()
    assert live_owners(store.locks_dir) == []
    assert destroy(cache_dir).removed


def test_destroy_waits_for_a_disk_writer_then_gives_up(cache_dir):
    with TieredStore(config(cache_dir), tiers=("disk",)) as store:
        store.put(make_kv(1))
    root, _, locks = store_paths(cache_dir)
    with FileLock(locks / MAINTENANCE_LOCK).exclusive(1.0) as got:
        assert got
        with pytest.raises(StoreBusyError, match="another process is writing"):
            destroy(cache_dir, lock_timeout_s=0.05)
    assert root.is_dir() and len(blob_files(cache_dir)) == 1


def test_a_lower_disk_budget_takes_effect_when_the_store_opens(cache_dir):
    kvs = [make_kv(i) for i in range(4)]
    with TieredStore(config(cache_dir), tiers=("disk",)) as store:
        for kv in kvs:
            store.put(kv)
        sizes = {r.variant_key: r.nbytes for r in entry_rows(cache_dir, "disk")}
    budget = max(sizes.values()) + min(sizes.values()) // 2  # room for one entry only
    with TieredStore(config(cache_dir, disk_budget_bytes=budget), tiers=("disk",)) as store:
        usage = store.usage()["disk"]
        assert usage.bytes <= budget and usage.entries == 1
        assert len(blob_files(cache_dir)) == 1
        assert len(store.catalog.events(kind="evict")) == 3
        assert store.counters.evictions == 3
    with TieredStore(config(cache_dir), tiers=("disk",)) as store:  # a larger budget evicts nothing more
        assert store.usage()["disk"].entries == 1
