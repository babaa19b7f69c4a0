"""Fitting the policy to a model: the selection rule, layers named by depth, the catalog
profile that query and config show use, and the CLI on a tiny model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import cachecraft.calibration as calibrate_module
import cli.app as cli_app
from cachecraft.catalog import Catalog
from cachecraft.config import Config, ConfigError
from cachecraft.methods import CacheCraft
from cachecraft.pipeline import Pipeline
from cachecraft.policy.calibrate import (ANY_DEVICE, POLICY_PROFILE, CalibrationError, CalibrationResult,
                                         CandidateRow, Goal, choose, parse_alphas, parse_check_layers)
from cachecraft.policy.planner import layer_at, params_from_config, policy_settings
from cachecraft.store import TieredStore
from cli.app import app
from tests.conftest import tiny_model

runner = CliRunner()


def row(alpha, recompute, answer_kl, check_layer=0.27):
    return CandidateRow(alpha, check_layer, recompute, answer_kl, token_agreement=0.9, agreement=0.9, kl=0.1,
                        ttft_s=1.0)


ROWS = [row(0.05, 0.02, 0.30), row(0.1, 0.04, 0.20), row(0.2, 0.05, 0.25), row(0.3, 0.09, 0.10)]


def test_a_budget_takes_the_lowest_divergence_within_it():
    assert choose(ROWS, Goal(budget=0.05)) == (ROWS[1], True)  # 0.20 beats 0.30 and 0.25 within 5%
    assert choose(ROWS, Goal(budget=0.1)) == (ROWS[3], True)
    assert choose(ROWS, Goal(budget=0.01)) == (ROWS[0], False)  # none within: the cheapest, and it says so


def test_a_target_takes_the_least_recompute_that_reaches_it():
    assert choose(ROWS, Goal(target_kl=0.25)) == (ROWS[1], True)
    assert choose(ROWS, Goal(target_kl=0.1)) == (ROWS[3], True)
    assert choose(ROWS, Goal(target_kl=0.05)) == (ROWS[3], False)  # none reaches: the lowest divergence


def test_ties_go_to_the_cheaper_candidate():
    tied = [row(0.2, 0.04, 0.2, check_layer=12), row(0.1, 0.04, 0.2, check_layer=0.4), row(0.1, 0.03, 0.2)]
    assert choose(tied, Goal(budget=0.05))[0] is tied[2]
    assert choose(tied[:2], Goal(budget=0.05))[0] is tied[1]


def test_each_candidate_is_compared_with_the_chosen_one_item_by_item():
    chosen = CandidateRow(0.1, 8, 0.05, 0.2, 0.9, 0.9, 0.1, 1.0, label="a")
    worse = CandidateRow(0.2, 8, 0.05, 0.3, 0.9, 0.9, 0.1, 1.0, label="b")
    mixed = CandidateRow(0.3, 8, 0.05, 0.2, 0.9, 0.9, 0.1, 1.0, label="c")
    elsewhere = CandidateRow(0.4, 8, 0.05, 0.2, 0.9, 0.9, 0.1, 1.0, label="d")
    kls = {"a": [0.1, 0.2, 0.3], "b": [0.2, 0.3, 0.4], "c": [0.0, 0.3, 0.3]}
    per_item = [{"item": i, "method": label, "answer_kl": kl} for label, values in kls.items()
                for i, kl in enumerate(values)]
    per_item.append({"item": 7, "method": "d", "answer_kl": 0.2})  # not the chosen one's items: left out
    result = CalibrationResult((chosen, worse, mixed, elsewhere), chosen, Goal(budget=0.1), True, 1.0, tuple(per_item))
    against = result.versus_chosen()
    assert set(against) == {"b", "c"}
    # b is 0.1 above on every item: every resample's mean is 0.1
    assert against["b"].mean == pytest.approx(0.1) and against["b"].low == pytest.approx(0.1)
    # c is -0.1, +0.1 and 0 from the chosen one: mean 0, and resamples of -0.1s and +0.1s both ways
    assert against["c"].mean == pytest.approx(0.0) and against["c"].low < 0 < against["c"].high
    shown = result.to_dict()["versus_chosen"]
    assert shown["b"]["verdict"] == "worse" and shown["c"]["verdict"] == "no measurable difference"


def labelled(label, recompute, kls):
    """A candidate whose per-item answer KLs are ``kls``, and those entries."""
    row = CandidateRow(0.1, 8, recompute, sum(kls) / len(kls), 0.9, 0.9, 0.1, 1.0, label=label)
    return row, [{"item": i, "method": label, "answer_kl": kl} for i, kl in enumerate(kls)]


def test_under_a_budget_the_config_settings_stay_unless_measurably_beaten():
    own, own_items = labelled("own", 0.04, [0.2, 0.2, 0.2, 0.2])
    noisy, noisy_items = labelled("noisy", 0.04, [0.0, 0.3, 0.1, 0.3])  # mean 0.175: -0.2, +0.1, -0.1, +0.1
    steady, steady_items = labelled("steady", 0.05, [0.15, 0.15, 0.15, 0.15])  # 0.05 below on every item
    steep, steep_items = labelled("steep", 0.05, [0.1, 0.1, 0.1, 0.2])  # mean 0.125: 0.1, 0.1, 0.1, 0 below
    costly, costly_items = labelled("costly", 0.2, [0.0, 0.0, 0.0, 0.0])  # outside the budget
    per_item = own_items + noisy_items + steady_items + steep_items + costly_items
    budget = Goal(budget=0.05)
    # the lowest mean, noisy's, is not measurably below the config's settings: they stay
    assert choose([own, noisy, costly], budget, per_item, "own") == (own, True)
    assert choose([own, noisy, costly], budget, per_item) == (noisy, True)  # no incumbent: the lowest mean
    # below on every item is measurably better; of two such, the lower mean
    assert choose([own, noisy, steady], budget, per_item, "own") == (steady, True)
    assert choose([own, noisy, steady, steep], budget, per_item, "own") == (steep, True)
    # an incumbent outside the budget, or not among the candidates, keeps no place
    assert choose([replace(own, recompute=0.1), noisy], budget, per_item, "own") == (noisy, True)
    assert choose([own, noisy], budget, per_item, "elsewhere") == (noisy, True)
    # a target is about the least recompute that reaches it, as before
    assert choose([own, noisy], Goal(target_kl=0.19), per_item, "own") == (noisy, True)
    result = CalibrationResult((own, noisy), own, budget, True, 1.0, tuple(own_items + noisy_items), "own")
    assert result.kept_incumbent() and result.to_dict()["incumbent"] == "own"
    assert result.to_dict()["kept_incumbent"] is True
    assert not replace(result, chosen=noisy).kept_incumbent() and not replace(result, incumbent="").kept_incumbent()


def test_the_candidate_with_the_config_settings_is_found_by_value():
    from cachecraft.calibration import own_settings

    config = Config.load(overrides={"policy_alpha": 0.1, "policy_check_layer": 6, "policy_floor": 0.05,
                                    "policy_sink_tokens": 16, "policy_drift_shift": 0.5}, environ={})
    same = CandidateRow(0.1, 6, 0.04, 0.2, 0.9, 0.9, 0.1, 1.0, floor=0.05, sink_tokens=16, drift_shift=0.5)
    assert own_settings(same, config, 24)
    assert own_settings(replace(same, check_layer=0.25), config, 24)  # depth 0.25 of 24 layers is layer 6
    assert not own_settings(replace(same, check_layer=0.25), config, 30)  # of 30, layer 8 (7.5 rounded)
    for change in ({"alpha": 0.2}, {"floor": 0.0}, {"sink_tokens": 0}, {"drift_shift": 1.0},
                   {"drift_estimator": "median"}, {"relevance": 0.5}):
        assert not own_settings(replace(same, **change), config, 24), change


def test_goals_and_candidates_are_checked():
    assert parse_alphas("0.2, 0.05,,0.2") == [0.05, 0.2]
    assert parse_check_layers("8, 0.27,0.5") == [0.27, 0.5, 8.0]
    for text in ("", "0.1,x", "-0.1", "1.5", "nan"):
        with pytest.raises(CalibrationError):
            parse_alphas(text)
    with pytest.raises(CalibrationError, match="neither a whole layer"):
        parse_check_layers("2.5")
    for goal in ({}, {"budget": 0.1, "target_kl": 0.1}):
        with pytest.raises(CalibrationError, match="either"):
            Goal(**goal)
    for bad in ({"budget": 0.0}, {"budget": 1.5}, {"target_kl": -1.0}, {"target_kl": float("nan")}):
        with pytest.raises(CalibrationError):
            Goal(**bad)


def test_layers_are_named_by_number_or_by_depth():
    assert layer_at(8, 30) == 8 and layer_at(40, 30) == 29  # a layer, cut to the model's last
    assert layer_at(0.27, 30) == 8 and layer_at(0.27, 24) == 6  # 8.1 and 6.48 rounded
    assert layer_at(0.0, 24) == 0 and layer_at(0.99, 24) == 23
    config = Config.load(overrides={"policy_check_layer": "0.5", "early_stop_layers": "0.5, 20"}, environ={})
    params = params_from_config(config, 24)
    assert params.check_layer == 12 and params.early_stop_layers == (12, 20)
    for bad in ({"policy_check_layer": 2.5}, {"policy_check_layer": -1}, {"early_stop_layers": "3,x"},
                {"early_stop_layers": "1.5"}):
        with pytest.raises(ConfigError):
            Config.load(overrides=bad, environ={})


def test_fitted_settings_apply_where_the_config_keeps_the_default():
    fitted = {"policy_alpha": 0.3, "policy_check_layer": 0.5, "policy_floor": 0.04, "policy_sink_tokens": 8,
              "policy_drift_shift": 1.0, "policy_drift_estimator": "pooled", "policy_relevance": 0.5}
    default = Config.load(environ={})
    values, sources = policy_settings(default, fitted)
    assert values == fitted
    assert set(sources.values()) == {"calibrated"}
    own = Config.load(overrides={"policy_alpha": 0.2, "policy_sink_tokens": 2}, environ={})
    values, sources = policy_settings(own, fitted)
    assert values == {**fitted, "policy_alpha": 0.2, "policy_sink_tokens": 2}
    assert sources == {"policy_alpha": "config", "policy_check_layer": "calibrated", "policy_floor": "calibrated",
                       "policy_sink_tokens": "config", "policy_drift_shift": "calibrated",
                       "policy_drift_estimator": "calibrated", "policy_relevance": "calibrated"}
    params = params_from_config(own, 24, fitted)
    assert (params.alpha, params.check_layer, params.floor, params.sink_tokens, params.drift_shift,
            params.drift_estimator, params.relevance) == (0.2, 12, 0.04, 2, 1.0, "pooled", 0.5)
    # a profile fitted before the estimator existed shifts by the mean; one stored while it was
    # a yes/no for the median keeps its choice
    older = {k: v for k, v in fitted.items() if k != "policy_drift_estimator"}
    assert params_from_config(default, 24, older).drift_estimator == "mean"
    for median, estimator in ((True, "median"), (False, "mean")):
        assert params_from_config(default, 24, {**older, "policy_drift_median": median}).drift_estimator == estimator
    with pytest.raises(ConfigError, match="policy_drift_estimator must be one of"):
        Config.load(overrides={"policy_drift_estimator": "mode"}, environ={})
    # a value given explicitly wins even where it is the default's (0 sink tokens, no shift)
    given = Config.load(environ={"CACHECRAFT_POLICY_SINK_TOKENS": "0", "CACHECRAFT_POLICY_DRIFT_SHIFT": "0"})
    values, sources = policy_settings(given, fitted)
    assert (values["policy_sink_tokens"], values["policy_drift_shift"], values["policy_floor"]) == (0, 0.0, 0.04)
    assert (sources["policy_sink_tokens"], sources["policy_drift_shift"]) == ("config", "config")
    assert params_from_config(default.replace(policy_floor=0.0), 24, fitted).floor == 0.0
    older = {"policy_alpha": 0.3, "policy_check_layer": 0.5}  # stored before floors and sinks were fitted
    assert policy_settings(default, older)[1]["policy_floor"] == "default"
    assert set(policy_settings(default, None)[1].values()) == {"default"}


def fake_result(alphas, goal, layers=None):
    rows = tuple(replace(row(a, a / 4, 0.5 - a / 2, check_layer=spec), label=f"a{a}@{spec}")
                 for spec in (layers or [0.27]) for a in alphas)
    chosen, reached = choose(rows, goal)
    # two items per candidate, 0.1 either side of its mean, the other way round every other row
    per_item = tuple({"item": i, "method": r.label, "answer_kl": r.answer_kl + (0.1 if (i + j) % 2 else -0.1)}
                     for j, r in enumerate(rows) for i in range(2))
    return CalibrationResult(rows, chosen, goal, reached, full_ttft_s=2.0, per_item=per_item)


@pytest.fixture
def fake_calibration(monkeypatch):
    seen = []

    def fake(lm, config, items, alphas, goal, check_layers=None, floors=None, sink_tokens=None, drift_shifts=None,
             drift_estimators=None, relevances=None, **kwargs):
        seen.append({"config": config, "items": items, "alphas": alphas, "goal": goal, "layers": check_layers,
                     "floors": floors, "sinks": sink_tokens, "shifts": drift_shifts, "estimators": drift_estimators,
                     "relevances": relevances})
        return fake_result(alphas, goal, check_layers)

    monkeypatch.setattr(calibrate_module, "calibrate", fake)
    monkeypatch.setattr(cli_app, "load_model_quietly", lambda config: tiny_model("llama"))
    return seen


def test_calibrate_stores_the_fit_for_the_model_and_query_uses_it(fake_calibration, dataset, cache_dir):
    result = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.1,0.2,0.3",
                                 "--check-layers", "0.5,2"])
    assert result.exit_code == 0, result.output
    assert fake_calibration[0]["goal"] == Goal(budget=0.05) and fake_calibration[0]["layers"] == [0.5, 2.0]
    # recompute a/4: 0.025, 0.05, 0.075; within 5% the lowest divergence is alpha 0.2 (0.4)
    lm = tiny_model("llama")
    with Catalog(cache_dir) as catalog:
        stored = catalog.profile(lm.fingerprint, ANY_DEVICE, POLICY_PROFILE)
    assert stored["policy_alpha"] == 0.2 and stored["policy_check_layer"] == 0.5
    assert stored["fitted"]["model"] == "smollm2" and stored["fitted"]["items"] == 2

    config = Config.load(environ={"CACHECRAFT_CACHE_DIR": str(cache_dir)})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=lm, store=store)
        assert pipe.policy.alpha == 0.2 and pipe.policy.check_layer == layer_at(0.5, lm.adapter.num_layers)
        assert pipe.policy_sources == {"policy_alpha": "calibrated", "policy_check_layer": "calibrated",
                                       "policy_floor": "calibrated", "policy_sink_tokens": "calibrated",
                                       "policy_drift_shift": "calibrated", "policy_drift_estimator": "calibrated",
                                       "policy_relevance": "calibrated"}
    own = config.replace(policy_alpha=0.4)
    with TieredStore(own, tiers=("cpu",)) as store:
        assert Pipeline(own, lm=lm, store=store).policy.alpha == 0.4  # the config's own value wins

    shown = runner.invoke(app, ["config", "show", "--json"])
    data = json.loads(shown.stdout)
    assert data["values"]["policy_alpha"] == 0.2 and data["sources"]["policy_alpha"].startswith("calibrated for smollm2")


def test_calibrate_takes_items_apart_and_a_divergence_target(fake_calibration, dataset, cache_dir):
    result = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--skip", "1", "--limit", "5",
                                 "--target-kl", "0.42", "--alphas", "0.1,0.2", "--json"])
    assert result.exit_code == 0, result.output
    seen = fake_calibration[0]
    assert len(seen["items"]) == 1 and seen["goal"] == Goal(target_kl=0.42) and seen["layers"] is None
    data = json.loads(result.stdout)
    assert data["policy_alpha"] == 0.2 and data["reached"] is True  # 0.4 <= 0.42; 0.45 is not
    assert data["stored"]["fitted"]["skip"] == 1


def test_calibrate_writes_its_result_file_and_names_the_whole_choice(fake_calibration, dataset, cache_dir, tmp_path,
                                                                     monkeypatch):
    out = tmp_path / "results" / "calibrate.json"
    args = ["calibrate", "--dataset", str(dataset), "--skip", "1", "--alphas", "0.1,0.2", "--json", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["cachecraft", *args])  # the command line the result records
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)  # stdout stays one JSON document; "wrote" goes to stderr
    written = json.loads(out.read_text())
    assert written["benchmark"] == "calibrate" and written["skip"] == 1 and written["limit"] == 1
    assert written["command"].endswith(f"cachecraft calibrate --dataset {dataset} --skip 1 --alphas 0.1,0.2 "
                                       f"--json --out {out}")
    assert written["rows"] == printed["rows"] and len(written["rows"]) == 2
    assert {"date", "machine", "code"} <= set(written) and written["dataset"] == str(dataset)
    table = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.1,0.2"])
    # alpha 0.2: 0.2/4
    assert "policy_sink_tokens 0, policy_drift_shift 0, policy_relevance 0 (recompute 0.050" in table.output
    assert "first-token KL" in table.output  # not a terminal: the table is not squeezed to 80 columns
    # alpha 0.1 against 0.2 item by item: 0.45 - 0.1 - (0.4 + 0.1) and 0.45 + 0.1 - (0.4 - 0.1)
    assert "+0.0500 [-0.1500, +0.2500]" in table.output
    assert "1 of the 1 other candidate(s) are not measurably worse than the chosen one" in table.output
    assert "the intervals are rough over 2 item(s): use 10 or more" in table.output
    assert written["versus_chosen"] == {"a0.1@0.27": {"mean": pytest.approx(0.05), "low": pytest.approx(-0.15),
                                                      "high": pytest.approx(0.25),
                                                      "verdict": "no measurable difference"}}


def test_calibrate_says_when_it_kept_the_config_settings_over_a_lower_mean(monkeypatch, dataset, cache_dir):
    own, own_items = labelled("own", 0.04, [0.2, 0.2, 0.2, 0.2])
    noisy, noisy_items = labelled("noisy", 0.04, [0.0, 0.3, 0.1, 0.3])
    result = CalibrationResult((own, noisy), own, Goal(budget=0.05), True, 1.0, tuple(own_items + noisy_items), "own")
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *args, **kwargs: result)
    monkeypatch.setattr(cli_app, "load_model_quietly", lambda config: tiny_model("llama"))
    shown = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.1"])
    assert shown.exit_code == 0, shown.output
    assert "kept the config's own settings: no candidate within the budget with a lower mean" in shown.output
    kept = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.1", "--json"])
    assert json.loads(kept.stdout)["kept_incumbent"] is True
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *args, **kwargs: replace(result, chosen=noisy))
    assert "kept the config's own settings" not in runner.invoke(app, ["calibrate", "--dataset", str(dataset)]).output


def test_calibrate_makes_caches_the_way_warm_does(fake_calibration, dataset, cache_dir, tmp_path):
    context = tmp_path / "context.txt"
    context.write_text("Some neutral prose the caches are made after.")
    for extra in ([], ["--warm-context", "none"], ["--warm-context", str(context)]):
        result = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.1", *extra])
        assert result.exit_code == 0, result.output
    assert [s["config"].warm_context for s in fake_calibration] == ["builtin", "none", str(context)]


def test_calibrate_on_a_tiny_model_measures_every_candidate(tiny_llama, dataset, tmp_path):
    from cachecraft.calibration import calibrate
    from cachecraft.dataset import load_items

    config = Config.load(overrides={"cache_dir": tmp_path, "max_new_tokens": 3, "warm_context": "none"},
                         environ={})
    result = calibrate(tiny_llama, config, load_items(dataset), [0.1, 0.6], Goal(budget=1.0), [1, 0.99],
                       max_new_tokens=3)
    assert [(r.alpha, r.check_layer) for r in result.rows] == [(0.1, 1), (0.6, 1), (0.1, 0.99), (0.6, 0.99)]
    assert all(r.answer_kl >= 0 and 0 <= r.token_agreement <= 1 for r in result.rows)
    assert result.reached and result.chosen.answer_kl == min(r.answer_kl for r in result.rows)
    assert result.incumbent == ""  # the config's alpha, 0.08, is not among the candidates
    own = config.replace(policy_alpha=0.6, policy_check_layer=1)
    again = calibrate(tiny_llama, own, load_items(dataset, 1), [0.1, 0.6], Goal(budget=1.0), max_new_tokens=3)
    assert again.incumbent == next(r.label for r in again.rows if r.alpha == 0.6)


@pytest.mark.parametrize("args,needle", [
    (["--dataset", "missing.json"], "dataset file not found"),
    (["--dataset", "{good}", "--alphas", "0.1,1.5"], "alphas must be within [0, 1]"),
    (["--dataset", "{good}", "--alphas", "a,b"], "not a number"),
    (["--dataset", "{good}", "--budget", "0"], "budget must be within (0, 1]"),
    (["--dataset", "{good}", "--budget", "0.1", "--target-kl", "0.1"], "either"),
    (["--dataset", "{good}", "--check-layers", "1.5"], "neither a whole layer"),
    (["--dataset", "{good}", "--limit", "0"], "limit must be >= 1"),
    (["--dataset", "{good}", "--skip", "5"], "no items after the first 5"),
])
def test_bad_input_is_one_line_and_exit_1(args, needle, dataset, cache_dir):
    args = ["calibrate"] + [a.replace("{good}", str(dataset)) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert needle in result.output and result.output.strip().count("\n") == 0


def test_calibrate_searches_floors_and_sink_tokens_and_refuses_bad_ones(fake_calibration, dataset, cache_dir):
    result = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.1", "--floors", "0.05,0",
                                 "--sink-tokens", "8,0", "--drift-shifts", "1,0",
                                 "--drift-estimators", "median,mean,pooled,median", "--relevances", "1,0.5"])
    assert result.exit_code == 0, result.output
    assert fake_calibration[0]["floors"] == [0.0, 0.05] and fake_calibration[0]["sinks"] == [0, 8]
    assert fake_calibration[0]["shifts"] == [0.0, 1.0] and fake_calibration[0]["estimators"] == ["median", "mean", "pooled"]
    assert fake_calibration[0]["relevances"] == [0.5, 1.0]
    for flag, bad, message in (("--floors", "1.5", "floors must be within"), ("--sink-tokens", "2.5", "not a whole"),
                               ("--sink-tokens", "x", "not a number"),
                               ("--drift-shifts", "3", "drift shifts must be within [0, 2]"),
                               ("--drift-estimators", "mode", "give some of mean, median, shrunk, pooled"),
                               ("--relevances", "1.5", "relevances must be within [0, 1]")):
        result = runner.invoke(app, ["calibrate", "--dataset", str(dataset), flag, bad])
        assert result.exit_code != 0 and message in result.output, result.output


def test_calibrate_on_a_tiny_model_measures_floors_and_sinks(tiny_llama, dataset, tmp_path):
    from cachecraft.calibration import calibrate
    from cachecraft.dataset import load_items

    config = Config.load(overrides={"cache_dir": tmp_path, "max_new_tokens": 3, "warm_context": "none",
                                    "policy_check_layer": 1}, environ={})
    result = calibrate(tiny_llama, config, load_items(dataset, 1), [0.0], Goal(budget=1.0), None, [0.0, 1.0],
                       [0, 2], max_new_tokens=3)
    rows = {(r.floor, r.sink_tokens): r for r in result.rows}
    assert set(rows) == {(0.0, 0), (0.0, 2), (1.0, 0), (1.0, 2)}
    assert rows[(0.0, 0)].recompute == 0.0  # alpha 0 and no floor: nothing recomputed
    assert rows[(1.0, 0)].recompute == rows[(1.0, 2)].recompute > 0.5  # the floor recomputes every reused chunk
    assert rows[(1.0, 0)].answer_kl == pytest.approx(0.0, abs=1e-5)
    assert result.profile()["policy_floor"] == result.chosen.floor
    # every answer is kept, full's and each candidate's, and the rows are their means
    per_item = result.to_dict()["per_item"]
    assert len(per_item) == 5 and sum(e["method"] == "full" for e in per_item) == 1
    for label in {e["method"] for e in per_item} - {"full"}:
        mine = [e for e in per_item if e["method"] == label]
        row = next(r for r in result.rows if CacheCraft(r.alpha, floor=r.floor, sink_tokens=r.sink_tokens).label
                   == label)
        assert len(mine) == 1 and mine[0]["item"] == 0 and row.label == label
        assert mine[0]["answer_kl"] == row.answer_kl and mine[0]["recompute_fraction"] == row.recompute
    assert set(result.to_dict()["versus_chosen"]) == {r.label for r in result.rows} - {result.chosen.label}


def test_calibrate_on_a_tiny_model_measures_drift_shifts(tiny_llama, dataset, tmp_path):
    from cachecraft.calibration import calibrate
    from cachecraft.dataset import load_items

    config = Config.load(overrides={"cache_dir": tmp_path, "max_new_tokens": 3, "warm_context": "none"}, environ={})
    result = calibrate(tiny_llama, config, load_items(dataset, 1), [0.0], Goal(budget=1.0), None, [0.2], None,
                       [0.0, 1.0], ["mean", "median", "shrunk"], max_new_tokens=3)
    rows = {(r.drift_shift, r.drift_estimator): r for r in result.rows}
    assert set(rows) == {(s, e) for s in (0.0, 1.0) for e in ("mean", "median", "shrunk")}
    assert rows[0.0, "mean"].recompute == rows[1.0, "mean"].recompute > 0  # the same counts, placed differently
    assert rows[0.0, "mean"].answer_kl != rows[1.0, "mean"].answer_kl
    # no shift: nothing for an estimator to do
    assert rows[0.0, "mean"].answer_kl == rows[0.0, "median"].answer_kl == rows[0.0, "shrunk"].answer_kl
    assert len({rows[1.0, e].answer_kl for e in ("mean", "median", "shrunk")}) == 3
    for key in ("policy_drift_shift", "policy_drift_estimator"):
        assert result.profile()[key] == result.to_dict()[key] == getattr(result.chosen, key[len("policy_"):])


def test_a_shipped_fit_applies_only_to_a_model_of_the_shape_it_was_fitted_on(monkeypatch, cache_dir):
    """A fit recorded for a bundled model's shape (the judge's 24 layers of 896) is not applied
    to a tiny random-weight model loaded under that model's name; the same fit naming the tiny
    model's shape is, and showing the configuration (no model loaded) names it either way."""
    import cachecraft.policy.shipped as shipped

    lm = tiny_model("llama")
    assert shipped.shipped_fit("qwen2.5-coder-0.5b")["architecture"]["num_hidden_layers"] == 24
    assert shipped.shipped_fit("qwen2.5-coder-0.5b", lm.model.config) is None
    assert shipped.shipped_fit("no-such-model", lm.model.config) is None
    judge_shape = shipped.shipped_fit("qwen2.5-coder-0.5b")["architecture"]
    fit = {"policy_alpha": 0.08, "policy_check_layer": 8, "policy_floor": 0.0, "policy_sink_tokens": 7,
           "policy_drift_shift": 0.0, "architecture": judge_shape,
           "fitted": {"model": "smollm2", "source": "shipped", "date": "2026-11-25"}}
    monkeypatch.setitem(shipped.SHIPPED_FITS, "smollm2", fit)
    config = Config.load(environ={"CACHECRAFT_CACHE_DIR": str(cache_dir)})
    with TieredStore(config, tiers=("cpu",)) as store:
        assert Pipeline(config, lm=lm, store=store).policy.sink_tokens == 0
    shape = {"model_type": "llama", "num_hidden_layers": lm.model.config.num_hidden_layers,
             "hidden_size": lm.model.config.hidden_size, "vocab_size": lm.model.config.vocab_size}
    monkeypatch.setitem(shipped.SHIPPED_FITS, "smollm2", {**fit, "architecture": shape})
    assert shipped.shipped_fit("smollm2", lm.model.config)["policy_sink_tokens"] == 7
    with TieredStore(config, tiers=("cpu",)) as store:
        assert Pipeline(config, lm=lm, store=store).policy.sink_tokens == 7
    shown = json.loads(runner.invoke(app, ["config", "show", "--json"]).stdout)
    assert shown["values"]["policy_sink_tokens"] == 7
    assert isinstance(shown["values"]["policy_sink_tokens"], int)  # shown as 7, not 7.0


def test_a_shipped_fit_applies_until_the_model_is_calibrated_here(monkeypatch, cache_dir):
    """A bundled model's shipped parameters are used where the config keeps the defaults;
    a calibration stored in the catalog wins over them; benchmarks' scratch pipelines use
    what query would, and calibrate's use the config alone."""
    import cachecraft.policy.shipped as shipped
    from cachecraft.evaluation import scratch_pipeline

    monkeypatch.setitem(shipped.SHIPPED_FITS, "smollm2", {
        "policy_alpha": 0.08, "policy_check_layer": 8, "policy_floor": 0.2, "policy_sink_tokens": 3,
        "policy_drift_shift": 1.0, "fitted": {"model": "smollm2", "source": "shipped", "date": "2026-11-24"}})
    lm = tiny_model("llama")
    config = Config.load(environ={"CACHECRAFT_CACHE_DIR": str(cache_dir)})
    shown = json.loads(runner.invoke(app, ["config", "show", "--json"]).stdout)
    assert shown["values"]["policy_floor"] == 0.2
    assert shown["sources"]["policy_floor"] == "calibrated for smollm2 on 2026-11-24 (shipped with cachecraft)"
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=lm, store=store)
        assert (pipe.policy.floor, pipe.policy.sink_tokens, pipe.policy.drift_shift) == (0.2, 3, 1.0)
        assert pipe.policy_report()["drift_shift"] == 1.0
        assert pipe.policy_sources["policy_floor"] == "calibrated"
    with scratch_pipeline(lm, config) as pipe:
        assert pipe.policy.floor == 0.2
    with Catalog(cache_dir) as catalog:
        catalog.save_profile(lm.fingerprint, ANY_DEVICE, POLICY_PROFILE,
                             {"policy_alpha": 0.1, "policy_check_layer": 2, "policy_floor": 0.05,
                              "policy_sink_tokens": 0, "fitted": {"model": "smollm2"}})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=lm, store=store)
        assert (pipe.policy.floor, pipe.policy.drift_shift) == (0.05, 0.0)  # a profile without it: the default
    with scratch_pipeline(lm, config) as pipe:
        assert (pipe.policy.floor, pipe.policy.alpha) == (0.05, 0.1)
    with scratch_pipeline(lm, config, fitted=False) as pipe:
        assert (pipe.policy.floor, pipe.policy.alpha) == (0.0, 0.08)


def test_explain_names_the_drift_estimator_where_it_is_not_the_mean():
    """A request's recorded policy names its estimator; one recorded while the estimator was a
    yes/no for the median says ``drift_median``."""
    words = cli_app._drift_estimator_words
    assert words({"drift_estimator": "pooled"}) == " by the pooled mean"
    assert words({"drift_estimator": "mean"}) == words({}) == words({"drift_median": False}) == ""
    assert words({"drift_median": True}) == " by the median"
