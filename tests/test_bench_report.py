"""``bench report`` from small synthetic result files shaped like the real ones."""

from __future__ import annotations

import json
import sys

import matplotlib.pyplot as plt
import pytest
from typer.testing import CliRunner

from cachecraft.bench.report import write_report
from cachecraft.cli.app import app

MACHINE = {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "python": "3.11"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUALITY_CMD = "cachecraft bench quality --dataset d.json --limit 2 --out q.json"
WORKLOAD_CMD = "cachecraft bench workload --dataset d.json --requests 4 --out w.json"
SCALING_CMD = "cachecraft bench scaling --dataset d.json --contexts 1000,2000 --out s.json"


def quality_result() -> dict:
    def method(ttft, recompute, kl, agreement):
        return {"n": 2, "ttft_s_median": ttft, "ttft_s_mean": ttft, "speedup_vs_full_median": 20.0 / ttft,
                "recompute_fraction_mean": recompute, "kl_mean": kl, "agreement_f1_mean": agreement,
                "exact_match_rate": agreement, "gold_f1_mean": 0.04, "peak_rss_mb_max": 3000.0, "kv_mb_mean": 260.0}
    methods = {"full": method(20.0, 1.0, 0.0, 1.0), "prefix": method(21.0, 1.0, 0.0, 1.0),
               "reuse": method(0.5, 0.0, 0.16, 0.76)}
    for r, (t, kl, a) in {0.05: (2.0, 0.12, 0.78), 0.15: (4.0, 0.10, 0.80), 0.3: (7.0, 0.06, 0.90),
                          0.5: (11.0, 0.03, 0.85)}.items():
        methods[f"cacheblend@{r:g}"] = method(t, r, kl, a)
    for r, (t, kl, a) in {0.05: (1.5, 0.07, 0.85), 0.15: (2.5, 0.05, 0.92), 0.6: (6.0, 0.01, 0.97)}.items():
        methods[f"cachecraft@{r:g}"] = method(t, r / 2, kl, a)
    items = [{"item": i, "method": label, "ttft_s": m["ttft_s_median"], "agreement_f1": m["agreement_f1_mean"]}
             for i in range(2) for label, m in methods.items()]
    return {"date": "2026-11-21T00:00:00+00:00", "machine": MACHINE, "benchmark": "quality", "command": QUALITY_CMD,
            "model": "smollm2", "dataset": "d.json", "limit": 2, "items": items, "methods": methods}


def workload_result() -> dict:
    labels = ["full", "prefix", "reuse", "cacheblend", "cachecraft", "cachecraft[lru]", "cachecraft[cachecraft]"]
    rows, methods = [], {}
    for k, label in enumerate(labels):
        for n in range(4):
            hits = {} if label in ("full", "prefix") else {"cpu": min(n, 2), "disk": 1 if n == 3 else 0}
            hits["miss"] = 3 - sum(hits.values())
            rows.append({"method": label, "request": n, "item": n % 2, "prompt_tokens": 2000, "ttft_s": 1.0 + k + n,
                         "request_s": 2.0 + k, "recompute_fraction": 0.5, "token_layers": 1000 * (n + 1),
                         "hits": hits, "chunks": 3, "agreement_f1": 1.0 if k < 2 else 0.9, "answer": "x",
                         "store_bytes": {"cpu": 2**20 * (n + 1), "disk": 2**21 * n}})
        methods[label] = {"requests": 4, "ttft_s_mean": 2.5 + k, "ttft_s_median": 2.5 + k, "ttft_s_p95": 4.0 + k,
                          "throughput_rps": 0.5, "recompute_fraction_mean": 0.5, "token_layers": 10000,
                          "hit_rate": 0.0 if k < 2 else 0.5 + k / 100, "hit_rate_by_tier": {"cpu": 0.4, "disk": 0.1},
                          "agreement_f1_mean": 1.0 if k < 2 else 0.9,
                          "compute_reduction_vs_full": 0.0 if k == 0 else 0.1 * k,
                          "compute_reduction_vs_prefix": -0.1 if k == 0 else 0.1 * (k - 1),
                          "store_usage": {"cpu": {"entries": 3, "bytes": 4 * 2**20, "budget": 8 * 2**20}}}
    return {"date": "2026-11-21T00:00:00+00:00", "machine": MACHINE, "benchmark": "workload", "command": WORKLOAD_CMD,
            "model": "smollm2", "dataset": "d.json", "items": 2, "corpus_chunks": 20, "unique_requests": 3, "top_k": 3,
            "budgets": {"cpu": 8 * 2**20, "disk": 32 * 2**20}, "requests": rows, "methods": methods}


def scaling_result() -> dict:
    rows = []
    speed = {"full": 1.0, "prefix": 1.1, "reuse": 30.0, "cacheblend": 4.0, "cachecraft@0.15": 8.0}
    for sweep, points in (("context", [(1000, 2), (2000, 4)]), ("chunks", [(2000, 2), (2000, 5)])):
        for tokens, chunks in points:
            for label, s in speed.items():
                full = tokens / 100
                rows.append({"sweep": sweep, "method": label, "target_tokens": tokens, "context_tokens": tokens - 3,
                             "n_chunks": chunks, "repeats": 2, "ttft_s": full / s, "speedup_vs_full": s,
                             "agreement_f1": 1.0 if s < 2 else 0.8, "kl": 0.0 if s < 2 else 0.1,
                             "recompute_fraction": 1.0 if s < 2 else 0.1, "peak_rss_mb": 1000 + tokens / 10})
    summary = {"max_context_tokens": 1997, "method": "cachecraft@0.15", "speedup_at_max_context": 8.0,
               "agreement_at_max_context": 0.8, "goal": {"speedup": 10.0, "agreement_f1": 0.95, "met": False}}
    return {"date": "2026-11-21T00:00:00+00:00", "machine": MACHINE, "benchmark": "scaling", "command": SCALING_CMD,
            "model": "smollm2", "dataset": "d.json", "scaling": rows, "requests": [], "summary": summary,
            "setup": {"chunk_caches": "warmed", "prefix": "one earlier request", "prefix_shared": 1}}


EXPECTED_PNGS = ["quality_tradeoff.png", "quality_bars.png", "workload_compute.png", "workload_ttft.png",
                 "workload_hits.png", "workload_bytes.png", "workload_evictions.png", "scaling_context.png",
                 "scaling_chunks.png", "scaling_memory.png"]


@pytest.fixture
def results(tmp_path):
    paths = {}
    for name, make in (("quality", quality_result), ("workload", workload_result), ("scaling", scaling_result)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(make()))
    return paths


def test_report_has_sections_commands_and_valid_plots(results, tmp_path):
    out = tmp_path / "report"
    text = write_report(out, results).read_text()
    for command in (QUALITY_CMD, WORKLOAD_CMD, SCALING_CMD):
        assert command in text
    for heading in ("## Quality", "## Workload", "### Eviction policies", "## Scaling", "## Where cachecraft loses",
                    "## GPU", "## Reproduce"):
        assert heading in text
    assert "No GPU run was made on this machine" in text and "Gold-answer F1 is near zero" in text
    assert "Test CPU, 2 cores" in text and "| cachecraft[lru] |" in text
    assert "- code: not recorded" in text  # these results predate the record of the code
    assert "**8.0x**" in text and "not met" in text
    # losses computed from the data
    assert "`reuse` is faster than every cachecraft setting" in text
    assert "`cacheblend` agrees less at ratio 0.5 (0.850) than at 0.3 (0.900)" in text
    assert "`prefix` beats `cachecraft` on agreement with full" in text
    assert "`reuse` is faster than `cachecraft@0.15` at 4 of 4 points" in text
    for name in EXPECTED_PNGS:
        path = out / name
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        image = plt.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100, name
        assert f"]({name})" in text


def test_missing_results_and_gpu_section(results, tmp_path):
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({**quality_result(), "machine": {**MACHINE, "gpu": "NVIDIA H100"}}))
    sources = {**results, "scaling": tmp_path / "absent.json"}
    text = write_report(tmp_path / "r", sources, gpu).read_text()
    assert "GPU results exist" in text and "NVIDIA H100" in text
    assert "No result at" in text and "cachecraft bench scaling --dataset" in text
    assert not (tmp_path / "r" / "scaling_context.png").exists()
    bare = {**results, "workload": tmp_path / "w2.json"}
    data = workload_result()
    data["methods"] = {k: v for k, v in data["methods"].items() if "[" not in k}
    for row in data["requests"]:
        row.pop("store_bytes")
    bare["workload"].write_text(json.dumps(data))
    text = write_report(tmp_path / "r2", bare).read_text()
    assert "## Eviction" not in text  # neither the workload nor a separate run compared policies
    assert (tmp_path / "r2" / "workload_bytes.png").exists()  # falls back to the final usage
    assert not (tmp_path / "r2" / "workload_evictions.png").exists()


def test_command(results, tmp_path):
    out = tmp_path / "cli-report"
    result = CliRunner().invoke(app, ["bench", "report", "--out", str(out), "--quality", str(results["quality"]),
                                      "--workload", str(results["workload"]), "--scaling", str(results["scaling"]),
                                      "--eviction", str(tmp_path / "no-eviction-run.json"),
                                      "--replay", str(tmp_path / "no-replay.json"),
                                      "--revisit", str(tmp_path / "no-revisit.json"),
                                      "--tradeoff", str(tmp_path / "no-tradeoff.json"),
                                      "--diagnose", str(tmp_path / "no-diagnose.json")])
    assert result.exit_code == 0, result.output
    assert (out / "report.md").is_file() and "10 plots" in " ".join(result.output.split())
    missing = CliRunner().invoke(app, ["bench", "report", "--out", str(out), "--gpu-json", str(tmp_path / "no.json"),
                                       "--quality", str(results["quality"])])
    assert missing.exit_code == 1 and "GPU result not found" in " ".join(missing.output.split())


def test_missing_results_show_the_dataset_given_or_a_placeholder(results, tmp_path):
    sources = {**results, "scaling": tmp_path / "absent.json"}
    text = write_report(tmp_path / "r", sources).read_text()
    assert f"cachecraft bench scaling --dataset DATASET --out {sources['scaling']}" in text
    text = write_report(tmp_path / "r2", sources, dataset="my.json").read_text()
    assert f"cachecraft bench scaling --dataset my.json --out {sources['scaling']}" in text


def test_run_needs_a_dataset(results, tmp_path):
    result = CliRunner().invoke(app, ["bench", "report", "--run", "--out", str(tmp_path / "r"),
                                      "--quality", str(results["quality"]), "--scaling", str(tmp_path / "no.json")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--run needs --dataset" in " ".join(result.output.split())


def test_without_matplotlib_the_report_is_a_one_line_error(results, tmp_path, monkeypatch):
    import cachecraft.bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    for name in ("plots", "report"):  # make the command import them afresh
        monkeypatch.delitem(sys.modules, f"cachecraft.bench.{name}")
        monkeypatch.delattr(cachecraft.bench, name)
    result = CliRunner().invoke(app, ["bench", "report", "--out", str(tmp_path / "r"),
                                      "--quality", str(results["quality"])])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines() == [
        "error: matplotlib is not installed: pip install 'cachecraft[bench]'"]


def test_a_separate_eviction_run_gets_its_own_section(tmp_path):
    workload = workload_result()
    evictions = {k: v for k, v in workload["methods"].items() if k == "full" or k.startswith("cachecraft[")}
    plain = {**workload, "methods": {k: v for k, v in workload["methods"].items() if "[" not in k}}
    eviction = {**workload, "command": "cachecraft bench workload --methods full --evictions lru,cachecraft",
                "methods": evictions, "requests": [r for r in workload["requests"] if r["method"] in evictions]}
    paths = {}
    for name, data in (("workload", plain), ("eviction", eviction)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    text = write_report(tmp_path / "r", paths).read_text()
    assert "## Eviction policies" in text and eviction["command"] in text
    assert "| cachecraft[lru] | 0.55 |" in text  # hit rate 0.5 + 5/100 from the synthetic result
    assert (tmp_path / "r" / "workload_evictions.png").read_bytes().startswith(PNG_MAGIC)
    assert "beats cachecraft's own policy on hit rate" not in text  # lru 0.55 < own 0.56
    assert "no `cachecraft` run to compare" not in text  # an eviction-only run is not a missing comparison
    eviction["methods"]["cachecraft[lru]"] = {**evictions["cachecraft[lru]"], "hit_rate": 0.9}
    paths["eviction"].write_text(json.dumps(eviction))
    text = write_report(tmp_path / "r3", paths).read_text()
    assert "Eviction: `cachecraft[lru]` beats cachecraft's own policy on hit rate: 0.90 vs 0.56." in text


def test_an_eviction_replay_gets_its_section_plot_and_losses(tmp_path):
    rows = [{"budget_fraction": f, "policy": p, "budget_bytes": int(f * 2**30), "lookups": 100,
             "hits": hits, "hit_rate": hits / 100, "compute_saved": hits / 100, "evictions": 5}
            for f, hits_by_policy in ((0.1, {"lru": 30, "cachecraft": 40}), (0.25, {"lru": 70, "cachecraft": 60}))
            for p, hits in hits_by_policy.items()]
    replay = {"date": "2026-11-21T00:00:00+00:00", "machine": MACHINE, "benchmark": "eviction",
              "command": "cachecraft bench eviction --out e.json", "model": "smollm2", "dataset": "d.json",
              "requests": 50, "top_k": 2, "rows": rows,
              "summary": {"distinct_chunks": 40, "lookups": 100, "corpus_bytes": 2**30}}
    path = tmp_path / "replay.json"
    path.write_text(json.dumps(replay))
    text = write_report(tmp_path / "r", {"replay": path}).read_text()
    assert "## Eviction policies on a long trace" in text and replay["command"] in text
    assert "| 25% (256 MiB) | lru | 0.700 | 70.0% | 5 |" in text
    assert (tmp_path / "r" / "eviction_replay.png").read_bytes()[:8] == PNG_MAGIC
    assert "at a 25% budget: `lru` beats cachecraft's own policy on hit rate: 0.700 vs 0.600" in text
    assert "at a 10% budget" not in text  # cachecraft ahead there
    # ``replay:TAG`` (``--also-replay``): another trace, its own section, plot and losses
    shifted = tmp_path / "shift.json"
    shifted.write_text(json.dumps({**replay, "seed": 7, "shift_every": 10,
                                   "rows": [{**r, "hits": 80, "hit_rate": 0.8} if r["policy"] == "lru" else r
                                            for r in rows]}))
    text = write_report(tmp_path / "r2", {"replay": path, "replay:shift": shifted}).read_text()
    assert "## Eviction policies on a long trace (seed ?)" in text
    assert "## Eviction policies on a long trace (seed 7, popularity drawn anew every 10 requests)" in text
    assert (tmp_path / "r2" / "eviction_replay_shift.png").read_bytes()[:8] == PNG_MAGIC
    assert "at a 10% budget: `lru` beats cachecraft's own policy on hit rate: 0.800 vs 0.400" in text
    assert "--also-replay " + str(shifted) in text


def one_context_result(path, command: str, rows: list[dict], summary: dict, setup: dict):
    """Write a one-context ``bench scaling`` result with these rows at ``path``."""
    path.write_text(json.dumps({"date": "2026-11-21T00:00:00+00:00", "machine": MACHINE, "benchmark": "scaling",
                                "command": command, "model": "smollm2", "dataset": "d.json", "scaling": rows,
                                "requests": [], "summary": summary, "setup": setup}))
    return path


def test_a_revisit_run_gets_its_section_plot_and_losses(tmp_path):
    def row(method, ttft, kl, agreement, overlap):
        return {"sweep": "context", "method": method, "target_tokens": 7900, "context_tokens": 7912, "n_chunks": 15,
                "repeats": 6, "ttft_s": ttft, "speedup_vs_full": 28.0 / ttft, "agreement_f1": agreement, "kl": kl,
                "recompute_fraction": 0.02, "peak_rss_mb": 2000.0, "prefix_overlap": overlap}
    rows = [row("full", 28.0, 0.0, 1.0, None), row("reuse", 0.8, 0.12, 0.84, None),
            row("cachecraft@0.08", 1.6, 0.10, 0.71, 0.0), row("cachecraft@0.08 revisit", 1.75, 0.035, 0.96, 0.41),
            row("prefix revisit", 27.0, 0.0, 1.0, None)]
    summary = {"max_context_tokens": 7912, "method": "cachecraft@0.08", "speedup_at_max_context": 17.5,
               "agreement_at_max_context": 0.71, "goal": {"speedup": 10.0, "agreement_f1": 0.95, "met": False},
               "goal_revisit": {"method": "cachecraft@0.08 revisit", "speedup": 16.0, "agreement_f1": 0.96,
                                "met": True}}
    command = "cachecraft bench scaling --contexts 7900 --revisit --out r.json"
    path = one_context_result(tmp_path / "revisit.json", command, rows, summary,
                              {"revisit": "one earlier request over the same chunks, shuffled"})
    text = write_report(tmp_path / "r", {"revisit": path}).read_text()
    assert "## Chunks seen before, in another order" in text and command in text
    assert "| cachecraft@0.08 revisit | 7912 | 6 | 1.75 | 16.0x | 0.020 | 0.0350 | 0.960 | 0.41 |" in text
    assert "| reuse | 7912 | 6 | 0.80 | 35.0x | 0.020 | 0.1200 | 0.840 | - |" in text
    assert "`cachecraft@0.08 revisit` is **16.0x** faster than full prefill at agreement 0.960" in text
    assert "**met**" in text and "**not met**" in text  # the revisit goal, then the first-sight one
    assert "Revisit: `reuse` is faster than `cachecraft@0.08 revisit`" in text
    assert "Revisit: `cachecraft@0.08` agrees with full below 0.95" in text
    assert "shuffled, the goal is not met either" not in text
    image = tmp_path / "r" / "revisit.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and "](revisit.png)" in text


def test_a_ratio_sweep_gets_its_section_plot_and_goal_reach(tmp_path):
    def row(method, ttft, agreement, recompute):
        return {"sweep": "context", "method": method, "target_tokens": 7900, "context_tokens": 7912, "n_chunks": 15,
                "repeats": 6, "ttft_s": ttft, "speedup_vs_full": 30.0 / ttft, "agreement_f1": agreement,
                "exact_match": 0.5, "kl": 0.1 * (1 - agreement), "recompute_fraction": recompute,
                "peak_rss_mb": 2000.0}
    rows = [row("full", 30.0, 1.0, 1.0), row("reuse", 0.75, 0.84, 0.0), row("cachecraft@0.08", 1.5, 0.80, 0.01),
            row("qguided@0.05", 2.0, 0.85, 0.05), row("qguided@0.4", 12.0, 0.90, 0.4),
            row("cacheblend@0.15", 6.0, 0.83, 0.15), row("cacheblend@0.5", 15.0, 0.96, 0.5)]
    summary = {"max_context_tokens": 7912, "method": "cachecraft@0.08", "speedup_at_max_context": 20.0,
               "agreement_at_max_context": 0.80, "goal": {"speedup": 10.0, "agreement_f1": 0.95, "met": False}}
    command = "cachecraft bench scaling --contexts 7900 --methods full,reuse,qguided@0.05 --out t.json"
    path = one_context_result(tmp_path / "tradeoff.json", command, rows, summary, {"chunk_caches": "made by warm"})
    text = write_report(tmp_path / "r", {"tradeoff": path}).read_text()
    assert "## Recompute against agreement at the longest context" in text and command in text
    assert "| qguided@0.4 | 7912 | 6 | 12.00 | 2.5x | 0.400 | 0.0100 | 0.900 | 0.50 |" in text
    # 30 s / 15 s = 2x for the one setting at >= 0.95; qguided's best is 0.90 at 2.5x, its best >= 10x 0.85 at 15x
    assert "`cacheblend` reaches 0.95 agreement at best at `cacheblend@0.5`, 2.0x sooner than full" in text
    assert ("`qguided` stays below 0.95 agreement at every setting tried; its best is `qguided@0.4`, 0.900 at 2.5x "
            "(recompute 0.400); at 10x or more its closest is `qguided@0.05`, agreement 0.850.") in text
    assert "- `reuse`: agreement 0.840 at 40.0x (recompute 0.000)." in text
    assert "- Settings with both: none." in text
    assert "Recompute sweep: the goal (10x faster than full at agreement >= 0.95" in text
    image = tmp_path / "r" / "goal_tradeoff.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and "](goal_tradeoff.png)" in text
    rows[2] = row("cachecraft@0.08", 2.5, 0.97, 0.02)
    path = one_context_result(tmp_path / "tradeoff.json", command, rows, summary, {})
    assert "- Settings with both: `cachecraft@0.08`." in write_report(tmp_path / "r2", {"tradeoff": path}).read_text()


def test_a_whole_read_run_gets_its_loading_section_and_losses(tmp_path):
    def row(method, ttft, rss):
        return {"sweep": "context", "method": method, "target_tokens": 7900, "context_tokens": 7912, "n_chunks": 15,
                "ttft_s": ttft, "speedup_vs_full": 28.0 / ttft, "agreement_f1": 0.8, "kl": 0.1,
                "recompute_fraction": 0.02, "peak_rss_mb": rss}
    rows = [row("full", 28.0, 1900.0), row("reuse", 0.8, 1700.0), row("cachecraft@0.08", 2.2, 1800.0),
            row("reuse whole-read", 1.0, 2100.0), row("cachecraft@0.08 whole-read", 2.0, 2050.0)]
    command = "cachecraft bench scaling --tier disk --whole-read --out l.json"
    path = one_context_result(tmp_path / "loading.json", command, rows, {},
                              {"tier": "disk", "whole_read": "the same caches read whole first",
                               "loading_bandwidths": {"warm": {"cpu": 3e9, "disk": 2.5e9},
                                                      "whole": {"disk": 1.25e9}}})
    text = write_report(tmp_path / "r", {"loading": path}).read_text()
    assert "## Loading: streamed in during the prefill, or read whole first" in text and command in text
    assert "- setup, tier: disk" in text
    assert "- loading controller's bandwidths, streamed: cpu 3.00 GB/s, disk 2.50 GB/s" in text
    assert "- loading controller's bandwidths, read whole: disk 1.25 GB/s" in text
    assert "| reuse | 7912 | 1.00 | 0.80 | -20% | 2100 | 1700 | 0.800 / 0.800 |" in text
    assert "| cachecraft@0.08 | 7912 | 2.00 | 2.20 | +10% | 2050 | 1800 | 0.800 / 0.800 |" in text
    assert ("Loading: streaming `cachecraft@0.08`'s chunk-caches in during the prefill is slower than reading "
            "them whole first at 7912 tokens (2.20 s vs 2.00 s).") in text
    assert "Loading: streaming `reuse`" not in text
    missing = write_report(tmp_path / "m", {"loading": tmp_path / "none.json"}).read_text()
    assert "--tier disk --methods full,reuse,cachecraft --whole-read --out" in missing


def test_a_second_quality_result_gets_its_own_section_and_plots(tmp_path):
    """``quality:TAG`` (``--also-quality``): the second model's figures beside the first's,
    with plot files of their own, and its losses read off too."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({**quality_result(), "model": "judge"}))
    second.write_text(json.dumps({**quality_result(), "model": "small"}))
    text = write_report(tmp_path / "r", {"quality": first, "quality:b": second}).read_text()
    assert "## Quality and speed on the same requests (judge: a)" in text
    assert "## Quality and speed on the same requests (small: b)" in text
    assert (tmp_path / "r" / "quality_tradeoff.png").is_file()
    assert (tmp_path / "r" / "quality_tradeoff_b.png").is_file()
    assert "--also-quality " + str(second) in text
