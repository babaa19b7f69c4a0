"""``bench scaling`` on a tiny model: rows, fields, and the command's JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from cachecraft.bench.scaling import Point, cut_chunks, passage_stream, plan_points, run_scaling, shuffled
from cachecraft.cli.app import app
from cachecraft.config import Config
from cachecraft.policy.loading import DEFAULT_BANDWIDTHS
from cachecraft.policy.planner import PolicyParams
from cachecraft.dataset import QAItem
from cachecraft.methods import parse_methods
from cachecraft.prompt import PromptBuilder
from tests.conftest import tiny_model, tiny_tokenizer

REQUIRED = ("method", "sweep", "context_tokens", "n_chunks", "ttft_s", "speedup_vs_full", "agreement_f1",
            "peak_rss_mb", "recompute_fraction")


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


ITEMS = [QAItem(words(250 + i, 4), tuple((f"w{i}", words(10 + 20 * i + 3 * j, 25)) for j in range(4)),
                (words(1, 1),)) for i in range(3)]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread avoids contention on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_points_and_contexts_hit_their_targets():
    points = plan_points([100, 300], [2, 5], fixed_context=200, chunk_tokens=100)
    assert points == [Point("context", 100, 1), Point("context", 300, 3), Point("chunks", 200, 2),
                      Point("chunks", 200, 5)]
    builder = PromptBuilder(tiny_tokenizer(), "w300 w301")
    stream = passage_stream(builder, ITEMS, 1, 250)
    assert len(stream) >= 250
    chunks = cut_chunks(builder, stream, ITEMS[1].question, Point("chunks", 200, 5))
    assert len(chunks) == 5
    assert builder.build(chunks, ITEMS[1].question).num_tokens == 200
    with pytest.raises(ValueError, match="fewer than"):
        passage_stream(builder, ITEMS, 0, 10_000)


def test_run_rows_have_every_field(cache_dir):
    cache_dir.mkdir(parents=True)
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    specs = parse_methods("full,prefix,reuse,cacheblend,cachecraft", 0.15, 0.15)
    result = run_scaling(tiny_model("llama"), config, ITEMS, specs, contexts=[120, 240], chunk_counts=[2, 4],
                         fixed_context=160, chunk_tokens=60, repeats=2, max_new_tokens=3)
    rows = result["scaling"]
    assert len(rows) == 4 * 5 and len(result["requests"]) == 4 * 5 * 2
    for row in rows:
        assert all(key in row for key in REQUIRED)
        assert row["sweep"] in ("context", "chunks") and row["repeats"] == 2
    full = [r for r in rows if r["method"] == "full"]
    assert all(r["speedup_vs_full"] == 1.0 and r["agreement_f1"] == 1.0 for r in full)
    assert all(r["work_ratio_vs_full"] == 1.0 for r in full)
    assert {r["n_chunks"] for r in rows if r["sweep"] == "chunks"} == {2, 4}
    assert [r["context_tokens"] for r in full] == [120, 240, 160, 160]
    reuse = [r for r in rows if r["method"] == "reuse"]
    assert all(r["recompute_fraction"] == 0.0 and r["work_ratio_vs_full"] > 1 for r in reuse)  # all warmed
    summary = result["summary"]
    assert summary["method"] == "cachecraft@0.15" and summary["max_context_tokens"] == 240
    assert summary["speedup_at_max_context"] > 0 and isinstance(summary["goal"]["met"], bool)
    assert not list(cache_dir.iterdir())  # scratch stores are removed


def one_point(cache_dir, methods: str, context: int, chunk_tokens: int, **setting) -> tuple[dict, dict]:
    """``run_scaling`` on one context with cachecraft at alpha 0.1; the result and its rows by label."""
    cache_dir.mkdir(parents=True)
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32", "policy_alpha": 0.1},
                         environ={})
    result = run_scaling(tiny_model("llama"), config, ITEMS, parse_methods(methods, 0.15, 0.1), contexts=[context],
                         chunk_counts=[], chunk_tokens=chunk_tokens, repeats=1, max_new_tokens=2, **setting)
    return result, {r["method"]: r for r in result["requests"]}


def test_cold_rows_answer_with_nothing_cached(cache_dir):
    result, requests = one_point(cache_dir, "full,cachecraft", 120, 60, cold=True)
    assert list(requests) == ["full", "cachecraft@0.1", "cachecraft@0.1 cold"]
    assert requests["cachecraft@0.1"]["cached_chunks"] == 2 and requests["cachecraft@0.1"]["setup_s"] > 0
    cold = requests["cachecraft@0.1 cold"]
    assert cold["cached_chunks"] == 0
    assert cold["agreement_f1"] == 1.0 and cold["kl"] < 1e-6  # nothing reused: a full prefill's answer
    assert result["summary"]["method"] == "cachecraft@0.1"
    assert "cold" in result["setup"] and not list(cache_dir.iterdir())


def test_command_writes_json(tiny_dir, dataset, tmp_path, cache_dir):
    out = tmp_path / "scaling.json"
    result = CliRunner().invoke(app, ["bench", "scaling", "--dataset", str(dataset), "--model", str(tiny_dir),
                                      "--contexts", "100", "--chunks", "", "--chunk-tokens", "40", "--repeats", "1",
                                      "--methods", "full,reuse", "--max-new-tokens", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["benchmark"] == "scaling" and data["command"].startswith("cachecraft bench scaling")
    assert [r["method"] for r in data["scaling"]] == ["full", "reuse"]
    assert "machine" in data and "date" in data and data["setup"]["prefix_shared"] == 1
    bad = CliRunner().invoke(app, ["bench", "scaling", "--dataset", str(dataset), "--model", str(tiny_dir),
                                   "--contexts", "5000", "--chunks", "", "--out", str(out)])
    assert bad.exit_code == 1 and "context window" in bad.output


def test_default_run_writes_the_json_and_its_command(dataset, tmp_path, cache_dir):
    from cachecraft.bench.runs import run_scaling_default

    cache_dir.mkdir(parents=True)
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    out = run_scaling_default(tiny_model("llama"), config, dataset, tmp_path / "s.json", contexts=[100],
                              chunk_counts=[], fixed_context=100, chunk_tokens=50, repeats=1, max_new_tokens=2)
    data = json.loads(out.read_text())
    assert data["command"].startswith("CACHECRAFT_KV_DTYPE=float32 cachecraft bench scaling --dataset")
    assert data["command"].endswith("--contexts 100 --chunks '' --fixed-context 100 --chunk-tokens 50 --repeats 1 "
                                    "--max-new-tokens 2")
    assert [r["method"] for r in data["scaling"]] == ["full", "prefix", "reuse", "cacheblend@0.15", f"cachecraft@{PolicyParams().alpha:g}"]


def test_default_revisit_run_takes_its_defaults_and_writes_its_command(dataset, tmp_path, cache_dir):
    from cachecraft.bench.runs import run_revisit_default

    cache_dir.mkdir(parents=True)
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    out = run_revisit_default(tiny_model("llama"), config, dataset, tmp_path / "r.json", contexts=100,
                              chunk_tokens=40, repeats=1, max_new_tokens=2)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "scaling" and data["command"].startswith("CACHECRAFT_KV_DTYPE=float32 cachecraft")
    assert "--contexts 100 --chunks '' --repeats 1 --chunk-tokens 40 --max-new-tokens 2" in data["command"]
    assert {r["target_tokens"] for r in data["scaling"]} == {100}
    assert any(r["method"].endswith("revisit") for r in data["scaling"])


def test_default_tradeoff_run_sweeps_the_ratios_at_one_context(dataset, tmp_path, cache_dir):
    from cachecraft.bench.runs import TRADEOFF_METHODS, run_tradeoff_default

    cache_dir.mkdir(parents=True)
    config = Config.load(overrides={"cache_dir": cache_dir}, environ={})
    out = run_tradeoff_default(tiny_model("mistral"), config, dataset, tmp_path / "t.json", contexts=100,
                               chunk_tokens=40, repeats=1, max_new_tokens=2)
    data = json.loads(out.read_text())
    assert f"--methods {TRADEOFF_METHODS} --out" in data["command"]
    rows = {r["method"]: r for r in data["scaling"]}
    assert list(rows) == TRADEOFF_METHODS.split(",")
    assert rows["full"]["kl"] == 0.0 and rows["reuse"]["recompute_fraction"] == 0.0
    swept = [rows[f"qguided@{r}"]["recompute_fraction"] for r in ("0.05", "0.1", "0.2", "0.4", "0.7")]
    assert swept == sorted(swept) and swept[0] < swept[-1]  # more recomputed tokens as the ratio grows
    assert rows["cacheblend@0.5"]["recompute_fraction"] > rows["cacheblend@0.15"]["recompute_fraction"]


def test_whole_read_rows_time_the_same_caches_read_whole_with_the_same_answers(dataset, tmp_path, cache_dir,
                                                                              monkeypatch):
    from cachecraft.bench.runs import run_loading_default
    from cachecraft.pipeline import Pipeline

    # A full prefill that timed this machine as very fast makes hiding a load cost all of a
    # chunk's recompute (so cachecraft loads nothing): every setting's rows must then plan
    # with that same rate (on a busy
    # machine, the timed rate moved the streamed rows' recompute away from the whole-read ones').
    fast = lambda self, tokens, seconds: setattr(  # noqa: E731
        self, "cost_model", dataclasses.replace(self.ensure_cost_model(), prefill_s_per_token_layer=1e-15))
    monkeypatch.setattr(Pipeline, "_learn_prefill", fast)
    cache_dir.mkdir(parents=True)
    config = Config.load(overrides={"cache_dir": cache_dir}, environ={})
    out = run_loading_default(tiny_model("qwen3"), config, dataset, tmp_path / "l.json", contexts=100,
                              chunk_tokens=40, repeats=1, max_new_tokens=3)
    data = json.loads(out.read_text())
    assert "--tier disk --methods full,reuse,cachecraft --whole-read --out" in data["command"]
    assert data["setup"]["tier"] == "disk" and "read whole" in data["setup"]["whole_read"]
    rows = {r["method"]: r for r in data["requests"]}
    craft = f"cachecraft@{PolicyParams().alpha:g}"
    assert set(rows) == {"full", "reuse", craft, "reuse whole-read", f"{craft} whole-read"}
    for method in ("reuse", craft):
        streamed, whole = rows[method], rows[f"{method} whole-read"]
        assert streamed["answer"] == whole["answer"] and streamed["kl"] == whole["kl"]
        assert streamed["recompute_fraction"] == whole["recompute_fraction"]
        assert streamed["cached_chunks"] == whole["cached_chunks"]
    # reuse loads whatever it costs; cachecraft, at that rate, finds no variant worth loading
    assert rows["reuse"]["cached_chunks"] > 0 and rows[craft]["cached_chunks"] == 0
    assert rows[craft]["recompute_fraction"] == 1.0
    assert data["summary"]["method"] == craft  # the goal is read off the default (streamed) rows
    bandwidths = data["setup"]["loading_bandwidths"]  # what the loading controller assumed, per setting
    assert set(bandwidths) == {"warm", "whole"}
    assert bandwidths["warm"]["disk"] == DEFAULT_BANDWIDTHS["disk"]  # this tiny model's loads are too small to time


def test_shuffled_order_moves_the_first_chunk():
    for n in (2, 3, 4, 15):
        chunks = [f"c{i}" for i in range(n)]
        order = shuffled(chunks)
        assert sorted(order) == sorted(chunks) and order[0] != "c0" and order == shuffled(chunks)


def test_revisit_rows_reuse_the_earlier_requests_variants(cache_dir):
    result, requests = one_point(cache_dir, "full,prefix,cachecraft", 200, 50, revisit=True)
    assert list(requests) == ["full", "prefix", "cachecraft@0.1", "cachecraft@0.1 revisit", "prefix revisit"]
    warm, again = requests["cachecraft@0.1"], requests["cachecraft@0.1 revisit"]
    assert again["cached_chunks"] == 4 and again["setup_s"] > 0
    # Warmed caches share no chunk with the request's prefix; the earlier request's do.
    assert warm["prefix_overlap"] == 0.0 and again["prefix_overlap"] > 0.0
    # Shuffled, the earlier request leaves prefix caching only the system prompt to share.
    assert requests["prefix revisit"]["recompute_fraction"] > requests["prefix"]["recompute_fraction"]
    assert requests["full"]["prefix_overlap"] is None
    assert result["summary"]["goal_revisit"]["method"] == "cachecraft@0.1 revisit"
    assert "revisit" in result["setup"] and not list(cache_dir.iterdir())


def test_a_shared_warm_store_gives_every_method_the_caches_it_would_warm_itself(tmp_path):
    """Warmed once and shared, or once per method: the same caches, so the same answers and KL."""
    rows = {}
    for share in (False, True):
        _, rows[share] = one_point(tmp_path / str(share), "full,prefix,reuse,cacheblend,cachecraft", 180, 60,
                                   share_warm=share)
    assert list(rows[True]) == list(rows[False])
    for method, row in rows[True].items():
        alone = rows[False][method]
        assert (row["answer"], row["kl"], row["recompute_fraction"], row["cached_chunks"]) == \
            (alone["answer"], alone["kl"], alone["recompute_fraction"], alone["cached_chunks"]), method
    # warmed once: on the first method that uses the caches; the later ones found them ready
    assert rows[True]["reuse"]["setup_s"] > 0
    assert rows[True]["cacheblend@0.15"]["setup_s"] == rows[True]["cachecraft@0.1"]["setup_s"] == 0.0
    assert all(row["peak_gpu_mb"] is None for row in rows[True].values())  # on the CPU
    assert not list((tmp_path / "True").iterdir())  # the shared store is removed too
