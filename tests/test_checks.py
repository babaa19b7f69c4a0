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


def test_greedy_tokens_agree_when_equal_or_first_different_at_a_near_tie():
    from cachecraft.checks import greedy_agrees

    margins = [1.0, 0.3, 0.05, 2.0]
    assert greedy_agrees([5, 6, 7, 8], margins, [5, 6, 7, 8], near_tie=0.1)
    assert greedy_agrees([5, 6, 7, 8], margins, [5, 6, 9, 1], near_tie=0.1)  # step 2: margin 0.05 < 0.1
    assert not greedy_agrees([5, 6, 7, 8], margins, [5, 9, 7, 8], near_tie=0.1)  # step 1: margin 0.3
    assert greedy_agrees([5, 6, 7, 8], margins, [5, 6, 7, 8], near_tie=0.0)
    assert not greedy_agrees([5, 6], margins[:2], [5, 6, 7], near_tie=0.1)  # plain stopped at step 2: no margin
    assert greedy_agrees([5, 6, 7], margins[:3], [5, 6], near_tie=0.1)  # blended stopped where plain's was a near tie
    assert not greedy_agrees([5], [1.0], [6], near_tie=0.0)  # float32: exact


def test_top_two_margins_per_step():
    from cachecraft.checks import top_two_margins

    scores = (torch.tensor([[0.0, 2.5, 1.0]]), torch.tensor([[3.0, -1.0, 2.75]]))
    assert top_two_margins(scores) == [1.5, 0.25]
