"""ingest, warm, query, evict and clear through the CLI on a tiny local model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cachecraft.bench.servers import free_port
from cachecraft.catalog import Catalog, CatalogUnavailableError
from cli.app import app
from tests.servers import redis_server  # noqa: F401  (fixture)

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


@pytest.fixture
def env(tiny_dir, cache_dir, monkeypatch):
    """The tiny model, small chunks, short answers; returns the variables for subprocesses."""
    values = {"CACHECRAFT_MODEL": str(tiny_dir), "CACHECRAFT_CHUNK_TOKENS": "24", "CACHECRAFT_MAX_NEW_TOKENS": "4",
              "CACHECRAFT_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **values}


@pytest.fixture
def docs(tmp_path):
    root = tmp_path / "docs"
    (root / "more").mkdir(parents=True)
    (root / "a.md").write_text(f"# w5 w6\n\n{words(10, 12)}.\n\n{words(30, 20)}\n", encoding="utf-8")
    (root / "b.md").write_text(f"# w7\n\n{words(60, 15)}\n\n{words(80, 18)}\n", encoding="utf-8")
    (root / "more" / "c.markdown").write_text(f"{words(120, 10)}\n", encoding="utf-8")
    return root


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


def one_line_error(result, needle: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert needle in result.output and result.output.strip().count("\n") <= 1, result.output


def test_ingest_warm_query_end_to_end(env, docs, cache_dir):
    ingested = invoke("ingest", str(docs))
    assert "chunks added" in ingested.stdout
    again = json.loads(invoke("ingest", str(docs), "--json").stdout)
    assert again["added"] == 0 and again["unchanged"] == again["chunks"] > 0
    warming = invoke("warm", "--json")
    warmed = json.loads(warming.stdout)
    assert warmed["made"] == warmed["total"] == again["chunks"]
    # stderr is no terminal here, as in a log file: the progress comes as plain lines there
    size = sum(p.stat().st_size for p in docs.rglob("*") if p.is_file())
    assert ingested.stderr.splitlines()[-1].endswith(f"] embedding (chunks) {again['chunks']}/{again['chunks']}")
    assert f"] reading and chunking (bytes) {size}/{size}" in ingested.stderr
    assert warming.stderr.splitlines()[-1].endswith(f"] warming chunks {warmed['total']}/{warmed['total']}")
    assert json.loads(invoke("warm", "--json").stdout)["skipped"] == again["chunks"]

    first = json.loads(invoke("query", "w12 w13 w14", "--json").stdout)
    second = json.loads(invoke("query", "w12 w13 w14", "--json", "--top-k", "2").stdout)
    assert len(second["sources"]) == len(second["chunks"]) == 2
    assert all(c["tier"] != "miss" and c["variant"] for c in first["chunks"] + second["chunks"])
    assert second["sources"][0]["source"].endswith("a.md") and second["sources"][0]["title"] == "w5 w6"
    with Catalog(cache_dir) as catalog:
        with catalog.read() as tx:
            assert tx.request_ids() == [second["request_id"], first["request_id"]]
        record = catalog.get_request(second["request_id"])
    assert [c.tier for c in record.chunks] == [c["tier"] for c in second["chunks"]]
    assert all(c.variant_key for c in record.chunks)

    shown = invoke("query", "w12 w13 w14", "--method", "reuse")
    assert "source(s)" in shown.output and "TTFT" in shown.output and "a.md" in shown.output
    assert "low relevance" not in shown.output
    emoji = invoke("query", "\U0001F642\U0001F642", "--method", "reuse")
    assert "low relevance: the best source scores" in emoji.output and "-0.0" not in emoji.output
    stats = json.loads(invoke("stats", "--json").stdout)
    sources = {c["source"] for c in stats["top_chunks"]}
    assert {Path(s).name for s in sources if s and s.endswith(".md")} == {"a.md", "b.md"}  # recorded by warm
    assert all(s and Path(s).parent.name in ("docs", "more") for s in sources)  # no system prompt, no warm context
    table = invoke("stats").output
    assert "a.md" in table and str(docs) not in table  # file names, not long paths, in the narrow column


def test_ingest_reads_html_and_reports_every_skipped_file(env, docs):
    (docs / "page.html").write_text(f"<title>w9</title><p>{words(200, 8)}</p>", encoding="utf-8")
    (docs / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (docs / "gone.md").symlink_to(docs / "nowhere.md")
    result = runner.invoke(app, ["ingest", str(docs)])
    assert result.exit_code == 1, result.output  # something was skipped
    assert "(4 file(s) read)" in result.output and "2 file(s) skipped" in result.output
    assert "latin.txt: is not UTF-8 text" in result.output and "gone.md: broken symbolic link" in result.output
    shown = runner.invoke(app, ["ingest", str(docs), "--json"])
    assert shown.exit_code == 1
    report = json.loads(shown.stdout)
    assert report["files"] == 4 and {Path(s["path"]).name for s in report["skipped"]} == {"latin.txt", "gone.md"}
    assert report["unchanged"] == report["chunks"] and report["corpus_files"] == 4


def test_files_of_other_types_in_a_directory_are_listed_but_do_not_fail_ingest(env, docs):
    (docs / "settings.json").write_text("{}", encoding="utf-8")
    (docs / "more" / "logo.png").write_bytes(b"\x89PNG")
    result = runner.invoke(app, ["ingest", str(docs)])
    assert result.exit_code == 0, result.output  # so `ingest docs && warm` goes on to warm
    assert "2 file(s) skipped (2 of another type, in a directory)" in result.output
    assert "settings.json: unsupported file type '.json'" in result.output and "logo.png" in result.output
    report = json.loads(runner.invoke(app, ["ingest", str(docs), "--json"]).stdout)
    assert sorted((Path(s["path"]).name, s["ignored"]) for s in report["skipped"]) == [("logo.png", True),
                                                                                       ("settings.json", True)]
    # named on the command line, the same file is a problem
    named = runner.invoke(app, ["ingest", str(docs / "a.md"), str(docs / "settings.json")])
    assert named.exit_code == 1 and "1 file(s) skipped:" in named.output
    # and so is a file of a type that is read but could not be, next to ignored ones
    (docs / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    mixed = runner.invoke(app, ["ingest", str(docs)])
    assert mixed.exit_code == 1 and "3 file(s) skipped (2 of another type, in a directory)" in mixed.output


def test_warm_says_when_the_disk_budget_did_not_keep_what_it_made(env, docs, cache_dir, monkeypatch):
    invoke("ingest", str(docs))
    made = json.loads(invoke("warm", "--json").stdout)["made"]
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        sizes = [r.nbytes for r in tx.entries(tier="disk")]
    invoke("evict", "--tier", "disk")
    monkeypatch.setenv("CACHECRAFT_DISK_BUDGET_BYTES", str(3 * min(sizes)))  # two or three chunks
    again = runner.invoke(app, ["warm", "--json"])
    assert again.exit_code == 0, again.output
    report = json.loads(again.stdout)
    assert report["made"] == made and report["kept"] < made
    shown = invoke("warm")  # nothing kept is cached, so it is made again, and not kept again
    assert "chunk-caches made are still stored" in shown.output
    assert "disk_budget_bytes" in shown.output
    monkeypatch.delenv("CACHECRAFT_DISK_BUDGET_BYTES")
    assert "still stored" not in invoke("warm").output


def test_warm_neighbours_makes_in_context_variants_once(env, docs, cache_dir):
    chunks = json.loads(invoke("ingest", str(docs), "--json").stdout)["chunks"]
    shown = " ".join(invoke("warm", "--neighbours", "1").output.split())  # the console wraps long lines
    assert f"chunk-caches made {chunks}," in shown and f"in-context variants made {chunks}" in shown
    again = json.loads(invoke("warm", "--neighbours", "1", "--json").stdout)
    assert (again["made"], again["in_context"], again["skipped"]) == (0, 0, chunks)
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        prefixes = [len(tx.variant(e.variant_key).prefix) for e in tx.entries(tier="disk")]
    # the system prompt, the warm context and the corpus chunks, each chunk twice: after the
    # warm context (system, context) and after its nearest chunk (system, neighbour)
    assert sorted(prefixes) == [0, 1] + [2] * (2 * chunks)
    refused = runner.invoke(app, ["warm", "--neighbours", "9"])
    assert refused.exit_code == 2 and "--neighbours" in refused.output and "less than or equal" in refused.output


def test_warm_previous_makes_each_chunk_after_the_one_before_it_in_its_file(env, docs, cache_dir):
    ingested = json.loads(invoke("ingest", str(docs), "--json").stdout)
    chunks, files = ingested["chunks"], ingested["corpus_files"]
    made = json.loads(invoke("warm", "--previous", "--json").stdout)
    # every chunk but each file's first (no text repeats in these files)
    assert (made["made"], made["in_context"]) == (chunks, chunks - files)
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        prefixes = [len(tx.variant(e.variant_key).prefix) for e in tx.entries(tier="disk")]
    assert sorted(prefixes) == [0, 1] + [2] * (2 * chunks - files)
    assert "--previous" in invoke("warm", "--help").output


def test_evict_and_clear(env, docs, cache_dir):
    invoke("ingest", str(docs))
    invoke("warm")
    answer = json.loads(invoke("query", "w12 w13", "--json", "--method", "reuse").stdout)
    key = answer["chunks"][0]["chunk"]
    evicted = json.loads(invoke("evict", "--chunk", key[:10], "--json").stdout)
    assert evicted["removed"] >= 1
    after = json.loads(invoke("query", "w12 w13", "--json", "--method", "reuse").stdout)
    assert after["chunks"][0]["tier"] == "miss"
    assert "cpu tier lives inside" in invoke("evict", "--tier", "cpu").output
    second = after["chunks"][1]["variant"]
    evicted = json.loads(invoke("evict", "--variant", second[:10], "--json").stdout)
    assert evicted["variants"] == [second]
    one_line_error(runner.invoke(app, ["evict", "--variant", second]), "no cached variant matches")
    one_line_error(runner.invoke(app, ["evict", "--chunk", "zzzzzzzz"]), "no cached chunk matches")
    one_line_error(runner.invoke(app, ["evict"]), "give exactly one of")

    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        from_b = {r.variant_key for r in tx.entries()
                  if (tx.chunk(tx.variant(r.variant_key).chunk_key).source or "").endswith("b.md")}
    assert from_b
    evicted = json.loads(invoke("evict", "--source", "b.md", "--json").stdout)  # a file name naming one document
    assert set(evicted["variants"]) == from_b
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        assert not from_b & {r.variant_key for r in tx.entries()}
        assert tx.entries()  # a.md's caches stay
    one_line_error(runner.invoke(app, ["evict", "--source", str(docs / "b.md")]), "no cached chunk comes from")
    one_line_error(runner.invoke(app, ["evict", "--source", "b.md", "--all"]), "give exactly one of")

    assert runner.invoke(app, ["clear"], input="n\n").exit_code == 1  # not confirmed: nothing deleted
    assert (cache_dir / "store").exists()
    assert "deleted" in invoke("clear", "--yes").output
    assert not (cache_dir / "store").exists() and not (cache_dir / "catalog.sqlite").exists()
    assert json.loads(invoke("warm", "--json").stdout)["made"] > 0  # the corpus survived
    invoke("clear", "--corpus", "--yes")
    one_line_error(runner.invoke(app, ["query", "w12"]), "cachecraft ingest PATH")


def test_documents_and_forget(env, docs, cache_dir):
    assert "0 file(s)" in invoke("documents").output
    invoke("ingest", str(docs))
    listed = json.loads(invoke("documents", "--json").stdout)
    a, b, c = (str(p.resolve()) for p in (docs / "a.md", docs / "b.md", docs / "more" / "c.markdown"))
    assert [d["path"] for d in listed] == [a, b, c] and all(d["chunks"] >= 1 for d in listed)
    invoke("warm")
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        def stored_from(path):
            return {r.variant_key for r in tx.entries() if tx.chunk(tx.variant(r.variant_key).chunk_key).source == path}
        from_b, from_c, from_a = stored_from(b), stored_from(c), stored_from(a)
    assert from_a and from_b and from_c

    one_line_error(runner.invoke(app, ["forget", str(docs / "nothing.md")]), "nothing was ingested from")
    forgot = json.loads(invoke("forget", "b.md", "--json").stdout)  # a file name naming one document
    assert forgot["files"] == [b] and forgot["evicted"] == len(from_b) and forgot["corpus_files"] == 2
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        left = {r.variant_key for r in tx.entries()}
    assert not from_b & left and from_a | from_c <= left
    assert [d["path"] for d in json.loads(invoke("documents", "--json").stdout)] == [a, c]
    answer = json.loads(invoke("query", "w60 w61 w62", "--json", "--top-k", "10").stdout)
    assert {s["source"] for s in answer["sources"]} == {a, c}  # every chunk left, none of b

    (docs / "more" / "c.markdown").unlink()  # a directory gone from disk can still be forgotten
    (docs / "more").rmdir()
    with pytest.MonkeyPatch.context() as patch:  # --keep-caches needs no store: a catalog away does not matter
        patch.setenv("CACHECRAFT_CATALOG_URL", f"postgresql+psycopg://me@127.0.0.1:{free_port()}/away")
        one_line_error(runner.invoke(app, ["forget", str(docs / "more")]), "catalog_url")
        assert "forgot 1 file(s)" in invoke("forget", str(docs / "more"), "--keep-caches").output
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        assert from_c <= {r.variant_key for r in tx.entries()}

    def outage(self, sources):
        raise CatalogUnavailableError("the catalog server is away")

    with pytest.MonkeyPatch.context() as patch:  # the corpus changes first; the error says how to finish
        patch.setattr("cachecraft.store.TieredStore.evict_documents", outage)
        one_line_error(runner.invoke(app, ["forget", str(docs)]),
                       f"`cachecraft evict --source FILE` drops them, for: {a}")
    assert "0 file(s)" in invoke("documents").output
    assert json.loads(invoke("evict", "--source", a, "--json").stdout)["removed"] == len(from_a)
    one_line_error(runner.invoke(app, ["query", "w12"]), "cachecraft ingest PATH")


def test_forget_says_when_the_shared_tier_did_not_answer_and_evict_finishes_later(env, docs, cache_dir, redis_server,
                                                                                 monkeypatch, caplog):  # noqa: F811
    redis = pytest.importorskip("redis")
    monkeypatch.setenv("CACHECRAFT_REDIS_URL", redis_server.url)
    invoke("ingest", str(docs))
    invoke("warm")
    b = str((docs / "b.md").resolve())
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        from_b = {r.key for r in tx.stored_variants() if tx.chunk(r.chunk_key).source == b}
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert from_b and all(client.exists(f"cachecraft:blob:{v}") for v in from_b)
        with pytest.MonkeyPatch.context() as patch:  # Redis away (refused; a hung one is a store test)
            patch.setenv("CACHECRAFT_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
            caplog.clear()
            one_line_error(runner.invoke(app, ["forget", "b.md"]), "`cachecraft evict --source FILE` drops them")
            away = runner.invoke(app, ["evict", "--source", "a.md"])
        assert away.exit_code == 1 and "did not answer" in away.output and "evicted" in away.output
        # the error line says that the tier failed; its own warning would say it twice
        assert not [r for r in caplog.records if r.name == "cachecraft.store.shared"]
        assert [d["path"] for d in json.loads(invoke("documents", "--json").stdout)] == [
            str((docs / "a.md").resolve()), str((docs / "more" / "c.markdown").resolve())]
        assert all(client.exists(f"cachecraft:blob:{v}") for v in from_b)  # this node's copies went, Redis's stayed
        evicted = json.loads(invoke("evict", "--source", b, "--json").stdout)  # Redis answers again
        assert set(evicted["variants"]) == from_b and evicted["unreached"] is None
        assert not any(client.exists(f"cachecraft:blob:{v}") for v in from_b)
    finally:
        client.close()


def test_bad_input_is_one_line(env, docs, tmp_path):
    one_line_error(runner.invoke(app, ["query", "w1 w2"]), "nothing ingested")
    one_line_error(runner.invoke(app, ["warm"]), "cachecraft ingest PATH")
    one_line_error(runner.invoke(app, ["ingest", str(tmp_path / "missing")]), "no such file or directory")
    (tmp_path / "x.png").write_bytes(b"\x89PNG")
    one_line_error(runner.invoke(app, ["ingest", str(tmp_path / "x.png")]), "unsupported file type")
    invoke("ingest", str(docs))
    one_line_error(runner.invoke(app, ["query", "  "]), "the question is empty")
    one_line_error(runner.invoke(app, ["query", "w1", "--method", "fancy"]), "unknown method 'fancy'")
    one_line_error(runner.invoke(app, ["--config", str(tmp_path / "none.toml"), "query", "w1"]), "config file not found")


def test_checks_that_need_no_model_come_before_it_loads(env, docs, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("cachecraft.model.loader.load_model", no_model)
    one_line_error(runner.invoke(app, ["warm"]), "cachecraft ingest PATH")
    long_question = "w1 " * 1400  # 4200 characters: over 4 per token of the tiny model's 1024
    one_line_error(runner.invoke(app, ["query", long_question]), "the question is too long")
    monkeypatch.setenv("CACHECRAFT_MODEL", "smollm2")  # a bundled model: its window is known without it
    one_line_error(runner.invoke(app, ["query", "x" * 39_900]), "8,192-token context of smollm2")


def test_max_new_tokens_is_capped_at_the_room_left_in_the_context(env, docs):
    invoke("ingest", str(docs))
    result = runner.invoke(app, ["query", "w12 w13", "--json", "--max-new-tokens", "9000", "--method", "full"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["prompt_tokens"] + answer["new_tokens"] <= 1024
    assert "max_new_tokens 9000 capped at" in result.output and "1024" in result.output


def test_help_teaches_with_examples():
    for command in ("ingest", "warm", "query", "evict", "clear"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "Example" in result.output, command


def test_concurrent_queries_and_warm_leave_a_consistent_cache(env, docs, cache_dir):
    invoke("ingest", str(docs))
    cli = [sys.executable, "-m", "cli.app"]
    run = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen(cli + ["warm", "--workers", "2", "--json"], **run)]
    procs += [subprocess.Popen(cli + ["query", question, "--json"], **run) for question in ("w12 w13", "w61 w62")]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
        json.loads(out)
    assert json.loads(outputs[0][0])["total"] == json.loads(invoke("ingest", str(docs), "--json").stdout)["chunks"]
    report = json.loads(invoke("verify", "--json").stdout)
    assert report["consistent"] and not report["problems"]
    assert json.loads(invoke("warm", "--json").stdout)["made"] == 0
    with Catalog(cache_dir) as catalog, catalog.read() as tx:
        assert len(tx.request_ids()) == 2


def test_warm_workers_with_neighbours_make_each_cache_once_and_count_it_once(env, docs):
    """The workers meet between their own caches and their variants, so none makes (and
    leaves uncounted) a neighbour's cache that another's shard holds."""
    invoke("ingest", str(docs))
    cli = [sys.executable, "-m", "cli.app", "warm", "--workers", "2", "--neighbours", "1", "--json"]
    done = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["made"], report["skipped"]) == (report["total"], 0) and report["total"] > 2
    assert report["in_context"] == report["total"]  # one neighbour each
    again = json.loads(invoke("warm", "--neighbours", "1", "--json").stdout)
    assert (again["made"], again["in_context"], again["skipped"]) == (0, 0, report["total"])


def test_bench_dataset_turns_questions_about_the_corpus_into_items_quality_runs_on(env, docs, tmp_path):
    """Each question gets the chunks `query` retrieves for it; `bench quality` then runs on
    the file, and every answer carries its repetition flag."""
    from cachecraft.dataset import load_items

    invoke("ingest", str(docs))
    questions = tmp_path / "questions.txt"
    questions.write_text(f"# about the docs\n{words(10, 3)}\n\n{words(60, 3)}\n", encoding="utf-8")
    out = tmp_path / ("a-name-long-enough-to-pass-the-width-of-a-terminal-" * 2 + "mine.json")
    said = invoke("bench", "dataset", "--questions", str(questions), "--out", str(out), "--top-k", "2").output
    # One line however long the path: scripts read it (it once broke mid-sentence at 80 columns).
    assert said == f"wrote {out}: 2 question(s), top-2 chunks each from 5 in the corpus\n"
    items = load_items(out)
    assert [i.question for i in items] == [words(10, 3), words(60, 3)]
    assert all(len(i.passages) == 2 and i.answers == () for i in items)
    assert words(10, 12) in items[0].passages[0][1]  # the best chunk for its words
    invoke("bench", "quality", "--dataset", str(out), "--methods", "full,reuse", "--max-new-tokens", "4",
           "--out", str(tmp_path / "q.json"))
    data = json.loads((tmp_path / "q.json").read_text())
    assert all(r["repetition"] in (0.0, 1.0) for r in data["items"])
    assert data["methods"]["reuse"]["repetitions_where_full_does_not"] >= 0
    one_line_error(runner.invoke(app, ["bench", "dataset", "--questions", str(tmp_path / "none.txt"), "--out",
                                       str(out)]), "no file at")
    questions.write_text("# nothing\n\n", encoding="utf-8")
    one_line_error(runner.invoke(app, ["bench", "dataset", "--questions", str(questions), "--out", str(out)]),
                   "holds no question")
