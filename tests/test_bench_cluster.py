"""``bench cluster`` on the tiny model against real servers: node processes share what
they compute through Redis and the PostgreSQL catalog, and the tier timing reads the same
chunk-caches from Redis, the CPU tier and the disk tier."""

from __future__ import annotations

import pytest

pytest.importorskip("redis", reason="redis-py not installed (pip install cachecraft[shared])")
pytest.importorskip("psycopg", reason="psycopg not installed (pip install cachecraft[shared])")

from cachecraft.bench.cluster import PhaseResult, run_cluster, split  # noqa: E402
from cachecraft.bench.workload import build_trace  # noqa: E402
from cachecraft.config import Config  # noqa: E402
from tests.servers import pg_url, postgres, redis_server  # noqa: E402,F401  (fixtures)
from tests.test_workload import ITEMS, fake_embed  # noqa: E402


def test_split_deals_requests_round_robin():
    assert split(list("abcdefg"), 3) == [("a", "d", "g"), ("b", "e"), ("c", "f")]
    with pytest.raises(ValueError):
        split(["a"], 0)


def test_a_phase_sums_its_nodes_rows_and_counts_the_requests_that_kept_their_order_exact():
    def row(ttft, fraction, layers, tiers, kept=None):
        out = {"ttft_s": ttft, "recompute_fraction": fraction, "token_layers": layers, "tiers": tiers}
        return out if kept is None else {**out, "kept_exact": kept}

    phase = PhaseResult([row(4.0, 1.0, 300, ["miss", "miss"], kept=True), row(1.0, 0.25, 100, ["redis", "cpu"]),
                         row(2.0, 0.5, 200, ["cpu", "miss"], kept=False)], wall_s=9.0)
    summary = phase.summary()
    assert summary["requests"] == 3 and summary["chunks"] == 6
    assert summary["hit_rate"] == pytest.approx(3 / 6)
    assert summary["hit_rate_by_tier"] == pytest.approx({"redis": 1 / 6, "cpu": 2 / 6})
    assert summary["recompute_fraction_mean"] == pytest.approx(1.75 / 3)
    assert summary["ttft_s_mean"] == pytest.approx(7 / 3) and summary["ttft_s_median"] == 2.0
    assert summary["token_layers"] == 600 and summary["wall_s"] == 9.0
    assert summary["kept_exact_requests"] == 1  # a row without the field (an older node's) counts none

    from cachecraft.bench.readme import cluster_table
    timing = {"prompts_from_one_tier": 0, "summary": {"full": {"ttft_s_median": None},
                                                      **{t: {"ttft_s_median": None} for t in ("redis", "cpu", "disk")}}}
    data = {"command": "cachecraft bench cluster", "model": "tiny", "nodes": 2, "requests": 3, "unique_requests": 3,
            "top_k": 2, "date": "2026-12-07", "machine": {"cpu": "cpu", "cores": 2}, "tier_timing": timing,
            "prefill_work_saved_vs_isolated": None, "phases": {"shared": summary}}
    assert "| shared | 50% | 17% | 33% | 0% | 0.583 | 2.000 | 600 | 1 |" in cluster_table(data)
    older = {**data, "phases": {"shared": {k: v for k, v in summary.items() if k != "kept_exact_requests"}}}
    assert "kept exact" not in cluster_table(older)  # a result from before the column


def test_nodes_share_their_chunk_caches_and_save_prefill_work(tiny_dir, tmp_path, redis_server, pg_url):  # noqa: F811
    distinct = list(dict.fromkeys(build_trace(ITEMS, 30, 3, embed=fake_embed, seed=1)[0]))[:4]
    a, b, c, d = distinct
    # dealt to two nodes: a, c, b, d and b, d, a, c: each node's last two requests were the
    # other's first two, answered a round earlier (so found in Redis)
    trace = [a, b, c, d, b, a, d, c]
    config = Config.load(overrides={"model": str(tiny_dir), "kv_dtype": "float32", "cache_dir": tmp_path / "c"},
                         environ={})
    result = run_cluster(config, trace, nodes=2, method="reuse", max_new_tokens=2, workdir=tmp_path / "w",
                         redis_url=redis_server.url, catalog_url=pg_url, timed_prompts=2)
    isolated, shared = result["phases"]["isolated"], result["phases"]["shared"]
    assert isolated["requests"] == shared["requests"] == 8
    assert "redis" not in isolated["hit_rate_by_tier"]
    assert shared["hit_rate_by_tier"].get("redis", 0) > 0  # a node served from another's chunk-caches
    assert shared["hit_rate"] >= isolated["hit_rate"]
    assert shared["token_layers"] <= isolated["token_layers"]
    assert result["prefill_work_saved_vs_isolated"] == pytest.approx(
        1 - shared["token_layers"] / isolated["token_layers"])
    assert len(result["catalog_by_node"]) == 2
    assert sum(n["requests"] for n in result["catalog_by_node"]) == 8
    assert len(set(trace)) == 4
    timing = result["tier_timing"]
    assert timing["prompts"] == 2 and timing["prompts_from_one_tier"] == 2
    for row in timing["rows"]:
        assert {t: s["tiers"] for t, s in row["sources"].items()} == {"redis": ["redis"], "cpu": ["cpu"],
                                                                       "disk": ["disk"]}
    from cachecraft.bench.readme import cluster_table
    table = cluster_table({**result, "command": "cachecraft bench cluster", "model": "tiny", "unique_requests": 3,
                           "top_k": 3, "date": "2026-11-24", "machine": {"cpu": "cpu", "cores": 2}})
    assert "| shared | " in table and "| isolated | " in table and "| redis | " in table
    assert "kept exact |" in table and shared["kept_exact_requests"] == 0  # reuse never keeps an order exact


def test_the_servers_must_start_empty(tmp_path, redis_server, pg_url):  # noqa: F811
    from cli.bench import _require_empty
    from cli.common import UserError
    from cachecraft.store import TieredStore
    from tests.store_helpers import make_kv

    _require_empty(redis_server.url, pg_url, tmp_path)  # empty: accepted (and the catalog made)
    with pytest.raises(UserError, match="--catalog-url .* already holds a catalog"):
        _require_empty(redis_server.url, pg_url, tmp_path)
    with TieredStore(Config(cache_dir=tmp_path / "n", redis_url=redis_server.url), tiers=("cpu",)) as store:
        store.put(make_kv(1))
    with pytest.raises(UserError, match="--redis-url .* already holds 1 chunk-caches"):
        _require_empty(redis_server.url, pg_url, tmp_path)


def test_a_throwaway_redis_makes_its_own_directory(tmp_path):
    from tests.servers import RedisServer
    server = RedisServer(tmp_path / "not" / "yet").start()  # bench cluster hands it a path that does not exist
    try:
        assert (tmp_path / "not" / "yet").is_dir()
    finally:
        server.stop()
