"""In-context variants: each chunk's cache made after its nearest chunks in the index."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from cachecraft.bench.quality import compare_methods, run_quality
from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.engine import Segment, blended_prefill
from cachecraft.evaluation import InContext, item_chunks
from cachecraft.kv import chunk_key, variant_key
from cachecraft.methods import parse_methods
from cachecraft.pipeline import Pipeline
from cachecraft.pipeline.core import in_shard
from cachecraft.policy.planner import PolicyParams
from cachecraft.retrieval.index import ChunkIndex
from cachecraft.store import TieredStore
from tests.conftest import tiny_model

CHUNKS = [" ".join(f"w{i}" for i in range(10 + 20 * j, 30 + 20 * j)) + "\n\n" for j in range(3)]
QUESTION = "w200 w201 w202"


def _at(degrees: float) -> list[float]:
    return [math.cos(math.radians(degrees)), math.sin(math.radians(degrees))]


def test_index_neighbours_are_the_nearest_others_and_never_the_same_text():
    # unit vectors on a circle: similarity falls with the angle between them
    angles, texts = [0, 10, 30, 70, 1], ["a", "b", "c", "d", "a"]  # row 4 repeats row 0's text
    index = ChunkIndex(2)
    index.add(np.array([_at(a) for a in angles], dtype=np.float32), texts, [f"s{i}" for i in range(5)])
    assert index.neighbours(2) == [[1, 2],  # 0 deg: 10 (10 away), 30 (30); never row 4, the same text
                                   [4, 0],  # 10 deg: 1 (9 away), 0 (10)
                                   [1, 4],  # 30 deg: 10 (20 away), 1 (29)
                                   [2, 1],  # 70 deg: 30 (40 away), 10 (60)
                                   [1, 2]]  # 1 deg: 10 (9 away), 30 (29)
    assert index.neighbours(0) == [[]] * 5
    assert ChunkIndex(2).neighbours(3) == []


@pytest.fixture
def pipeline(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32",
                                    "warm_context": "none"}, environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        yield Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(alpha=0.5, check_layer=2))


def test_a_variant_made_after_its_neighbour_is_that_prefill_and_is_reused_exactly(pipeline):
    pipe = pipeline
    assert pipe.warm(CHUNKS) == 3
    assert pipe.warm_after([(CHUNKS[0], CHUNKS[1])]) == 1
    assert pipe.warm_after([(CHUNKS[0], CHUNKS[1])]) == 0  # already stored
    pieces = pipe.builder.build(CHUNKS, "warm")
    prefix_key = chunk_key(pipe.lm.fingerprint, pieces.prefix)
    key0, key1 = (chunk_key(pipe.lm.fingerprint, ids) for ids in pieces.chunks[:2])
    name = variant_key(key1, (prefix_key, key0))
    assert {tuple(r.prefix) for r in pipe.store.variants_of(key1)} == {(prefix_key,), (prefix_key, key0)}
    by_hand = blended_prefill(pipe.lm.adapter, [Segment(pieces.prefix, "prefix"), Segment(pieces.chunks[0]),
                                                Segment(pieces.chunks[1], save=True)]).saved[2]
    stored = pipe.store.get(name, dtype=torch.float32, device=torch.device("cpu"), fingerprint=pipe.lm.fingerprint)
    assert (stored.keys - by_hand.keys).abs().max() < 1e-5 and (stored.values - by_hand.values).abs().max() < 1e-5

    # a request that puts chunk 0 right before chunk 1 reuses both exactly: a full prefill's answer
    traces = []
    answer = pipe.answer(CHUNKS[:2], QUESTION, observer=traces.append, record=False)
    full_traces = []
    full = pipe.answer(CHUNKS[:2], QUESTION, method="full", observer=full_traces.append, record=False)
    assert [c.variant for c in answer.chunks] == [variant_key(key0, (prefix_key,)), name]
    assert answer.recompute_fraction == 0.0 and all(c.cfo == 0.0 for c in answer.chunks)
    assert (traces[0].logits - full_traces[0].logits).abs().max() < 1e-4 and answer.text == full.text

    # with chunk 0 further ahead, chunk 1 still takes the variant that saw it (its whole context is there)
    apart = pipe.answer([CHUNKS[0], CHUNKS[2], CHUNKS[1]], QUESTION, record=False)
    assert apart.chunks[2].variant == name and apart.chunks[2].cfo == 0.0
    # and without chunk 0, the variant made after the system prompt alone
    alone = pipe.answer([CHUNKS[2], CHUNKS[1]], QUESTION, record=False)
    assert alone.chunks[1].variant == variant_key(key1, (prefix_key,))


def test_a_variant_follows_its_neighbours_own_stored_cache_made_first_if_missing(cache_dir):
    # with a warm context, a chunk's own cache differs from a fresh prefill of it; a request
    # that puts it first reuses that cache, so its neighbour's variant is made after it
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32"},
                         environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store)
        assert pipe.warm_after([(CHUNKS[0], CHUNKS[1])]) == 1  # chunk 0 never warmed
        pieces = pipe.builder.build(CHUNKS[:2], "warm")
        prefix_key = chunk_key(pipe.lm.fingerprint, pieces.prefix)
        key0, key1 = (chunk_key(pipe.lm.fingerprint, ids) for ids in pieces.chunks)
        context_key = pipe._warm_key_of(prefix_key)
        assert context_key is not None
        get = lambda name: pipe.store.get(name, dtype=torch.float32, device=torch.device("cpu"),  # noqa: E731
                                          fingerprint=pipe.lm.fingerprint)
        own = get(variant_key(key0, context_key))  # made on the way, as warm makes it
        assert [tuple(r.prefix) for r in pipe.store.variants_of(key0)] == [context_key]
        prefix = Segment(pieces.prefix, "prefix")
        after_own = blended_prefill(pipe.lm.adapter, [prefix, Segment(pieces.chunks[0], cached=own),
                                                      Segment(pieces.chunks[1], save=True)]).saved[2]
        after_fresh = blended_prefill(pipe.lm.adapter, [prefix, Segment(pieces.chunks[0]),
                                                        Segment(pieces.chunks[1], save=True)]).saved[2]
        stored = get(variant_key(key1, (prefix_key, key0)))
        assert (stored.keys - after_own.keys).abs().max() < 1e-5
        assert (stored.values - after_own.values).abs().max() < 1e-5
        assert (stored.values - after_fresh.values).abs().max() > 1e-3  # the difference is real


def test_each_reused_variant_has_what_the_request_saved_folded_into_its_quality(pipeline):
    pipe = pipeline
    pipe.warm(CHUNKS)
    pipe.warm_after([(CHUNKS[0], CHUNKS[1])])
    order = [CHUNKS[2], CHUNKS[0], CHUNKS[1]]

    def qualities() -> dict[str, float]:
        with pipe.store.catalog.read() as tx:
            return {r.key: r.quality for r in tx.stored_variants()}

    stored = qualities()
    pipe.keep_new_variants = False  # a benchmark's pipeline measures without teaching the store
    first = pipe.answer(order, QUESTION, record=False)
    assert qualities() == stored
    chosen = [c.variant for c in first.chunks]
    pipe.keep_new_variants = True
    answer = pipe.answer(order, QUESTION, record=False)
    assert [c.variant for c in answer.chunks] == chosen and answer.chunks[2].cfo == 0.0
    assert [c.fraction for c in answer.chunks] == [c.fraction for c in first.chunks]
    assert len({c.fraction for c in answer.chunks}) > 1  # the shares saved differ between chunks
    for c in answer.chunks:  # halfway from the stored quality to 1 - the share recomputed
        assert pipe.store.info(c.variant).quality == pytest.approx(stored[c.variant] + 0.5 * (1 - c.fraction
                                                                                             - stored[c.variant]))


def _chunk_key_of(pipe: Pipeline, text: str) -> str:
    """The key of one chunk text's cache."""
    return chunk_key(pipe.lm.fingerprint, pipe.builder.build([text], "w").chunks[0])


@pytest.fixture
def corpus_pipeline(cache_dir, tmp_path):
    """A tiny-model pipeline over a small ingested corpus, warming one neighbour per chunk."""
    from tests.test_pipeline import _write_docs

    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32", "chunk_tokens": 24,
                                    "warm_context": "none", "warm_neighbours": 1}, environ={})
    with TieredStore(config, tiers=("cpu", "disk")) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store)
        pipe.ingest([_write_docs(tmp_path / "docs")])
        yield pipe


def test_warm_with_neighbours_makes_each_chunk_after_its_nearest_chunks(corpus_pipeline):
    pipe = corpus_pipeline
    chunks = pipe.corpus.chunks()
    near = pipe.corpus.neighbours(1)
    assert set(near) == {c.id for c in chunks} and all(len(v) == 1 and v[0].id != k for k, v in near.items())
    report = pipe.warm_corpus()
    assert (report.made, report.in_context) == (len(chunks), len(chunks))
    again = pipe.warm_corpus()
    assert (again.made, again.in_context, again.skipped) == (0, 0, len(chunks))
    key_of = functools.partial(_chunk_key_of, pipe)
    prefix_key = chunk_key(pipe.lm.fingerprint, pipe.builder.build([chunks[0].prompt_text], "w").prefix)
    for chunk in chunks:
        other = near[chunk.id][0]
        assert pipe.store.contains(variant_key(key_of(chunk.prompt_text), (prefix_key, key_of(other.prompt_text))))
        assert pipe.catalog.chunk(key_of(chunk.prompt_text)).source == chunk.source


def test_warm_previous_makes_each_chunk_after_the_one_before_it_and_a_document_order_query_reuses_it(
        corpus_pipeline):
    pipe = corpus_pipeline
    pipe.config = pipe.config.replace(warm_neighbours=0, warm_previous=True)
    chunks = pipe.corpus.chunks()
    previous = pipe.corpus.previous_chunks()
    firsts = {c.id for c in chunks if c.position == 0}
    assert set(previous) == {c.id for c in chunks} - firsts  # _write_docs' files hold no repeated text
    report = pipe.warm_corpus()
    assert (report.made, report.in_context) == (len(chunks), len(previous))
    key_of = functools.partial(_chunk_key_of, pipe)
    prefix_key = chunk_key(pipe.lm.fingerprint, pipe.builder.build([chunks[0].prompt_text], "w").prefix)
    for chunk_id, before in previous.items():
        chunk = next(c for c in chunks if c.id == chunk_id)
        assert pipe.store.contains(variant_key(key_of(chunk.prompt_text), (prefix_key, key_of(before.prompt_text))))
    # a file's first two chunks, retrieved in the file's order: the second comes right after
    # the first, so its variant made after it is its exact context and nothing is recomputed
    first, second = (c for c in chunks if c.source == chunks[0].source and c.position < 2)
    answer = pipe.answer([first.prompt_text, second.prompt_text], "w1 w2", method="cachecraft", record=False)
    assert answer.chunks[1].variant == variant_key(key_of(second.prompt_text), (prefix_key, key_of(first.prompt_text)))
    assert answer.chunks[1].fraction == 0.0


def test_sharded_warm_makes_every_variant_after_the_shards_own_caches_and_counts_each_once(corpus_pipeline):
    """Two shards as two workers would run them: shard 0 waits (``between``) until shard 1
    has made its own caches, so no variant of shard 0 makes a neighbour's cache that shard 1
    then skips: every chunk is counted made once, by its own shard."""
    pipe = corpus_pipeline
    chunks = pipe.corpus.chunks()
    key_of = functools.partial(_chunk_key_of, pipe)
    mine = [c for c in chunks if in_shard(c.id, (0, 2))]
    assert 0 < len(mine) < len(chunks)  # both shards hold chunks
    seen = []

    def other_shard_makes_its_own():
        assert all(pipe.store.variants_of(key_of(c.prompt_text)) for c in mine)
        assert not any(pipe.store.variants_of(key_of(c.prompt_text)) for c in chunks if c not in mine)
        seen.append(pipe.warm([c.prompt_text for c in chunks if c not in mine]))

    first = pipe.warm_corpus(shard=(0, 2), between=other_shard_makes_its_own)
    assert seen == [len(chunks) - len(mine)]
    assert (first.made, first.skipped, first.in_context) == (len(mine), 0, len(mine))
    second = pipe.warm_corpus(shard=(1, 2), between=lambda: None)
    assert (second.made, second.in_context) == (0, len(chunks) - len(mine))  # made above, as worker 1 would
    plain = pipe.warm_corpus(shard=(0, 2), between=lambda: seen.append("called"))
    assert plain.made == 0 and seen[-1] == "called"


def test_warm_neighbours_is_a_checked_config_key(cache_dir):
    from cachecraft.config import ConfigError

    with pytest.raises(ConfigError, match="warm_neighbours must be 0 to 8"):
        Config.load(overrides={"cache_dir": cache_dir, "warm_neighbours": 9}, environ={})
    assert Config.load(overrides={"cache_dir": cache_dir}, environ={"CACHECRAFT_WARM_NEIGHBOURS": "2"}).warm_neighbours == 2


def test_in_context_runs_come_last_and_are_paired_with_their_plain_run(tiny_llama, dataset, tmp_path):
    item = load_items(dataset, limit=1)[0]
    config = Config.load(overrides={"cache_dir": tmp_path / "bench", "max_new_tokens": 3, "warm_context": "none",
                                    "policy_check_layer": 2}, environ={})
    chunks = item_chunks(item)
    angles = [20.0 * i for i in range(len(chunks))]  # passage i's nearest is i - 1 (i + 1 for the first)
    embed = lambda texts: np.array([_at(angles[chunks.index(t)]) for t in texts], dtype=np.float32)  # noqa: E731
    plain = parse_methods("cachecraft@0.5,reuse")
    methods = [InContext(plain[0], 1, embed), *plain]
    result = run_quality(tiny_llama, config, [item], methods, max_new_tokens=3)
    labels = [r["method"] for r in result["items"]]
    assert labels == ["full", "cachecraft@0.5", "reuse", "cachecraft@0.5+nb1"]
    row = result["items"][-1]
    assert row["in_context_variants"] == len(chunks)  # one per passage
    # passages 1.. are preceded by their nearest passage: the in-context variants serve them exactly
    assert row["recompute_fraction"] < result["items"][1]["recompute_fraction"]
    assert set(result["comparisons"]["cachecraft@0.5+nb1"]) == {"vs full", "vs cachecraft@0.5"}


def test_an_in_context_run_is_paired_with_the_baselines_run_over_the_same_prompts():
    rows = []
    for item, (plain, nb, blend_nb, order) in enumerate([(0.4, 0.1, 0.3, 0.2), (0.2, 0.1, 0.2, 0.1)]):
        for method, kl in (("full", 0.0), ("cachecraft", plain), ("full+nb2", order), ("cachecraft+nb2", nb),
                           ("cacheblend@0.15+nb2", blend_nb)):
            rows.append({"item": item, "method": method, "kl": kl, "answer_kl": kl, "token_agreement": 1.0,
                         "agreement_f1": 1.0, "exact_match": 1.0, "gold_f1": 0.5})
    out = compare_methods(rows, ["full", "cachecraft", "full+nb2", "cachecraft+nb2", "cacheblend@0.15+nb2"])
    assert set(out["cachecraft+nb2"]) == {"vs full", "vs cachecraft", "vs cacheblend@0.15+nb2"}
    assert out["cachecraft+nb2"]["vs cacheblend@0.15+nb2"]["answer_kl"]["mean"] == pytest.approx(
        ((0.1 - 0.3) + (0.1 - 0.2)) / 2)
    assert set(out["full+nb2"]) == {"vs full"}


def test_compare_methods_pairs_an_in_context_run_with_its_plain_run():
    rows = []
    for item, (full, plain, nb) in enumerate([(0.0, 0.4, 0.1), (0.0, 0.2, 0.1), (0.0, 0.3, 0.2)]):
        for method, kl in (("full", full), ("qguided@0.05", plain), ("qguided@0.05+nb2", nb)):
            rows.append({"item": item, "method": method, "kl": kl, "answer_kl": kl, "token_agreement": 1.0,
                         "agreement_f1": 1.0, "exact_match": 1.0, "gold_f1": 0.5})
    out = compare_methods(rows, ["full", "qguided@0.05", "qguided@0.05+nb2"])
    diff = out["qguided@0.05+nb2"]["vs qguided@0.05"]["answer_kl"]
    assert diff["mean"] == pytest.approx(((0.1 - 0.4) + (0.1 - 0.2) + (0.2 - 0.3)) / 3)
    assert InContext.base_label("cachecraft+nb1") == "cachecraft" and InContext.base_label("cachecraft") is None
    assert InContext.base_label("x+nbz") is None


def test_neighbours_come_from_a_pool_when_one_is_given():
    """On a circle of unit vectors (similarity falls with the angle): without a pool a
    passage's neighbours are the item's other passages; with one, the pool's passages,
    its own text never among them, each pool text once however often it appears."""
    where = {"a": 0, "b": 50, "c": 100, "p": 10, "q": 45, "r": 95, "s": 170}
    embed = lambda texts: np.array([_at(where[t]) for t in texts], dtype=np.float32)  # noqa: E731
    method = parse_methods("reuse")[0]
    assert InContext(method, 1, embed).nearest(["a", "b", "c"]) == [["b"], ["a"], ["b"]]  # 50, 50, 50 away
    pooled = InContext(method, 2, embed, pool=["p", "q", "r", "s", "b", "q"])
    assert pooled.pool == ["p", "q", "r", "s", "b"]
    # a (0): p 10, q 45 away; b (50, in the pool): q 5, p 40 - never b itself; c (100): r 5, b 50
    assert pooled.nearest(["a", "b", "c"]) == [["p", "q"], ["q", "p"], ["r", "b"]]
    with pytest.raises(ValueError, match="at least two different"):
        InContext(method, 1, embed, pool=["p", "p"])
    # given the chunk before each in its file, that one alone, whatever the embedding says
    before = InContext(method, 1, embed, previous={"b": "a", "c": "s"})
    assert before.nearest(["a", "b", "c"]) == [[], ["a"], ["s"]]


@pytest.fixture
def ordering_pipeline(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32",
                                    "warm_context": "none", "chunk_order": "cache"}, environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        yield Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(alpha=0.5, check_layer=2))


def test_lookup_links_name_the_chunks_each_variant_was_made_right_after(ordering_pipeline):
    pipe = ordering_pipeline
    pipe.warm(CHUNKS[:2])
    pipe.warm_after([(CHUNKS[2], CHUNKS[0]), (CHUNKS[1], CHUNKS[0])])
    given = [CHUNKS[1], CHUNKS[0], CHUNKS[2]]
    pieces = pipe.builder.build(given, "q")
    keys = [chunk_key(pipe.lm.fingerprint, ids) for ids in pieces.chunks]
    request = pipe._request(given, "q", None)
    # chunk 0 (given second) was made after chunks 2 and 1; every chunk after the prompt alone,
    # chunk 2 too: its own cache, missing, was made for chunk 0's variant to follow
    assert request.lookup.links(keys, request.prefix_key) == ([set(), {0, 2}, set()], {0, 1, 2})
    # under another system prompt nothing links
    assert request.lookup.links(keys, "another prompt") == ([set(), set(), set()], set())


def test_cache_order_puts_a_chunk_after_its_neighbour_and_answers_as_full_over_that_order(ordering_pipeline):
    pipe = ordering_pipeline
    pipe.warm(CHUNKS)
    pipe.warm_after([(CHUNKS[2], CHUNKS[0])])  # chunk 0's cache made right after chunk 2
    traces, full_traces = [], []
    answer = pipe.answer(CHUNKS, QUESTION, observer=traces.append, record=False)
    # chains [1] and [2, 0]; [2, 0] holds the first chunk given, so it comes first
    assert answer.order == [2, 0, 1] and answer.to_dict()["order"] == [2, 0, 1]
    moved = [CHUNKS[2], CHUNKS[0], CHUNKS[1]]
    pieces = pipe.builder.build(moved, QUESTION)
    assert traces[0].token_ids.tolist() == pieces.token_ids
    prefix_key = chunk_key(pipe.lm.fingerprint, pieces.prefix)
    key2, key0 = (chunk_key(pipe.lm.fingerprint, pieces.chunks[i]) for i in (0, 1))
    # chunk 2 first, and chunk 0 right after it, are their variants' own contexts: nothing
    # of either is recomputed (chunk 1, after both, is approximate)
    assert answer.chunks[1].variant == variant_key(key0, (prefix_key, key2))
    assert answer.chunks[0].cfo == answer.chunks[1].cfo == 0.0
    assert answer.chunks[0].fraction == answer.chunks[1].fraction == 0.0
    # full orders alike, and is the plain full prefill of that order
    full = pipe.answer(CHUNKS, QUESTION, method="full", observer=full_traces.append, record=False)
    assert full.order == [2, 0, 1]
    pipe.config = pipe.config.replace(chunk_order="given")
    given_traces = []
    plain = pipe.answer(moved, QUESTION, method="full", observer=given_traces.append, record=False)
    assert plain.order is None and plain.text == full.text
    assert torch.equal(full_traces[0].logits, given_traces[0].logits)
    assert pipe.answer(CHUNKS, QUESTION, method="reuse", record=False).order is None


def test_the_chunk_order_is_a_checked_config_key(cache_dir):
    with pytest.raises(Exception, match="chunk_order must be one of"):
        Config.load(overrides={"cache_dir": cache_dir, "chunk_order": "random"}, environ={})


def test_with_cache_order_the_in_context_runs_are_compared_with_full_over_their_order(tiny_llama, dataset,
                                                                                      tmp_path):
    item = load_items(dataset, limit=1)[0]
    config = Config.load(overrides={"cache_dir": tmp_path / "bench", "max_new_tokens": 3, "warm_context": "none",
                                    "policy_check_layer": 2, "chunk_order": "cache"}, environ={})
    chunks = item_chunks(item)
    # passage i's nearest is i + 2 (the last two: i - 2): the variants ask for another order
    angles = [0.0, 100.0, 10.0, 110.0, 20.0, 120.0, 30.0, 130.0, 40.0, 140.0][:len(chunks)]
    embed = lambda texts: np.array([_at(angles[chunks.index(t)]) for t in texts], dtype=np.float32)  # noqa: E731
    plain = parse_methods("reuse")
    result = run_quality(tiny_llama, config, [item], [InContext(plain[0], 1, embed), *plain], max_new_tokens=3)
    rows = result["items"]
    assert [r["method"] for r in rows] == ["full", "reuse", "full+nb1", "reuse+nb1"]
    assert rows[0]["order"] is None or rows[0]["order"] == list(range(len(chunks)))
    reordered = rows[2]["order"]
    assert sorted(reordered) != reordered and sorted(reordered) == list(range(len(chunks)))
    assert rows[3]["order"] == reordered
    assert rows[2]["answer_kl"] > 0  # full over the new order, against full over the given one
    # each against its own reference: the order's effect against full's given order only
    assert set(result["comparisons"]["reuse+nb1"]) == {"vs full", "vs reuse"}
    assert set(result["comparisons"]["full+nb1"]) == {"vs full"}


def test_each_source_is_paired_with_its_chunk_wherever_the_prompt_held_it():
    from cachecraft.pipeline.reports import Answer, ChunkReport, Source

    chunks = [ChunkReport(i, f"key{i}", 5, "cpu", None, None, None, None, 0.0, None) for i in range(3)]
    sources = [Source(f"id{i}", f"title{i}", f"file{i}", 1.0 - i / 10, "text") for i in range(3)]
    # the prompt held the third source first, then the first, then the second
    answer = Answer("x", "cachecraft", 0.1, 20, 1, 0.0, chunks, sources=sources, order=[2, 0, 1])
    assert [(s.id, c.position) for s, c in answer.chunk_of_source()] == [("id0", 1), ("id1", 2), ("id2", 0)]
    plain = Answer("x", "cachecraft", 0.1, 20, 1, 0.0, chunks, sources=sources)
    assert [(s.id, c.position) for s, c in plain.chunk_of_source()] == [("id0", 0), ("id1", 1), ("id2", 2)]


def test_the_same_chunks_asked_in_another_order_are_put_back_in_the_order_their_caches_saw(ordering_pipeline):
    pipe = ordering_pipeline
    first = pipe.answer(CHUNKS, QUESTION, record=False)  # every chunk a miss: each kept after those before it
    assert first.order == [0, 1, 2] and all(c.tier == "miss" for c in first.chunks)
    again_traces, full_traces = [], []
    again = pipe.answer([CHUNKS[2], CHUNKS[0], CHUNKS[1]], QUESTION, observer=again_traces.append, record=False)
    # chunk 0 was kept after the system prompt alone, 1 after 0, 2 after 0 and 1: that order again,
    # every chunk reused as it was made, nothing recomputed, full's answer over that order
    assert again.order == [1, 2, 0]
    assert all(c.tier != "miss" and c.cfo == 0.0 and c.fraction == 0.0 for c in again.chunks)
    full = pipe.answer(CHUNKS, QUESTION, method="full", observer=full_traces.append, record=False)
    assert full.order == [0, 1, 2]
    assert (again_traces[0].logits - full_traces[0].logits).abs().max() < 1e-4 and again.text == full.text
