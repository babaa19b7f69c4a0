"""Recompute planning against hand-computed plans."""

import math

import torch

from cachecraft.policy.planner import PolicyParams, VariantInfo, apply_budget, choose_variant, plan_request
from cachecraft.policy.rules import (can_keep_exact, early_stop_decision, exact_from, exact_history_limit, exact_wait,
                                     may_give_way, pool_by_need, share_by_attention)

INTER = torch.tensor([[1.0, 1.0]])
INTRA = torch.tensor([2.0])
CCI = math.tanh(0.75)  # see test_policy_scores


def variant(name, prefix, inter=INTER, sizes=(2, 4)):
    return VariantInfo(name, tuple(prefix), inter, INTRA, 4, tuple(sizes))


def alone(name):
    return VariantInfo(name, (), torch.zeros(1, 0), INTRA, 4, ())


def test_lowest_cfo_variant_wins_and_exact_needs_nothing():
    params = PolicyParams(alpha=0.5, order_weight=1.0)
    candidates = [variant("v-disjoint", ["p", "q"]), variant("v-exact", ["x", "y"])]
    info, score = choose_variant(candidates, ["x", "y"], params)
    assert info.variant == "v-exact" and score.exact and score.cfo == 0.0
    info, score = choose_variant([variant("v-rev", ["y", "x"]), variant("v-half", ["x", "q"], torch.tensor([[3.0, 1.0]]))],
                                 ["x", "y"], params)
    # v-rev: beta 1, gamma 1 -> beta' 0 -> cfo .5*CCI; v-half: beta 3/4, gamma 0 -> cfo .5*CCI_half*.25
    assert info.variant == "v-half"


def test_the_exact_variant_wins_a_tie_at_cfo_zero():
    params = PolicyParams(alpha=0.5, order_weight=1.0, floor=0.5)
    # made after y alone: all its inter mass went to y, which the request has before it too,
    # in the same order -> beta' 1 -> cfo 0, like the exact one; stored first
    candidates = [variant("v-after-y", ["y"], torch.tensor([[1.0]]), sizes=(4,)), variant("v-exact", ["x", "y"])]
    info, score = choose_variant(candidates, ["x", "y"], params)
    assert info.variant == "v-exact" and score.exact
    plan = plan_request(["x", "y", "c"], [2, 4, 10], {"c": candidates}, params)
    assert plan.chunks[2].variant == "v-exact" and plan.chunks[2].count == 0  # no floor: exact
    assert choose_variant(candidates[:1], ["x", "y"], params)[1].cfo == 0.0
    assert plan_request(["x", "y", "c"], [2, 4, 10], {"c": candidates[:1]}, params).chunks[2].count == 5  # floor


def test_plan_counts_by_hand():
    params = PolicyParams(alpha=0.5, order_weight=1.0, cci_prior=0.6)
    plan = plan_request(["a", "b", "c"], [10, 10, 10],
                        {"a": [alone("a0")], "b": [alone("b0")]}, params)
    a, b, c = plan.chunks
    assert a.variant == "a0" and a.score.exact and a.count == 0  # first chunk, cached alone: same context
    assert b.variant == "b0" and b.score.cfo == 0.3 and b.count == 3  # ceil(0.3 * 10)
    assert c.variant is None and c.count == 10  # no cache: computed in full
    assert plan.recompute_fraction == 13 / 30


def test_budget_scales_cached_chunks_only():
    params = PolicyParams(alpha=1.0, cci_prior=0.8, budget=0.2)
    plan = plan_request(["a", "b", "c", "d"], [10, 10, 10, 10],
                        {"b": [alone("b0")], "c": [alone("c0")], "d": [alone("d0")]}, params)
    counts = [p.count for p in plan.chunks]
    # wanted: b, c, d -> 8 each = 24 > floor(0.2 * 30) = 6 -> scale 0.25 -> 2 each; a uncached keeps 10
    assert counts == [10, 2, 2, 2] and plan.budget_scaled
    assert apply_budget(list(plan.chunks), None).chunks == plan.chunks


def test_early_stop_decision_by_hand():
    mass = torch.tensor([5.0, 1.0, 0.1, 3.0, 2.0])  # prefix, chunks 1..3, question
    # chunk mass 1.0, 0.1, 3.0: even share 4.1/3 = 1.367; threshold 0.25 * 1.367 = 0.342
    assert early_stop_decision(4, mass, [1, 2, 3], 0.25) == {2: 5}
    assert early_stop_decision(4, mass, [], 0.25) == {}


def test_share_by_attention_by_hand():
    """20 tokens, the question's attention 3 : 1. Weight 1: 20 * 3/4 = 15 and 5. Weight 0.5:
    wanted 0.5 * 10 + 0.5 * 15 = 12.5 and 7.5, rounded down 12 and 7, the token left to the
    earlier of the two equally short. A room of 12 on the first: it takes 12, and the 3
    tokens over it go to the other (5 + 3 = 8)."""
    assert share_by_attention([10, 10], [100, 100], [3.0, 1.0], 1.0) == [15, 5]
    assert share_by_attention([10, 10], [100, 100], [3.0, 1.0], 0.5) == [13, 7]
    assert share_by_attention([10, 10], [12, 100], [3.0, 1.0], 1.0) == [12, 8]
    # 3 tokens by 1 : 1 : 2: wanted 0.75, 0.75, 1.5 -> 0, 0, 1, then one each to the first two
    assert share_by_attention([1, 1, 1], [9, 9, 9], [1.0, 1.0, 2.0], 1.0) == [1, 1, 1]
    # 4 tokens by 0 : 1 : 3: wanted 0, 1, 3
    assert share_by_attention([2, 1, 1], [9, 9, 9], [0.0, 1.0, 3.0], 1.0) == [0, 1, 3]
    for weight, mass, counts in ((0.0, [3.0, 1.0], [10, 10]), (1.0, [0.0, 0.0], [10, 10]),
                                 (1.0, [3.0, 1.0], [0, 0])):
        assert share_by_attention(counts, [100, 100], mass, weight) == counts  # nothing to give out again


def test_pooling_moves_the_floor_from_chunks_whose_variant_saw_their_context():
    """alpha 0.1, CCI prior 0.5, floor 0.2, 10 tokens a chunk. w is cached alone and comes
    first (exact: 0); x, c and d were cached alone (CFO 0.1 * 0.5 = 0.05: ceil(0.5) = 1, the
    floor's 2); y's variant was made after x, which the request has right before it (CFO 0,
    yet the floor's 2); e has no cache (10). Pooled in full, the 8 tokens of x, y, c, d go by
    CFO x tokens, 0.5 : 0 : 0.5 : 0.5: wanted 8/3, 0, 8/3, 8/3 -> 2, 0, 2, 2 and the two
    tokens left one each to x and c (equally short: the earlier first) -> 3, 0, 3, 2. Half
    pooled: wanted 1 + 4/3 for x, c, d and 1 for y -> 2, 1, 2, 2 and the token left to x."""
    after_x = VariantInfo("y-after-x", ("x",), torch.tensor([[1.0]]), INTRA, 4, (10,))
    infos = {"w": [alone("w0")], "x": [alone("x0")], "y": [after_x], "c": [alone("c0")], "d": [alone("d0")]}
    params = PolicyParams(alpha=0.1, cci_prior=0.5, floor=0.2)
    plan = plan_request(["w", "x", "y", "c", "d", "e"], [10] * 6, infos, params)
    assert [p.count for p in plan.chunks] == [0, 2, 2, 2, 2, 10]
    assert plan.chunks[2].score.cfo == 0.0 and not plan.chunks[2].score.exact
    assert [p.count for p in pool_by_need(plan, 1.0).chunks] == [0, 3, 0, 3, 2, 10]
    assert [p.count for p in pool_by_need(plan, 0.5).chunks] == [0, 3, 1, 2, 2, 10]
    assert pool_by_need(plan, 0.0) == plan
    assert pool_by_need(plan, 1.0).recompute_fraction == plan.recompute_fraction  # the total stays
    linked = plan_request(["w", "x", "y"], [10] * 3, {"y": [after_x]}, params)
    assert [p.count for p in linked.chunks] == [10, 10, 2]
    assert pool_by_need(linked, 1.0) == linked  # no CFO above 0: nothing to pool by


def test_a_floor_raises_every_reused_chunk_but_an_exact_match():
    """alpha 0.1, CCI prior 0.6: CFO 0.06 -> ceil(0.6) = 1 token of 10; a floor of 0.25 makes
    it floor(2.5) = 2 (the floor rounds down), one of 0.35 floor(3.5) = 3; the chunk cached
    right after the system prefix (exact) still needs none."""
    plain = plan_request(["a", "b"], [10, 10], {"a": [alone("a0")], "b": [alone("b0")]},
                         PolicyParams(alpha=0.1, cci_prior=0.6))
    assert [p.count for p in plain.chunks] == [0, 1]
    floored = plan_request(["a", "b"], [10, 10], {"a": [alone("a0")], "b": [alone("b0")]},
                           PolicyParams(alpha=0.1, cci_prior=0.6, floor=0.25))
    assert [p.count for p in floored.chunks] == [0, 2]
    higher = plan_request(["a", "b"], [10, 10], {"a": [alone("a0")], "b": [alone("b0")]},
                          PolicyParams(alpha=0.1, cci_prior=0.6, floor=0.35))
    assert [p.count for p in higher.chunks] == [0, 3]


def test_exact_from_by_hand():
    # asked twice before, the setting two: from the first chunk not stored exactly
    assert exact_from(2, 2, [True, False, True, False]) == 1
    assert exact_from(5, 2, [False, False]) == 0
    assert exact_from(1, 2, [False, False]) is None  # asked once before: not yet
    assert exact_from(0, 1, [False]) is None  # never asked
    assert exact_from(9, 0, [False]) is None  # off
    assert exact_from(3, 1, [True, True, True]) is None  # stored exactly already: nothing to make


def test_exact_wait_by_hand():
    ask, reuse = {"kept_exact": False}, {"kept_exact": False, "reused_exact": True}

    def keep(waited=None):
        return {"kept_exact": True, **({} if waited is None else {"exact_wait": waited})}

    assert exact_wait([], 2) == (0, 2)  # never asked
    assert exact_wait([ask, {}, ask], 2) == (3, 2)  # never kept (one row recorded without a policy)
    # kept after 2 asks, evicted before any ask reused it: the next keep waits 4, then 8, 16
    assert exact_wait([ask, keep(2), ask, ask], 2) == (1, 4)
    assert exact_wait([keep(4)], 2) == (0, 8)
    assert exact_wait([ask] * 3 + [keep(8)], 2) == (3, 16)
    assert exact_wait([keep(16)], 2) == (0, 16)  # at most 2**3 times the setting
    assert exact_wait([keep(16)], 2, doublings=5) == (0, 32)
    assert exact_wait([keep(3)], 3) == (0, 6)
    # a keep that served an ask (reused exactly): the next waits as the setting, however long the last
    assert exact_wait([ask, reuse, keep(8)], 2) == (2, 2)
    assert exact_wait([ask, ask, keep(2), reuse, keep(16)], 2) == (2, 4)  # only the last keep counts
    assert exact_wait([ask, keep()], 2) == (1, 2)  # a keep recorded before waits were: as the setting
    assert exact_wait([reuse, reuse], 2) == (2, 2)  # reuses with no keep among the rows read


def test_an_order_whose_keeps_never_last_is_kept_at_asks_3_8_17_34_and_then_every_17th():
    # waits 2, 4, 8, 16, 16, ...: each keep counts the asks after the one before it
    assert exact_history_limit(2) == 17 and exact_history_limit(3, doublings=1) == 7
    history: list[dict] = []  # newest first, as the catalog gives it
    kept = []
    for ask in range(1, 70):
        asked, due = exact_wait(history[:exact_history_limit(2)], 2)
        keep = exact_from(asked, due, [False]) == 0
        if keep:
            kept.append(ask)
        history.insert(0, {"kept_exact": keep, **({"exact_wait": due} if keep else {})})
    assert kept == [3, 8, 17, 34, 51, 68]
    # the 16 asks after a keep that waited 16 are all read, and the keep behind them
    assert exact_wait(([{"kept_exact": False}] * 16 + [{"kept_exact": True, "exact_wait": 16}]), 2) == (16, 16)


def test_may_give_way_by_hand():
    assert may_give_way(False, 5, 0)  # an inexact variant always may, however used
    assert not may_give_way(True, 0, 0)  # an exact one never to a keep no ask earned (a looping answer's)
    assert may_give_way(True, 0, 2) and may_give_way(True, 1, 2)  # reused fewer times than the order was asked
    assert not may_give_way(True, 2, 2) and not may_give_way(True, 3, 2)
    assert may_give_way(True, 3, 4)  # an order kept out keeps counting: asked 4 times, it outweighs 3 reuses


def test_can_keep_exact_by_hand():
    assert can_keep_exact(False, 3, 0)  # room for a fourth
    assert not can_keep_exact(False, 4, 0)  # at the cap, nothing may give way
    assert can_keep_exact(False, 4, 1)  # at the cap, one may give way
    assert can_keep_exact(True, 4, 0)  # its variant of this prefix is replaced in place
    assert not can_keep_exact(False, 2, 0, cap=2)
