"""check-model passes on supported models and catches a broken engine."""

import torch

from cachecraft.checks import check_model
from tests.conftest import tiny_model


def test_check_model_passes_on_each_tiny_architecture(any_tiny):
    report = check_model(any_tiny, prompts=2, chunk_tokens=20)
    assert report.passed, report.to_dict()
    assert {r.name for r in report.results} == {"full", "recompute_all", "cacheblend_all", "exact_prefix", "generate"}
    assert all(r.max_abs_diff < 1e-4 for r in report.results)


def test_check_model_fails_when_rope_is_wrong(monkeypatch):
    lm = tiny_model("llama")
    monkeypatch.setattr(lm.adapter, "rope", lambda positions, like: (torch.ones(len(positions), lm.adapter.head_dim),
                                                                      torch.zeros(len(positions), lm.adapter.head_dim)))
    report = check_model(lm, prompts=1, chunk_tokens=20)
    assert not report.passed
    assert next(r for r in report.results if r.name == "full").max_abs_diff > 1e-3
