"""TieredStore: round trips, tiers and budgets, eviction through the store, integrity, bad input."""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import sqlite3

import diskcache
import pytest
import torch

from cachecraft.catalog import CatalogCorruptError, EntryRecord, stats
from cachecraft.config import Config, ConfigError
from cachecraft.kv import variant_key
from cachecraft.store import (CacheDirError, CorruptEntryError, DiskFullError, StoreConfigError,
                              TieredStore, verify)
from cachecraft.store.codec import encode
from cachecraft.store.tiers import entry_nbytes

from tests.store_helpers import bits_equal, config, disk_blob_files, flip_byte, make_kv, same_kv

gpu = pytest.mark.gpu

ENTRY = entry_nbytes(make_kv(0).to(torch.float16))  # bytes a memory tier charges for make_kv()


def blob_size(kv) -> int:
    return len(encode(kv.to(torch.float16)).data)


BLOB = blob_size(make_kv(0))


@pytest.fixture
def store_factory(cache_dir):
    opened = []

    def make(**kw):
        tiers = kw.pop("tiers", ("cpu", "disk"))
        budgets = kw.pop("budgets", None)
        eviction = kw.pop("eviction", None)
        s = TieredStore(config(cache_dir, **kw), tiers=tiers, budgets=budgets, eviction=eviction)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close(persist=False)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_round_trip_is_bit_identical_per_tier(store_factory, tier, kv_dtype):
    store = store_factory(tiers=(tier,), kv_dtype=kv_dtype)
    dtype = getattr(torch, kv_dtype)
    kv = make_kv(1, prefix=("sys", "other-chunk"), tokens=12, heads=2)
    assert store.put(kv) == tier
    got = store.get(kv.variant)
    assert got.keys.dtype == dtype
    assert same_kv(got, kv, dtype)
    with store.iter_layers(kv.variant) as reader:
        assert reader.tier == tier and reader.prefix == kv.prefix and reader.token_ids == kv.token_ids
        layers = list(reader)
    assert len(layers) == kv.num_layers
    for layer, (k, v) in enumerate(layers):
        assert bits_equal(k, kv.keys[layer].to(dtype)) and bits_equal(v, kv.values[layer].to(dtype))
    with store.iter_layers(kv.variant, promote=False) as reader:
        assert same_kv(reader.read_all(), kv, dtype)
    # converted to the compute dtype on the way out
    as_f32 = store.get(kv.variant, dtype=torch.float32)
    assert as_f32.keys.dtype == torch.float32
    assert torch.equal(as_f32.keys, kv.keys.to(dtype).float())


@gpu
def test_round_trip_through_the_gpu_tier_and_pinned_cpu(store_factory):
    store = store_factory(tiers=("gpu", "cpu", "disk"), budgets={"gpu": 2 * ENTRY, "cpu": 2 * ENTRY})
    kvs = [make_kv(i) for i in range(6)]
    for kv in kvs:
        store.put(kv.to(device="cuda"))
    assert [store.locate(kv.variant) for kv in kvs] == ["disk", "disk", "cpu", "cpu", "gpu", "gpu"]
    cpu_entry = store._tier("cpu").get(kvs[2].variant)
    assert cpu_entry.kv.keys.is_pinned()
    for kv in kvs:
        got = store.get(kv.variant, device="cuda", promote=False)
        assert got.keys.is_cuda and same_kv(got.to(device="cpu"), kv, torch.float16)
        with store.iter_layers(kv.variant, dtype=torch.float32, device="cuda", promote=False) as reader:
            for layer, (k, _v) in enumerate(reader):
                assert k.is_cuda and torch.equal(k.cpu(), kv.keys[layer].half().float())


def test_get_returns_fresh_copies_and_put_keeps_none_of_the_callers_tensors(store_factory):
    store = store_factory(tiers=("cpu",), kv_dtype="float32")
    kv = make_kv(2)
    original = kv.keys.clone()
    store.put(kv)
    kv.keys.zero_()  # the caller reuses its buffer
    got = store.get(kv.variant)
    assert torch.equal(got.keys, original)
    got.keys.fill_(7.0)  # the engine overwrites recomputed rows in place
    with store.iter_layers(kv.variant) as reader:
        for k, _ in reader:
            k.fill_(9.0)
    assert torch.equal(store.get(kv.variant).keys, original)


def test_stats_are_stored_and_readable_without_loading_kv(store_factory):
    store = store_factory(tiers=("disk",))
    kv = make_kv(3, prefix=("a", "b", "c"))
    store.put(kv, cci=0.7, stats={"a_bar": 0.1, "b_bar": 0.2}, cost_s=0.25, quality=0.9,
              source="doc-7#3", preview="The quick brown fox")
    got = store.stats_of(kv.variant)
    assert all(bits_equal(x, y) for x, y in zip(got.to_tensors().values(), kv.stats.to_tensors().values()))
    assert store.counters.hits["disk"] == 0  # reading statistics is not a hit
    rec = store.info(kv.variant)
    assert (rec.cci, rec.stats, rec.cost_s, rec.quality, rec.tier) == (0.7, {"a_bar": 0.1, "b_bar": 0.2},
                                                                        0.25, 0.9, "disk")
    assert store.catalog.chunk(kv.chunk).preview == "The quick brown fox"
    assert store.stats_of("no-such-key") is None


# ---------------------------------------------------------------- tiers, promotion, eviction


def test_writes_fill_the_fastest_tier_and_demote_lru_victims_downward(store_factory):
    store = store_factory(eviction="lru", budgets={"cpu": 2 * ENTRY, "disk": 2 * BLOB})
    kvs = {name: make_kv(i) for i, name in enumerate("abcde")}
    for name in "ab":
        assert store.put(kvs[name]) == "cpu"
    assert store.put(kvs["c"]) == "cpu"  # a -> disk
    assert store.get(kvs["b"].variant) is not None  # b is now more recent than c
    assert store.put(kvs["d"]) == "cpu"  # c -> disk
    assert store.put(kvs["e"]) == "cpu"  # b -> disk, disk full: a (least recent there) dropped
    where = {name: store.locate(kv.variant) for name, kv in kvs.items()}
    assert where == {"a": None, "b": "disk", "c": "disk", "d": "cpu", "e": "cpu"}
    kinds = [(e.kind, e.from_tier, e.to_tier) for e in store.catalog.events(variant_key=kvs["a"].variant)]
    assert kinds == [("put", None, "cpu"), ("demote", "cpu", "disk"), ("evict", "disk", None)]
    assert store.counters.evictions == 1 and store.counters.demotions == 3


def test_disk_hit_promotes_a_copy_and_memory_demotion_reuses_it(store_factory):
    store = store_factory(eviction="lru", budgets={"cpu": 1 * ENTRY, "disk": 4 * BLOB})
    a, b = make_kv(10), make_kv(11)
    store.put(a)
    store.put(b)  # a -> disk
    assert store.locate(a.variant) == "disk"
    blobs_before = set(disk_blob_files(store))
    assert same_kv(store.get(a.variant), a, torch.float16)  # promotes a copy; b -> disk
    assert store.locate(a.variant) == "cpu"
    assert store.counters.promotions == 1
    with store.catalog.read() as tx:
        assert tx.entry(a.variant, "disk") is not None  # the disk copy stays for other processes
    store.put(make_kv(12))  # a leaves the CPU again: its disk copy is identical, no rewrite
    assert store.locate(a.variant) == "disk"
    assert set(disk_blob_files(store)) >= blobs_before
    assert same_kv(store.get(a.variant, promote=False), a, torch.float16)


def test_iter_layers_from_disk_promotes_after_a_full_read(store_factory):
    store = store_factory(budgets={"cpu": 4 * ENTRY})
    kv = make_kv(13)
    store.put(kv)
    store.close()  # persisted to disk
    store = store_factory(budgets={"cpu": 4 * ENTRY})
    assert store.locate(kv.variant) == "disk"
    reader = store.iter_layers(kv.variant, dtype=torch.float32)
    assert store.locate(kv.variant) == "disk"  # nothing read yet
    layers = list(reader)
    assert store.locate(kv.variant) == "cpu"
    assert torch.equal(torch.stack([k for k, _ in layers]), kv.keys.half().float())
    assert same_kv(store.get(kv.variant), kv, torch.float16)


def test_entries_too_large_for_every_tier_are_not_cached(store_factory):
    store = store_factory(budgets={"cpu": ENTRY // 2, "disk": BLOB // 2})
    kv = make_kv(14)
    assert store.put(kv) is None
    assert store.locate(kv.variant) is None and store.counters.not_cached == 1
    small = store_factory(tiers=("cpu",), budgets={"cpu": ENTRY})
    assert small.put(make_kv(15, tokens=8)) == "cpu"
    assert small.put(make_kv(16, tokens=16)) is None  # larger than the whole budget
    assert small.locate(make_kv(15).variant) == "cpu"  # and nothing was evicted for it


@pytest.mark.parametrize("eviction, first_out", [("lfu", "b"), ("pgdsf", "b"), ("cachecraft", "b"),
                                                  ("decay", "b"), ("lru", "a")])
def test_prior_uses_count_for_eviction_orders_that_count_uses_but_not_as_hits(store_factory, eviction, first_out):
    # room for two: a comes first with two uses credited, then b, then c pushes one out.
    # Every order but lru weighs a at three uses against b's one (same cost and size);
    # lru goes by recency alone, and a is the oldest.
    store = store_factory(eviction=eviction, budgets={"cpu": 2 * ENTRY})
    kvs = {name: make_kv(40 + i) for i, name in enumerate("abc")}
    assert store.put(kvs["a"], prior_uses=2) == "cpu"
    assert store.put(kvs["b"]) == "cpu"
    assert store.put(kvs["c"]) == "cpu"
    assert {name: store.locate(kv.variant) for name, kv in kvs.items()} == {
        "a": "disk" if first_out == "a" else "cpu", "b": "disk" if first_out == "b" else "cpu", "c": "cpu"}
    assert store.info(kvs["a"].variant).hits == 0  # credited, never read
    with pytest.raises(ValueError, match="prior_uses must be >= 0"):
        store.put(kvs["a"], prior_uses=-1)


def test_put_replaces_and_delete_removes_everywhere(store_factory):
    store = store_factory(budgets={"cpu": 1 * ENTRY})
    a, b = make_kv(20), make_kv(21)
    store.put(a)
    store.put(b)  # a -> disk
    a2 = dataclasses.replace(make_kv(20), keys=make_kv(20).keys + 1)  # same key, new bytes
    assert a2.variant == a.variant
    assert store.put(a2) == "cpu"  # b -> disk; the stale disk copy of a is gone
    with store.catalog.read() as tx:
        assert tx.entry(a.variant, "disk") is None
    assert same_kv(store.get(a.variant), a2, torch.float16)
    assert store.delete(b.variant) and store.delete(a.variant)
    assert not store.delete(a.variant)
    assert store.locate(a.variant) is None and store.locate(b.variant) is None
    assert store.usage()["disk"].entries == 0 and store.usage()["cpu"].bytes == 0
    assert disk_blob_files(store) == {}


def test_variants_of_lists_what_this_store_can_read(store_factory):
    v1 = make_kv(30, prefix=("s",), token_base=500)
    v2 = make_kv(31, prefix=("s", "x"), token_base=500)  # same tokens, another prefix
    assert v1.chunk == v2.chunk and v1.variant != v2.variant
    store = store_factory(budgets={"cpu": entry_nbytes(v2.to(torch.float16))})  # room for one
    store.put(v1)
    store.put(v2)  # v1 -> disk
    assert {(r.key, r.tier, r.prefix) for r in store.variants_of(v1.chunk)} == {
        (v1.variant, "disk", ("s",)), (v2.variant, "cpu", ("s", "x"))}
    assert store.variants_of("no-such-chunk") == []


def test_hits_and_requests_reach_the_catalog(store_factory):
    store = store_factory()
    kv = make_kv(32)
    store.put(kv)
    for _ in range(3):
        store.get(kv.variant)
    assert store.info(kv.variant).hits == 3
    # A read again for the same request is served, not counted.
    assert same_kv(store.get(kv.variant, count_hit=False), kv, torch.float16)
    assert store.iter_layers(kv.variant, count_hit=False) is not None
    assert store.info(kv.variant).hits == 3 and sum(store.counters.hits.values()) == 3
    assert store.get("missing") is None and store.counters.misses == 1
    top = stats.top_chunks(store.catalog)
    assert top[0].chunk_key == kv.chunk and top[0].hits == 3


def test_measured_use_moves_quality_in_memory_on_disk_and_in_the_catalog(store_factory):
    near = make_kv(40, prefix=("s",), token_base=700)
    far = make_kv(41, prefix=("s", "x"), token_base=700)  # a second variant of the same chunk
    store = store_factory(budgets={"cpu": entry_nbytes(far.to(torch.float16))})  # room for one
    store.put(near, quality=0.9)
    store.put(far, quality=0.8)  # near -> disk
    assert store.locate(near.variant) == "disk" and store.locate(far.variant) == "cpu"
    new = store.record_use({near.variant: 0.1, far.variant: 1.0, "unknown": 0.5})
    assert new == pytest.approx({near.variant: 0.5, far.variant: 0.9})  # halfway from 0.9 and 0.8
    assert store.info(near.variant).quality == pytest.approx(0.5)
    assert store.info(far.variant).quality == pytest.approx(0.9)
    assert store._tiers[0].get(far.variant).info.quality == pytest.approx(0.9)
    disk_policy = store._policies["disk"]
    assert disk_policy._state[near.variant].info.quality == pytest.approx(0.5)
    assert store.record_use({}) == {}
    hits = store.info(far.variant).hits
    store.record_use({far.variant: 0.0})  # a measure is no hit
    assert store.info(far.variant).hits == hits
    assert store.info(far.variant).quality == pytest.approx(0.45)


@pytest.mark.parametrize("policy,steps", [("cachecraft", 1000), ("lru", 250), ("lfu", 250), ("pgdsf", 250),
                                          ("decay", 250)])
def test_randomized_budgets_hold_and_only_the_last_tier_drops(store_factory, policy, steps):
    """Every tier stays within budget after every step; a key disappears only by a
    delete or an eviction from the disk tier; every read returns the last put, bit for bit."""
    rng = random.Random(1234)
    budgets = {"cpu": 3 * ENTRY + 50, "disk": 5 * BLOB + 100}
    store = store_factory(eviction=policy, budgets=budgets)
    pool = [make_kv(100 + i, tokens=rng.choice([4, 8, 12]), prefix=(f"p{i % 3}",)) for i in range(24)]
    model: dict[str, object] = {}  # key -> the kv last put
    last_event = 0
    for step in range(steps):
        op = rng.random()
        kv = rng.choice(pool)
        if op < 0.5:
            if rng.random() < 0.2:  # sometimes new bytes under the same key
                kv = dataclasses.replace(kv, keys=torch.randn_like(kv.keys))
            tier = store.put(kv, cost_s=rng.uniform(0.1, 2.0), quality=rng.uniform(0.2, 1.0))
            assert tier in ("cpu", "disk")
            model[kv.variant] = kv
        elif op < 0.9:
            got = store.get(kv.variant, promote=rng.random() < 0.7)
            if got is not None:
                assert kv.variant in model and same_kv(got, model[kv.variant], torch.float16), step
        else:
            assert store.delete(kv.variant) == (kv.variant in model)
            model.pop(kv.variant, None)
        usage = store.usage()
        for name, state in usage.items():
            assert state.bytes <= budgets[name], (step, name, state)
        assert store._tier("cpu").used == sum(store._tier("cpu").get(k).info.nbytes for k in store._tier("cpu").keys())
        on_disk = sum(b.size for b in store._disk().listing().values())
        assert on_disk == usage["disk"].bytes <= budgets["disk"], step
        events = store.catalog.events(since_id=last_event)
        last_event = events[-1].id if events else last_event
        dropped = {e.variant_key for e in events if e.kind == "evict"}
        assert all(e.from_tier == "disk" for e in events if e.kind == "evict"), step
        for key in list(model):
            if not store.contains(key):
                assert key in dropped, f"step {step}: {key} vanished without an eviction from disk"
                del model[key]
        if step % 100 == 99:
            for key, want in model.items():
                assert same_kv(store.get(key, promote=False), want, torch.float16)
    assert verify(store.cache_dir).ok


# ---------------------------------------------------------------- integrity


def test_damaged_blob_is_dropped_and_counted_as_a_miss(store_factory):
    store = store_factory(tiers=("disk",))
    kv = make_kv(40)
    store.put(kv)
    (path,) = disk_blob_files(store).values()
    flip_byte(path, offset_from_end=3)
    assert store.get(kv.variant) is None
    assert store.counters.corrupt == 1 and store.counters.misses == 1
    assert store.locate(kv.variant) is None and disk_blob_files(store) == {}
    assert [e.kind for e in store.catalog.events(variant_key=kv.variant)][-1] == "corrupt"
    assert store.info(kv.variant).tier is None


def test_damaged_header_is_never_served(store_factory):
    store = store_factory(tiers=("disk",))
    kv = make_kv(41)
    store.put(kv)
    (path,) = disk_blob_files(store).values()
    flip_byte(path, offset=20)  # inside the JSON header
    assert store.iter_layers(kv.variant) is None
    assert store.counters.corrupt == 1 and store.locate(kv.variant) is None


def test_damaged_layer_raises_while_streaming_and_earlier_layers_were_sound(store_factory):
    store = store_factory(tiers=("disk",))
    kv = make_kv(42, layers=4, stats=False)
    store.put(kv)
    (path,) = disk_blob_files(store).values()
    flip_byte(path, offset_from_end=2)  # the last tensor written: a late layer
    reader = store.iter_layers(kv.variant, promote=False)
    seen = []
    with pytest.raises(CorruptEntryError, match="recompute"):
        for k, _v in reader:
            seen.append(k)
    assert 0 < len(seen) < kv.num_layers
    for layer, k in enumerate(seen):
        assert bits_equal(k, kv.keys[layer].half())
    assert store.locate(kv.variant) is None and store.counters.corrupt == 1


def test_two_models_never_share_caches(store_factory):
    store = store_factory(tiers=("cpu", "disk"), budgets={"cpu": 1 * ENTRY})
    a = make_kv(50, fingerprint="tiny-model-a", token_base=7)
    b = make_kv(51, fingerprint="tiny-model-b", token_base=7)  # same tokens, another model
    assert a.token_ids == b.token_ids and a.chunk != b.chunk and a.variant != b.variant
    store.put(a)
    store.put(b)  # a -> disk
    assert store.get(a.variant).fingerprint == "tiny-model-a"
    assert store.get(b.variant, fingerprint="tiny-model-b").fingerprint == "tiny-model-b"
    assert store.get(a.variant, fingerprint="tiny-model-b") is None
    assert store.iter_layers(b.variant, fingerprint="tiny-model-a") is None
    assert [r.key for r in store.variants_of(a.chunk)] == [a.variant]
    # even a tampered index cannot serve model A's bytes under model B's key
    store.get(a.variant)  # a back in the CPU, b on disk
    store.close()
    store = store_factory(tiers=("disk",))
    with store.catalog.read() as tx:
        row_a = tx.entry(a.variant, "disk")
    with store.catalog.write() as tx:
        tx.add_entry(EntryRecord(b.variant, "disk", "", row_a.nbytes, row_a.blob, row_a.checksum))
    assert store.get(b.variant) is None
    assert store.counters.corrupt == 1


def test_no_pickle_in_the_disk_tier(store_factory):
    store = store_factory(tiers=("disk",))
    kv = make_kv(60)
    store.put(kv)
    (path,) = disk_blob_files(store).values()
    head = path.read_bytes()[:9]
    assert head[8:9] == b"{"  # a safetensors file: 8-byte header length, then JSON
    with pytest.raises(TypeError):
        store._disk().cache.set("k", {"a": 1})  # anything but bytes is refused
    con = sqlite3.connect(store._disk().directory / "cache.db")
    modes = {m for (m,) in con.execute("SELECT DISTINCT mode FROM Cache")}
    con.close()
    assert modes == {diskcache.core.MODE_BINARY}


# ---------------------------------------------------------------- bad input


def test_budgets_must_be_positive(tmp_path):
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="must be positive"):
            Config(cache_dir=tmp_path, cpu_budget_bytes=bad)
        with pytest.raises(StoreConfigError, match="cpu tier budget must be a positive"):
            TieredStore(config(tmp_path), tiers=("cpu", "disk"), budgets={"cpu": bad})
    with pytest.raises(StoreConfigError, match="tiers must be"):
        TieredStore(config(tmp_path), tiers=("ssd",))
    if not torch.cuda.is_available():
        with pytest.raises(StoreConfigError, match="needs CUDA"):
            TieredStore(config(tmp_path), tiers=("gpu", "cpu"))


def test_unwritable_cache_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(CacheDirError, match="not writable.*CACHECRAFT_CACHE_DIR"):
        TieredStore(config(blocker / "cache"))


def test_read_only_cache_directory_is_a_clear_error(tmp_path, monkeypatch):
    if os.geteuid() == 0:  # root writes anyway: simulate the permission error instead
        import tempfile

        def deny(*a, **k):
            raise PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(tempfile, "mkstemp", deny)
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o500)
    with pytest.raises(CacheDirError, match="Permission denied"):
        TieredStore(config(tmp_path / "ro"))


def test_full_disk_keeps_everything_already_stored(store_factory, monkeypatch):
    store = store_factory(budgets={"cpu": 2 * ENTRY})
    kvs = [make_kv(70 + i) for i in range(4)]
    for kv in kvs:
        store.put(kv)  # two on disk, two in the CPU tier
    before = {kv.variant: store.locate(kv.variant) for kv in kvs}
    assert sorted(before.values()) == ["cpu", "cpu", "disk", "disk"]

    def full_write(self, full_path, iterator, mode, encoding=None):
        os.makedirs(os.path.dirname(full_path), exist_ok=True)
        with open(full_path, mode) as f:  # half a file, then the device is full
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diskcache.Disk, "_write", full_write)
    new = make_kv(80)
    with pytest.raises(DiskFullError, match="free disk space"):
        store.put(new)  # needs a CPU victim demoted to disk: that write fails
    in_cpu = next(kv for kv in kvs if before[kv.variant] == "cpu")
    bigger = make_kv(int(in_cpu.token_ids[0] // 1000), layers=4)  # same key, twice the bytes
    assert bigger.variant == in_cpu.variant
    with pytest.raises(DiskFullError):
        store.put(bigger)  # a failed replacement keeps the old bytes
    monkeypatch.undo()
    assert {kv.variant: store.locate(kv.variant) for kv in kvs} == before  # nothing moved, nothing lost
    for kv in kvs:
        assert same_kv(store.get(kv.variant, promote=False), kv, torch.float16)
    report = verify(store.cache_dir)
    assert report.ok, report.problems  # the half-written file was removed
    assert store.put(new) == "cpu"  # and the store works again once there is room


def test_corrupted_catalog_is_an_error_then_rebuilt_by_repair(store_factory, cache_dir):
    store = store_factory(tiers=("disk",))
    kvs = [make_kv(90 + i) for i in range(3)]
    for kv in kvs:
        store.put(kv)
    store.close()
    path = cache_dir / "catalog.sqlite"
    for side in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (cache_dir / side).unlink(missing_ok=True)
    path.write_bytes(b"garbage" * 1000)
    with pytest.raises(CatalogCorruptError, match="verify --repair"):
        TieredStore(config(cache_dir), tiers=("disk",))
    report = verify(cache_dir, repair=True)
    assert [p.kind for p in report.problems] == ["catalog-damaged"] and report.consistent
    assert report.counts["rebuilt_entries"] == 3
    assert list((cache_dir).glob("catalog.sqlite.damaged-*"))  # the old file is kept aside
    store = store_factory(tiers=("disk",))
    for kv in kvs:  # nothing already stored was lost
        assert same_kv(store.get(kv.variant), kv, torch.float16)
    assert verify(cache_dir).ok


def test_corrupted_disk_tier_database_is_salvaged_by_repair(store_factory, cache_dir):
    store = store_factory(tiers=("disk",))
    kvs = [make_kv(95 + i) for i in range(3)]
    for kv in kvs:
        store.put(kv)
    store.close()
    disk_dir = cache_dir / "store" / "disk"
    for side in ("cache.db-wal", "cache.db-shm"):
        (disk_dir / side).unlink(missing_ok=True)
    (disk_dir / "cache.db").write_bytes(b"garbage" * 1000)
    with pytest.raises(Exception, match="verify --repair"):
        TieredStore(config(cache_dir), tiers=("disk",))
    report = verify(cache_dir)
    assert not report.consistent and report.problems[0].kind == "disk-db-damaged"
    report = verify(cache_dir, repair=True)
    assert report.consistent
    assert "3 sound blobs salvaged" in report.problems[0].detail
    store = store_factory(tiers=("disk",))
    for kv in kvs:
        assert same_kv(store.get(kv.variant), kv, torch.float16)
    assert verify(cache_dir).ok


def test_put_rejects_a_chunkkv_whose_key_lies(store_factory):
    store = store_factory()
    kv = make_kv(99)
    liar = dataclasses.replace(kv, chunk="0" * 32)
    with pytest.raises(ValueError, match="does not match"):
        store.put(liar)
    with pytest.raises(ValueError, match="quality"):
        store.put(kv, quality=1.5)
    assert variant_key(kv.chunk, kv.prefix) == kv.variant


def test_a_deleted_catalog_is_rebuilt_not_mistaken_for_orphans(store_factory, cache_dir):
    store = store_factory(tiers=("disk",))
    kvs = [make_kv(110 + i) for i in range(3)]
    for kv in kvs:
        store.put(kv)
    store.close()
    for name in ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm"):
        (cache_dir / name).unlink(missing_ok=True)
    store = store_factory(tiers=("disk",))
    for kv in kvs:
        assert same_kv(store.get(kv.variant), kv, torch.float16)
    assert store.info(kvs[0].variant).prefix == kvs[0].prefix
    assert verify(cache_dir).ok


def test_damaged_statistics_are_caught_when_the_entry_is_opened(store_factory):
    import json
    import struct

    store = store_factory(tiers=("disk",))
    kv = make_kv(120)
    store.put(kv)
    (path,) = disk_blob_files(store).values()
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    start, _ = json.loads(data[8:8 + n])["stats.intra"]["data_offsets"]
    flip_byte(path, offset=8 + n + start)
    assert store.stats_of(kv.variant) is None
    assert store.iter_layers(kv.variant) is None  # never a reader over damaged bytes
    assert store.counters.corrupt == 1 and store.locate(kv.variant) is None
