"""LayerStream: a request's chunk-caches read layer by layer on a background thread."""

from __future__ import annotations

import pytest
import torch

from cachecraft.config import Config
from cachecraft.engine import Segment, blended_prefill
from cachecraft.evaluation import answer_traced
from cachecraft.pipeline import Pipeline
from cachecraft.policy.planner import PolicyParams
from cachecraft.selection import create_chunk_cache
from cachecraft.store import CorruptEntryError, LayerStream, TieredStore
from cachecraft.store.streaming import host_copy_bandwidth
from tests.conftest import tiny_model
from tests.store_helpers import bits_equal, config, disk_blob_files, flip_byte, make_kv


@pytest.fixture
def store(cache_dir):
    with TieredStore(config(cache_dir), tiers=("cpu", "disk")) as opened:
        yield opened


def test_memory_tier_layers_arrive_bit_for_bit_with_the_variant_metadata(store):
    kv = make_kv(1, layers=3, prefix=("system", "other"))
    store.put(kv)
    reader = store.iter_layers(kv.variant)
    assert reader.tier == "cpu"
    with LayerStream([reader]) as stream:
        (got,) = stream.kvs
        assert got.variant == kv.variant and got.token_ids == kv.token_ids and got.prefix == kv.prefix
        assert got.prefix_tokens == kv.prefix_tokens and got.fingerprint == kv.fingerprint
        assert got.num_tokens == 8 and got.num_layers == 3 and got.tier == "cpu"
        assert bits_equal(got.stats.outside, kv.stats.outside)
        for layer in range(3):
            k, v = got.layer(layer)
            assert bits_equal(k, kv.keys[layer].half()) and bits_equal(v, kv.values[layer].half())
        stored = store._memory_tiers()[0].get(kv.variant).kv  # handed over as held, not copied
        assert got.layer(2)[1].data_ptr() == stored.values[2].data_ptr() and got.layers_read == 3
    assert stream.read_bytes == {} and stream.read_seconds == {}  # nothing was read


def test_disk_layers_stream_in_and_the_entry_is_promoted_when_read_to_the_end(cache_dir):
    kvs = [make_kv(10 + i, layers=4, tokens=6 + i) for i in range(3)]
    with TieredStore(config(cache_dir), tiers=("disk",)) as writer:
        for kv in kvs:
            writer.put(kv)
    with TieredStore(config(cache_dir), tiers=("cpu", "disk")) as store:
        readers = [store.iter_layers(kv.variant) for kv in kvs]
        assert [r.tier for r in readers] == ["disk"] * 3 and all(r.held() is None for r in readers)
        stream = LayerStream(readers)
        for layer in reversed(range(4)):  # any order of asking works
            for got, kv in zip(stream.kvs, kvs):
                k, v = got.layer(layer)
                assert bits_equal(k, kv.keys[layer].half()) and bits_equal(v, kv.values[layer].half())
        stream.close()
        assert all(got.layers_read == 4 for got in stream.kvs)
        assert [store.locate(kv.variant) for kv in kvs] == ["cpu"] * 3
        assert bits_equal(stream.kvs[1].layer(0)[0], kvs[1].keys[0].half())  # still held after close
        with pytest.raises(IndexError):
            stream.kvs[0].layer(4)


def test_a_damaged_layer_fails_its_own_variant_and_the_others_stream_on(cache_dir):
    sound, damaged = make_kv(20, layers=4, stats=False, prefix=("system",)), make_kv(21, layers=4, stats=False)
    with TieredStore(config(cache_dir), tiers=("disk",)) as store:
        store.put(damaged)
        (path,) = disk_blob_files(store).values()
        flip_byte(path, offset_from_end=2)  # the last tensor written: a late layer
        store.put(sound)
        stream = LayerStream([store.iter_layers(damaged.variant), store.iter_layers(sound.variant)])
        bad, good = stream.kvs
        assert good.prefix == ("system",) and good.prefix_tokens == sound.prefix_tokens == (5,)  # read from disk
        assert bits_equal(bad.layer(0)[0], damaged.keys[0].half())
        with pytest.raises(CorruptEntryError, match="recompute"):
            for layer in range(4):
                bad.layer(layer)
        for layer in range(4):
            assert bits_equal(good.layer(layer)[1], sound.values[layer].half())
        stream.close()
        assert store.locate(damaged.variant) is None and store.counters.corrupt == 1
        # Timed for the loading controller: the sound variant's 4 layers, the 3 of the damaged one
        # before its last, in float16.
        assert stream.read_bytes == {"disk": 2 * (4 + 3) * damaged.keys[0].numel() * 2}
        assert stream.read_seconds["disk"] > 0
        assert store.locate(sound.variant) == "disk"


def test_an_empty_stream_starts_no_thread_and_closes():
    stream = LayerStream([])
    assert stream.kvs == []
    stream.close()


def test_blended_prefill_over_streamed_disk_caches_equals_the_same_caches_in_memory(cache_dir):
    lm = tiny_model("qwen2")
    prefix = Segment([1, 5, 6, 7], "prefix")
    chunks = [list(range(10 + 9 * j, 19 + 9 * j)) for j in range(3)]
    made = [create_chunk_cache(lm.adapter, [prefix], ids, fingerprint=lm.fingerprint) for ids in chunks]
    question = Segment([200, 201, 202], "question")
    with TieredStore(config(cache_dir), tiers=("disk",)) as store:
        for kv in made:
            store.put(kv)
        in_memory = [store.get(kv.variant) for kv in made]  # the stored float16 bytes, read whole
        with LayerStream([store.iter_layers(kv.variant) for kv in made]) as stream:
            streamed = blended_prefill(lm.adapter, [prefix, *(Segment(ids, cached=kv) for ids, kv
                                                             in zip(chunks, stream.kvs)), question])
    whole = blended_prefill(lm.adapter, [prefix, *(Segment(ids, cached=kv) for ids, kv in zip(chunks, in_memory)),
                                         question])
    assert torch.equal(streamed.logits, whole.logits)
    assert all(torch.equal(a, b) for a, b in zip(streamed.keys, whole.keys))


@pytest.mark.parametrize("stream_kv", [True, False])
def test_a_request_that_meets_a_damaged_cache_answers_as_if_it_were_never_stored(cache_dir, caplog, stream_kv):
    config_ = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32",
                                     "stream_kv": stream_kv}, environ={})
    chunks = [" ".join(f"w{i}" for i in range(10 + 20 * j, 30 + 20 * j)) + "\n\n" for j in range(3)]
    lm = tiny_model("llama")
    with TieredStore(config_, tiers=("disk",)) as store:
        pipe = Pipeline(config_, lm=lm, store=store, policy=PolicyParams(alpha=0.5, check_layer=2))
        first, first_trace = answer_traced(pipe, chunks, "w200 w201", "reuse")  # makes the caches
        with store.catalog.read() as tx:
            blob = tx.entry(store.variants_of(first.chunks[1].chunk)[0].key, "disk").blob
        path = disk_blob_files(store)[blob]
        flip_byte(path, offset=path.stat().st_size // 2)  # inside a layer: found only while streaming
        hits_before = store.counters.hits["disk"]
        again, again_trace = answer_traced(pipe, chunks, "w200 w201", "reuse")
        with store.catalog.read() as tx:
            variant_hits = [tx.variant(store.variants_of(c.chunk)[0].key).hits for c in again.chunks[::2]]
    assert [c.tier for c in again.chunks] == ["disk", "miss", "disk"]
    assert store.counters.corrupt == 1
    # Each cache was looked up once for the request, though a streamed one was read twice:
    # the prefix and the two sound chunks, plus the damaged one where it was opened before failing.
    assert store.counters.hits["disk"] - hits_before == (4 if stream_kv else 3)
    assert variant_hits == [1, 1]
    assert ("answering again without it" in caplog.text) == stream_kv  # read whole, it is a miss up front
    assert again.text == first.text and (again_trace.logits - first_trace.logits).abs().max() < 1e-5


def test_streamed_and_whole_loading_give_the_same_answer_bit_for_bit(cache_dir):
    chunks = [" ".join(f"w{i}" for i in range(10 + 15 * j, 25 + 15 * j)) + "\n\n" for j in range(3)]
    answers = {}
    for stream_kv in (True, False):
        config_ = Config.load(overrides={"cache_dir": cache_dir / str(stream_kv), "max_new_tokens": 4,
                                         "stream_kv": stream_kv}, environ={})
        with TieredStore(config_, tiers=("cpu", "disk")) as store:
            pipe = Pipeline(config_, lm=tiny_model("mistral"), store=store,
                            policy=PolicyParams(alpha=0.5, check_layer=2))
            pipe.warm(chunks)
            answers[stream_kv] = [answer_traced(pipe, chunks[::-1], "w200 w201", m)
                                  for m in ("reuse", "cacheblend", "cachecraft")]
    for (streamed, streamed_trace), (whole, whole_trace) in zip(answers[True], answers[False]):
        assert torch.equal(streamed_trace.logits, whole_trace.logits) and streamed.text == whole.text
        assert [c.tier for c in streamed.chunks] == [c.tier for c in whole.chunks]
        assert streamed.recompute_fraction == whole.recompute_fraction


def test_host_copy_bandwidth_is_bytes_over_the_fastest_copy():
    bandwidth = host_copy_bandwidth(torch.device("cpu"), nbytes=1024 * 1024, repeats=2)
    assert 0 < bandwidth < float("inf")


@pytest.mark.gpu
def test_on_a_gpu_the_pinned_tier_starts_at_its_measured_copy_speed(tmp_path):
    """Not the default 3 GB/s, which made big models' caches look slower to load than to
    recompute, so they were never loaded and the tier never timed."""
    from cachecraft.policy.loading import DEFAULT_BANDWIDTHS
    from tests.test_engine_gpu import cuda_model

    config = Config.load(overrides={"cache_dir": tmp_path, "stream_kv": True}, environ={})
    with TieredStore(config, tiers=("gpu", "cpu", "disk")) as store:
        pipe = Pipeline(config, lm=cuda_model("llama", torch.bfloat16), store=store)
        bandwidths = pipe.starting_bandwidths()
        assert bandwidths["gpu"] == float("inf") and bandwidths["disk"] == DEFAULT_BANDWIDTHS["disk"]
        # the measured copy, whatever this machine's speed (no timing threshold)
        assert pipe._host_bandwidth is not None and bandwidths["cpu"] == pipe._host_bandwidth
        assert 0 < bandwidths["cpu"] < float("inf")
        assert pipe.starting_bandwidths() == bandwidths  # measured once
