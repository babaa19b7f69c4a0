"""Result files record the code that made them; the one-measurement scripts summarise their runs."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess

import pytest

import cachecraft
from cachecraft.bench.common import code_identity, summarise_runs, write_result, write_script_result
from cachecraft.bench.report import describe_code

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@needs_git
def test_code_identity_names_the_commit_and_only_code_changes_mark_it_modified(tmp_path):
    (tmp_path / "cachecraft").mkdir()
    (tmp_path / "cachecraft" / "engine.py").write_text("x = 1\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "result.json").write_text("{}\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert code_identity(tmp_path) == {"version": cachecraft.__version__, "commit": head, "modified": False}

    (tmp_path / "benchmarks" / "result.json").write_text('{"new": 1}\n')  # a rerun's result is not a code change
    (tmp_path / "README.md").write_text("docs\n")
    assert code_identity(tmp_path)["modified"] is False
    (tmp_path / "cachecraft" / "engine.py").write_text("x = 2\n")
    assert code_identity(tmp_path) == {"version": cachecraft.__version__, "commit": head, "modified": True}


@needs_git
def test_two_commits_that_differ_only_in_results_and_docs_are_the_same_code(tmp_path):
    from cachecraft.bench.common import same_code

    (tmp_path / "cachecraft").mkdir()
    (tmp_path / "cachecraft" / "engine.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    first = code_identity(tmp_path)
    (tmp_path / "README.md").write_text("docs\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "docs")
    docs = code_identity(tmp_path)
    assert docs["commit"] != first["commit"] and same_code(first, docs, tmp_path)
    (tmp_path / "cachecraft" / "engine.py").write_text("x = 2\n")
    assert not same_code(first, code_identity(tmp_path), tmp_path)  # a code change not yet committed
    _git(tmp_path, "commit", "-q", "-am", "code")
    assert not same_code(first, code_identity(tmp_path), tmp_path) and not same_code(docs, code_identity(tmp_path),
                                                                                      tmp_path)


def test_a_result_names_the_code_the_run_started_with_and_says_when_it_changed(tmp_path, monkeypatch):
    import cachecraft.bench.common as common

    now = code_identity()
    monkeypatch.setattr(common, "_CODE_AT_START", now)
    written = json.loads(write_result(tmp_path / "same.json", {"x": 1}).read_text())
    assert written["code"] == now and "changed_since_start" not in written["code"]
    started = {"version": now["version"], "commit": "0" * 40, "modified": False}
    monkeypatch.setattr(common, "_CODE_AT_START", started)  # a commit landed while the run went on
    written = json.loads(write_result(tmp_path / "later.json", {"x": 1}).read_text())
    assert written["code"] == {**started, "changed_since_start": now}


def test_code_identity_outside_a_checkout_has_no_commit(tmp_path):
    assert code_identity(tmp_path) == {"version": cachecraft.__version__, "commit": None, "modified": None}


@needs_git
def test_an_install_inside_a_checkout_is_not_taken_for_it(tmp_path):
    site = tmp_path / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "first")
    assert code_identity(site)["commit"] is None


def test_write_result_records_the_code_and_the_report_names_it(tmp_path):
    data = json.loads(write_result(tmp_path / "r.json", {"command": "cachecraft bench x"}).read_text())
    assert data["code"]["version"] == cachecraft.__version__ and data["command"] == "cachecraft bench x"
    assert describe_code({"code": {"version": "0.1.0", "commit": "0123456789abcdef", "modified": False}}) \
        == "cachecraft 0.1.0, commit 0123456789"
    assert describe_code({"code": {"version": "0.1.0", "commit": "0123456789abcdef", "modified": True}}) \
        == "cachecraft 0.1.0, commit 0123456789 with uncommitted changes"
    assert describe_code({"code": {"version": "0.1.0", "commit": None}}) == "cachecraft 0.1.0, not from a git checkout"
    assert describe_code({}) == "not recorded"


def _row(item, label, answer_kl, agreement, kl, recompute, **extra):
    return {"item": item, "way": label, "answer_kl": answer_kl, "token_agreement": agreement, "kl": kl,
            "recompute_fraction": recompute, **extra}


def test_summarise_runs_means_each_run_and_pairs_the_others_with_the_baseline():
    rows = [_row(1, "base", 0.2, 0.9, 0.3, 0.05, removed=0.0), _row(1, "new", 0.1, 1.0, 0.2, 0.05, removed=0.5),
            _row(2, "base", 0.4, 0.8, 0.5, 0.05, removed=0.0), _row(2, "new", 0.5, 0.8, 0.1, 0.05, removed=0.25)]
    out = summarise_runs(rows, "way", ["base", "new"], "base", name=str.upper, extra=("removed",))
    assert out["items"] == 2 and out["per_item"] is rows
    assert out["summary"]["NEW"]["answer_kl"] == pytest.approx(0.3)  # (0.1 + 0.5) / 2
    assert out["summary"]["NEW"]["token_agreement"] == pytest.approx(0.9)
    assert out["summary"]["NEW"]["first_token_kl"] == pytest.approx(0.15)
    assert out["summary"]["NEW"]["removed"] == pytest.approx(0.375)
    assert out["summary"]["BASE"]["recompute"] == pytest.approx(0.05)
    [pair] = out["paired"]
    assert pair["way"] == "new" and pair["against"] == "base"
    assert pair["lower_on"] == 1  # item 1: 0.1 < 0.2; item 2: 0.5 > 0.4
    assert pair["answer_kl"]["mean"] == pytest.approx(0.0)  # (-0.1 + 0.1) / 2
    assert pair["token_agreement"]["mean"] == pytest.approx(0.05)
    assert pair["kl"]["mean"] == pytest.approx(-0.25)  # (-0.1 - 0.4) / 2
    assert {pair[k]["verdict"] for k in ("answer_kl", "token_agreement", "kl")} <= {
        "better", "worse", "no measurable difference"}


def test_write_script_result_names_the_benchmark_model_and_dataset(tmp_path):
    args = argparse.Namespace(out=tmp_path / "deep" / "out.json", model="smollm2", dataset=tmp_path / "items.json")
    write_script_result(args, "a_measurement", items=3)
    written = json.loads(args.out.read_text())
    assert (written["benchmark"], written["model"], written["dataset"], written["items"]) == (
        "a_measurement", "smollm2", str(tmp_path / "items.json"), 3)
    assert "machine" in written


def test_serve_runs_are_made_side_by_side_alternating_which_method_goes_first():
    from cachecraft.bench.serving import run_order

    assert run_order([1, 2, 4], ["cachecraft", "full"]) == [("cachecraft", 1), ("full", 1), ("full", 2),
                                                             ("cachecraft", 2), ("cachecraft", 4), ("full", 4)]
    assert run_order([8], ["full"]) == [("full", 8)]


def test_the_serve_table_gives_the_server_ttft_mean_beside_its_median():
    from cachecraft.bench.readme import serve_table

    rows = [{"server_ttft_s": s} for s in (0.25, 0.25, 4.0, None)]  # the last one failed
    run = {"method": "cachecraft", "clients": 1, "throughput_rps": 0.5, "hit_rate": 0.5, "errors": ["x"],
           "client_ttft_s": {"p50": 1.0, "p90": 2.0, "p99": 3.0}, "server_ttft_s_median": 0.25, "rows": rows}
    table = serve_table({"runs": [run], "command": "cachecraft bench serve", "model": "tiny", "unique_requests": 3,
                         "top_k": 3, "date": "2026-12-07", "machine": {"cpu": "cpu", "cores": 2}})
    header, rule, line = table.splitlines()[-3:]
    assert header.count("|") == rule.count("|") == line.count("|") == 11
    assert "| 0.250 | 1.500 | 50% | 1 |" in line  # mean of 0.25, 0.25 and 4.0
