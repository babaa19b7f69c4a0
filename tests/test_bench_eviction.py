"""``bench eviction``: policies replayed chunk by chunk, against hand-worked traces."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cachecraft.bench.eviction import replay, run_eviction
from cli.app import app

ONE = {k: 1 for k in "abcd"}


def test_lfu_keeps_the_popular_chunk_that_lru_lets_go():
    trace = [["a"], ["a"], ["b"], ["c"], ["a"]]  # budget 2: c pushes out a (LRU) or b (LFU)
    lru = replay(trace, ONE, ONE, 2, "lru")
    lfu = replay(trace, ONE, ONE, 2, "lfu")
    assert (lru.hits, lru.evictions, lru.compute_saved) == (1, 2, pytest.approx(1 / 5))
    assert (lfu.hits, lfu.evictions, lfu.compute_saved) == (2, 1, pytest.approx(2 / 5))
    assert lru.lookups == lfu.lookups == 5 and lfu.hit_rate == pytest.approx(0.4)


def test_a_request_never_evicts_its_own_chunks_and_oversized_chunks_stay_out():
    assert replay([["a", "b", "c"], ["a", "b", "c"]], ONE, ONE, 2, "cachecraft").hits == 2  # a, b kept; c not
    sizes = {"a": 1, "b": 5}
    costs = {"a": 1.0, "b": 3.0}
    result = replay([["b"], ["a"], ["b"], ["a"]], sizes, costs, 2, "pgdsf")
    assert result.hits == 1 and result.compute_saved == pytest.approx(1 / 8)


def test_budgets_are_fractions_of_the_distinct_chunks_bytes():
    sizes = {"a": 10, "b": 30}
    result = run_eviction([["a", "b"], ["a"]], sizes, {"a": 1.0, "b": 1.0}, ["lru", "lfu"], [0.25, 1.0])
    assert result["summary"]["corpus_bytes"] == 40 and result["summary"]["lookups"] == 3
    assert [(r["budget_fraction"], r["budget_bytes"], r["policy"]) for r in result["rows"]] == [
        (0.25, 10, "lru"), (0.25, 10, "lfu"), (1.0, 40, "lru"), (1.0, 40, "lfu")]
    assert all(r["hits"] == 1 for r in result["rows"])  # a fits every budget; b only the whole one, unused again


def test_command_writes_json(tiny_dir, dataset, tmp_path, cache_dir):
    out = tmp_path / "eviction.json"
    result = CliRunner().invoke(app, ["bench", "eviction", "--dataset", str(dataset), "--model", str(tiny_dir),
                                      "--requests", "30", "--top-k", "2", "--budgets", "0.2,0.5",
                                      "--policies", "lru,cachecraft", "--out", str(out)],
                                 env={"CACHECRAFT_KV_DTYPE": "float32"})
    assert result.exit_code == 0, result.output
    # stderr is no terminal here: what the spinner would say comes as a line there, not on stdout
    assert "] embedding the corpus, then replaying 30 requests ..." in result.stderr
    assert "embedding" not in result.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "eviction" and data["kv_dtype"] == "float32"
    assert data["command"].startswith("CACHECRAFT_KV_DTYPE=float32 cachecraft bench eviction")
    assert len(data["rows"]) == 4 and data["summary"]["lookups"] == 60
    small, large = (next(r for r in data["rows"] if r["budget_fraction"] == f and r["policy"] == "lru")
                    for f in (0.2, 0.5))
    assert small["hit_rate"] <= large["hit_rate"]
    bad = CliRunner().invoke(app, ["bench", "eviction", "--dataset", str(dataset), "--model", str(tiny_dir),
                                   "--budgets", "1.5"])
    assert bad.exit_code != 0 and "budgets must be fractions" in bad.output



def test_report_run_makes_the_replay_with_its_command(dataset, tmp_path, cache_dir):
    from cachecraft.bench.runs import RUNS
    from cachecraft.config import Config
    from tests.conftest import tiny_model
    from tests.test_workload import fake_embed

    out = tmp_path / "replay.json"
    RUNS["replay"](tiny_model("llama"), Config.load(environ={}), dataset, out, requests=40, limit=3, top_k=2,
                   embed=fake_embed)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "eviction" and data["command"].startswith("cachecraft bench eviction --dataset")
    assert data["summary"]["lookups"] == 80 and data["kv_dtype"] == "float16"
    assert {r["policy"] for r in data["rows"]} == {"lru", "lfu", "pgdsf", "decay", "cachecraft"}
    assert len(data["rows"]) == 5 * 3 and all(0.0 <= r["hit_rate"] <= 1.0 for r in data["rows"])
