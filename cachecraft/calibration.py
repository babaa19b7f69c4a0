"""``cachecraft calibrate``: measure candidate policy settings through the pipeline and
pick the one the goal asks for.

Each candidate (an alpha, a check layer, a floor, a number of sink tokens, a drift shift, a
relevance) runs as a
``cachecraft`` method next to
``full`` on the same items, through the one request path (:mod:`cachecraft.evaluation`)
with the user's config, so early termination and the loading rules are the ones
``query`` uses; the yardstick's answer-level divergence is what is compared, and
:func:`cachecraft.policy.calibrate.choose` picks from the measured rows (under a budget,
the candidate with the config's own settings stays unless another is measurably
better). The result is
kept in the catalog against the model's fingerprint (:func:`store_fitted`), where
``query``, the LlamaIndex engine, ``config show`` and ``explain`` find it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.evaluation import OnAnswer, evaluate_items, scratch_pipeline
from cachecraft.methods import CacheCraft, Full
from cachecraft.policy.calibrate import (ANY_DEVICE, POLICY_PROFILE, CalibrationResult, CandidateRow, Goal,
                                         choose)
from cachecraft.policy.planner import layer_at


# What the result keeps of each answer, for comparing candidates item by item afterwards.
PER_ITEM_KEYS = ("item", "method", "recompute_fraction", "answer_kl", "token_agreement", "kl", "ttft_s")


def calibrate(lm, config: Config, items: Sequence[QAItem], alphas: Sequence[float], goal: Goal,
              check_layers: Sequence[float] | None = None, floors: Sequence[float] | None = None,
              sink_tokens: Sequence[int] | None = None, drift_shifts: Sequence[float] | None = None,
              drift_estimators: Sequence[str] | None = None, relevances: Sequence[float] | None = None, *,
              max_new_tokens: int = 32,
              on_item: Callable[[int, int], None] | None = None,
              on_answer: OnAnswer | None = None) -> CalibrationResult:
    """Run ``full`` and ``cachecraft`` for every alpha x check layer (layers or depths) x
    floor x sink-token count x drift shift x drift estimator x relevance (each default:
    the config's) on ``items`` and choose by
    ``goal`` (``on_answer`` sees every answer, with its per-chunk plan in ``answer.chunks``)."""
    specs = list(check_layers) if check_layers else [config.policy_check_layer]
    layers = {spec: layer_at(spec, lm.adapter.num_layers) for spec in specs}
    floor_list = list(floors) if floors else [None]
    sink_list = list(sink_tokens) if sink_tokens else [None]
    shift_list = list(drift_shifts) if drift_shifts else [None]
    estimator_list = list(drift_estimators) if drift_estimators else [None]
    relevance_list = list(relevances) if relevances else [None]
    candidates = {(a, spec, f, s, d, m, r): CacheCraft(a, check_layer=layers[spec] if check_layers else None, floor=f,
                                                       sink_tokens=s, drift_shift=d, drift_estimator=m, relevance=r)
                  for spec in specs for f in floor_list for s in sink_list for d in shift_list for m in estimator_list
                  for r in relevance_list for a in alphas}
    unique = list({m.label: m for m in candidates.values()}.values())  # two depths may name one layer
    with scratch_pipeline(lm, config, fitted=False) as pipeline:  # candidates as given, nothing fitted before
        rows = evaluate_items(pipeline, items, [Full(), *unique], max_new_tokens=max_new_tokens,
                              on_item=on_item, on_answer=on_answer)

    def mean(label: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows if r["method"] == label)

    measured = []
    for (alpha, spec, floor, sinks, shift, estimator, relevance), method in candidates.items():
        label = method.label
        measured.append(CandidateRow(alpha, spec, mean(label, "recompute_fraction"), mean(label, "answer_kl"),
                                     mean(label, "token_agreement"), mean(label, "agreement_f1"), mean(label, "kl"),
                                     statistics.median(r["ttft_s"] for r in rows if r["method"] == label),
                                     floor=config.policy_floor if floor is None else floor,
                                     sink_tokens=config.policy_sink_tokens if sinks is None else sinks,
                                     drift_shift=config.policy_drift_shift if shift is None else shift,
                                     drift_estimator=(config.policy_drift_estimator if estimator is None
                                                      else estimator),
                                     relevance=config.policy_relevance if relevance is None else relevance,
                                     label=label))
    per_item = tuple({key: r[key] for key in PER_ITEM_KEYS} for r in rows)
    incumbent = next((r.label for r in measured if own_settings(r, config, lm.adapter.num_layers)), "")
    chosen, reached = choose(measured, goal, per_item, incumbent)
    full_ttft = statistics.median(r["ttft_s"] for r in rows if r["method"] == Full().label)
    return CalibrationResult(tuple(measured), chosen, goal, reached, full_ttft, per_item, incumbent)


def own_settings(row: CandidateRow, config: Config, num_layers: int) -> bool:
    """Whether candidate ``row`` repeats the config's own policy settings (its check layer
    compared as the layer it names on a model of ``num_layers``)."""
    return (row.alpha == config.policy_alpha
            and layer_at(row.check_layer, num_layers) == layer_at(config.policy_check_layer, num_layers)
            and (row.floor, row.sink_tokens, row.drift_shift, row.drift_estimator, row.relevance)
            == (config.policy_floor, config.policy_sink_tokens, config.policy_drift_shift,
                config.policy_drift_estimator, config.policy_relevance))


def store_fitted(catalog, fingerprint: str, result: CalibrationResult, **about) -> dict:
    """Keep ``result``'s parameters in ``catalog`` for the model ``fingerprint`` (``about``:
    model name, dataset, items... recorded beside them); returns what was stored."""
    profile = result.profile(**about, date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    catalog.save_profile(fingerprint, ANY_DEVICE, POLICY_PROFILE, profile)
    return profile
