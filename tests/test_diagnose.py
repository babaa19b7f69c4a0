"""bench diagnose: its helpers against values computed by hand, and its runs against the
full prefill they measure drift from (tiny random-weight model)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cachecraft.bench.report import write_report
from cachecraft.bench.diagnose import (bucket_name, position_profile, relative_deviation, run_diagnose,
                                       split_budget, summarize, top_per_chunk)
from cachecraft.config import Config
from cachecraft.dataset import load_items


def test_buckets_are_named_as_people_count_positions():
    assert [bucket_name(0, 1), bucket_name(1, 4), bucket_name(4, 16), bucket_name(64, None)] == \
        ["1", "2-4", "5-16", "65+"]


def test_relative_deviation_per_token():
    full = torch.zeros(1, 2, 2)
    full[0, 0] = torch.tensor([3.0, 4.0])  # norm 5
    full[0, 1] = torch.tensor([1.0, 0.0])
    reused = full.clone()
    reused[0, 0] = torch.tensor([3.0, 1.0])  # off by 3 -> 3/5
    assert torch.allclose(relative_deviation(reused, full), torch.tensor([0.6, 0.0]))


def test_position_profile_averages_each_bucket_over_chunks():
    per_token = torch.arange(10, dtype=torch.float32)  # token i has value i
    spans = [(0, 3), (3, 10)]  # chunk A: 0,1,2; chunk B: 3..9
    profile = position_profile(per_token, spans)
    assert profile["1"] == pytest.approx((0 + 3) / 2)  # first token of each chunk
    assert profile["2-4"] == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)
    assert profile["5-16"] == pytest.approx((7 + 8 + 9) / 3)  # only chunk B is long enough
    assert math.isnan(profile["65+"])


def test_top_per_chunk_and_split_budget():
    score = torch.tensor([5.0, 1.0, 9.0, 2.0, 0.0, 7.0, 3.0, 8.0])
    picks = top_per_chunk(score, [(0, 4), (4, 8)], 0.5)
    assert [p.tolist() for p in picks] == [[0, 2], [1, 3]]  # local indices, sorted
    assert split_budget(5) == (2, 3) and split_budget(4) == (2, 2) and split_budget(0) == (0, 0)


def test_summary_means_over_items():
    def row(dev, kl):
        run = {"answer_kl": kl, "token_agreement": 1.0, "kl": kl, "recompute_fraction": 0.0}
        return {"contexts": {"system": {"layers_k": [0.0, dev], "layers_v": [0.0, dev], "positions_v": {"1": dev},
                                        "reuse": run, "selectors": {"firstk@0.5": run}}}}
    summary = summarize([row(0.2, 0.1), row(0.4, 0.3)])["system"]
    assert summary["layers_v"] == pytest.approx([0.0, 0.3]) and summary["positions_v"]["1"] == pytest.approx(0.3)
    assert summary["runs"]["reuse"]["answer_kl"] == pytest.approx(0.2)


def test_every_selector_at_a_budget_of_one_is_the_full_prefill(tiny_llama, dataset, tmp_path):
    """Recomputing every chunk token gives full's prefill back (answer KL and first-token KL
    0 to float precision) whatever the cache was made after; reusing them untouched does
    not, and layer 0, which sees no context, never deviates."""
    config = Config.load(overrides={"cache_dir": tmp_path, "system_prompt": "w3 w4 w5", "max_new_tokens": 3,
                                    "warm_context": "builtin", "warm_context_tokens": 16,
                                    "policy_check_layer": 1}, environ={})
    items = load_items(dataset, limit=2)
    result = run_diagnose(tiny_llama, config, items, [1.0])
    row = result["rows"][0]
    assert set(row["contexts"]) == {"system", "warm", "previous", "other", "foreign", "related", "corpus"}
    for context, entry in row["contexts"].items():
        assert entry["layers_v"][0] == pytest.approx(0.0, abs=1e-6) and entry["layers_k"][0] == pytest.approx(0.0,
                                                                                                          abs=1e-5)
        assert max(entry["layers_v"][1:]) > 1e-4, context  # the caches were made in another context
        for label, figures in entry["selectors"].items():
            assert figures["recompute_fraction"] == pytest.approx(1.0), (context, label)
            assert figures["answer_kl"] == pytest.approx(0.0, abs=1e-5), (context, label)
            assert figures["kl"] == pytest.approx(0.0, abs=1e-5), (context, label)
            assert figures["token_agreement"] == 1.0, (context, label)
    assert set(result["summary"]) == set(row["contexts"])
    # each context made different caches: reuse drifts by a different amount
    drift = {c: e["layers_v"][-1] for c, e in row["contexts"].items()}
    assert len({round(d, 6) for d in drift.values()}) == len(drift), drift

    source = tmp_path / "diagnose.json"
    source.write_text(json.dumps({**result, "model": "tiny", "command": "cachecraft bench diagnose"}))
    text = write_report(tmp_path / "report", {"diagnose": source}).read_text()
    assert "## Why reuse drifts: layers, tokens, cache context, selectors (tiny)" in text
    assert (tmp_path / "report" / "diagnose.png").read_bytes()[:4] == b"\x89PNG"
    assert "| warm | firstk@1 | 1.000 |" in text and "Caches reused untouched, answer KL" in text
