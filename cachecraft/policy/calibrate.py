"""Choosing the policy's alpha from measured candidates (pure decisions).

The chosen alpha is the one with the lowest mean recompute fraction whose mean answer
agreement (token F1 against full's answer) reaches the target. If none does, the best
agreement wins and the result says so. The candidates are measured by
:func:`cachecraft.calibration.calibrate`, through the pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence


class CalibrationError(ValueError):
    """Calibration input that cannot work (bad alphas or target); the message says which."""


@dataclass(frozen=True)
class AlphaRow:
    """How one candidate alpha did, averaged over the requests."""

    alpha: float
    recompute: float
    agreement: float
    kl: float
    ttft_s: float


@dataclass(frozen=True)
class CalibrationResult:
    """Every candidate's row, the chosen alpha and whether it reached the target."""

    rows: tuple[AlphaRow, ...]
    chosen: AlphaRow
    target: float
    reached: bool
    full_ttft_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "reached": self.reached, "policy_alpha": self.chosen.alpha,
                "full_ttft_s_median": self.full_ttft_s, "rows": [vars(r) for r in self.rows]}


def parse_alphas(text: str) -> list[float]:
    """``"0.1,0.05,0.1"`` -> ``[0.05, 0.1]`` (sorted, unique, each within [0, 1])."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise CalibrationError(f"alphas: {part!r} is not a number") from None
        values.append(value)
    return check_alphas(values)


def check_alphas(alphas: Sequence[float]) -> list[float]:
    """Sorted unique candidates; each must be within [0, 1] (a recompute fraction scale)."""
    if not alphas:
        raise CalibrationError("alphas: give at least one candidate, e.g. 0.05,0.1,0.2")
    bad = [a for a in alphas if not (math.isfinite(a) and 0.0 <= a <= 1.0)]
    if bad:
        raise CalibrationError(f"alphas must be within [0, 1], got {bad[0]:g}")
    return sorted(set(float(a) for a in alphas))


def check_target(target: float) -> float:
    """The agreement target must be within (0, 1]."""
    if not (math.isfinite(target) and 0.0 < target <= 1.0):
        raise CalibrationError(f"target must be within (0, 1], got {target:g}")
    return target


def choose_alpha(rows: Sequence[AlphaRow], target: float) -> tuple[AlphaRow, bool]:
    """The row with the lowest recompute (then lowest alpha) whose agreement reaches
    ``target``, and True; else the best agreement (then lowest recompute), and False."""
    assert rows, "no candidate to choose from"
    reaching = [r for r in rows if r.agreement >= target]
    if reaching:
        return min(reaching, key=lambda r: (r.recompute, r.alpha)), True
    return min(rows, key=lambda r: (-r.agreement, r.recompute, r.alpha)), False
