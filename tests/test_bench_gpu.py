"""``bench gpu`` on the CPU with the tiny shape: models built from shapes, fixed fractions, the JSON."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cachecraft.bench.gpu import SHAPES, add_context_arguments, fixed_fraction_methods, random_model, shape_context
from cachecraft.cli.app import app
from cachecraft.methods import CacheCraft
from tests.conftest import tiny_tokenizer


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


@pytest.fixture
def long_dataset(tmp_path):
    """Six items of four 40-word passages: about a thousand tokens in the tiny tokenizer."""
    items = [{"ctxs": [{"title": "w1", "text": words(10 + 9 * i + 2 * j, 40)} for j in range(4)],
              "question": words(250 + i, 4), "answers": [words(1, 1)]} for i in range(6)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(items))
    return path


def test_a_shape_is_built_as_published_with_random_weights():
    lm = random_model("tiny-llama", tiny_tokenizer(), torch.device("cpu"), torch.float32)
    dims = SHAPES["tiny-llama"].dims
    config = lm.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size) == \
        (dims["num_hidden_layers"], dims["hidden_size"], dims["num_key_value_heads"], dims["vocab_size"])
    assert lm.adapter.num_layers == 4 and lm.model.lm_head.weight.dtype == torch.float32
    again = random_model("tiny-llama", tiny_tokenizer(), torch.device("cpu"), torch.float32)
    assert again.fingerprint == lm.fingerprint  # seeded: the same weights each time
    big_vocab = type("Tok", (), {"__len__": lambda self: 50_000})()
    with pytest.raises(ValueError, match="do not fit"):
        random_model("tiny-llama", big_vocab, torch.device("cpu"), torch.float32)


def test_fixed_fractions_are_the_policy_with_a_floor_and_no_alpha():
    methods = fixed_fraction_methods([0.02, 0.1])
    assert all(isinstance(m, CacheCraft) and m.ratio == 0.0 for m in methods)
    assert [m.floor for m in methods] == [0.02, 0.1]
    assert [m.label for m in methods] == ["cachecraft@0/F0.02", "cachecraft@0/F0.1"]
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        fixed_fraction_methods([0.0])


def test_command_writes_one_sweep_per_tier(long_dataset, tmp_path, cache_dir):
    tok = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok)
    out = tmp_path / "gpu.json"
    args = ["bench", "gpu", "--dataset", str(long_dataset), "--shapes", "tiny-llama", "--tiers", "cpu,disk",
            "--contexts", "600", "--chunk-tokens", "100", "--methods", "full,prefix,reuse", "--fractions", "0.1",
            "--tokenizer", str(tok), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["benchmark"] == "gpu" and data["weights"].startswith("random")
    assert out.with_suffix(".png").stat().st_size > 10_000  # the speedups plotted
    assert data["command"].startswith("cachecraft bench gpu")
    assert [(r["shape"], r["tier"]) for r in data["runs"]] == [("tiny-llama", "cpu"), ("tiny-llama", "disk")]
    cpu, disk = data["runs"]
    assert [r["method"] for r in cpu["scaling"]] == ["full", "prefix", "reuse", "cachecraft@0/F0.1"]
    assert [r["method"] for r in disk["scaling"]] == ["full", "reuse", "cachecraft@0/F0.1"]  # prefix: once
    assert cpu["setup"]["tier"] == "cpu" and disk["setup"]["tier"] == "disk"
    assert cpu["layers"] == 4 and cpu["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 2  # K and V, float16
    for run in data["runs"]:
        craft = next(r for r in run["scaling"] if r["method"] == "cachecraft@0/F0.1")
        # a tenth of each cached chunk, rounded down per chunk
        assert 0.09 <= craft["recompute_fraction"] <= 0.1
        assert all(r["peak_gpu_mb"] is None for r in run["scaling"])
    for bad, message in ((["--shapes", "gpt-5"], "--shapes"), (["--tiers", "ssd"], "--tiers"),
                         (["--fractions", "2"], "--fractions"), (["--tokenizer", str(tmp_path / "no")], "not a dir")):
        failed = CliRunner().invoke(app, [*args, *bad])
        assert failed.exit_code == 1 and message in failed.output, failed.output
    cold = CliRunner().invoke(app, [*args, "--tiers", "disk,cpu", "--methods", "full", "--cold", "--repeats", "2"])
    assert cold.exit_code == 0, cold.output
    first, second = json.loads(out.read_text())["runs"]
    # a first-time request loads nothing: timed once, in the first tier's sweep, computing everything
    assert [r["method"] for r in first["scaling"]] == ["full", "cachecraft@0/F0.1", "cachecraft@0/F0.1 cold"]
    assert [r["method"] for r in second["scaling"]] == ["full", "cachecraft@0/F0.1"]
    assert first["scaling"][-1]["recompute_fraction"] == 1.0 and first["setup"]["cold"]
    # two questions a point, each kept in the rows, their mean in the table
    assert first["setup"]["repeats"] == 2 and first["scaling"][0]["repeats"] == 2
    assert sorted(r["repeat"] for r in first["requests"] if r["method"] == "full") == [0, 1]


def test_the_readme_table_shows_each_tier_with_speedups_recompute_and_peak_memory():
    from cachecraft.bench.readme import gpu_table

    def row(method, tokens, ttft, speedup, recompute, peak):
        return {"method": method, "context_tokens": tokens, "ttft_s": ttft, "speedup_vs_full": speedup,
                "recompute_fraction": recompute, "peak_gpu_mb": peak}
    run = {"shape": "s", "parameters": 8.0e9, "kv_bytes_per_token": 131072, "tier": "gpu",
           "scaling": [row("full", 100, 1.0, 1.0, 1.0, 2048), row("reuse", 100, 0.25, 4.0, 0.0, 3072),
                       row("cachecraft@0/F0.05", 100, 0.5, 2.0, 0.05, 4096)]}
    data = {"command": "cachecraft bench gpu", "date": "2026-11-26T00:00:00", "code": {"commit": "abc"},
            "machine": {"gpu": "G", "torch": "2"}, "runs": [run, {**run, "tier": "disk"}]}
    table = gpu_table(data)
    assert "| prompt tokens | full | reuse | cachecraft 5% |" in table
    assert "| 100 | 1.00 s | 0.25 s (4.0x) | 0.50 s (2.0x, 5%) |" in table
    assert "8.0B parameters, 128 KiB of chunk-cache per token), caches in the **disk** tier" in table
    assert "at 100 tokens, caches in the gpu tier" in table and "full 2.0, reuse 3.0, cachecraft 5% 4.0." in table
    assert "; one question per point)" in table
    three = {**run, "scaling": [{**r, "repeats": 3} for r in run["scaling"]]}
    assert "; means of 3 questions a point)" in gpu_table({**data, "runs": [three]})


def test_the_one_request_scripts_context_is_cut_as_bench_scaling_cuts_it(long_dataset, tmp_path):
    import argparse

    from cachecraft.config import Config
    from cachecraft.dataset import load_items

    parser = argparse.ArgumentParser()
    add_context_arguments(parser, shape="tiny-llama", tokens=600)
    args = parser.parse_args([str(tmp_path / "out"), "--dataset", str(long_dataset), "--tokenizer", "tok"])
    assert (args.shape, args.tokens, args.out) == ("tiny-llama", 600, tmp_path / "out")
    config = Config.load(overrides={"cache_dir": tmp_path / "cache"}, environ={})
    lm, chunks = shape_context(args.shape, tiny_tokenizer(), torch.device("cpu"), torch.float32, config,
                               load_items(args.dataset), args.tokens, chunk_tokens=100)
    assert lm.adapter.num_layers == SHAPES["tiny-llama"].dims["num_hidden_layers"]
    assert len(chunks) == 6  # 600 tokens in chunks of 100
    assert all(len(lm.tokenizer(c, add_special_tokens=False)["input_ids"]) <= 101 for c in chunks)
