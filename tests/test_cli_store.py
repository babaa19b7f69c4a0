"""verify, stats, evict, clear and bench store through the CLI, checked against files and rows."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cachecraft.catalog import Catalog, catalog_path
from cachecraft.store import TieredStore, store_paths
from cli.app import app
from tests.store_helpers import config, make_kv

runner = CliRunner()


def test_verify_reports_damage_and_repairs_it(cache_dir):
    store = TieredStore(config(cache_dir), tiers=("disk",))
    kvs = [make_kv(i) for i in range(3)]
    for kv in kvs:
        store.put(kv)
    disk = store._disk()
    with store.catalog.read() as tx:
        row = next(r for r in tx.entries(tier="disk") if r.variant_key == kvs[1].variant)
    path = disk.path_of(disk.listing()[row.blob].filename)
    store.close()
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))

    damaged = runner.invoke(app, ["verify", "--json"])
    assert damaged.exit_code == 1
    report = json.loads(damaged.stdout)
    assert not report["consistent"] and report["problems"]
    repaired = runner.invoke(app, ["verify", "--repair"])
    assert repaired.exit_code == 0, repaired.output
    clean = json.loads(runner.invoke(app, ["verify", "--json"]).stdout)
    assert clean["ok"] and clean["counts"]["disk_entries"] == 2

    with TieredStore(config(cache_dir), tiers=("disk",)) as again:
        assert again.get(kvs[1].variant) is None
        assert again.get(kvs[0].variant) is not None


def test_stats_json_counts_what_is_stored(cache_dir):
    with TieredStore(config(cache_dir), tiers=("cpu", "disk")) as store:
        for i in range(4):
            store.put(make_kv(i))
    result = runner.invoke(app, ["stats", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["counts"]["chunks"] == 4 and data["counts"]["variants"] == 4
    assert data["tiers"]["disk"]["budget_bytes"] > 0
    human = runner.invoke(app, ["stats"])
    assert human.exit_code == 0 and "4 chunks" in human.output


def test_evict_a_tier_and_clear_leave_no_files_or_rows(cache_dir):
    kvs = [make_kv(i) for i in range(3)]
    with TieredStore(config(cache_dir), tiers=("disk",)) as store:
        for kv in kvs:
            store.put(kv)
    root, disk_dir, _ = store_paths(cache_dir)
    assert len(list(disk_dir.rglob("*.val"))) == 3

    evicted = runner.invoke(app, ["evict", "--tier", "disk", "--json"])
    assert evicted.exit_code == 0, evicted.output
    assert sorted(json.loads(evicted.stdout)["variants"]) == sorted(kv.variant for kv in kvs)
    assert list(disk_dir.rglob("*.val")) == []
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        assert tx.entries() == [] and tx.counts()["variants"] == 3  # history kept
    note = runner.invoke(app, ["evict", "--tier", "cpu"])
    assert note.exit_code == 0 and "cpu tier lives inside" in note.output
    unknown = runner.invoke(app, ["evict", "--tier", "tape"])
    assert unknown.exit_code == 1 and "unknown tier 'tape'" in unknown.output

    store = TieredStore(config(cache_dir), tiers=("disk",))
    busy = runner.invoke(app, ["clear", "--yes"])
    assert busy.exit_code == 1 and "other cachecraft process" in busy.output and "Traceback" not in busy.output
    assert root.is_dir() and catalog_path(cache_dir).exists()
    store.close()
    pending = cache_dir / "pending-requests"  # requests a lost catalog left unrecorded go too
    pending.mkdir()
    (pending / "1234.json").write_text("[]")
    cleared = runner.invoke(app, ["clear", "--yes"])
    assert cleared.exit_code == 0 and "deleted" in cleared.output
    assert not root.exists() and not catalog_path(cache_dir).exists() and not pending.exists()
    again = runner.invoke(app, ["clear", "--yes"])
    assert again.exit_code == 0 and "nothing to delete" in again.output


def test_bench_store_writes_throughput(cache_dir, tmp_path):
    out = tmp_path / "store.json"
    result = runner.invoke(app, ["bench", "store", "--out", str(out), "--chunks", "2", "--tokens", "32",
                                 "--repeats", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["command"].startswith("cachecraft bench store")
    tiers = data["tiers"]
    assert {"cpu", "disk"} <= set(tiers)
    assert all(tiers[t]["put_gbps"] > 0 and tiers[t]["get_stored_gbps"] > 0 for t in ("cpu", "disk"))


def test_unwritable_cache_dir_is_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(blocker / "cache"))
    result = runner.invoke(app, ["bench", "store", "--out", str(tmp_path / "o.json"), "--chunks", "1",
                                 "--tokens", "8", "--repeats", "1"])
    assert result.exit_code == 1 and "Traceback" not in result.output
