"""Bootstrap confidence intervals for per-method means and paired differences.

Items are resampled with replacement (the percentile bootstrap), with a fixed seed so
that a result file's intervals are reproducible. A paired difference resamples items
once for both methods, so what two methods share per item (a hard item, a long prompt)
cancels out. "Better" or "worse" is said only where the paired interval excludes zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
NO_DIFFERENCE = "no measurable difference"
ROUNDING = 1e-6
"""Differences whose whole interval lies within this of zero are float rounding, not a
difference: reusing an exact prefix differs from a full prefill by about 1e-8 in KL."""


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap interval."""

    mean: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "low": self.low, "high": self.high}


def bootstrap(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
              seed: int = SEED) -> Interval:
    """The mean of ``values`` and its percentile-bootstrap interval at ``confidence``."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("no values to bootstrap")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return Interval(float(data.mean()), float(low), float(high))


def paired(values: Sequence[float], baseline: Sequence[float], **options) -> Interval:
    """Mean of the per-item differences ``values - baseline`` and its interval."""
    if len(values) != len(baseline):
        raise ValueError(f"paired samples differ in length: {len(values)} vs {len(baseline)}")
    return bootstrap([a - b for a, b in zip(values, baseline)], **options)


def verdict(difference: Interval, lower_is_better: bool) -> str:
    """``better``/``worse`` when the interval of ``method - baseline`` excludes zero (and is
    not all within :data:`ROUNDING` of it), else :data:`NO_DIFFERENCE`."""
    if max(abs(difference.low), abs(difference.high)) < ROUNDING:
        return NO_DIFFERENCE
    if difference.low > 0:
        return "worse" if lower_is_better else "better"
    if difference.high < 0:
        return "better" if lower_is_better else "worse"
    return NO_DIFFERENCE
