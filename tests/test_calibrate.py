"""Fitting policy_alpha: the selection rule, the config writer and the CLI on a tiny model."""

from __future__ import annotations

import tomllib

import pytest
from typer.testing import CliRunner

import cachecraft.calibration as calibrate_module
import cli.app as cli_app
from cachecraft.config import Config, ConfigError, write_config_value
from cachecraft.policy.calibrate import (AlphaRow, CalibrationError, CalibrationResult, check_target, choose_alpha,
                                         parse_alphas)
from cli.app import app

runner = CliRunner()


def row(alpha, recompute, agreement):
    return AlphaRow(alpha, recompute, agreement, kl=0.1, ttft_s=1.0)


def test_choose_alpha_takes_the_lowest_recompute_that_reaches_the_target():
    rows = [row(0.05, 0.04, 0.90), row(0.1, 0.08, 0.96), row(0.2, 0.15, 0.95), row(0.3, 0.22, 0.99)]
    chosen, reached = choose_alpha(rows, 0.95)
    assert (chosen.alpha, reached) == (0.1, True)
    chosen, reached = choose_alpha(rows, 0.99)
    assert (chosen.alpha, reached) == (0.3, True)
    chosen, reached = choose_alpha(rows, 0.90)
    assert (chosen.alpha, reached) == (0.05, True)


def test_choose_alpha_falls_back_to_the_best_agreement():
    rows = [row(0.05, 0.04, 0.80), row(0.1, 0.08, 0.91), row(0.2, 0.15, 0.91), row(0.3, 0.22, 0.85)]
    chosen, reached = choose_alpha(rows, 0.95)
    assert (chosen.alpha, reached) == (0.1, False)  # tie on agreement: the cheaper one


def test_parse_alphas_and_target():
    assert parse_alphas("0.2, 0.05,,0.2") == [0.05, 0.2]
    for text in ("", "0.1,x", "-0.1", "1.5", "nan"):
        with pytest.raises(CalibrationError):
            parse_alphas(text)
    assert check_target(1.0) == 1.0
    for target in (0.0, -0.5, 1.01):
        with pytest.raises(CalibrationError, match="target"):
            check_target(target)


def test_write_config_value_keeps_other_keys_and_round_trips(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model = "smollm2"\nmax_new_tokens = 5\ncpu_budget_bytes = "1MiB"\npolicy_alpha = 0.3\n')
    write_config_value(path, "policy_alpha", 0.1)
    write_config_value(path, "system_prompt", 'Say "hi"\\ then\n\tanswer; é \x7f')
    data = tomllib.loads(path.read_text())
    assert data == {"model": "smollm2", "max_new_tokens": 5, "cpu_budget_bytes": "1MiB", "policy_alpha": 0.1,
                    "system_prompt": 'Say "hi"\\ then\n\tanswer; é \x7f'}
    assert Config.load(path, environ={}).policy_alpha == 0.1
    write_config_value(tmp_path / "new" / "fresh.toml", "policy_alpha", 1e-05)
    assert tomllib.loads((tmp_path / "new" / "fresh.toml").read_text()) == {"policy_alpha": 1e-05}


def test_write_config_value_keeps_a_cachecraft_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('note = true\n[cachecraft]\nmodel = "m"\n')
    write_config_value(path, "policy_alpha", 0.2)
    assert tomllib.loads(path.read_text()) == {"note": True, "cachecraft": {"model": "m", "policy_alpha": 0.2}}
    bad = tmp_path / "bad.toml"
    bad.write_text("model = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        write_config_value(bad, "policy_alpha", 0.2)


def test_calibrate_cli_writes_the_chosen_alpha(tiny_dir, dataset, tmp_path, cache_dir):
    config = tmp_path / "cfg.toml"
    config.write_text('max_new_tokens = 4\ncheck_layer = 2\n')
    result = runner.invoke(app, ["--config", str(config), "calibrate", "--dataset", str(dataset), "--limit", "2",
                                 "--alphas", "0.5,0.1", "--model", str(tiny_dir), "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    data = tomllib.loads(config.read_text())
    assert data["policy_alpha"] in (0.1, 0.5)
    assert data["max_new_tokens"] == 4 and data["check_layer"] == 2
    assert "policy_alpha" in result.output and "agreement" in result.output


def test_calibrate_cli_defaults_to_the_cache_dir_config(dataset, cache_dir, monkeypatch):
    def fake_calibrate(lm, config, items, alphas, target, **kwargs):
        rows = tuple(row(a, a, 0.5 + a / 2) for a in alphas)
        chosen, reached = choose_alpha(rows, target)
        return CalibrationResult(rows, chosen, target, reached, full_ttft_s=2.0)

    monkeypatch.setattr(calibrate_module, "calibrate", fake_calibrate)
    monkeypatch.setattr(cli_app, "load_model_quietly", lambda config: None)
    result = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.2,0.5,0.7",
                                 "--target", "0.99"])
    assert result.exit_code == 0, result.output
    assert "no alpha reached" in result.output
    assert tomllib.loads((cache_dir / "config.toml").read_text()) == {"policy_alpha": 0.7}  # best agreement
    assert Config.load().policy_alpha == 0.7  # picked up without --config


def test_calibrate_makes_caches_the_way_warm_does(dataset, cache_dir, monkeypatch, tmp_path):
    seen = []

    def fake_calibrate(lm, config, items, alphas, target, **kwargs):
        seen.append((config.warm_context, config.warm_context_tokens))
        rows = tuple(row(a, a, 0.99) for a in alphas)
        return CalibrationResult(rows, rows[0], target, True, full_ttft_s=2.0)

    monkeypatch.setattr(calibrate_module, "calibrate", fake_calibrate)
    monkeypatch.setattr(cli_app, "load_model_quietly", lambda config: None)
    context = tmp_path / "context.txt"
    context.write_text("Some neutral prose the caches are made after.")
    for extra in ([], ["--warm-context", "none"], ["--warm-context", str(context)]):
        result = runner.invoke(app, ["calibrate", "--dataset", str(dataset), "--alphas", "0.1", *extra])
        assert result.exit_code == 0, result.output
    assert seen[0] == ("builtin", Config.load().warm_context_tokens)  # the config default
    assert seen[1][0] == "none" and seen[2][0] == str(context)


@pytest.mark.parametrize("args,needle", [
    (["--dataset", "missing.json"], "dataset file not found"),
    (["--dataset", "{good}", "--alphas", "0.1,1.5"], "alphas must be within [0, 1]"),
    (["--dataset", "{good}", "--alphas", "a,b"], "not a number"),
    (["--dataset", "{good}", "--target", "0"], "target must be within (0, 1]"),
    (["--dataset", "{good}", "--target", "1.2"], "target must be within (0, 1]"),
    (["--dataset", "{good}", "--limit", "0"], "limit must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_1(args, needle, dataset, cache_dir):
    args = ["calibrate"] + [a.replace("{good}", str(dataset)) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert needle in result.output and result.output.strip().count("\n") == 0
    assert not (cache_dir / "config.toml").exists()
