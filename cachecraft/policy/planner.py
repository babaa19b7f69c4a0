"""Turn reusability scores into a recompute plan for one request (pure decisions).

For each chunk: pick the variant with the lowest CFO (an exact prefix match needs no
fix), turn its CFO into a token count (floor and ceiling), then scale counts down to
an optional per-request budget. The question and uncached chunks are always computed.
Which tokens get recomputed is decided later, by the token selector, within these
counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cachecraft.config import named_drift_estimator
from cachecraft.policy.scores import VariantScore, cci, score_variant, tokens_to_recompute


@dataclass(frozen=True)
class PolicyParams:
    """Knobs of the policy; ``calibrate`` fits ``alpha`` (and ``order_weight``)."""

    alpha: float = 0.08
    order_weight: float = 0.2
    cci_prior: float = 0.5
    floor: float = 0.0
    ceiling: float = 1.0
    budget: float | None = None  # max recomputed fraction of all cached chunk tokens
    check_layer: int = 8
    sink_tokens: int = 0  # of a chunk's count, its first tokens come first
    # > 0: the rest of a chunk's count is spread evenly over it, and its other tokens move by
    # this share of the drift those spread tokens show (the engine's drift shift); 0: the rest
    # goes where the question looks and the other tokens stay as stored
    drift_shift: float = 0.0
    drift_estimator: str = "mean"  # how the spread tokens' changes make the shift (config.DRIFT_ESTIMATORS)
    # with a drift shift: the share of the chunks' spread counts given out again by the
    # question's attention to each chunk at the check layer (0: the plan's counts stand)
    relevance: float = 0.0
    # the share of the cached chunks' planned counts given out again in proportion to each
    # chunk's expected fix (CFO x tokens): chunks whose variant saw their real context pass
    # their floor to those whose variant did not (0: each chunk keeps its own count)
    pool: float = 0.0
    early_stop_layers: tuple[int, ...] = ()
    early_stop_share: float = 0.25
    # a chunk order asked at least this many times before, some of whose chunks are not
    # stored as a full prefill's KV after the chunks before them, is computed in full from
    # its first such chunk on and kept so, once (0: never; see rules.exact_from and
    # rules.exact_wait, which waits longer after a keep that no ask reused)
    exact_after_asks: int = 1

    def __post_init__(self) -> None:
        assert self.alpha >= 0, f"alpha must be >= 0, got {self.alpha}"
        assert 0.0 <= self.floor <= self.ceiling <= 1.0, "need 0 <= floor <= ceiling <= 1"
        assert self.budget is None or 0.0 <= self.budget <= 1.0, "budget must be within [0, 1]"
        assert self.sink_tokens >= 0, f"sink_tokens must be >= 0, got {self.sink_tokens}"
        assert self.drift_shift >= 0, f"drift_shift must be >= 0, got {self.drift_shift}"
        assert 0.0 <= self.relevance <= 1.0, f"relevance must be within [0, 1], got {self.relevance}"
        assert 0.0 <= self.pool <= 1.0, f"pool must be within [0, 1], got {self.pool}"
        assert self.exact_after_asks >= 0, f"exact_after_asks must be >= 0, got {self.exact_after_asks}"


@dataclass(frozen=True)
class VariantInfo:
    """What the planner needs to know about one stored variant of a chunk.

    ``prefix``: the chunk keys it was computed after (system prefix excluded);
    ``inter`` ``[L, len(prefix)]`` and ``intra`` ``[L]``: its attention statistics;
    ``prefix_tokens``: token counts of those prefix chunks.
    """

    variant: str
    prefix: tuple[str, ...]
    inter: torch.Tensor
    intra: torch.Tensor
    chunk_tokens: int
    prefix_tokens: tuple[int, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """The decision for one chunk of the request."""

    chunk: str
    variant: str | None  # None: no cache, computed in full
    score: VariantScore | None
    count: int  # tokens to recompute
    tokens: int

    @property
    def fraction(self) -> float:
        return self.count / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class RecomputePlan:
    """Per-chunk decisions, in prompt order."""

    chunks: tuple[ChunkPlan, ...]
    budget_scaled: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def recompute_fraction(self) -> float:
        total = sum(c.tokens for c in self.chunks)
        return sum(c.count for c in self.chunks) / total if total else 0.0


def layer_at(spec: float, num_layers: int) -> int:
    """The layer ``spec`` names in a model of ``num_layers`` layers: a whole number is a
    layer (cut to the last one), a fraction below 1 a depth (``round(spec * num_layers)``:
    0.27 is layer 8 of 30, layer 6 of 24), so one setting carries across models."""
    assert spec >= 0 and num_layers >= 1, f"need spec >= 0 and num_layers >= 1, got {spec}, {num_layers}"
    layer = round(spec * num_layers) if spec < 1 else int(spec)
    return min(layer, num_layers - 1)


# The policy's settings a calibration may fit for a model; explicit config values win.
FITTED_KEYS = ("policy_alpha", "policy_check_layer", "policy_floor", "policy_sink_tokens", "policy_drift_shift",
               "policy_drift_estimator", "policy_relevance")


def policy_settings(config, fitted: dict | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """The policy's settings and where each came from: ``config`` where the config gives a
    value (a file, the environment or an override, even one equal to the default) or sets
    one other than the default, else ``calibrated`` where ``fitted`` (the model's stored
    profile) has one, else ``default``."""
    defaults = type(config)(cache_dir=config.cache_dir)
    values, sources = {}, {}
    if fitted and "policy_drift_median" in fitted:  # stored while the estimator was a yes/no for the median
        fitted = {**fitted, "policy_drift_estimator": named_drift_estimator(fitted, "policy_")}
    for key in FITTED_KEYS:
        own = getattr(config, key)
        mine = own != getattr(defaults, key) or key in config.given
        if mine or not fitted or key not in fitted:
            values[key], sources[key] = own, "config" if mine else "default"
        else:
            value = fitted[key]
            if not isinstance(own, str):
                value = float(value)
                if value.is_integer() and isinstance(own, int):  # 16 first tokens, layer 8: as the config gives them
                    value = int(value)
            values[key], sources[key] = value, "calibrated"
    return values, sources


def params_from_config(config, num_layers: int, fitted: dict | None = None) -> PolicyParams:
    """The policy parameters a :class:`~cachecraft.config.Config` sets for a model of
    ``num_layers`` layers (layers given as depths resolved), with ``fitted`` (the model's
    calibrated profile) where the config leaves the default."""
    values, _ = policy_settings(config, fitted)
    stops = tuple(sorted({layer_at(s, num_layers) for s in config.early_stop_layer_list}))
    return PolicyParams(alpha=values["policy_alpha"], check_layer=layer_at(values["policy_check_layer"], num_layers),
                        floor=float(values["policy_floor"]), sink_tokens=int(values["policy_sink_tokens"]),
                        drift_shift=float(values["policy_drift_shift"]),
                        drift_estimator=str(values["policy_drift_estimator"]),
                        relevance=float(values["policy_relevance"]),
                        early_stop_layers=stops, early_stop_share=config.early_stop_share,
                        exact_after_asks=config.exact_after_asks)


def choose_variant(variants: Sequence[VariantInfo], new_prefix: Sequence[str],
                   params: PolicyParams) -> tuple[VariantInfo, VariantScore] | None:
    """The variant with the lowest CFO for a chunk preceded by ``new_prefix``; the exact
    one (made after ``new_prefix`` itself) wherever it is stored, even where another's CFO
    is 0 too (one made after some of those chunks, whose attention went to them alone):
    only the exact one needs no fixing, and no floor applies to it."""
    best = None
    for info in variants:
        score = score_variant(inter=info.inter, intra=info.intra, chunk_tokens=info.chunk_tokens,
                              prefix_tokens=info.prefix_tokens, old_prefix=info.prefix,
                              new_prefix=new_prefix, alpha=params.alpha,
                              order_weight=params.order_weight, cci_prior=params.cci_prior)
        if best is None or (score.cfo, not score.exact) < (best[1].cfo, not best[1].exact):
            best = (info, score)
        if score.exact:
            break
    return best


def expected_reuse(info: VariantInfo, params: PolicyParams) -> tuple[float, float]:
    """A variant's CCI and the share of its prefill a later reuse is expected to save:
    ``1 - clamp(alpha * CCI)``, its recompute fraction for a request sharing none of its
    prefix chunks (the eviction policy's quality term; sharing some only saves more)."""
    if info.prefix:
        value = cci(info.inter, info.intra, info.chunk_tokens, info.prefix_tokens)
    else:
        value = params.cci_prior
    fraction = min(max(params.alpha * value, params.floor), params.ceiling, 1.0)
    return value, 1.0 - fraction


def plan_request(chunk_keys: Sequence[str], chunk_tokens: Sequence[int],
                 variants: dict[str, Sequence[VariantInfo]], params: PolicyParams) -> RecomputePlan:
    """Plan a request whose chunks (in prompt order) are ``chunk_keys``."""
    plans: list[ChunkPlan] = []
    for index, (key, tokens) in enumerate(zip(chunk_keys, chunk_tokens)):
        choice = choose_variant(variants.get(key, ()), chunk_keys[:index], params)
        if choice is None:
            plans.append(ChunkPlan(key, None, None, tokens, tokens))
            continue
        info, score = choice
        count = 0 if score.exact else tokens_to_recompute(score.cfo, tokens, params.floor, params.ceiling)
        plans.append(ChunkPlan(key, info.variant, score, count, tokens))
    return apply_budget(plans, params.budget)


def apply_budget(plans: list[ChunkPlan], budget: float | None) -> RecomputePlan:
    """Scale the cached chunks' counts down proportionally so that recomputed cached
    tokens stay within ``budget`` of all cached chunk tokens."""
    cached = [p for p in plans if p.variant is not None]
    limit = None if budget is None else math.floor(budget * sum(p.tokens for p in cached))
    wanted = sum(p.count for p in cached)
    if limit is None or wanted <= limit:
        return RecomputePlan(tuple(plans))
    scale = limit / wanted
    scaled = [ChunkPlan(p.chunk, p.variant, p.score, math.floor(p.count * scale), p.tokens)
              if p.variant is not None else p for p in plans]
    return RecomputePlan(tuple(scaled), budget_scaled=True,
                         notes=(f"budget {budget:g}: {wanted} tokens scaled to at most {limit}",))
