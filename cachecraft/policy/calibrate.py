"""Choosing the policy's parameters from measured candidates (pure decisions).

A candidate is an alpha, a check layer (a whole number names a layer, a fraction
below 1 a depth; see :func:`cachecraft.policy.planner.layer_at`), a floor (the least
share of each reused chunk recomputed), a number of sink tokens (each chunk's first
tokens, recomputed first), a drift shift (0: the rest where the question looks; above
0: the rest spread over the chunk, whose other tokens move by that share of the drift
the spread ones show) and, with a shift, a relevance (the share of the spread tokens
given out again by the question's attention to each chunk). What is optimised is
the yardstick's answer-level divergence: the mean per-token KL(full || candidate) along
full's greedy answer. Two goals:

- a recompute **budget**: the lowest divergence among the candidates whose mean
  recompute fraction stays within it (none within it: the cheapest, and the result
  says the budget was missed). Where one candidate repeats the config's own settings,
  it stays unless another within the budget is measurably better item by item;
- a divergence **target**: the lowest recompute among the candidates whose divergence
  reaches it (none does: the lowest divergence, and the result says so).

The candidates are measured by :func:`cachecraft.calibration.calibrate`, through the
pipeline, on items kept apart from the ones results are reported on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from cachecraft.config import DRIFT_ESTIMATORS
from cachecraft.intervals import Interval, paired, verdict

POLICY_PROFILE = "policy"  # the catalog's model-profile kind for fitted parameters
ANY_DEVICE = "*"  # fitted parameters hold on every device (they are about answers, not speed)


class CalibrationError(ValueError):
    """Calibration input that cannot work (bad candidates or goal); the message says which."""


@dataclass(frozen=True)
class CandidateRow:
    """How one candidate did, averaged over the items (``ttft_s`` a median)."""

    alpha: float
    check_layer: float
    recompute: float
    answer_kl: float
    token_agreement: float
    agreement: float
    kl: float
    ttft_s: float
    floor: float = 0.0
    sink_tokens: int = 0
    drift_shift: float = 0.0
    drift_estimator: str = "mean"
    relevance: float = 0.0
    label: str = ""  # the method's label, naming its answers in ``CalibrationResult.per_item``


@dataclass(frozen=True)
class Goal:
    """What calibration optimises: a recompute ``budget`` or a divergence ``target_kl``."""

    budget: float | None = None
    target_kl: float | None = None

    def __post_init__(self) -> None:
        if (self.budget is None) == (self.target_kl is None):
            raise CalibrationError("give either a recompute budget or a divergence target, not both")
        if self.budget is not None and not (math.isfinite(self.budget) and 0.0 < self.budget <= 1.0):
            raise CalibrationError(f"budget must be within (0, 1], got {self.budget:g}")
        if self.target_kl is not None and not (math.isfinite(self.target_kl) and self.target_kl > 0):
            raise CalibrationError(f"target KL must be > 0, got {self.target_kl:g}")

    def describe(self) -> str:
        """``recompute budget 0.05`` or ``answer KL target 0.02``."""
        return f"recompute budget {self.budget:g}" if self.budget is not None else f"answer KL target {self.target_kl:g}"


@dataclass(frozen=True)
class CalibrationResult:
    """Every candidate's row, the chosen one and whether it met the goal."""

    rows: tuple[CandidateRow, ...]
    chosen: CandidateRow
    goal: Goal
    reached: bool
    full_ttft_s: float
    # one entry per item and method (full and each candidate, by its label): what the rows
    # average, kept so that two candidates can be compared item by item afterwards
    per_item: tuple[dict[str, Any], ...] = ()
    # the label of the candidate that repeats the config's own settings ("": none did),
    # kept under a budget unless another was measurably better
    incumbent: str = ""

    def profile(self, **about: Any) -> dict[str, Any]:
        """The fitted parameters as the catalog keeps them (``about``: model, dataset,
        items... recorded beside them)."""
        return {"policy_alpha": self.chosen.alpha, "policy_check_layer": self.chosen.check_layer,
                "policy_floor": self.chosen.floor, "policy_sink_tokens": self.chosen.sink_tokens,
                "policy_drift_shift": self.chosen.drift_shift, "policy_drift_estimator": self.chosen.drift_estimator,
                "policy_relevance": self.chosen.relevance,
                "fitted": {**about, "goal": asdict(self.goal), "reached": self.reached,
                           "answer_kl": self.chosen.answer_kl, "recompute": self.chosen.recompute,
                           "token_agreement": self.chosen.token_agreement}}

    def kept_incumbent(self) -> bool:
        """Whether the chosen candidate is the one with the config's own settings."""
        return bool(self.incumbent) and self.chosen.label == self.incumbent

    def versus_chosen(self) -> dict[str, Interval]:
        """For every other candidate (by label), its answer KL minus the chosen one's, item by
        item, with the paired bootstrap interval (:mod:`cachecraft.intervals`): an interval
        that holds 0 means the two were not told apart on these items. Empty without
        ``per_item`` or labels."""
        out = {}
        for row in self.rows:
            difference = answer_kl_difference(self.per_item, row.label, self.chosen.label)
            if row is not self.chosen and difference is not None:
                out[row.label] = difference
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: goal, chosen parameters, every row, the per-item figures and each
        other candidate's answer KL against the chosen one's (``versus_chosen``: mean, low,
        high, verdict)."""
        return {"goal": asdict(self.goal), "reached": self.reached, "policy_alpha": self.chosen.alpha,
                "policy_check_layer": self.chosen.check_layer, "policy_floor": self.chosen.floor,
                "policy_sink_tokens": self.chosen.sink_tokens, "policy_drift_shift": self.chosen.drift_shift,
                "policy_drift_estimator": self.chosen.drift_estimator, "policy_relevance": self.chosen.relevance,
                "full_ttft_s_median": self.full_ttft_s, "incumbent": self.incumbent,
                "kept_incumbent": self.kept_incumbent(),
                "rows": [asdict(r) for r in self.rows], "per_item": list(self.per_item),
                "versus_chosen": {label: {**d.to_dict(), "verdict": verdict(d, lower_is_better=True)}
                                  for label, d in self.versus_chosen().items()}}


def parse_numbers(text: str, what: str, low: float, high: float) -> list[float]:
    """``"0.1,0.05,0.1"`` -> ``[0.05, 0.1]`` (sorted, unique, each within [low, high])."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            values.append(float(part))
        except ValueError:
            raise CalibrationError(f"{what}: {part!r} is not a number") from None
    if not values:
        raise CalibrationError(f"{what}: give at least one candidate")
    bad = [v for v in values if not (math.isfinite(v) and low <= v <= high)]
    if bad:
        raise CalibrationError(f"{what} must be within [{low:g}, {high:g}], got {bad[0]:g}")
    return sorted(set(values))


def parse_alphas(text: str) -> list[float]:
    """Candidate alphas, each within [0, 1] (a recompute fraction scale)."""
    return parse_numbers(text, "alphas", 0.0, 1.0)


def parse_check_layers(text: str) -> list[float]:
    """Candidate check layers: whole layer numbers, or depths as fractions below 1."""
    values = parse_numbers(text, "check layers", 0.0, 1024.0)
    bad = [v for v in values if v >= 1 and v != int(v)]
    if bad:
        raise CalibrationError(f"check layers: {bad[0]:g} is neither a whole layer number nor a depth below 1")
    return values


def parse_floors(text: str) -> list[float]:
    """Candidate floors: shares of a chunk's tokens, each within [0, 1]."""
    return parse_numbers(text, "floors", 0.0, 1.0)


def parse_sink_tokens(text: str) -> list[int]:
    """Candidate sink-token counts: whole numbers >= 0."""
    values = parse_numbers(text, "sink tokens", 0.0, 4096.0)
    bad = [v for v in values if v != int(v)]
    if bad:
        raise CalibrationError(f"sink tokens: {bad[0]:g} is not a whole number")
    return [int(v) for v in values]


def parse_drift_shifts(text: str) -> list[float]:
    """Candidate drift shifts: shares of the measured drift, each within [0, 2] (0: off)."""
    return parse_numbers(text, "drift shifts", 0.0, 2.0)


def parse_relevances(text: str) -> list[float]:
    """Candidate relevances: shares of the spread tokens given out by the question's
    attention per chunk, each within [0, 1] (0: off)."""
    return parse_numbers(text, "relevances", 0.0, 1.0)


def parse_drift_estimators(text: str) -> list[str]:
    """Candidate drift estimators, comma-separated names from :data:`DRIFT_ESTIMATORS`."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in DRIFT_ESTIMATORS]
    if not names or bad:
        raise CalibrationError(f"drift estimators: give some of {', '.join(DRIFT_ESTIMATORS)}, got {text!r}")
    return list(dict.fromkeys(names))


def answer_kl_difference(per_item: Sequence[dict[str, Any]], label: str, base: str) -> Interval | None:
    """``label``'s answer KL minus ``base``'s, item by item, with its paired interval, from a
    result's ``per_item`` entries; None unless both answered the same items."""
    def by_item(name: str) -> dict[int, float]:
        return {r["item"]: r["answer_kl"] for r in per_item if r["method"] == name}

    mine, theirs = by_item(label), by_item(base)
    if not mine or mine.keys() != theirs.keys():
        return None
    items = sorted(mine)
    return paired([mine[i] for i in items], [theirs[i] for i in items])


def measurably_lower(row: CandidateRow, other: CandidateRow, per_item: Sequence[dict[str, Any]]) -> bool:
    """Whether ``row``'s answer KL is below ``other``'s with the paired interval excluding
    zero (not answered on the same items: False)."""
    difference = answer_kl_difference(per_item, row.label, other.label)
    return difference is not None and verdict(difference, lower_is_better=True) == "better"


def choose(rows: Sequence[CandidateRow], goal: Goal, per_item: Sequence[dict[str, Any]] = (),
           incumbent: str = "") -> tuple[CandidateRow, bool]:
    """The candidate ``goal`` asks for, and whether it met it (ties: lower recompute, then
    lower alpha, shallower check layer, lower floor, fewer sink tokens, smaller drift shift,
    estimators in the order of :data:`DRIFT_ESTIMATORS`, lower relevance).

    Under a budget, ``incumbent`` (the label of the candidate that repeats the config's own
    settings) is kept unless some candidate within the budget is measurably better on answer KL
    item by item (``per_item``); of those, the lowest mean wins. On the few items
    calibration runs on, a lower mean alone may be noise rather than a better setting."""
    assert rows, "no candidate to choose from"

    def cheaper(r: CandidateRow) -> tuple:
        return (r.recompute, r.alpha, r.check_layer, r.floor, r.sink_tokens, r.drift_shift,
                DRIFT_ESTIMATORS.index(r.drift_estimator), r.relevance)

    if goal.budget is not None:
        within = [r for r in rows if r.recompute <= goal.budget]
        if not within:
            return min(rows, key=cheaper), False
        keeper = next((r for r in within if incumbent and r.label == incumbent), None)
        if keeper is not None:
            better = [r for r in within if r is not keeper and measurably_lower(r, keeper, per_item)]
            within = better or [keeper]
        return min(within, key=lambda r: (r.answer_kl, *cheaper(r))), True
    reaching = [r for r in rows if r.answer_kl <= goal.target_kl]
    if reaching:
        return min(reaching, key=cheaper), True
    return min(rows, key=lambda r: (r.answer_kl, *cheaper(r))), False
