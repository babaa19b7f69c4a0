"""Bootstrap intervals and paired verdicts against values worked out by hand."""

from __future__ import annotations

import pytest

from cachecraft.intervals import NO_DIFFERENCE, Interval, bootstrap, clustered, paired, verdict


def test_a_quarter_of_ones_by_hand():
    # Resampling [0, 0, 0, 1] gives k/4 with k ~ Binomial(4, 1/4): P(k <= 0) = 0.316,
    # P(k <= 2) = 0.949, P(k <= 3) = 0.996, so the 2.5% point is 0 and the 97.5% point 3/4.
    assert bootstrap([0, 0, 0, 1]) == Interval(0.25, 0.0, 0.75)


def test_two_values_by_hand_and_a_constant_sample():
    # [0, 1] resampled: means 0, 1/2, 1 with chances 1/4, 1/2, 1/4: both ends lie in the end masses.
    assert bootstrap([0.0, 1.0]) == Interval(0.5, 0.0, 1.0)
    assert bootstrap([0.3, 0.3, 0.3]) == Interval(pytest.approx(0.3), pytest.approx(0.3), pytest.approx(0.3))
    with pytest.raises(ValueError):
        bootstrap([])


def test_paired_differences_and_their_verdicts():
    lower = paired([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])  # every item 0.5 lower
    assert (lower.mean, lower.low, lower.high) == pytest.approx((-0.5, -0.5, -0.5))
    assert verdict(lower, lower_is_better=True) == "better" and verdict(lower, lower_is_better=False) == "worse"
    mixed = paired([1.0, 0.0], [0.0, 1.0])  # differences +1 and -1: the interval is [-1, 1]
    assert (mixed.low, mixed.high) == (-1.0, 1.0) and verdict(mixed, True) == NO_DIFFERENCE
    rounding = paired([2e-8, 1.5e-8, 2.5e-8], [0.0, 0.0, 0.0])  # an exact prefix against full: float noise
    assert rounding.low > 0 and verdict(rounding, True) == NO_DIFFERENCE
    with pytest.raises(ValueError, match="length"):
        paired([1.0], [1.0, 2.0])


def test_clusters_are_resampled_whole_by_hand():
    # clusters a = [1, 1] and b = [0]: the mean is 2/3; resampling two clusters draws aa
    # (mean 1, chance 1/4), ab or ba (2/3, 1/2) or bb (0, 1/4): the ends lie in the end masses
    assert clustered([1.0, 1.0, 0.0], ["a", "a", "b"]) == Interval(pytest.approx(2 / 3), 0.0, 1.0)
    # one value per cluster: the plain bootstrap of the values
    assert clustered([0, 0, 0, 1], [1, 2, 3, 4]) == bootstrap([0, 0, 0, 1])
    # weights make it a ratio of totals: (2 + 4) / (1 + 1) = 3; each cluster's own ratio is 2 or 4
    ratio = clustered([2.0, 4.0], ["x", "y"], weights=[1.0, 1.0])
    assert (ratio.mean, ratio.low, ratio.high) == (3.0, 2.0, 4.0)
    # a cluster's values stay together: two clusters of one value each, repeated, give the same interval
    assert clustered([1.0, 1.0, 0.0, 0.0], ["a", "a", "b", "b"]) == clustered([1.0, 0.0], ["a", "b"])
    with pytest.raises(ValueError, match="differ"):
        clustered([1.0, 2.0], ["a"])
