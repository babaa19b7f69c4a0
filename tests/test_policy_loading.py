"""The loading controller and tier placement, against values computed by hand."""

from __future__ import annotations

import pytest

from cachecraft.policy.loading import (FULL_WEIGHT_BYTES, LOAD_BOUND_MARGIN, MIN_OBSERVED_BYTES, OBSERVED_WEIGHT,
                                       CostModel, cheapest_tier, load_hiding_fraction, raise_fractions, tier_for_new_variant)
from tests.conftest import tiny_model
from cachecraft.pipeline.cost import (cost_model_from_profile, cost_profile, measure_cost_model, per_token_seconds,
                                     probe_sizes, teaches_rate)

# 1 ms of prefill and 2000 KV bytes per token; loading hides at 2000 / (bw * 0.001).
BANDWIDTHS = {"gpu": 1e9, "cpu": 1e8, "disk": 1e7}  # r_load: 0.002, 0.02, 0.2


def test_load_hiding_fraction():
    assert load_hiding_fraction(0.001, 2000, 1e7) == pytest.approx(0.2)
    assert load_hiding_fraction(0.001, 2000, 1e9) == pytest.approx(0.002)
    assert load_hiding_fraction(0.001, 2000, 1e6) == 1.0  # load takes 2x a full prefill: capped
    assert load_hiding_fraction(0.001, 0, 1e6) == 0.0


def test_the_blending_cost_hides_part_of_the_load_first():
    # 2000 bytes at 1e7 B/s: 2e-4 s a token to load; the blend's own 5e-5 s hides a quarter of it,
    # and recomputing 0.15 of the 1 ms prefill the rest
    assert load_hiding_fraction(0.001, 2000, 1e7, 5e-5) == pytest.approx(0.15)
    assert load_hiding_fraction(0.001, 2000, 1e7, 2e-4) == 0.0  # the blend alone takes as long
    assert load_hiding_fraction(0.001, 2000, 1e7, 1e-3) == 0.0  # longer: nothing to hide, never below 0
    assert load_hiding_fraction(0.001, 2000, 1e6, 5e-4) == 1.0  # 2e-3 s to load: capped
    with pytest.raises(AssertionError, match="blend_s_per_token"):
        load_hiding_fraction(0.001, 2000, 1e7, -1e-6)


def test_r_hide_uses_the_timed_blending_cost_and_r_load_does_not():
    # 4 layers, 2.5e-4 s and 500 bytes per token and layer: 1 ms and 2000 bytes a token
    model = CostModel(2.5e-4, 500, 4, dict(BANDWIDTHS))
    assert model.r_hide("disk") == model.r_load("disk") == pytest.approx(0.2)  # none timed: as r_load
    timed = CostModel(2.5e-4, 500, 4, dict(BANDWIDTHS), blend_s_per_token_layer=1.25e-5)  # 5e-5 s a token
    assert timed.r_hide("disk") == pytest.approx(0.15) and timed.r_load("disk") == pytest.approx(0.2)
    assert timed.r_hide("cpu") == 0.0  # 2e-5 s a token to load: the blend hides it all
    assert timed.load_s("disk", 100) == pytest.approx(100 * 2000 / 1e7)


def test_a_timed_blended_prefill_sets_then_moves_the_blending_cost():
    model = CostModel(2.5e-4, 500, 4, dict(BANDWIDTHS))  # 1 ms a token to prefill
    # 1000 tokens, 200 token-layers computed (0.05 s at the rate) in 0.25 s: 0.2 s beyond them,
    # 5e-5 per token and layer; loads expected to take 0.1 s cannot have held it up
    first = model.observe_blend(1000, 200, 0.25, 0.1)
    assert first.blend_s_per_token_layer == pytest.approx(5e-5)  # the first replaces the starting none
    assert model.blend_s_per_token_layer is None  # a new model; the old one unchanged
    # the next (0.45 s: 1e-4 per token and layer) moves it by the prefill weight
    second = first.observe_blend(1000, 200, 0.45, 0.0)
    assert second.blend_s_per_token_layer == pytest.approx(0.7 * 5e-5 + 0.3 * 1e-4)
    # one that took less than LOAD_BOUND_MARGIN x its expected loads may have waited for them
    assert LOAD_BOUND_MARGIN == 1.5
    assert first.observe_blend(1000, 200, 0.25, 0.25 / 1.5 + 1e-9) is first
    assert first.observe_blend(1000, 200, 0.25, 0.25 / 1.5 - 1e-9) is not first
    # compute longer than the time taken (the rate is a slope): nothing beyond it, 0
    assert model.observe_blend(1000, 4000, 0.5, 0.0).blend_s_per_token_layer == 0.0
    assert model.observe_blend(0, 0, 1.0, 0.0) is model and model.observe_blend(10, 0, 0.0, 0.0) is model


def test_raise_fractions_lifts_to_r_load_and_never_above_one():
    assert raise_fractions([0.0, 0.1, 0.5, 1.0], 0.2) == pytest.approx([0.2, 0.2, 0.5, 1.0])
    assert raise_fractions([0.0, 0.3], 0.0) == [0.0, 0.3]
    assert raise_fractions([0.0, 0.3], 1.5) == [1.0, 1.0]
    assert raise_fractions([], 0.2) == []


@pytest.mark.parametrize("fraction,tier", [(0.2, "disk"), (0.5, "disk"), (0.15, "cpu"), (0.02, "cpu"),
                                           (0.01, "gpu"), (0.001, None)])
def test_cheapest_tier_is_the_slowest_one_recompute_hides(fraction, tier):
    assert cheapest_tier(fraction, 0.001, 2000, BANDWIDTHS) == tier


@pytest.mark.parametrize("reuse,tier", [(0.1, None), (1, "disk"), (5, "cpu"), (49, "cpu"), (50, "gpu")])
def test_tier_for_new_variant_by_value_per_byte(reuse, tier):
    # 3 s of prefill saved per reuse for 15 MB: 200 s/GB per reuse (thresholds 50 / 1000 / 10000).
    assert tier_for_new_variant(reuse, 3.0, 15_000_000) == tier


def test_tier_for_new_variant_skips_tiers_slower_than_recompute():
    # disk at 1 MB/s loads 15 MB in 15 s, slower than the 3 s recompute: not worth it.
    slow = {"gpu": 1e12, "cpu": 1e10, "disk": 1e6}
    assert tier_for_new_variant(1, 3.0, 15_000_000, bandwidths=slow) is None
    assert tier_for_new_variant(5, 3.0, 15_000_000, bandwidths=slow) == "cpu"
    assert tier_for_new_variant(1, 3.0, 15_000_000, thresholds={"disk": 100.0, "cpu": 150.0}) == "cpu"


def test_cost_model_from_history():
    rows = [(1000, 2.0), (3000, 6.0), (0, 1.0), (500, None)]  # 8 s / 4000 tokens = 2 ms per token
    model = CostModel.from_history(rows, num_layers=4, kv_bytes_per_token_layer=500, bandwidths=BANDWIDTHS)
    assert model.prefill_s_per_token_layer == pytest.approx(0.0005)
    assert model.prefill_s_per_token == pytest.approx(0.002)
    assert model.kv_bytes_per_token == 2000
    assert model.r_load("disk") == pytest.approx(0.1)  # 2000 / (1e7 * 0.002)
    assert model.cheapest_tier(0.1) == "disk" and model.cheapest_tier(0.05) == "cpu"
    assert CostModel.from_history([], num_layers=4, kv_bytes_per_token_layer=500) is None


def test_cost_model_measure_on_a_tiny_model():
    lm = tiny_model("llama")
    model = measure_cost_model(lm, tokens=16, repeats=1)
    assert model.prefill_s_per_token_layer > 0
    assert model.num_layers == 4
    assert model.kv_bytes_per_token_layer == 2 * 2 * 16 * 2  # K and V, 2 KV heads, head_dim 16, float16
    assert 0 < model.r_load("cpu") <= 1


def test_cost_model_measure_at_two_sizes_takes_the_slope():
    lm = tiny_model("llama")
    model = measure_cost_model(lm, tokens=(8, 32), repeats=1)
    assert model.prefill_s_per_token_layer > 0 and model.num_layers == 4


def test_the_prefill_rate_is_the_slope_between_sizes_without_the_fixed_cost():
    assert per_token_seconds([128], [0.064]) == pytest.approx(0.0005)  # one size: its average
    # 0.05 s of launches plus 40 us a token: the slope finds the 40 us, the average would not
    assert per_token_seconds([1024, 2048], [0.05 + 1024 * 4e-5, 0.05 + 2048 * 4e-5]) == pytest.approx(4e-5)
    assert per_token_seconds([2048, 1024], [0.05 + 2048 * 4e-5, 0.05 + 1024 * 4e-5]) == pytest.approx(4e-5)
    assert per_token_seconds([1024, 2048], [0.2, 0.1]) == pytest.approx(0.1 / 2048)  # noise: the longest's average


def test_only_a_full_prefill_as_long_as_the_longest_probe_teaches_the_rate():
    assert not teaches_rate(127, "cpu", 8192) and teaches_rate(128, "cpu", 8192)
    # a GPU's short prefills time launches; a model with a short window is probed (and taught) within it
    assert not teaches_rate(2047, "cuda", 8192) and teaches_rate(2048, "cuda:0", 8192)
    assert teaches_rate(1000, "cuda", 1000) and not teaches_rate(999, "cuda", 1000)


def test_a_stored_rate_measured_at_other_probe_sizes_is_measured_again():
    model = CostModel(2e-4, 500, 4, {"cpu": 3e9, "disk": 5e8}, frozenset({"disk"}))
    stored = cost_profile(model, (1024, 2048))
    assert stored["probe_tokens"] == [1024, 2048] and stored["bandwidths"] == {"disk": 5e8}
    back = cost_model_from_profile(stored, 4, 500, {"cpu": 3e9, "disk": 7e8}, (1024, 2048))
    assert back == model  # the rate and the timed disk bandwidth come back; cpu as assumed
    assert cost_model_from_profile(stored, 4, 500, {"cpu": 3e9, "disk": 7e8}, (128,)) is None
    older = {k: v for k, v in stored.items() if k != "probe_tokens"}  # stored before probes were named
    assert cost_model_from_profile(older, 4, 500, {"cpu": 3e9, "disk": 7e8}, (1024, 2048)) is None
    assert cost_model_from_profile(older, 4, 500, {"cpu": 3e9, "disk": 7e8}) is not None  # no probe asked
    assert "blend_s_per_token_layer" not in stored  # none timed: none stored
    blended = model.observe_blend(1000, 200, 0.25, 0.0)
    kept = cost_profile(blended, (1024, 2048))
    assert cost_model_from_profile(kept, 4, 500, {"cpu": 3e9, "disk": 7e8}, (1024, 2048)) == blended
    for bad in (-1.0, float("nan"), "x"):  # a damaged value is not a measurement: as if none was timed
        back = cost_model_from_profile({**kept, "blend_s_per_token_layer": bad}, 4, 500, {"cpu": 3e9}, (1024, 2048))
        assert back is None if bad == "x" else back.blend_s_per_token_layer is None


def test_probes_stay_within_the_window():
    assert probe_sizes("cpu", 8192) == (128,) and probe_sizes("cuda", 8192) == (1024, 2048)
    assert probe_sizes("cuda", 1500) == (1024, 1500) and probe_sizes("cuda", 1024) == (1024,)
    lm = tiny_model("llama")  # a window of 1024 tokens
    assert measure_cost_model(lm, tokens=(512, 4096), repeats=1).prefill_s_per_token_layer > 0


def test_a_timed_full_prefill_moves_the_prefill_rate_by_its_weight():
    model = CostModel(0.001, 500, 4)  # 0.004 s per token
    moved = model.observe_prefill(100, 0.8)  # 0.008 s per token: 0.002 per token-layer
    assert moved.prefill_s_per_token_layer == pytest.approx(0.7 * 0.001 + 0.3 * 0.002)
    assert moved.prefill_s(10) == pytest.approx(10 * 4 * (0.7 * 0.001 + 0.3 * 0.002))
    assert model.observe_prefill(0, 1.0) is model and model.observe_prefill(10, 0.0) is model


def test_measured_loads_replace_then_move_the_bandwidth():
    full = FULL_WEIGHT_BYTES
    model = CostModel(0.001 / 4, 500, 4, dict(BANDWIDTHS, gpu=float("inf")))
    assert model.r_load("gpu") == 0.0  # used where it is stored: nothing to load
    first = model.observe_load("disk", full, full / 4e7)  # a full-size load at 4e7 B/s replaces the 1e7 guess
    assert first.bandwidths["disk"] == pytest.approx(4e7) and first.r_load("disk") == pytest.approx(0.05)
    assert first.timed == {"disk"} and model.timed == frozenset()
    assert model.bandwidths["disk"] == 1e7  # a new model; the old one is unchanged
    second = first.observe_load("disk", full, full / 2e7)  # 2e7 B/s, weighted in as seconds per byte
    assert OBSERVED_WEIGHT == 0.3
    assert second.bandwidths["disk"] == pytest.approx(1 / (0.7 / 4e7 + 0.3 / 2e7))  # 3.077e7
    assert first.observe_load("disk", MIN_OBSERVED_BYTES - 1, 1e-6) is first  # too small to time
    assert first.observe_load("disk", full, 0.0) is first
    assert model.observe_load("gpu", full, full / 4e9).bandwidths["gpu"] == pytest.approx(4e9)


def test_small_loads_count_in_proportion_to_their_size():
    full = FULL_WEIGHT_BYTES
    model = CostModel(0.001 / 4, 500, 4, dict(BANDWIDTHS))
    # A quarter-size load read at 1e6 B/s (per-read overhead) moves the 1e7 guess a quarter of the way.
    small = model.observe_load("disk", full // 4, (full // 4) / 1e6)
    assert small.bandwidths["disk"] == pytest.approx(1 / (0.75 / 1e7 + 0.25 / 1e6))  # 3.077e6
    assert small.timed == frozenset()  # not a full-size measurement yet
    # so the first full-size load still replaces the estimate outright
    assert small.observe_load("disk", full, full / 4e7).bandwidths["disk"] == pytest.approx(4e7)
    # once timed, a small load moves it by its share of OBSERVED_WEIGHT
    timed = small.observe_load("disk", full, full / 4e7)
    after = timed.observe_load("disk", full // 2, (full // 2) / 1e7)
    assert after.bandwidths["disk"] == pytest.approx(1 / (0.85 / 4e7 + 0.15 / 1e7))
