"""Cache-Craft scores against values computed by hand."""

import math

import pytest
import torch

from cachecraft.policy.scores import (cci, layer_ab, order_penalty, prefix_overlap, score_variant,
                                      tokens_to_recompute)

# One layer; a 4-token chunk after prefix chunks of 2 and 4 tokens; masses 1, 1 outside, 2 inside.
INTER = torch.tensor([[1.0, 1.0]])
INTRA = torch.tensor([2.0])
# a = 1/(4*2) + 1/(4*4) = 0.1875; b = 2/16 = 0.125; a/b = 1.5; CCI = 2*sigmoid(1.5) - 1 = tanh(0.75)
CCI = math.tanh(0.75)


def test_layer_ab_and_cci_by_hand():
    a, b = layer_ab(INTER, INTRA, 4, [2, 4])
    assert a.item() == pytest.approx(0.1875) and b.item() == pytest.approx(0.125)
    assert cci(INTER, INTRA, 4, [2, 4]) == pytest.approx(CCI)
    assert cci(torch.zeros(1, 0), INTRA, 4, []) == 0.0  # no context: nothing to lean on
    two_layers = cci(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([2.0, 4.0]), 4, [2, 4])
    # mean a = 0.09375, mean b = (0.125 + 0.25) / 2 = 0.1875 -> ratio 0.5
    assert two_layers == pytest.approx(math.tanh(0.25))


def test_prefix_overlap_by_hand():
    assert prefix_overlap([3.0, 1.0], ["x", "y"], ["y", "z"]) == pytest.approx(0.25)
    assert prefix_overlap([3.0, 1.0], ["x", "y"], ["y", "x"]) == 1.0
    assert prefix_overlap([3.0, 1.0], ["x", "y"], ["z"]) == 0.0  # disjoint
    assert prefix_overlap([], [], []) == 1.0  # first chunk in both: same context
    assert prefix_overlap([], [], ["x"]) == 0.0  # cached alone, now after a chunk


def test_order_penalty_by_hand():
    assert order_penalty(["a", "b", "c"], ["c", "b", "a"]) == 1.0  # reversed
    assert order_penalty(["a", "b", "c"], ["a", "c", "b"]) == pytest.approx(1 / 3)
    assert order_penalty(["a", "b", "c"], ["x", "a", "b", "c"]) == 0.0
    assert order_penalty(["a"], ["a"]) == 0.0  # fewer than two shared chunks


def test_cfo_edge_cases():
    common = dict(inter=INTER, intra=INTRA, chunk_tokens=4, prefix_tokens=[2, 4], alpha=0.5)
    exact = score_variant(**common, old_prefix=["x", "y"], new_prefix=["x", "y"])
    assert exact.exact and exact.cfo == 0.0
    reversed_paper = score_variant(**common, old_prefix=["x", "y"], new_prefix=["y", "x"])
    assert reversed_paper.beta == 1.0 and reversed_paper.gamma == 1.0 and reversed_paper.beta_prime == 0.0
    assert reversed_paper.cfo == pytest.approx(0.5 * CCI)
    reversed_fitted = score_variant(**common, old_prefix=["x", "y"], new_prefix=["y", "x"], order_weight=0.2)
    assert reversed_fitted.beta_prime == pytest.approx(0.8)
    assert reversed_fitted.cfo == pytest.approx(0.5 * CCI * 0.2)
    disjoint = score_variant(**common, old_prefix=["x", "y"], new_prefix=["z"])
    assert disjoint.cfo == pytest.approx(0.5 * CCI)
    alone = score_variant(inter=torch.zeros(1, 0), intra=INTRA, chunk_tokens=4, prefix_tokens=[], alpha=0.5,
                          old_prefix=[], new_prefix=["x"], cci_prior=0.6)
    assert alone.cci == 0.6 and alone.beta == 0.0 and alone.cfo == pytest.approx(0.3)
    first_again = score_variant(inter=torch.zeros(1, 0), intra=INTRA, chunk_tokens=4, prefix_tokens=[], alpha=0.5,
                                old_prefix=[], new_prefix=[], cci_prior=0.6)
    assert first_again.exact and first_again.cfo == 0.0


def test_tokens_to_recompute():
    assert tokens_to_recompute(0.3176, 10) == 4
    assert tokens_to_recompute(0.01, 10, floor=0.05) == 1  # need 0.1 rounds up, floor 0.5 down
    assert tokens_to_recompute(0.9, 10, ceiling=0.5) == 5
    assert tokens_to_recompute(0.0, 10) == 0
    # the floor rounds down: 5% of 610 is 30.5 -> 30; of 19 is 0.95 -> 0; of 600 exactly 30
    assert tokens_to_recompute(0.0, 610, floor=0.05) == 30
    assert tokens_to_recompute(0.0, 19, floor=0.05) == 0
    assert tokens_to_recompute(0.0, 600, floor=0.05) == 30
    # a CFO above the floor still rounds up: 0.06 * 610 = 36.6 -> 37
    assert tokens_to_recompute(0.06, 610, floor=0.05) == 37
    # the floor at the ceiling: 0.2 of 10 -> 2
    assert tokens_to_recompute(0.0, 10, floor=0.2, ceiling=0.2) == 2
