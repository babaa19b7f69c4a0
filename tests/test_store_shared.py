"""The shared Redis tier (``redis_url``) against a real redis-server: bit-identical
round trips between two nodes, layer-by-layer reads, promotion into local tiers, the
byte budget, damaged values, and a server stopped, restarted or flushed mid-run."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

redis = pytest.importorskip("redis", reason="redis-py not installed (pip install cachecraft[shared])")

from cachecraft.config import Config, ConfigError  # noqa: E402
from cachecraft.store import CorruptEntryError, LayerStream, SelectorError, TieredStore  # noqa: E402
from cachecraft.store import shared as shared_mod  # noqa: E402
from cachecraft.store.codec import decode, encode, header_checksum  # noqa: E402
from cachecraft.store.placement import to_stored  # noqa: E402
from tests.servers import RedisServer, free_port, redis_server  # noqa: E402,F401  (fixture)
from tests.store_helpers import bits_equal, make_kv, same_kv  # noqa: E402

F16 = torch.float16


def node(tmp_path, name: str, url: str, **overrides) -> TieredStore:
    """A store with its own cache directory (its own catalog and disk), sharing ``url``."""
    cfg = Config(cache_dir=tmp_path / name, redis_url=url, **overrides)
    return TieredStore(cfg, tiers=("cpu", "disk"), reconcile=False)


def blob_key(kv) -> str:
    return f"{shared_mod.PREFIX}blob:{kv.variant}"


@pytest.fixture
def client(redis_server):  # noqa: F811
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def test_a_request_looks_up_all_its_chunks_in_the_shared_tier_in_two_round_trips(tmp_path, redis_server,  # noqa: F811
                                                                                  monkeypatch):
    one, other = make_kv(11, layers=2), make_kv(12, layers=2)
    again = make_kv(11, layers=2, prefix=("p",))  # a second variant of the first chunk
    with node(tmp_path, "a", redis_server.url) as a:
        for kv in (one, other, again):
            a.put(kv, cost_s=0.1)
    with node(tmp_path, "b", redis_server.url) as b:
        alone = {c: b.shared.variants_of(c) for c in (one.chunk, other.chunk, "no-such-chunk")}
        sent = []
        real = b.shared.client.execute_command
        monkeypatch.setattr(b.shared.client, "execute_command", lambda *a, **k: sent.append(a[0]) or real(*a, **k))
        pipelined = []
        real_pipe = b.shared.client.pipeline
        monkeypatch.setattr(b.shared.client, "pipeline",
                            lambda *a, **k: pipelined.append(1) or real_pipe(*a, **k))
        many = b.shared.variants_of_chunks([one.chunk, other.chunk, "no-such-chunk", one.chunk])
        records = b.variants_of_chunks([one.chunk, other.chunk])
    assert many == alone  # the same answers as one chunk at a time
    assert sorted(m.variant for m in many[one.chunk]) == sorted([one.variant, again.variant])
    assert [m.variant for m in many[other.chunk]] == [other.variant] and many["no-such-chunk"] == []
    assert pipelined == [1, 1] and sent == ["HMGET", "HMGET"]  # per lookup: one pipeline, one HMGET
    assert {c: sorted(r.key for r in rs) for c, rs in records.items()} == {
        one.chunk: sorted([one.variant, again.variant]), other.chunk: [other.variant]}
    assert all(r.tier == "redis" for rs in records.values() for r in rs)


def test_a_variant_put_on_one_node_is_read_bit_identical_on_another_and_promoted(tmp_path, redis_server, client):  # noqa: F811
    kv = make_kv(1, layers=3)
    with node(tmp_path, "a", redis_server.url) as a:
        assert a.put(kv, cost_s=0.5, quality=0.9, cci=0.2, source="doc.txt") == "cpu"
    data = client.get(blob_key(kv))
    # the disk tier's format: safetensors whose header checksum the index records
    meta = shared_mod.SharedMeta.from_json(client.hget(f"{shared_mod.PREFIX}meta", kv.variant))
    assert meta.checksum == header_checksum(data) and same_kv(decode(data, meta.checksum, kv.variant), kv, F16)
    with node(tmp_path, "b", redis_server.url) as b:
        assert b.locate(kv.variant) == "redis"
        [record] = b.variants_of(kv.chunk)
        assert record.tier == "redis" and record.cost_s == 0.5 and record.quality == 0.9
        assert b.stats_of(kv.variant) is not None
        got = b.get(kv.variant)
        assert got is not None and same_kv(got, kv, F16)
        assert b.locate(kv.variant) == "cpu"  # promoted into this node's local tiers
        assert b.info(kv.variant).hits == 1 and b.shared.counters.hits == 1
        assert [e.kind for e in b.catalog.events(variant_key=kv.variant)] == ["promote"]
        assert b.catalog.chunk(kv.chunk).source == "doc.txt"
        again = b.get(kv.variant)  # now a local hit
        assert same_kv(again, kv, F16) and b.shared.counters.hits == 1


def test_layer_by_layer_reads_from_the_shared_tier(tmp_path, redis_server):  # noqa: F811
    kv = make_kv(2, layers=4, tokens=16)
    with node(tmp_path, "a", redis_server.url) as a:
        a.put(kv)
    with node(tmp_path, "b", redis_server.url) as b:
        reader = b.iter_layers(kv.variant)
        assert reader is not None and reader.tier == "redis"
        assert reader.token_ids == kv.token_ids and reader.num_layers == 4
        with reader:
            layers = list(reader)
        for i, (k, v) in enumerate(layers):
            assert bits_equal(k, kv.keys[i].to(F16)) and bits_equal(v, kv.values[i].to(F16))
        assert b.locate(kv.variant) == "cpu"  # read to the end: promoted
    with node(tmp_path, "c", redis_server.url) as c:  # the streaming loader times the tier
        stream = LayerStream([c.iter_layers(kv.variant, promote=False)])
        try:
            [streamed] = stream.kvs
            assert bits_equal(streamed.layer(3)[0], kv.keys[3].to(F16))
        finally:
            stream.close()
        assert stream.read_bytes.get("redis", 0) > 0 and "redis" in stream.read_seconds
        assert c.locate(kv.variant) == "redis"  # promote=False: not copied


def test_pipelined_multi_key_reads(tmp_path, redis_server):  # noqa: F811
    kvs = [make_kv(i) for i in range(3)]
    with node(tmp_path, "a", redis_server.url) as a:
        for kv in kvs:
            a.put(kv)
        found = a.shared.get_many([kv.variant for kv in kvs] + ["missing"])
    assert set(found) == {kv.variant for kv in kvs}
    for kv in kvs:
        assert same_kv(found[kv.variant][1], kv, F16)


def test_the_byte_budget_is_kept_least_recently_used_first(tmp_path, redis_server, client):  # noqa: F811
    kvs = [make_kv(i, tokens=16) for i in range(5)]
    size = len(encode(to_stored(kvs[0], F16)).data)
    budget = int(2.5 * size)
    with node(tmp_path, "a", redis_server.url, redis_budget_bytes=budget) as a:
        for i, kv in enumerate(kvs):
            a.put(kv)
            if i == 1:
                a.shared.touch([kvs[0].variant])  # kvs[0] used after kvs[1]
        used = int(client.get(f"{shared_mod.PREFIX}bytes"))
        assert used <= budget and a.shared.count() == 2 == client.hlen(f"{shared_mod.PREFIX}meta")
        held = {k.decode() for k in client.hkeys(f"{shared_mod.PREFIX}meta")}
        assert held == {kvs[3].variant, kvs[4].variant}
        assert sum(int(v) for v in client.hvals(f"{shared_mod.PREFIX}size")) == used
        assert a.shared.counters.evictions == 3
        assert a.usage()["redis"].bytes == used and a.usage()["redis"].budget == budget
        too_big = make_kv(9, tokens=64)
        assert a.put(too_big) == "cpu"  # over the shared budget: local only
        assert not a.shared.contains(too_big.variant)


def test_a_damaged_value_is_dropped_and_counted_never_served(tmp_path, redis_server, client, caplog):  # noqa: F811
    kvs = [make_kv(i, layers=3) for i in range(3)]
    with node(tmp_path, "a", redis_server.url) as a:
        for kv in kvs:
            a.put(kv)
    for kv, offset in zip(kvs, (-5, -5, 20)):  # last layer's bytes twice, the header once
        data = client.get(blob_key(kv))
        pos = len(data) + offset if offset < 0 else offset
        client.setrange(blob_key(kv), pos, bytes([data[pos] ^ 0xFF]))
    with node(tmp_path, "b", redis_server.url) as b, caplog.at_level(logging.WARNING):
        assert b.get(kvs[0].variant) is None  # whole read
        reader = b.iter_layers(kvs[1].variant)  # header sound: opens, fails at the damaged layer
        with pytest.raises(CorruptEntryError, match="shared tier"):
            list(reader)
        assert b.iter_layers(kvs[2].variant) is None  # damaged header: a miss at once
        assert b.shared.counters.corrupt == 3
        assert all(not b.shared.contains(kv.variant) for kv in kvs)
        assert all(b.locate(kv.variant) is None for kv in kvs)  # nothing promoted
    assert client.exists(*[blob_key(kv) for kv in kvs]) == 0
    assert sum("damaged shared entry" in r.message for r in caplog.records) == 3


def test_server_stopped_mid_run_is_a_miss_with_one_warning_then_reconnects(tmp_path, redis_server, caplog,  # noqa: F811
                                                                          monkeypatch):
    monkeypatch.setattr(shared_mod, "BACKOFF_START_S", 0.0)
    local, remote = make_kv(1), make_kv(2)
    with node(tmp_path, "a", redis_server.url) as a:
        a.put(remote)
    with node(tmp_path, "b", redis_server.url) as b:
        b.put(local)
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="cachecraft.store.shared"):
            assert b.get(remote.variant) is None  # answered: a miss, no exception
            assert b.iter_layers(remote.variant) is None
            assert b.variants_of(remote.chunk) == [] and b.locate(remote.variant) is None
            assert b.put(make_kv(3)) == "cpu"  # local tiers keep working
            assert same_kv(b.get(local.variant), local, F16)  # untouched
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "shared tier" in warnings[0].message
        assert b.shared.counters.errors >= 1 and not b.shared.available
        redis_server.start()  # restarted, empty (no persistence)
        with node(tmp_path, "a2", redis_server.url) as a:
            a.put(remote)
        b.shared._retry_at = 0.0  # the backoff has passed
        got = b.get(remote.variant)
        assert got is not None and same_kv(got, remote, F16) and b.shared.available
        assert any("reachable again" in r.message for r in caplog.records)


def test_a_server_that_stops_answering_costs_one_timeout_per_attempt(tmp_path):
    """A listener that takes connections and never replies: an attempt times out once and
    is not tried again on a new connection, so a hung server stalls a request one socket
    timeout, not two (a broken connection, as after a restart, is still retried: see
    the test above)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    tier = shared_mod.RedisTier(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", 10**6, socket_timeout_s=0.3)
    try:
        assert tier.used() == 0 and tier.counters.errors == 1 and not tier.available
        assert len(accepted) == 1  # one connection, one timeout: not retried
    finally:
        tier.close()
        listener.close()
        for conn in accepted:
            conn.close()


def test_backoff_skips_redis_while_it_is_down(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    clock = [100.0]
    tier = shared_mod.RedisTier(url, 10**6, clock=lambda: clock[0])
    try:
        assert tier.get("v") is None and tier.counters.errors == 1
        assert tier.get("v") is None and tier.counters.skipped == 1  # not tried again yet
        clock[0] += shared_mod.BACKOFF_START_S + 0.01
        assert tier.get("v") is None and tier.counters.errors == 2
        assert tier._backoff == 2 * shared_mod.BACKOFF_START_S  # doubles, up to BACKOFF_MAX_S
    finally:
        tier.close()


def test_server_flushed_mid_run_is_an_empty_tier(tmp_path, redis_server, client):  # noqa: F811
    kv = make_kv(1)
    with node(tmp_path, "a", redis_server.url) as a:
        a.put(kv)
        client.flushall()
        with node(tmp_path, "b", redis_server.url) as b:
            assert b.get(kv.variant) is None and b.shared.counters.errors == 0
            assert b.shared.used() == 0
        a.put(kv)
        assert a.shared.count() == 1 and a.shared.used() == int(client.get(f"{shared_mod.PREFIX}bytes"))


def test_unreachable_at_open_the_store_still_works(tmp_path):
    with node(tmp_path, "a", f"redis://127.0.0.1:{free_port()}/0") as a:
        kv = make_kv(1)
        assert a.put(kv) == "cpu" and same_kv(a.get(kv.variant), kv, F16)


def test_without_redis_url_nothing_changes(tmp_path):
    with TieredStore(Config(cache_dir=tmp_path), tiers=("cpu", "disk")) as store:
        assert store.shared is None and set(store.usage()) == {"cpu", "disk"}
        assert store.locate("nope") is None and store.get("nope") is None


def test_redis_url_is_validated_and_its_password_hidden(tmp_path):
    with pytest.raises(ConfigError, match="redis_url"):
        Config(cache_dir=tmp_path, redis_url="http://x")
    with pytest.raises(ConfigError, match="redis_budget_bytes"):
        Config(cache_dir=tmp_path, redis_budget_bytes=0)
    cfg = Config.from_mapping({"cache_dir": tmp_path, "redis_url": "rediss://:pw@h:6380/1",
                               "redis_budget_bytes": "1GiB"})
    assert cfg.to_dict()["redis_url"] == "rediss://:***@h:6380/1" and cfg.redis_budget_bytes == 2**30
    assert "redis_url" not in cfg.settings_changed()


def test_a_shared_hit_can_be_recorded_and_timed():
    from cachecraft.catalog import RequestChunk
    from cachecraft.policy.loading import FULL_WEIGHT_BYTES, CostModel

    assert RequestChunk(0, "c1", "v1", "redis").tier == "redis"
    model = CostModel(prefill_s_per_token_layer=1e-5, num_layers=4, kv_bytes_per_token_layer=1024)
    assert 0.0 <= model.r_load("redis") <= 1.0
    timed = model.observe_load("redis", FULL_WEIGHT_BYTES, 0.01)  # a full-size load sets it
    assert timed.bandwidths["redis"] == pytest.approx(FULL_WEIGHT_BYTES / 0.01)


@pytest.mark.parametrize("stream_kv", [True, False])
def test_a_second_node_answers_from_the_first_nodes_caches(tmp_path, redis_server, monkeypatch, stream_kv):  # noqa: F811
    """End to end on the tiny model: node A answers and stores; node B, with its own cache
    directory and catalog, reuses A's chunk-caches through Redis, exactly."""
    from cachecraft.pipeline import Pipeline
    from cachecraft.policy.planner import PolicyParams
    from tests.conftest import tiny_model
    from tests.test_pipeline import CHUNKS, QUESTION, traced

    monkeypatch.setattr("cachecraft.policy.loading.MIN_OBSERVED_BYTES", 0)  # the tiny caches are timed

    def run(name: str):
        config = Config.load(overrides={"cache_dir": tmp_path / name, "max_new_tokens": 4, "kv_dtype": "float32",
                                        "redis_url": redis_server.url, "stream_kv": stream_kv}, environ={})
        with TieredStore(config, tiers=("cpu", "disk")) as store:
            pipe = Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(alpha=0.5, check_layer=2))
            answer = traced(pipe, CHUNKS, QUESTION)
            record = pipe.catalog.get_request(answer.request_id)
            return answer, record, pipe.cost_model, store.locate(answer.chunks[0].variant or "")

    first, _, _, _ = run("a")
    assert all(c.tier == "miss" for c in first.chunks)
    second, record, cost_model, now = run("b")
    assert second.recompute_fraction == 0.0 and second.text == first.text
    assert (second.logits - first.logits).abs().max() < 1e-4
    assert all(c.tier == "redis" for c in second.chunks)
    assert [c.tier for c in record.chunks] == ["redis"] * len(CHUNKS)
    assert now in ("cpu", "disk")  # promoted into node b's local tiers
    assert "redis" in cost_model.bandwidths  # the loader timed the shared tier


def test_a_password_in_the_url_is_used_and_a_wrong_one_is_a_miss(tmp_path, caplog):
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        kv = make_kv(1)
        with node(tmp_path, "a", server.url) as a:
            a.put(kv)
            assert a.shared.contains(kv.variant)
        wrong = server.url.replace("s3cret", "nope")
        with node(tmp_path, "b", wrong) as b, caplog.at_level(logging.WARNING):
            assert b.get(kv.variant) is None and b.shared.counters.errors == 1
        assert "nope" not in caplog.text and "s3cret" not in caplog.text
    finally:
        server.stop()


def test_server_stopped_during_a_layer_read_fails_that_read_without_blaming_the_value(tmp_path, redis_server):  # noqa: F811
    kv = make_kv(1, layers=4)
    with node(tmp_path, "a", redis_server.url) as a:
        a.put(kv)
    with node(tmp_path, "b", redis_server.url) as b:
        reader = b.iter_layers(kv.variant)
        layers = iter(reader)
        k0, _ = next(layers)
        assert bits_equal(k0, kv.keys[0].to(F16))
        redis_server.stop()
        with pytest.raises(CorruptEntryError, match="shared tier"):  # the caller recomputes the chunk
            list(layers)
        assert b.shared.counters.corrupt == 0 and b.locate(kv.variant) is None
        redis_server.start()


def test_a_damaged_index_entry_is_dropped_not_raised(tmp_path, redis_server, client):  # noqa: F811
    kvs = [make_kv(1), make_kv(2)]
    with node(tmp_path, "a", redis_server.url) as a:
        for kv in kvs:
            a.put(kv)
        for kv in kvs:
            client.hset(f"{shared_mod.PREFIX}meta", kv.variant, b"{not json")
        assert a.shared.variants_of(kvs[0].chunk) == []
        assert a.shared.get(kvs[0].variant) is None and a.shared.open(kvs[1].variant) is None
        assert a.shared.counters.corrupt == 2 and a.shared.count() == 0
        assert client.exists(blob_key(kvs[0]), blob_key(kvs[1])) == 0


def test_tls_through_the_url(tmp_path):
    server = RedisServer(tmp_path, password="pw", tls=True).start()
    try:
        kv = make_kv(1)
        with node(tmp_path, "a", server.url) as a:
            a.put(kv)
        with node(tmp_path, "b", server.url) as b:
            assert same_kv(b.get(kv.variant), kv, F16) and b.shared.counters.errors == 0
        plain = server.url.replace("rediss://", "redis://").split("?")[0]  # no TLS: refused, a miss
        with node(tmp_path, "c", plain) as c:
            assert c.get(kv.variant) is None and c.shared.counters.errors == 1
    finally:
        server.stop()


def test_several_node_processes_share_one_redis_within_its_budget(tmp_path, redis_server, client):  # noqa: F811
    """Three node processes put and read at once under a budget that forces evictions:
    no damaged read, and the byte count the Lua scripts keep is exact."""
    import json
    import multiprocessing as mp

    from tests.process_helpers import run_to_end
    from tests.shared_workers import node_kv, node_worker

    nodes, count = 3, 12
    size = len(encode(to_stored(node_kv(0, 0), F16)).data)
    budget = 10 * size  # fewer than the 36 entries: evictions race
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "cachecraft.store", "tests.shared_workers"])
    barrier = ctx.Barrier(nodes)
    outs = [tmp_path / f"node-{n}.json" for n in range(nodes)]
    procs = [ctx.Process(target=node_worker, args=(str(tmp_path / f"node-{n}"), redis_server.url, budget, n,
                                                   nodes, count, barrier, str(outs[n]))) for n in range(nodes)]
    assert run_to_end(procs, 240) == [0] * nodes
    results = [json.loads(o.read_text()) for o in outs]
    assert [r["errors"] for r in results] == [[]] * nodes
    assert all(r["counters"]["corrupt"] == 0 and r["counters"]["errors"] == 0 for r in results)
    assert sum(r["hits"] for r in results) > 0
    used = int(client.get(f"{shared_mod.PREFIX}bytes"))
    assert used == sum(int(v) for v in client.hvals(f"{shared_mod.PREFIX}size")) <= budget
    assert client.hlen(f"{shared_mod.PREFIX}meta") == client.zcard(f"{shared_mod.PREFIX}used") == used // size
    blobs = [k for k in client.scan_iter(f"{shared_mod.PREFIX}blob:*")]
    assert len(blobs) == used // size  # no blob without its index entry, none left over


def test_evicting_a_document_reaches_copies_only_the_shared_tier_holds(tmp_path, redis_server, client):  # noqa: F811
    a_kv, b_kv, c_kv = make_kv(1), make_kv(2), make_kv(3)
    c_after_a = make_kv(3, prefix=(a_kv.chunk,))  # a second variant of c's chunk
    with node(tmp_path, "a", redis_server.url) as a:
        for kv, doc in ((a_kv, "a.md"), (b_kv, "b.md"), (c_kv, "c.md"), (c_after_a, "c.md")):
            a.put(kv, source=f"/docs/{doc}")
        a.close(persist=False)  # this node's copies are gone; Redis keeps its own, which no catalog row places
    with node(tmp_path, "a", redis_server.url) as a:
        assert [a.locate(kv.variant) for kv in (a_kv, b_kv, c_kv, c_after_a)] == ["redis"] * 4
        assert a.evict(variant=c_after_a.variant[:8]).removed == (c_after_a.variant,)  # one variant, c's other stays
        assert a.locate(c_after_a.variant) is None and a.locate(c_kv.variant) == "redis"
        report = a.evict_documents(["/docs/a.md", "/docs/never-cached.md"])
        assert report.removed == (a_kv.variant,) and report.unreached is None
        assert a.evict(source="b.md").removed == (b_kv.variant,)  # a file name naming one document
        with pytest.raises(SelectorError, match="no cached chunk comes from 'b.md'"):
            a.evict(source="b.md")
        assert a.evict(chunk=c_kv.chunk[:8]).removed == (c_kv.variant,)
        with pytest.raises(SelectorError, match="no cached chunk matches"):
            a.evict(chunk=c_kv.chunk[:8])
    assert client.hlen(f"{shared_mod.PREFIX}meta") == 0 and not list(client.scan_iter(f"{shared_mod.PREFIX}blob:*"))


def test_a_shared_tier_that_does_not_answer_an_eviction_is_named_and_a_later_one_finishes(tmp_path, redis_server,  # noqa: F811
                                                                                          client):
    kv, other = make_kv(1), make_kv(2)
    with node(tmp_path, "a", redis_server.url) as a:
        a.put(kv, source="/docs/a.md")
        a.put(other, source="/docs/b.md")
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # hung: every call times out
        try:
            report = a.evict_documents(["/docs/a.md"])
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert report.removed == (kv.variant,) and report.unreached == a.shared.where  # this node's copies went
        assert report.to_dict()["unreached"] == a.shared.where
        assert a.locate(kv.variant) is None and client.exists(blob_key(kv))  # Redis's stayed
        a.shared._retry_at = 0.0  # the backoff has passed
        again = a.evict(source="/docs/a.md")
        assert again.removed == (kv.variant,) and again.unreached is None
        assert not client.exists(blob_key(kv)) and client.exists(blob_key(other))
