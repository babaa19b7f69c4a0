"""Several nodes on one Redis and one PostgreSQL catalog (real servers): a node answers
from another's chunk-caches and sees its variants; per-node and shared-tier hits in the
statistics; the lookup order of tiers; verify over the shared tier; four node processes
at once, one killed mid-write."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

redis = pytest.importorskip("redis", reason="redis-py not installed (pip install cachecraft[shared])")
pytest.importorskip("psycopg", reason="psycopg not installed (pip install cachecraft[shared])")

from cachecraft.catalog.stats import by_node, hit_rates  # noqa: E402
from cachecraft.config import Config, ConfigError  # noqa: E402
from cachecraft.store import TieredStore, verify  # noqa: E402
from cachecraft.store import shared as shared_mod  # noqa: E402
from tests.servers import pg_url, postgres, redis_server  # noqa: E402,F401  (fixtures)
from tests.store_helpers import make_kv, same_kv  # noqa: E402


@pytest.fixture
def client(redis_server):  # noqa: F811
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def test_a_node_answers_from_another_nodes_caches_and_the_catalog_counts_both(tmp_path, redis_server,  # noqa: F811
                                                                             pg_url, monkeypatch):  # noqa: F811
    """On the tiny model: node A answers and stores; node B (its own cache directory, the
    same Redis and catalog) sees A's variants with their statistics, answers from Redis with
    no recompute and the same logits, and the catalog records who answered from where."""
    from cachecraft.pipeline import Pipeline
    from cachecraft.policy.planner import PolicyParams
    from tests.conftest import tiny_model
    from tests.test_pipeline import CHUNKS, QUESTION, traced

    monkeypatch.setattr("cachecraft.policy.loading.MIN_OBSERVED_BYTES", 0)
    lm = tiny_model("llama")

    def node(name: str):
        config = Config.load(overrides={"cache_dir": tmp_path / name, "max_new_tokens": 4, "kv_dtype": "float32",
                                        "redis_url": redis_server.url, "catalog_url": pg_url}, environ={})
        store = TieredStore(config, tiers=("cpu", "disk"))
        return Pipeline(config, lm=lm, store=store, policy=PolicyParams(alpha=0.5, check_layer=2))

    a = node("a")
    first = traced(a, CHUNKS, QUESTION)
    a.close()
    b = node("b")
    chunk = first.chunks[0]
    seen = b.store.variants_of(chunk.chunk)
    assert len(seen) == 1 and seen[0].tier == "redis"  # the variant a made, found by b
    assert seen[0].cci is not None  # the statistics a's prefill gathered, through the catalog
    second = traced(b, CHUNKS, QUESTION)
    assert second.recompute_fraction == 0.0 and second.text == first.text
    assert (second.logits - first.logits).abs().max() < 1e-4
    assert [c.tier for c in second.chunks] == ["redis"] * len(CHUNKS)
    rates = hit_rates(b.catalog, cached_only=True)
    assert rates.hits_by_tier["redis"] == len(CHUNKS) and rates.misses == len(CHUNKS)
    nodes = {row["node"]: row for row in by_node(b.catalog)}
    assert set(nodes) == {a.store.node, b.store.node}
    assert nodes[b.store.node]["hits_by_tier"]["redis"] == len(CHUNKS)
    assert nodes[a.store.node]["misses"] == len(CHUNKS)
    assert b.catalog.get_request(second.request_id).node == b.store.node
    b.close()


def test_tier_order_puts_the_shared_tier_before_disk(tmp_path, redis_server):  # noqa: F811
    kv = make_kv(1)
    with pytest.raises(ConfigError, match="tier_order"):
        Config(cache_dir=tmp_path, tier_order="disk,gpu,cpu,redis")
    for order, expected in (("gpu,cpu,disk,redis", "disk"), ("gpu,cpu,redis,disk", "redis")):
        config = Config(cache_dir=tmp_path / order, redis_url=redis_server.url, tier_order=order)
        with TieredStore(config, tiers=("disk",)) as store:
            store.put(kv)  # on disk and in Redis
            assert store.locate(kv.variant) == expected
            hits = store.shared.counters.hits
            reader = store.iter_layers(kv.variant, promote=False)
            assert reader.tier == expected
            reader.close()
            got = store.get(kv.variant, promote=False)
            assert same_kv(got, kv, store.stored_dtype)
            assert store.shared.counters.hits - hits == (2 if expected == "redis" else 0)
            assert store.counters.hits["disk"] == (2 if expected == "disk" else 0)


def test_verify_checks_and_repairs_the_shared_tier(tmp_path, redis_server, client):  # noqa: F811
    good, bad, gone = make_kv(1), make_kv(2), make_kv(3)
    config = Config(cache_dir=tmp_path / "n", redis_url=redis_server.url)
    with TieredStore(config, tiers=("cpu",)) as store:
        for kv in (good, bad, gone):
            store.put(kv)
    blob = bytearray(client.get(f"{shared_mod.PREFIX}blob:{bad.variant}"))
    blob[-3] ^= 0xFF
    client.set(f"{shared_mod.PREFIX}blob:{bad.variant}", bytes(blob))
    client.delete(f"{shared_mod.PREFIX}blob:{gone.variant}")  # as a server's own eviction would
    client.set(f"{shared_mod.PREFIX}blob:stray", b"x")
    client.incrby(f"{shared_mod.PREFIX}bytes", 5)
    report = verify(tmp_path / "n", redis_url=redis_server.url)
    kinds = sorted((p.kind, p.target) for p in report.problems)
    assert kinds == sorted([("shared-damaged", bad.variant), ("shared-missing", gone.variant),
                            ("shared-orphan", "stray"), ("shared-count", f"{shared_mod.PREFIX}bytes")])
    assert not report.consistent
    repaired = verify(tmp_path / "n", repair=True, redis_url=redis_server.url)
    assert repaired.consistent and len(repaired.problems) == 4
    again = verify(tmp_path / "n", redis_url=redis_server.url)
    assert again.ok and again.counts["shared_entries"] == 1
    assert client.hkeys(f"{shared_mod.PREFIX}meta") == [good.variant.encode()]


def test_verify_says_in_one_line_when_redis_is_unreachable(tmp_path):
    from cachecraft.store.errors import SharedTierError
    from tests.servers import free_port
    with pytest.raises(SharedTierError, match="redis_url .* cannot be reached"):
        verify(tmp_path, redis_url=f"redis://127.0.0.1:{free_port()}/0")


def test_four_nodes_share_redis_and_postgres_and_one_killed_mid_write_loses_nothing(tmp_path, redis_server,  # noqa: F811
                                                                                   pg_url, client):  # noqa: F811
    """Three nodes read, write and record requests while a fourth writes in a loop and is
    killed with SIGKILL: no read is damaged, no request row is lost, and once the killed
    node's directory is opened again, verify finds its catalog rows, disk tier and the
    shared tier consistent."""
    import multiprocessing as mp

    from tests.cluster_workers import POOL, cluster_node, cluster_writer, pool_kv

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "cachecraft.store", "tests.cluster_workers"])
    readers, rounds = 3, 40
    barrier = ctx.Barrier(readers)
    outs = [tmp_path / f"node-{n}.json" for n in range(readers)]
    ready = tmp_path / "writer-ready"
    writer = ctx.Process(target=cluster_writer, args=(str(tmp_path / "victim"), redis_server.url, pg_url,
                                                      str(ready)))
    procs = [ctx.Process(target=cluster_node, args=(str(tmp_path / f"node-{n}"), redis_server.url, pg_url, n,
                                                    rounds, barrier, str(outs[n]))) for n in range(readers)]
    try:
        writer.start()
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and writer.is_alive():
            time.sleep(0.05)
        time.sleep(0.5)  # well into its writes
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        for p in procs:
            p.join(300)
    finally:  # never leave a node behind: the interpreter would wait for it at exit
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert [p.exitcode for p in procs] == [0] * readers
    assert writer.exitcode == -signal.SIGKILL
    results = [json.loads(o.read_text()) for o in outs]
    assert [r["errors"] for r in results] == [[]] * readers
    assert all(r["counters"]["corrupt"] == 0 for r in results)
    assert sum(r["tiers"].get("redis", 0) for r in results) > 0  # nodes served each other
    config = Config(cache_dir=tmp_path / "victim", redis_url=redis_server.url, catalog_url=pg_url)
    with TieredStore(config, tiers=("cpu", "disk")) as store:  # reopening reconciles the killed node
        for i in range(POOL):
            got = store.get(pool_kv(i).variant, promote=False)
            assert got is None or same_kv(got, pool_kv(i), store.stored_dtype)
        rates = hit_rates(store.catalog)
        assert rates.requests == readers * rounds
    for directory in ["victim", *(f"node-{n}" for n in range(readers))]:
        report = verify(tmp_path / directory, catalog_url=pg_url, redis_url=redis_server.url)
        assert report.ok, (directory, report.problems)
    used = int(client.get(f"{shared_mod.PREFIX}bytes"))
    assert used == sum(int(v) for v in client.hvals(f"{shared_mod.PREFIX}size"))
