"""README result blocks are rendered from result JSON."""

import json

from cachecraft.bench.readme import update, update_documents


def render(tmp_path, name: str, data: dict) -> str:
    """The README text after rendering block ``name`` from ``data``."""
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text(f"<!-- results:{name} -->\n<!-- /results:{name} -->\n")
    assert update(readme, results) == [name]
    return readme.read_text()


def test_blocks_are_replaced_and_others_left(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    data = {"benchmark": "quality", "command": "cachecraft bench quality --limit 2", "model": "m", "limit": 2, "date": "2026-11-21T00:00",
            "machine": {"cpu": "cpu", "cores": 2}, "code": {"version": "0.1.0", "commit": "feedbeef" * 5},
            "methods": {"full": {"ttft_s_median": 2.0, "speedup_vs_full_median": 1.0, "recompute_fraction_mean": 1.0,
                                 "kl_mean": 0.0, "agreement_f1_mean": 1.0, "exact_match_rate": 1.0,
                                 "gold_f1_mean": 0.5}}}
    (results / "quality.json").write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- results:quality -->\nSTALE-TABLE\n<!-- /results:quality -->\n"
                      "<!-- results:workload -->\nkeep\n<!-- /results:workload -->\n")
    assert update(readme, results) == ["quality"]
    text = readme.read_text()
    assert "| full | 2.00 | 1.0x | 1.000 | 0.0000 | 1.000 | 1.00 | 0.500 |" in text
    assert "STALE-TABLE" not in text and "keep" in text
    assert "(m, 2 items, 2026-11-21, commit feedbeeffe, cpu, 2 cores)" in text


def test_both_documents_are_rendered_each_from_its_own_blocks(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    data = {"benchmark": "quality", "command": "cachecraft bench quality", "model": "m", "limit": 1, "date": "2026-12-07",
            "machine": {"cpu": "cpu", "cores": 2},
            "methods": {"full": {"ttft_s_median": 3.0, "speedup_vs_full_median": 1.0, "recompute_fraction_mean": 1.0,
                                 "kl_mean": 0.0, "agreement_f1_mean": 1.0, "exact_match_rate": 1.0,
                                 "gold_f1_mean": 0.25}}}
    for name in ("a", "b"):
        (results / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "README.md").write_text("<!-- results:a -->\nSTALE\n<!-- /results:a -->\n")
    (tmp_path / "RESULTS.md").write_text("<!-- results:b -->\nSTALE\n<!-- /results:b -->\n")
    assert update_documents(tmp_path) == {"README.md": ["a"], "RESULTS.md": ["b"]}
    for doc in ("README.md", "RESULTS.md"):
        text = (tmp_path / doc).read_text()
        assert "STALE" not in text and "| full | 3.00 | 1.0x | 1.000 | 0.0000 | 1.000 | 1.00 | 0.250 |" in text
    (tmp_path / "RESULTS.md").unlink()  # a document that is not there is skipped
    assert update_documents(tmp_path) == {"README.md": ["a"]}


def test_scaling_block_has_one_row_per_size_and_a_column_per_method(tmp_path):
    rows = [{"sweep": "context", "method": m, "context_tokens": n, "n_chunks": n // 500, "ttft_s": t,
             "speedup_vs_full": s, "agreement_f1": 1.0}
            for m, n, t, s in (("full", 1000, 2.0, 1.0), ("cachecraft", 1000, 0.5, 4.0), ("full", 8000, 30.0, 1.0))]
    data = {"benchmark": "scaling", "command": "cachecraft bench scaling", "model": "m", "date": "2026-11-21T00:00",
            "machine": {"cpu": "cpu", "cores": 2}, "scaling": rows}
    text = render(tmp_path, "scaling", data)
    assert "| prompt tokens | full | cachecraft |" in text and "| chunks |" not in text
    assert "| 1000 | 2.00 s (1.0x, F1 1.00) | 0.50 s (4.0x, F1 1.00) |" in text
    assert "| 8000 | 30.00 s (1.0x, F1 1.00) | - |" in text


def test_revisit_block_has_a_row_per_method_with_its_kl_and_overlap(tmp_path):
    rows = [{"sweep": "context", "method": m, "context_tokens": 7912, "repeats": 6, "ttft_s": t,
             "speedup_vs_full": 30.0 / t, "recompute_fraction": f, "kl": kl, "agreement_f1": a, "prefix_overlap": o}
            for m, t, f, kl, a, o in (("full", 30.0, 1.0, 0.0, 1.0, None),
                                      ("cachecraft@0.08 revisit", 1.5, 0.018, 0.0266, 0.808, 0.498))]
    data = {"command": "cachecraft bench scaling --revisit", "model": "m", "date": "2026-11-21T00:00",
            "machine": {"cpu": "cpu", "cores": 2}, "scaling": rows}
    text = render(tmp_path, "scaling_8k_revisit", data)
    assert "(m, 6 questions, 2026-11-21, cpu, 2 cores)" in text
    assert "| full | 7912 | 30.00 | 1.0x | 1.000 | 0.0000 | 1.000 | - |" in text
    assert "| cachecraft@0.08 revisit | 7912 | 1.50 | 20.0x | 0.018 | 0.0266 | 0.808 | 0.50 |" in text


def test_store_block_names_its_command_when_the_result_has_one(tmp_path):
    tier = {"put_gbps": 2.0, "get_stored_gbps": 3.0, "get_compute_gbps": 4.0, "layers_gbps": 8.0}
    data = {"benchmark": "store", "tiers": {"cpu": tier}, "created": "2026-11-21T18:00:00+0000",
            "environment": {"cpu_count": 2}}
    for command, head in ((None, "| tier |"), ("cachecraft bench store", "`cachecraft bench store` (2026-11-21, 2 cores)")):
        text = render(tmp_path, "store", {**data, **({"command": command} if command else {})})
        assert text.splitlines()[1].startswith(head) and "| cpu | 2.00 | 3.00 | 4.00 | 8.00 |" in text


def test_diagnose_block_has_a_column_per_cache_context_and_the_drift_profile(tmp_path):
    run = lambda kl, agree: {"answer_kl": kl, "token_agreement": agree, "kl": kl, "recompute_fraction": 0.0}  # noqa: E731
    summary = {c: {"layers_v": [0.0, 0.02, v, 0.1], "layers_k": [0.0, 0.01, 0.1, 0.1],
                   "positions_v": {"1": v, "2-4": v / 2},
                   "runs": {"reuse": run(kl, 0.9), "firstk@0.05": run(kl / 2, 0.95)}}
               for c, v, kl in (("warm", 0.6, 0.2), ("previous", 0.3, 0.08))}
    data = {"benchmark": "diagnose", "command": "cachecraft bench diagnose", "model": "m", "limit": 6, "skip": 30, "date": "2026-11-24T00:00",
            "machine": {"cpu": "cpu", "cores": 2}, "summary": summary}
    text = render(tmp_path, "diagnose_qwen", data)
    assert "(m, 6 items from #30, 2026-11-24, cpu, 2 cores; means over items)" in text
    assert "| run | made after: warm | made after: previous |" in text
    assert "| firstk@0.05 | 0.100 (0.950) | 0.040 (0.950) |" in text
    # layer 1; the layer with most (2, of mean (0 + .02 + .6 + .1) / 4); positions
    assert "| warm | 0.020 | 2 (0.600) | 0.180 | 0.600 | 0.300 |" in text


def test_calibrate_block_lists_every_candidate_and_marks_the_chosen_one(tmp_path):
    row = lambda floor, shift, kl: {"alpha": 0.08, "check_layer": 8, "floor": floor, "sink_tokens": 0,  # noqa: E731
                                    "drift_shift": shift, "recompute": floor, "answer_kl": kl,
                                    "token_agreement": 0.9, "agreement": 0.8, "kl": 0.3, "ttft_s": 2.5}
    data = {"benchmark": "calibrate", "command": "cachecraft calibrate --drift-shifts 0,1", "model": "m", "limit": 8, "skip": 36,
            "date": "2026-11-25T00:00", "machine": {"cpu": "cpu", "cores": 2}, "full_ttft_s_median": 48.34,
            "policy_floor": 0.03, "policy_sink_tokens": 0, "policy_drift_shift": 1.0,
            "rows": [row(0.03, 0.0, 0.2), row(0.03, 1.0, 0.1)]}
    text = render(tmp_path, "calibrate_qwen2.5", data)
    assert "(m, 8 items from #36, 2026-11-25, cpu, 2 cores; full's TTFT median 48.3 s;" in text
    assert "| 0.08 | 0.03 | 0 | 0 | 0.030 | 0.2000 | 0.900 | 0.3000 | 2.50 |" in text
    assert "| 0.08 | 0.03 | 0 | 1 (chosen) | 0.030 | 0.1000 | 0.900 | 0.3000 | 2.50 |" in text


def test_calibrate_block_names_the_drift_estimator_of_new_and_older_results(tmp_path):
    """A row names its estimator where it is not the mean; a result written while the
    estimator was a yes/no for the median (``drift_median``) reads as one."""
    row = lambda shift, kl, **est: {"alpha": 0.08, "check_layer": 8, "floor": 0.05, "sink_tokens": 16,  # noqa: E731
                                    "drift_shift": shift, "recompute": 0.05, "answer_kl": kl, "token_agreement": 0.9,
                                    "agreement": 0.8, "kl": 0.3, "ttft_s": 2.5, **est}
    base = {"benchmark": "calibrate", "command": "cachecraft calibrate", "model": "m", "limit": 16, "skip": 36,
            "date": "2026-11-26T00:00", "machine": {"cpu": "cpu", "cores": 2}, "full_ttft_s_median": 40.0,
            "policy_floor": 0.05, "policy_sink_tokens": 16, "policy_drift_shift": 1.0}
    text = render(tmp_path, "calibrate_new", {**base, "policy_drift_estimator": "pooled",
                                               "rows": [row(0.5, 0.2, drift_estimator="mean"),
                                                        row(1.0, 0.1, drift_estimator="pooled")]})
    assert "| 16 | 0.5 | 0.050 | 0.2000 |" in text and "| 16 | 1 pooled (chosen) | 0.050 | 0.1000 |" in text
    text = render(tmp_path, "calibrate_old", {**base, "policy_drift_median": True,
                                               "rows": [row(1.0, 0.2, drift_median=False),
                                                        row(1.0, 0.1, drift_median=True)]})
    assert "| 16 | 1 | 0.050 | 0.2000 |" in text and "| 16 | 1 median (chosen) | 0.050 | 0.1000 |" in text


def test_calibrate_block_has_a_relevance_column_only_where_a_candidate_had_one(tmp_path):
    row = lambda relevance, kl: {"alpha": 0.08, "check_layer": 8, "floor": 0.05, "sink_tokens": 16,  # noqa: E731
                                 "drift_shift": 0.5, "drift_estimator": "mean", "relevance": relevance,
                                 "recompute": 0.05, "answer_kl": kl, "token_agreement": 0.9, "agreement": 0.8,
                                 "kl": 0.3, "ttft_s": 2.5}
    base = {"benchmark": "calibrate", "command": "cachecraft calibrate --relevances 0,0.5", "model": "m",
            "limit": 16, "skip": 36, "date": "2026-11-27T00:00", "machine": {"cpu": "cpu", "cores": 2},
            "full_ttft_s_median": 40.0, "policy_floor": 0.05, "policy_sink_tokens": 16, "policy_drift_shift": 0.5,
            "policy_drift_estimator": "mean"}
    text = render(tmp_path, "calibrate_relevance", {**base, "policy_relevance": 0.5,
                                                     "rows": [row(0.0, 0.2), row(0.5, 0.1)]})
    assert "| alpha | floor | sink tokens | drift shift | relevance | recompute |" in text
    assert "| 16 | 0.5 | 0 | 0.050 | 0.2000 |" in text and "| 16 | 0.5 | 0.5 (chosen) | 0.050 | 0.1000 |" in text
    text = render(tmp_path, "calibrate_plain", {**base, "policy_relevance": 0.0, "rows": [row(0.0, 0.2)]})
    assert "| relevance |" not in text and "| 16 | 0.5 (chosen) | 0.050 | 0.2000 |" in text


def test_a_block_is_rendered_by_the_benchmark_that_wrote_its_result(tmp_path):
    """A block no table is registered for by name takes its result's kind ("benchmark"); a
    result of no known kind leaves its block as it was."""
    row = {"alpha": 0.08, "check_layer": 8, "floor": 0.05, "sink_tokens": 4, "drift_shift": 0.0, "recompute": 0.05,
           "answer_kl": 0.125, "token_agreement": 0.9, "agreement": 0.8, "kl": 0.3, "ttft_s": 2.5}
    data = {"benchmark": "calibrate", "command": "cachecraft calibrate", "model": "m", "limit": 4, "skip": 36,
            "date": "2026-11-25T00:00", "machine": {"cpu": "cpu", "cores": 2}, "full_ttft_s_median": 40.0,
            "policy_floor": 0.05, "policy_sink_tokens": 4, "policy_drift_shift": 0.0, "rows": [row]}
    text = render(tmp_path, "calibrate_some_new_name", data)
    assert "| 0.08 | 0.05 | 4 | 0 (chosen) | 0.050 | 0.1250 | 0.900 | 0.3000 | 2.50 |" in text
    results = tmp_path / "results"
    (results / "odd.json").write_text(json.dumps({"benchmark": "unknown-kind"}))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:odd -->\nkept\n<!-- /results:odd -->\n")
    assert update(readme, results) == []
    assert "kept" in readme.read_text()


def test_workload_block_counts_kept_exact_requests_and_the_asks_they_served_where_the_result_has_them(tmp_path):
    method = {"ttft_s_mean": 1.25, "ttft_s_p95": 7.0, "throughput_rps": 0.2, "recompute_fraction_mean": 0.144,
              "hit_rate": 0.93, "compute_reduction_vs_full": 0.85, "agreement_f1_mean": 0.939}
    data = {"benchmark": "workload", "command": "cachecraft bench workload", "model": "m", "date": "2026-12-06T00:00",
            "unique_requests": 3, "corpus_chunks": 9, "top_k": 3, "requests": [{}] * 4,
            "methods": {"full": {**method, "kept_exact_requests": 0},
                        "cachecraft": {**method, "kept_exact_requests": 2}}}
    text = render(tmp_path, "workload_kept", data)
    assert "| agreement F1 vs full | kept exact |" in text
    assert "| cachecraft | 1.25 | 7.00 | 0.200 | 0.144 | 0.93 | 85% | - | 0.939 | 2 |" in text
    older = {**data, "methods": {"cachecraft": method}}  # before the count: no column
    assert "kept exact" not in render(tmp_path, "workload_older", older)
    # with the asks the keeps served, in brackets after the count
    served = {**data, "methods": {"full": {**method, "kept_exact_requests": 0, "keep_asks_served": 0},
                                  "cachecraft": {**method, "kept_exact_requests": 2, "keep_asks_served": 7}}}
    text = render(tmp_path, "workload_served", served)
    assert "| agreement F1 vs full | kept exact (asks they served) |" in text
    assert "| cachecraft | 1.25 | 7.00 | 0.200 | 0.144 | 0.93 | 85% | - | 0.939 | 2 (7) |" in text
    assert "reused exactly" not in text  # its rows do not say
    # rows that say which requests reused every chunk exactly: counted per method
    rows = [{"method": "full", "reused_exact": False}, {"method": "cachecraft", "reused_exact": False},
            {"method": "cachecraft", "reused_exact": True}, {"method": "cachecraft", "reused_exact": True}]
    text = render(tmp_path, "workload_exact", {**served, "requests": rows})
    assert "| kept exact (asks they served) | reused exactly |\n|---|---|---|---|---|---|---|---|---|---|---|\n" in text
    assert "| full | 1.25 | 7.00 | 0.200 | 0.144 | 0.93 | 85% | - | 0.939 | 0 (0) | 0 |" in text
    assert "| cachecraft | 1.25 | 7.00 | 0.200 | 0.144 | 0.93 | 85% | - | 0.939 | 2 (7) | 2 |" in text


def test_a_comparison_of_workloads_has_a_row_per_trace_and_the_pooled_verdict(tmp_path):
    side = {"requests": 90, "agreement_f1": 0.9876, "ttft_s_mean": 1.004, "kept_exact": 4, "reused_exact": 74}
    data = {"benchmark": "workload_compare", "command": "cachecraft bench compare-workloads", "model": "m",
            "date": "2026-12-07T00:00", "machine": {"cpu": "cpu", "cores": 2}, "base": ["r/s0.json"],
            "other": ["r/s0.json:cachecraft[asks=1]"], "requests": 90, "clusters": 7,
            "traces": [{"base": side, "other": {**side, "agreement_f1": 0.991, "kept_exact": 5}}],
            "agreement_f1_difference": {"mean": 0.0034, "low": 0.001, "high": 0.0071},
            "ttft_ratio": {"mean": 0.97, "low": 0.94, "high": 1.01}, "requests_better": 2, "requests_worse": 0}
    text = render(tmp_path, "compare_some_name", data)
    assert "(m, 1 trace, 90 requests in 7 chunk orders, 2026-12-07, cpu, 2 cores)" in text
    assert "| `s0.json` / `s0.json:cachecraft[asks=1]` | 0.988 / 0.991 | 1.00 / 1.00 | 4 / 5 | 74 / 74 |" in text
    assert ("agreement F1, other - base, +0.0034 [+0.0010, +0.0071] (better; 2 requests better, 0 worse); "
            "total TTFT, other / base, 0.970 [0.940, 1.010].") in text
