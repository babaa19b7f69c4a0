"""The workload trace and replay on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from cachecraft.bench.workload import (TraceRequest, build_trace, compare_runs, keep_worth, pooled_corpus,
                                       run_workload, warm_up)
from cachecraft.config import Config
from cachecraft.dataset import QAItem
from tests.conftest import tiny_model


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


ITEMS = [QAItem(words(250 + i, 3), tuple((f"w{i * 10 + j}", words(20 + 30 * i + 5 * j, 12)) for j in range(4)),
                (words(1, 1),)) for i in range(3)]


def fake_embed(texts):
    """Bag-of-words vectors: texts sharing words are similar."""
    out = np.zeros((len(texts), 320), dtype=np.float32)
    for row, text in enumerate(texts):
        for word in text.split():
            if word.startswith("w") and word[1:].rstrip(":").isdigit():
                out[row, int(word[1:].rstrip(":")) % 320] += 1
    out /= np.linalg.norm(out, axis=1, keepdims=True) + 1e-9
    return out


def test_trace_repeats_and_retrieves_top_k():
    trace, corpus = build_trace(ITEMS, 20, 3, embed=fake_embed, seed=1)
    assert corpus == 12 and len(trace) == 20
    assert all(len(r.chunks) == 3 and len(set(r.chunks)) == 3 for r in trace)
    assert len(set(trace)) < len(trace)  # popular requests repeat
    again, _ = build_trace(ITEMS, 20, 3, embed=fake_embed, seed=1)
    assert again == trace
    with pytest.raises(ValueError, match="top_k"):
        build_trace(ITEMS, 5, 13, embed=fake_embed)


def test_a_shifting_trace_draws_popularity_anew_every_n_requests():
    # Zipf 50: the top-ranked item takes every request, so each stretch shows its ranking.
    steady, _ = build_trace(ITEMS, 30, 2, zipf_s=50.0, embed=fake_embed, seed=5)
    assert len({r.item for r in steady}) == 1
    moving, _ = build_trace(ITEMS, 30, 2, zipf_s=50.0, embed=fake_embed, seed=5, shift_every=6)
    stretches = [{r.item for r in moving[i:i + 6]} for i in range(0, 30, 6)]
    assert all(len(s) == 1 for s in stretches) and len(set.union(*stretches)) > 1
    assert moving[:6] == steady[:6]  # the first stretch is the steady trace's
    with pytest.raises(ValueError, match="shift_every"):
        build_trace(ITEMS, 5, 2, embed=fake_embed, shift_every=-1)


def test_replay_counts_compute_and_compares_with_full(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    cache_dir.mkdir(parents=True)
    trace, _ = build_trace(ITEMS, 8, 3, embed=fake_embed, seed=2)
    result = run_workload(tiny_model("llama"), config, trace, ["prefix", "reuse", "cachecraft"],
                          budgets={"cpu": 1 << 20, "disk": 1 << 22}, max_new_tokens=3)
    methods = result["methods"]
    assert list(methods) == ["full", "prefix", "reuse", "cachecraft"]
    full = methods["full"]
    assert full["compute_reduction_vs_full"] == 0 and full["agreement_f1_mean"] == 1.0
    assert full["hit_rate"] == 0 and full["recompute_fraction_mean"] == 1.0
    assert methods["prefix"]["token_layers"] < full["token_layers"]  # repeated prompts reuse their blocks
    assert methods["cachecraft"]["token_layers"] < full["token_layers"]
    assert methods["cachecraft"]["hit_rate"] > 0
    assert len(result["requests"]) == 32
    full_rows = [r for r in result["requests"] if r["method"] == "full"]
    replayed = [r for r in full_rows if r.get("replayed")]
    assert len(replayed) == len(trace) - len(set(trace)) > 0  # each distinct request ran once
    assert all(set(r["store_bytes"]) == {"cpu", "disk"} for r in result["requests"])
    # each distinct chunk order numbered by its first ask, the same in every method's rows
    orders = {tuple(r.chunks) for r in trace}
    assert {r["order"] for r in result["requests"]} == set(range(len(orders)))
    assert len({(r["request"], r["order"]) for r in result["requests"]}) == len(trace)
    for name, m in methods.items():
        assert m["store_usage"]["cpu"]["bytes"] <= (1 << 20) or name in ("full", "prefix")


def test_keep_worth_counts_the_exact_asks_each_keep_served_by_hand():
    def row(n, order, f1=0.5, kept=False, exact=False):
        return {"request": n, "order": order, "agreement_f1": f1, "kept_exact": kept, "reused_exact": exact}

    rows = [row(0, 0, 1.0, exact=True),  # exact before any keep (a cold miss left it): no keep's
            row(1, 1, 0.4), row(2, 1, 0.6), row(3, 1, 1.0, kept=True),
            row(4, 1, 1.0, exact=True), row(5, 2, 0.2), row(6, 1, 1.0, exact=True),
            row(7, 1, 0.8),  # its variants lost: not exact, counted before the next keep
            row(8, 1, 1.0, kept=True),  # served nothing after it
            row(9, 2, 1.0, kept=True), row(10, 2, 1.0, exact=True),
            {"request": 11, "agreement_f1": 1.0, "kept_exact": True}]  # an older row: no order
    worth = keep_worth(rows)
    assert worth["keeps"] == [{"request": 3, "order": 1, "served": 2, "f1_before": 0.5},
                              {"request": 8, "order": 1, "served": 0, "f1_before": 0.8},
                              {"request": 9, "order": 2, "served": 1, "f1_before": 0.2}]
    assert worth["keep_asks_served"] == 3 and worth["keeps_serving_none"] == 1
    assert keep_worth([]) == {"keeps": [], "keep_asks_served": 0, "keeps_serving_none": 0}


def test_two_settings_are_compared_request_by_request_resampling_whole_orders_by_hand():
    def row(n, order, f1, ttft, kept=False):
        return {"request": n, "order": order, "agreement_f1": f1, "ttft_s": ttft, "kept_exact": kept,
                "reused_exact": False}

    trace_a = ([row(0, 0, 0.5, 2.0), row(1, 0, 1.0, 1.0)], [row(0, 0, 1.0, 1.0, kept=True), row(1, 0, 1.0, 1.0)])
    trace_b = ([row(0, 0, 1.0, 1.0)], [row(0, 0, 1.0, 2.0)])
    result = compare_runs([trace_a, trace_b])
    assert (result["requests"], result["clusters"]) == (3, 2)
    assert result["traces"][0] == {"base": {"requests": 2, "agreement_f1": 0.75, "ttft_s_mean": 1.5, "kept_exact": 0,
                                            "reused_exact": 0},
                                   "other": {"requests": 2, "agreement_f1": 1.0, "ttft_s_mean": 1.0, "kept_exact": 1,
                                             "reused_exact": 0}}
    # differences +0.5, 0 (trace a's one order) and 0 (trace b's): the mean 1/6; two orders
    # drawn: a twice (0.5 / 4, chance 1/4), a and b (1/6, 1/2), b twice (0, 1/4)
    assert result["agreement_f1_difference"] == {"mean": pytest.approx(1 / 6), "low": 0.0, "high": 0.25}
    # time, other over base: (2 + 2) / (3 + 1) = 1; a twice 4 / 6, b twice 2 / 1
    assert result["ttft_ratio"] == {"mean": 1.0, "low": pytest.approx(2 / 3), "high": 2.0}
    assert (result["requests_better"], result["requests_worse"]) == (1, 0)
    with pytest.raises(ValueError, match="trace 2: the two runs did not replay the same requests"):
        compare_runs([trace_a, ([row(0, 0, 1.0, 1.0)], [row(0, 1, 1.0, 1.0)])])


def test_eviction_policies_replay_cachecraft_under_each(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    cache_dir.mkdir(parents=True)
    trace, _ = build_trace(ITEMS, 6, 3, embed=fake_embed, seed=3)
    result = run_workload(tiny_model("llama"), config, trace, ["cachecraft"], evictions=["lru", "pgdsf"],
                          budgets={"cpu": 1 << 18, "disk": 1 << 19}, max_new_tokens=2)
    assert list(result["methods"]) == ["full", "cachecraft", "cachecraft[lru]", "cachecraft[pgdsf]"]
    for label in ("cachecraft[lru]", "cachecraft[pgdsf]"):
        m = result["methods"][label]
        assert m["requests"] == 6 and m["store_usage"]["cpu"]["bytes"] <= 1 << 18


def test_settings_of_exact_after_asks_replay_cachecraft_under_each(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    cache_dir.mkdir(parents=True)
    asked = TraceRequest(ITEMS[0].question, tuple(pooled_corpus(ITEMS)[:3]), 0)  # passages of item 0, as warmed
    result = run_workload(tiny_model("llama"), config, [asked] * 4, ["cachecraft"], exact_after=[2, 9],
                          budgets={"cpu": 1 << 24, "disk": 1 << 26}, max_new_tokens=2,
                          warm=warm_up(ITEMS, 0, embed=fake_embed))
    assert list(result["methods"]) == ["full", "cachecraft", "cachecraft[asks=2]", "cachecraft[asks=9]"]

    def kept(label):
        return [(r["kept_exact"], r["reused_exact"]) for r in result["requests"] if r["method"] == label]

    # the warmed caches answer the first ask; the order is kept exact at its second ask with
    # the default (1) and its third with the setting at 2, then reused exactly; never at 9
    assert kept("cachecraft") == [(False, False), (True, False), (False, True), (False, True)]
    assert kept("cachecraft[asks=2]") == [(False, False), (False, False), (True, False), (False, True)]
    assert kept("cachecraft[asks=9]") == [(False, False)] * 4


def test_warm_up_fills_each_store_with_every_passage_and_its_in_context_variants(cache_dir):
    # the builtin warm context (the default): its own cache is stored too, but is no chunk of the census
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    cache_dir.mkdir(parents=True)
    warm = warm_up(ITEMS, 1, embed=fake_embed)
    corpus = pooled_corpus(ITEMS)
    assert warm.texts == tuple(corpus) and len(warm.pairs) == len(corpus)
    assert all(before != chunk and before in corpus for before, chunk in warm.pairs)
    assert warm_up(ITEMS, 0, embed=fake_embed).pairs == ()
    trace, _ = build_trace(ITEMS, 5, 3, embed=fake_embed, seed=4)
    calls = []
    result = run_workload(tiny_model("llama"), config, trace, ["cachecraft"], evictions=["pgdsf"],
                          budgets={"cpu": 1 << 24, "disk": 1 << 26}, max_new_tokens=2, warm=warm,
                          on_request=lambda *call: calls.append(call))
    # one warm-up call (request 0) before each chunk-cache run's requests; full has none
    assert [c for c in calls if c[1] == 0] == [("cachecraft: warm-up", 0, 5), ("cachecraft[pgdsf]: warm-up", 0, 5)]
    assert len(calls) == 2 + 3 * 5
    methods = result["methods"]
    assert methods["full"]["warm"] == {} and methods["full"]["variants"]["variants"] == 0  # full starts empty
    for label in ("cachecraft", "cachecraft[pgdsf]"):
        m = methods[label]
        # budgets far above the corpus: every passage once, and once more after its neighbour
        assert (m["warm"]["made"], m["warm"]["in_context"]) == (len(corpus), len(corpus))
        assert m["warm"]["variants_after"] == {"variants": 2 * len(corpus), "chunks": len(corpus),
                                               "chunks_with_several": len(corpus)}
        assert m["hit_rate"] == 1.0  # every retrieved chunk was warmed
        rows = [r for r in result["requests"] if r["method"] == label]
        assert m["whole_prefix_reuse_rate"] == sum(r["whole_prefix_reuses"] for r in rows) / (3 * len(rows))
