"""Answer-level divergence: full's greedy answer teacher-forced through a method's prefill."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cachecraft.bench.quality import run_quality
from cachecraft.config import Config
from cachecraft.dataset import QAItem, load_items
from cachecraft.evaluation import answer_traced, evaluate_items, forced_logits, scratch_pipeline
from cachecraft.methods import parse_methods
from cachecraft.metrics import answer_divergence
from cachecraft.policy.planner import PolicyParams
from cli.app import app

CHUNKS = [" ".join(f"w{i}" for i in range(10 + 20 * j, 30 + 20 * j)) + "\n\n" for j in range(3)]
QUESTION = "w200 w201 w202"


def _config(path, **overrides) -> Config:
    return Config.load(overrides={"cache_dir": path, "max_new_tokens": 5, "kv_dtype": "float32",
                                  "warm_context": "none", "policy_check_layer": 2, **overrides}, environ={})


def test_answer_divergence_by_hand():
    reference = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    other = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    kl, agreement = answer_divergence(reference, other)
    p = torch.tensor([2.0, 0.0]).softmax(-1)  # position 1: KL(p || reversed p), position 0: 0
    assert kl == pytest.approx(float((p * (p.log() - p.flip(0).log())).sum()) / 2)
    assert agreement == 0.5  # position 0 ties (argmax 0 both), position 1 differs


def test_teacher_forcing_follows_the_greedy_answer_and_full_against_itself_is_exactly_zero(tiny_llama, tmp_path):
    with scratch_pipeline(tiny_llama, _config(tmp_path)) as pipeline:
        full, trace = answer_traced(pipeline, CHUNKS, QUESTION, "full")
        forced = forced_logits(pipeline, trace, trace.answer_ids)
        assert forced.shape[0] == trace.answer_ids.numel() == full.new_tokens
        assert torch.equal(forced.argmax(-1), trace.answer_ids)  # greedy: each forced row picks the next token
        assert (forced[0] - trace.logits).abs().max() < 1e-4  # row 0 is the prefill's prediction
        again, again_trace = answer_traced(pipeline, CHUNKS, QUESTION, "full")
        assert answer_divergence(forced, forced_logits(pipeline, again_trace, trace.answer_ids)) == (0.0, 1.0)


def test_every_fraction_at_one_has_no_answer_divergence(any_tiny, tmp_path):
    items = [QAItem(QUESTION, tuple(("", c) for c in CHUNKS), ("w200",))]
    with scratch_pipeline(any_tiny, _config(tmp_path)) as pipeline:
        pipeline.policy = PolicyParams(floor=1.0, check_layer=2)
        rows = evaluate_items(pipeline, items, parse_methods("full,cachecraft,cacheblend@1.0,qguided@1.0"),
                              max_new_tokens=5)
    full = rows[0]
    assert full["method"] == "full" and full["answer_kl"] == 0.0 and full["token_agreement"] == 1.0
    for row in rows[1:]:  # cachecraft leaves the first chunk, cached right after the system prompt, as it is
        assert row["recompute_fraction"] == (2 / 3 if row["method"].startswith("cachecraft") else 1.0)
        assert row["answer_kl"] < 1e-6 and row["token_agreement"] == 1.0, row["method"]


TIMED = ("ttft_s", "speedup_vs_full", "peak_rss_mb", "rss_growth_mb", "warm_s")


def _untimed(result: dict) -> dict:
    rows = [{k: v for k, v in r.items() if k not in TIMED} for r in result["items"]]
    methods = {label: {k: v for k, v in m.items() if not k.startswith(("ttft", "speedup", "peak", "rss"))
                       and k != "intervals"} | {"intervals": {k: v for k, v in m["intervals"].items()
                                                              if k != "speedup_vs_full"}}
               for label, m in result["methods"].items()}
    return {"items": rows, "methods": methods, "comparisons": result["comparisons"]}


def test_resume_after_a_killed_run_gives_the_same_result(tiny_llama, dataset, tmp_path):
    items = load_items(dataset)
    methods = parse_methods("full,reuse,cacheblend@0.15,cachecraft@0.3")
    config = _config(tmp_path / "cache")
    whole = run_quality(tiny_llama, config, items, methods, max_new_tokens=3, rows_path=tmp_path / "whole.jsonl")

    class Killed(Exception):
        pass

    def kill_after_first(done, total):
        if done == 1:
            raise Killed
    rows = tmp_path / "run.jsonl"
    with pytest.raises(Killed):
        run_quality(tiny_llama, config, items, methods, max_new_tokens=3, rows_path=rows, on_item=kill_after_first)
    with rows.open("a") as handle:
        handle.write('{"item": 1, "method": "fu')  # a line torn by the kill
    assert len(rows.read_text().splitlines()) == 1 + 4 + 1  # settings, item 0's four rows, the torn line
    seen = []
    resumed = run_quality(tiny_llama, config, items, methods, max_new_tokens=3, rows_path=rows, resume=True,
                          on_answer=lambda item, answer, trace: seen.append(item.index))
    assert set(seen) == {1}  # item 0 was not run again
    assert _untimed(resumed) == _untimed(whole)
    assert [json.loads(line)["item"] for line in rows.read_text().splitlines()[1:]] == [0] * 4 + [1] * 4


def test_resume_extends_a_run_to_more_items_and_reports_on_fewer(tiny_llama, dataset, tmp_path):
    """Resuming with another item list runs only the items the file lacks; a shorter list
    reports on its items alone, and the file keeps every finished item's rows."""
    items = load_items(dataset)
    assert len(items) >= 2
    methods = parse_methods("full,reuse")
    config = _config(tmp_path / "cache")
    rows = tmp_path / "run.jsonl"
    run_quality(tiny_llama, config, items[:1], methods, max_new_tokens=2, rows_path=rows)
    seen = []
    longer = run_quality(tiny_llama, config, items[:2], methods, max_new_tokens=2, rows_path=rows, resume=True,
                         on_answer=lambda item, answer, trace: seen.append(item.index))
    assert set(seen) == {items[1].index} and {r["item"] for r in longer["items"]} == {items[0].index, items[1].index}
    seen.clear()
    shorter = run_quality(tiny_llama, config, items[1:2], methods, max_new_tokens=2, rows_path=rows, resume=True,
                          on_answer=lambda item, answer, trace: seen.append(item.index))
    assert seen == [] and {r["item"] for r in shorter["items"]} == {items[1].index}
    assert shorter["methods"]["reuse"]["answer_kl_mean"] == next(
        r["answer_kl"] for r in longer["items"] if r["item"] == items[1].index and r["method"] == "reuse")
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    assert lines[0]["settings"]["items"] == [items[1].index]  # this run's items
    assert sorted(r["item"] for r in lines[1:]) == [items[0].index] * 2 + [items[1].index] * 2  # nothing dropped


def test_resume_refuses_a_rows_file_of_other_settings(tiny_dir, dataset, tmp_path, cache_dir):
    runner = CliRunner()
    args = ["bench", "quality", "--dataset", str(dataset), "--limit", "1", "--methods", "full,reuse",
            "--model", str(tiny_dir), "--max-new-tokens", "2", "--out", str(tmp_path / "q.json")]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert (tmp_path / "q.rows.jsonl").is_file() and "better" not in first.output.split("paired")[0]
    data = json.loads((tmp_path / "q.json").read_text())
    assert set(data["comparisons"]["reuse"]) == {"vs full"}
    other = runner.invoke(app, [*args[:-2], "--methods", "full,cacheblend", "--out", str(tmp_path / "q.json"),
                                "--resume"])
    assert other.exit_code == 1 and "other settings (methods)" in other.output
    # the error is one line, the last; before it, in a log, only the step that was running
    *steps, error = other.output.strip().splitlines()
    assert error.startswith("error: ") and steps == [f"[0m00s] loading model {tiny_dir} ..."]
    assert data["policy"]["values"]["policy_sink_tokens"] == 0  # the policy it ran with, and where from
    assert data["policy"]["sources"]["policy_sink_tokens"] == "default"
    # another policy (here a floor given in the environment) is another run
    again = runner.invoke(app, [*args, "--resume"], env={"CACHECRAFT_POLICY_FLOOR": "0.1"})
    assert again.exit_code == 1 and "other settings (policy)" in again.output
