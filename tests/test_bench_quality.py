"""bench quality and calibrate answer through the pipeline's one request path."""

from __future__ import annotations

import torch

from cachecraft.bench.quality import run_quality
from cachecraft.calibration import calibrate
from cachecraft.policy.calibrate import Goal
from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.evaluation import answer_traced, item_chunks, scratch_pipeline
from cachecraft.methods import METHODS, parse_methods
from cachecraft.pipeline import Pipeline
from cachecraft.store import TieredStore

SYSTEM = "w3 w4 w5"


def _config(path, **overrides) -> Config:
    return Config.load(overrides={"cache_dir": path, "system_prompt": SYSTEM, "max_new_tokens": 3,
                                  "warm_context": "none", "policy_check_layer": 2, **overrides}, environ={})


def test_the_quality_runner_answers_exactly_as_the_pipeline_does_for_every_method(tiny_llama, dataset, tmp_path):
    item = load_items(dataset, limit=1)[0]
    methods = parse_methods(",".join(METHODS), ratio=0.3, alpha=0.5)
    config = _config(tmp_path / "bench", early_stop_layers="1")
    seen = {}
    result = run_quality(tiny_llama, config, [item], methods, max_new_tokens=3,
                         on_answer=lambda item, answer, trace: seen.setdefault(answer.method, (answer, trace)))
    assert [r["method"] for r in result["items"]] == [m.label for m in methods]

    public = _config(tmp_path / "public", early_stop_layers="1")
    chunks = item_chunks(item)
    with TieredStore(public, tiers=("cpu",)) as store:
        pipeline = Pipeline(public, lm=tiny_llama, store=store, keep_new_variants=False)
        pipeline.warm(chunks)
        for method in methods:
            answer, trace = answer_traced(pipeline, chunks, item.question, method, max_new_tokens=3)
            bench_answer, bench_trace = seen[method.label]
            assert torch.equal(trace.logits, bench_trace.logits), method.label
            assert answer.text == bench_answer.text, method.label
            assert [(c.tier, c.fraction, c.stop_layer) for c in answer.chunks] == \
                [(c.tier, c.fraction, c.stop_layer) for c in bench_answer.chunks], method.label


def test_calibrate_plans_requests_exactly_as_query_does(tiny_llama, dataset, tmp_path):
    item = load_items(dataset, limit=1)[0]
    config = _config(tmp_path / "calibrate", policy_check_layer=1, early_stop_layers="1,2", early_stop_share=1.0)
    plans = {}
    calibrate(tiny_llama, config, [item], [0.3, 0.6], Goal(budget=1.0), max_new_tokens=3,
              on_answer=lambda item, answer, trace: plans.setdefault(answer.method, answer.chunks))
    chunks = item_chunks(item)
    query_config = config.replace(cache_dir=tmp_path / "query")
    with TieredStore(query_config, tiers=("cpu",)) as store:
        pipeline = Pipeline(query_config, lm=tiny_llama, store=store, keep_new_variants=False)
        pipeline.warm(chunks)
        for label in ("cachecraft@0.3", "cachecraft@0.6"):
            answer = pipeline.answer(chunks, item.question, method=label, max_new_tokens=3)
            assert answer.chunks == plans[label]
    assert any(c.stop_layer is not None for c in plans["cachecraft@0.6"])  # early termination took part


def test_a_run_longer_than_the_budget_keeps_the_caches_of_the_item_it_measures(tiny_llama, dataset, tmp_path):
    items = load_items(dataset)
    with scratch_pipeline(tiny_llama, _config(tmp_path / "sizes")) as pipeline:
        pipeline.warm(item_chunks(items[0]))
        with_item = pipeline.store.usage()["cpu"].bytes
        pipeline.forget(item_chunks(items[0]))
        prefix_bytes = pipeline.store.usage()["cpu"].bytes  # the system prefix stays
    item_bytes = with_item - prefix_bytes
    # Room for the prefix and one item's caches, not two items': each item's caches leave when it is done.
    config = _config(tmp_path / "run", cpu_budget_bytes=prefix_bytes + int(1.5 * item_bytes))
    result = run_quality(tiny_llama, config, items, parse_methods("full,reuse"), max_new_tokens=2)
    assert [(r["item"], r["method"]) for r in result["items"]] == [(0, "full"), (0, "reuse"), (1, "full"), (1, "reuse")]
    assert result["methods"]["reuse"]["recompute_fraction_mean"] == 0.0  # every chunk-cache was found
    assert list((tmp_path / "run").iterdir()) == []  # the scratch store is gone


def test_an_early_stop_run_is_labelled_and_paired_with_the_plain_policy(tiny_llama, dataset, tmp_path):
    from cachecraft.bench.quality import plain_label
    from cachecraft.methods import CacheCraft

    item = load_items(dataset, limit=1)[0]
    config = _config(tmp_path / "bench", early_stop_share=1.0)  # every chunk below an even share may stop
    plain, stopping = CacheCraft(0.5), CacheCraft(0.5, early_stop=(0.5,))
    assert (stopping.label, CacheCraft(0.5, early_stop=()).label) == ("cachecraft@0.5/E0.5", "cachecraft@0.5/Eoff")
    assert CacheCraft(0.08, pool=0.5).label == "cachecraft@0.08/P0.5"  # the floor pooled by need
    seen = {}
    result = run_quality(tiny_llama, config, [item], [plain, stopping], max_new_tokens=3,
                         on_answer=lambda item, answer, trace: seen.setdefault(answer.method, answer))
    assert [r["method"] for r in result["items"]] == ["full", "cachecraft@0.5", "cachecraft@0.5/E0.5"]
    assert set(result["comparisons"]["cachecraft@0.5/E0.5"]) == {"vs full", "vs cachecraft@0.5"}
    assert plain_label("cachecraft@0.08/E0.5,0.75") == "cachecraft@0.08" and plain_label("reuse") is None
    layers = tiny_llama.adapter.num_layers
    stops = [c.stop_layer for c in seen["cachecraft@0.5/E0.5"].chunks if c.stop_layer is not None]
    assert stops and all(s == round(0.5 * layers) + 1 for s in stops)  # the depth resolved: stop after that layer
    assert all(c.stop_layer is None for c in seen["cachecraft@0.5"].chunks)  # the config's early stop is off


def test_a_follow_up_is_answered_in_a_chat_as_the_pipeline_answers_it_and_paired_turn_for_turn(
        tiny_llama, dataset, tmp_path):
    from cachecraft.prompt import Conversation

    item = load_items(dataset, limit=1)[0]
    config = _config(tmp_path / "bench")
    seen = []
    result = run_quality(tiny_llama, config, [item], parse_methods("reuse,cacheblend@0.15"), max_new_tokens=3,
                         follow_up="w7 w8?", on_answer=lambda item, answer, trace: seen.append((answer, trace)))
    labels = ["full", "reuse", "cacheblend@0.15", "full+chat", "reuse+chat", "cacheblend@0.15+chat"]
    assert [r["method"] for r in result["items"]] == labels
    rows = {r["method"]: r for r in result["items"]}
    assert rows["full+chat"]["answer_kl"] == 0.0 and rows["full+chat"]["recompute_fraction"] == 1.0
    assert rows["reuse+chat"]["recompute_fraction"] == 0.0  # the chunk-caches serve the second turn too
    assert set(result["comparisons"]["reuse+chat"]) == {"vs full+chat", "vs cacheblend@0.15+chat", "vs reuse"}
    assert set(result["comparisons"]["full+chat"]) == {"vs cacheblend@0.15+chat"}

    # the second turn is what the pipeline answers in that chat: the item's question, full's answer
    chat = Conversation(turns=(("user", item.question), ("assistant", seen[0][0].text)))
    public = _config(tmp_path / "public")
    chunks = item_chunks(item)
    with TieredStore(public, tiers=("cpu",)) as store:
        pipeline = Pipeline(public, lm=tiny_llama, store=store, keep_new_variants=False)
        pipeline.warm(chunks)
        for (bench_answer, bench_trace), method in zip(seen[3:], ("full", "reuse", "cacheblend@0.15")):
            answer, trace = answer_traced(pipeline, chunks, "w7 w8?", method, max_new_tokens=3, conversation=chat)
            assert torch.equal(trace.logits, bench_trace.logits), method
            assert answer.text == bench_answer.text, method
    assert seen[3][1].token_ids.shape[0] > seen[0][1].token_ids.shape[0]  # the earlier turn is in the prompt
