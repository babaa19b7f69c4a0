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


def _two_nodes_with_a_request_each(tmp_path, redis_url: str, catalog_url: str):
    """Nodes ``a`` and ``b`` on one catalog and Redis, each storing one chunk-cache and
    answering one request; returns (a's kv, b's kv, a's node id, b's node id)."""
    from cachecraft.catalog.records import RequestChunk, RequestRecord
    kvs, nodes = (make_kv(1), make_kv(2)), []
    for name, kv in zip("ab", kvs):
        with TieredStore(Config(cache_dir=tmp_path / name, redis_url=redis_url, catalog_url=catalog_url),
                         tiers=("cpu", "disk")) as store:
            store.put(kv)
            chunk = RequestChunk(0, kv.chunk, kv.variant, "disk")
            store.catalog.record_request(RequestRecord("q", "reuse", (chunk,), 0.0, 0.01, 0.1, node=store.node))
            nodes.append(store.node)
    return (*kvs, *nodes)


def _clear_as(monkeypatch, cache_dir, *, catalog_url: str | None = None, redis_url: str | None = None):
    """``cachecraft clear ARGS`` as the node at ``cache_dir`` with these servers runs it (its
    config from the environment), as a function of the arguments (``input``: the answer to
    the prompt)."""
    from typer.testing import CliRunner

    from cli.app import app
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(cache_dir))
    for name, value in (("CATALOG_URL", catalog_url), ("REDIS_URL", redis_url)):
        if value:
            monkeypatch.setenv(f"CACHECRAFT_{name}", value)
        else:
            monkeypatch.delenv(f"CACHECRAFT_{name}", raising=False)
    return lambda *args, input=None: CliRunner().invoke(app, ["clear", *args], input=input)


def test_clear_on_a_node_drops_its_rows_and_files_and_leaves_the_other_nodes(tmp_path, redis_server,  # noqa: F811
                                                                            pg_url, client, monkeypatch):  # noqa: F811
    from cachecraft.catalog import Catalog
    from cachecraft.store import store_paths
    mine, theirs, a, b = _two_nodes_with_a_request_each(tmp_path, redis_server.url, pg_url)
    clear = _clear_as(monkeypatch, tmp_path / "a", catalog_url=pg_url, redis_url=redis_server.url)

    result = clear("--yes")
    assert result.exit_code == 0, result.output
    assert "1 placement(s), 1 request(s) from the catalog" in result.output
    assert "stay in the shared catalog" in result.output
    assert not store_paths(tmp_path / "a")[0].exists() and store_paths(tmp_path / "b")[1].is_dir()
    with Catalog(tmp_path, url=pg_url) as catalog, catalog.read() as tx:
        assert {e.node for e in tx.entries()} == {b}  # a's disk row went, b's stayed
        assert set(tx.nodes()) == {b}
        assert tx.variant(mine.variant) is not None and tx.variant(mine.variant).tier is None  # history kept
        assert tx.variant(theirs.variant).tier == "disk"
        assert tx.counts()["requests"] == 1
    assert len(client.hkeys(f"{shared_mod.PREFIX}meta")) == 2  # the shared tier is not this node's
    with Catalog(tmp_path, url=pg_url) as catalog:
        assert [e.kind for e in catalog.events(variant_key=mine.variant)][-1] == "clear"

    # the cleared directory joins again as a new node and still finds a's chunk-cache in Redis
    with TieredStore(Config(cache_dir=tmp_path / "a", redis_url=redis_server.url, catalog_url=pg_url),
                     tiers=("cpu", "disk")) as again:
        assert again.node not in (a, b)
        assert same_kv(again.get(mine.variant), mine, again.stored_dtype)
    for directory in "ab":
        assert verify(tmp_path / directory, catalog_url=pg_url, redis_url=redis_server.url).ok


def test_clear_shared_empties_the_catalog_and_the_shared_tier(tmp_path, redis_server, pg_url, client,  # noqa: F811
                                                              monkeypatch):
    from cachecraft.catalog import Catalog
    mine, theirs, a, b = _two_nodes_with_a_request_each(tmp_path, redis_server.url, pg_url)
    client.set("other:key", b"not ours")
    clear = _clear_as(monkeypatch, tmp_path / "a", catalog_url=pg_url, redis_url=redis_server.url)

    refused = clear("--shared", input="n\n")
    assert refused.exit_code == 1 and "stop every other node first" in refused.output
    assert len(client.hkeys(f"{shared_mod.PREFIX}meta")) == 2
    # b answered a request just now: a script's --yes alone deletes nothing under it
    scripted = clear("--shared", "--yes")
    text = " ".join(scripted.output.split())
    assert scripted.exit_code == 1 and "1 other node(s) may still be running" in text and f"node {b}" in text
    assert "nothing was deleted" in text and "add --force to delete anyway" in text
    assert len(client.hkeys(f"{shared_mod.PREFIX}meta")) == 2
    with Catalog(tmp_path, url=pg_url) as catalog, catalog.read() as tx:
        assert tx.counts()["requests"] == 2 and set(tx.nodes()) == {a, b}
    result = clear("--shared", "--yes", "--force")
    assert result.exit_code == 0, result.output
    assert "2 placement(s), 2 request(s), 2 variant(s) of 2 chunk(s), 2 node(s)" in result.output
    assert "2 entries from the shared tier" in result.output
    assert client.keys(f"{shared_mod.PREFIX}*") == [] and client.get("other:key") == b"not ours"
    with Catalog(tmp_path, url=pg_url) as catalog, catalog.read() as tx:
        counts = tx.counts()
        assert counts["chunks"] == counts["variants"] == counts["requests"] == 0
        assert tx.entries() == [] and tx.nodes() == {}
    # b's own directory stays; opened again, it joins anew and records its blob
    with TieredStore(Config(cache_dir=tmp_path / "b", redis_url=redis_server.url, catalog_url=pg_url),
                     tiers=("cpu", "disk")) as store_b:
        assert store_b.node == b
        assert same_kv(store_b.get(theirs.variant), theirs, store_b.stored_dtype)
    assert verify(tmp_path / "b", catalog_url=pg_url, redis_url=redis_server.url).ok


def test_clear_shared_with_the_shared_tier_down_says_what_was_done_and_keeps_the_directory(
        tmp_path, redis_server, pg_url, monkeypatch):  # noqa: F811
    from cachecraft.store import store_paths
    _two_nodes_with_a_request_each(tmp_path, redis_server.url, pg_url)
    redis_server.stop()
    clear = _clear_as(monkeypatch, tmp_path / "a", catalog_url=pg_url, redis_url=redis_server.url)
    result = clear("--shared", "--yes", "--force")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "the shared catalog was emptied, but redis_url" in result.output
    assert "run clear --shared again" in result.output
    assert store_paths(tmp_path / "a")[0].is_dir()
    redis_server.start()
    again = clear("--shared", "--yes")  # the catalog is empty now: no node looks alive
    assert again.exit_code == 0, again.output
    assert not store_paths(tmp_path / "a")[0].exists()


def test_clear_shared_without_servers_is_refused(cache_dir, monkeypatch):
    result = _clear_as(monkeypatch, cache_dir)("--shared", "--yes")
    assert result.exit_code == 1 and "neither is set" in result.output


def test_clear_with_the_catalog_unreachable_deletes_nothing(tmp_path, redis_server, pg_url, monkeypatch):  # noqa: F811
    from cachecraft.store import store_paths
    from tests.servers import free_port
    _two_nodes_with_a_request_each(tmp_path, redis_server.url, pg_url)
    unreachable = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"
    result = _clear_as(monkeypatch, tmp_path / "a", catalog_url=unreachable)("--yes")
    assert result.exit_code == 1 and "Traceback" not in result.output and "catalog_url" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert len(list(store_paths(tmp_path / "a")[1].rglob("*.val"))) == 1


def test_clear_node_drops_another_node_s_rows_only(tmp_path, redis_server, pg_url, monkeypatch):  # noqa: F811
    from cachecraft.catalog import Catalog
    from cachecraft.store import store_paths
    mine, theirs, a, b = _two_nodes_with_a_request_each(tmp_path, redis_server.url, pg_url)
    as_a = _clear_as(monkeypatch, tmp_path / "a", catalog_url=pg_url)

    def clear(*args: str):
        return as_a("--yes", *args)

    own = clear("--node", a[:8])
    assert own.exit_code == 1 and "this cache directory's own node" in own.output
    unknown = clear("--node", "zzzzzzzz")
    assert unknown.exit_code == 1 and "no node of the catalog" in unknown.output and a in unknown.output
    short = clear("--node", b[:3])
    assert short.exit_code == 1 and "at least 6 characters" in short.output
    mixed = clear("--node", b, "--shared")
    assert mixed.exit_code == 1 and "without --corpus and --shared" in mixed.output
    running = clear("--node", b[:6].upper())  # b answered a request just now
    assert running.exit_code == 1 and "nothing was deleted" in " ".join(running.output.split())
    with Catalog(tmp_path, url=pg_url) as catalog, catalog.read() as tx:
        assert set(tx.nodes()) == {a, b}
    result = clear("--node", b[:6].upper(), "--force")
    assert result.exit_code == 0, result.output
    assert f"deleted node {b} " in result.output and "1 placement(s), 1 request(s)" in result.output
    with Catalog(tmp_path, url=pg_url) as catalog, catalog.read() as tx:
        assert set(tx.nodes()) == {a} and {e.node for e in tx.entries()} == {a}
        assert tx.counts()["requests"] == 1 and tx.variant(theirs.variant).tier is None
    assert store_paths(tmp_path / "a")[0].is_dir() and store_paths(tmp_path / "b")[0].is_dir()
    alone = _clear_as(monkeypatch, tmp_path / "a")("--yes", "--node", b)
    assert alone.exit_code == 1 and "catalog_url is not set" in alone.output


def test_clear_with_only_a_shared_tier_keeps_its_entries_and_says_so(tmp_path, redis_server, client,  # noqa: F811
                                                                      monkeypatch):
    with TieredStore(Config(cache_dir=tmp_path / "n", redis_url=redis_server.url), tiers=("cpu", "disk")) as store:
        store.put(make_kv(3))
    clear = _clear_as(monkeypatch, tmp_path / "n", redis_url=redis_server.url)
    result = clear("--yes")
    assert result.exit_code == 0, result.output
    assert "the shared tier keeps its entries; clear --shared empties it" in result.output
    assert len(client.hkeys(f"{shared_mod.PREFIX}meta")) == 1
    emptied = clear("--shared", "--yes")
    assert emptied.exit_code == 0 and "1 entry from the shared tier" in emptied.output
    assert client.keys(f"{shared_mod.PREFIX}*") == []


def test_clear_shared_and_node_name_the_other_nodes_that_look_alive(tmp_path, redis_server, pg_url,  # noqa: F811
                                                                     monkeypatch):
    import time

    from cachecraft.store.maintenance import active_nodes
    mine, theirs, a, b = _two_nodes_with_a_request_each(tmp_path, redis_server.url, pg_url)
    config_c = Config(cache_dir=tmp_path / "c", redis_url=redis_server.url, catalog_url=pg_url)
    with TieredStore(config_c, tiers=("cpu", "disk")) as running:  # node c runs, a chunk-cache in memory
        running.put(make_kv(3))
        assert running.locate(make_kv(3).variant) == "cpu"
        c = running.node
        seen = {n.node: n for n in active_nodes(tmp_path / "a", pg_url)}
        assert set(seen) == {b, c}  # a itself is not named; b answered just now, c holds memory
        assert seen[b].in_memory == 0 and 0 <= seen[b].last_request_age_s < 60
        assert seen[c].in_memory == 1 and seen[c].last_request_age_s is None
        later = active_nodes(tmp_path / "a", pg_url, now=time.time() + 3600)
        assert [(n.node, n.in_memory) for n in later] == [(c, 1)]  # an hour on, only c's memory counts
        clear = _clear_as(monkeypatch, tmp_path / "a", catalog_url=pg_url, redis_url=redis_server.url)
        refused = clear("--shared", input="n\n")
        text = " ".join(refused.output.split())
        assert refused.exit_code == 1 and "2 other node(s) may still be running" in text
        assert f"node {b}: last request " in text and f"node {c}: 1 chunk-cache(s) in memory" in text
        one = clear("--node", c[:8], input="n\n")
        assert one.exit_code == 1 and "1 other node(s) may still be running" in one.output and b not in one.output
    # c closed its store: its memory rows went with it, so only b's recent request is named
    assert [n.node for n in active_nodes(tmp_path / "a", pg_url)] == [b]
    quiet = _clear_as(monkeypatch, tmp_path / "a", catalog_url=pg_url)("--node", c[:8], input="n\n")
    assert "may still be running" not in quiet.output


def test_a_node_s_activity_reads_in_seconds_minutes_or_hours():
    from cachecraft.store.maintenance import NodeActivity

    assert NodeActivity("3f9a", 42.4, 0).describe() == "node 3f9a: last request 42 s ago"
    assert NodeActivity("3f9a", 150.0, 2).describe() == "node 3f9a: last request 2 min ago, 2 chunk-cache(s) in memory"
    assert NodeActivity("3f9a", 3 * 3600.0, 0).describe() == "node 3f9a: last request 3 h ago"
    assert NodeActivity("3f9a", None, 1).describe() == "node 3f9a: 1 chunk-cache(s) in memory"
