"""The demo of `make demo`: ingest, warm, then cachecraft and full side by side."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console
from typer.testing import CliRunner

from cachecraft.catalog import Catalog
from cachecraft.config import Config
from cachecraft.demo import DEMO_METHODS, demo_config, run_demo
from cli.app import app
from tests.conftest import tiny_model


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def sample(tmp_path):
    corpus = tmp_path / "manual"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.md").write_text(f"# w{200 + i}\n\n{words(20 * i, 15)}\n", encoding="utf-8")
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps([{"question": words(5 * i, 3), "answers": [f"w{i}"],
                                      "ctxs": [{"title": "t", "text": "unused"}]} for i in range(3)]))
    return corpus, questions


def test_demo_answers_over_warmed_caches_in_its_own_directory(tmp_path, cache_dir):
    corpus, questions = sample(tmp_path)
    config = Config.load(overrides={"cache_dir": cache_dir, "top_k": 2, "max_new_tokens": 3,
                                    "chunk_tokens": 32}, environ={})
    out = io.StringIO()
    rows = run_demo(tiny_model("llama"), config, corpus, questions, 2, Console(file=out, width=200))
    assert [r["question"] for r in rows] == [words(0, 3), words(5, 3)]
    for row in rows:
        assert set(row["answers"]) == set(DEMO_METHODS)
        cached = row["answers"]["cachecraft"]
        assert cached.chunks and all(c.tier != "miss" for c in cached.chunks)  # warmed before asking
        assert row["answers"]["full"].recompute_fraction == 1.0
    text = out.getvalue()
    assert "chunk-caches: 3 made" in text and "median speedup" in text
    # a console that is no terminal (a log) gets the progress as lines, up to the end
    assert re.search(r"^\[0m\d\ds\] warming chunk-caches (\d+)/\1$", text, re.M), text
    home = demo_config(config).cache_dir
    assert (home / "corpus").is_dir() and not (cache_dir / "corpus").exists()  # the user's corpus untouched
    with Catalog(home) as catalog, catalog.read() as tx:
        assert len(tx.request_ids()) == 2 * len(DEMO_METHODS)


def test_a_demo_run_again_keeps_the_orders_asked_twice_exact_and_the_next_run_reuses_them(tmp_path, cache_dir):
    corpus, questions = sample(tmp_path)
    config = Config.load(overrides={"cache_dir": cache_dir, "top_k": 2, "max_new_tokens": 3, "chunk_tokens": 32,
                                    "kv_dtype": "float32"}, environ={})
    lm = tiny_model("llama")
    first = run_demo(lm, config, corpus, questions, 2, Console(file=io.StringIO(), width=200))
    assert not any(r["answers"]["cachecraft"].kept_exact for r in first)
    out = io.StringIO()
    second = run_demo(lm, config, corpus, questions, 2, Console(file=out, width=200))
    # each question's chunks asked twice before (cachecraft's and full's ask): computed in full once
    assert all(r["answers"]["cachecraft"].kept_exact for r in second)
    assert all(r["answers"]["cachecraft"].recompute_fraction == 1.0 for r in second)
    text = " ".join(out.getvalue().split())
    assert "computed them in full once and kept them exact" in text
    assert "2 of 2 chunk orders had been asked twice before" in text
    third = run_demo(lm, config, corpus, questions, 2, Console(file=io.StringIO(), width=200))
    for row in third:
        cached, full = row["answers"]["cachecraft"], row["answers"]["full"]
        assert not cached.kept_exact and cached.recompute_fraction == 0.0 and cached.text == full.text


def test_demo_command_rejects_a_missing_corpus(tmp_path, cache_dir, tiny_dir, monkeypatch):
    monkeypatch.setenv("CACHECRAFT_MODEL", str(tiny_dir))
    _, questions = sample(tmp_path)
    result = CliRunner().invoke(app, ["demo", "--corpus", str(tmp_path / "nope"), "--questions", str(questions)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "nope" in result.output


def test_the_demo_finds_its_sample_data_from_any_folder_and_says_what_is_missing(tmp_path, monkeypatch):
    from cachecraft.demo import PROJECT_DIR, SAMPLE_CORPUS, SAMPLE_QUESTIONS, sample_paths

    monkeypatch.chdir(tmp_path)  # no data/ here
    assert sample_paths(SAMPLE_CORPUS, SAMPLE_QUESTIONS) == (PROJECT_DIR / SAMPLE_CORPUS,
                                                             PROJECT_DIR / SAMPLE_QUESTIONS)
    assert (PROJECT_DIR / SAMPLE_CORPUS / "29-factory-reset.md").is_file()
    corpus, questions = sample(tmp_path)
    assert sample_paths(corpus, questions) == (corpus, questions)
    monkeypatch.setattr("cachecraft.demo.PROJECT_DIR", tmp_path / "installed")  # a wheel: no sample beside it
    result = CliRunner().invoke(app, ["demo"])  # fails before any model loads
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert ("the demo's corpus folder data/kestrel is not there (run the demo from the project's folder, or give "
            "--corpus and --questions)") in result.output
