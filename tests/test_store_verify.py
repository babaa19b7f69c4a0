"""verify(): each kind of inconsistency is reported, and repaired with repair=True."""

from __future__ import annotations

import json

import torch

from cachecraft.catalog import Catalog, EntryRecord
from cachecraft.store import TieredStore, verify
from cachecraft.store.codec import encode

from tests.store_helpers import config, make_kv, same_kv


def _store(cache_dir, **kw):
    return TieredStore(config(cache_dir), tiers=kw.pop("tiers", ("cpu", "disk")), **kw)


def test_missing_cache_directory_is_fine(tmp_path):
    report = verify(tmp_path / "nothing-here")
    assert report.ok and report.consistent and not (tmp_path / "nothing-here").exists()
    json.loads(report.to_json())


def test_every_inconsistency_is_found_and_repaired(cache_dir):
    store = _store(cache_dir, tiers=("disk",))
    kvs = [make_kv(i) for i in range(5)]
    for kv in kvs:
        store.put(kv)
    disk = store._disk()
    with store.catalog.read() as tx:
        rows = {r.variant_key: r for r in tx.entries(tier="disk")}
    # 0: bytes gone behind the catalog's back
    disk.cache.delete(rows[kvs[0].variant].blob)
    # 1: bytes damaged in place
    path = disk.path_of(disk.listing()[rows[kvs[1].variant].blob].filename)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    # an orphan blob and an orphan file
    orphan = make_kv(50)
    disk.write(f"{orphan.variant}.deadbeef", encode(orphan.to(torch.float16)))
    (disk.directory / "zz").mkdir()
    (disk.directory / "zz" / "stray.val").write_bytes(b"x" * 10)
    # memory rows of a process that is gone, and a wrong tier column
    with store.catalog.write() as tx:
        tx.add_entry(EntryRecord(kvs[2].variant, "cpu", "gone-owner", 123))
    with store.catalog.write() as tx:
        tx.session.connection().exec_driver_sql(
            f"UPDATE variants SET tier='gpu' WHERE key='{kvs[3].variant}'")
    store.close(persist=False)

    report = verify(cache_dir)
    kinds = sorted(p.kind for p in report.problems)
    assert kinds == ["damaged-blob", "dead-owner", "missing-bytes", "orphan-blob", "orphan-file", "tier-mismatch"]
    assert not report.consistent and not any(p.repaired for p in report.problems)
    doc = json.loads(report.to_json())
    assert doc["problems_by_kind"]["orphan-blob"] == 1 and doc["ok"] is False

    repaired = verify(cache_dir, repair=True)
    assert sorted(p.kind for p in repaired.problems) == kinds and repaired.consistent
    again = verify(cache_dir)
    assert again.ok, again.to_dict()
    assert again.counts["disk_entries"] == 3 and again.counts["blobs_checked"] == 3
    with _store(cache_dir, tiers=("disk",)) as store:
        for kv in kvs[2:]:
            assert same_kv(store.get(kv.variant), kv, torch.float16)
        assert store.get(kvs[0].variant) is None and store.get(kvs[1].variant) is None
        store.close(persist=False)
    with Catalog(cache_dir) as cat:
        kinds = [e.kind for e in cat.events() if e.variant_key in (kvs[0].variant, kvs[1].variant)]
    assert "lost" in kinds and "corrupt" in kinds


def test_live_processes_memory_rows_are_not_touched(cache_dir):
    store = _store(cache_dir)
    kv = make_kv(7)
    store.put(kv)  # held in this live store's CPU tier
    report = verify(cache_dir, repair=True)
    assert report.ok and report.counts["cpu_entries"] == 1
    assert store.locate(kv.variant) == "cpu"
    store.close()
    assert verify(cache_dir).counts["disk_entries"] == 1
