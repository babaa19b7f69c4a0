"""The CLI through typer's runner and as a real subprocess, on a tiny local model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.app import app

runner = CliRunner()


def one_line_error(result, needle: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert needle in result.output


def test_help_works_with_short_flag():
    result = runner.invoke(app, ["-h"])
    assert result.exit_code == 0
    for command in ("check-model", "bench", "demo", "config"):
        assert command in result.output


def test_check_model_on_a_local_directory(tiny_dir, cache_dir):
    result = runner.invoke(app, ["check-model", str(tiny_dir), "--prompts", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] is True
    assert {r["name"] for r in report["results"]} >= {"recompute_all", "exact_prefix", "generate"}


def test_bench_quality_writes_results(tiny_dir, dataset, tmp_path, cache_dir):
    out = tmp_path / "q.json"
    result = runner.invoke(app, ["bench", "quality", "--dataset", str(dataset), "--limit", "2",
                                 "--methods", "full,reuse,cacheblend@0.5,cachecraft@0.5", "--out", str(out),
                                 "--model", str(tiny_dir), "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"full", "reuse", "cacheblend@0.5", "cachecraft@0.5"}
    full, blend = data["methods"]["full"], data["methods"]["cacheblend@0.5"]
    for key in ("ttft_s_median", "recompute_fraction_mean", "kl_mean", "agreement_f1_mean",
                "exact_match_rate", "gold_f1_mean", "peak_rss_mb_max"):
        assert key in blend
    assert full["kl_mean"] == 0.0 and full["agreement_f1_mean"] == 1.0 and full["recompute_fraction_mean"] == 1.0
    assert data["methods"]["reuse"]["recompute_fraction_mean"] == 0.0
    assert 0.5 <= blend["recompute_fraction_mean"] < 0.6
    assert 0 < data["methods"]["cachecraft@0.5"]["recompute_fraction_mean"] < 1  # planned from the stored statistics
    assert len(data["items"]) == 8 and data["machine"]["cores"] >= 1
    assert [r["item"] for r in data["items"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    held_out = tmp_path / "held-out.json"
    result = runner.invoke(app, ["bench", "quality", "--dataset", str(dataset), "--skip", "1", "--methods", "full",
                                 "--out", str(held_out), "--model", str(tiny_dir), "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert [r["item"] for r in json.loads(held_out.read_text())["items"]] == [1]  # its place in the file


def test_bench_quality_finds_in_context_neighbours_in_a_pool(tiny_dir, dataset, tmp_path, cache_dir):
    """Item 0's three passages get one variant each, made after its nearest passage among
    both items' six (the pool), and the result says where the neighbours came from."""
    out = tmp_path / "pool.json"
    common = ["bench", "quality", "--dataset", str(dataset), "--limit", "1", "--methods", "full",
              "--model", str(tiny_dir), "--max-new-tokens", "2", "--out", str(out)]
    result = runner.invoke(app, [*common, "--in-context", "reuse", "--neighbour-pool", str(dataset)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["neighbour_pool"] == str(dataset)
    assert [r["in_context_variants"] for r in data["items"] if r["method"] == "reuse+nb1"] == [3]
    one_line_error(runner.invoke(app, [*common, "--neighbour-pool", str(dataset)]), "add --in-context")
    one_line_error(runner.invoke(app, [*common, "--in-context", "reuse", "--neighbour-pool",
                                       str(tmp_path / "none.json")]), "no file at")
    one_line_error(runner.invoke(app, [*common, "--in-context", "reuse", "--neighbour-pool", "corpus"]),
                   "run `cachecraft ingest` first")
    one_line_error(runner.invoke(app, [*common, "--in-context", "reuse", "--neighbour-pool", "previous"]),
                   "run `cachecraft ingest` first")
    one_line_error(runner.invoke(app, [*common, "--in-context", "reuse", "--neighbour-pool", "previous",
                                       "--neighbours", "2"]), "leave --neighbours at 1")


def test_bench_quality_can_make_the_caches_after_the_warm_context(tiny_dir, dataset, tmp_path, cache_dir):
    kls = {}
    for context in ("none", "builtin"):
        out = tmp_path / f"{context}.json"
        result = runner.invoke(app, ["bench", "quality", "--dataset", str(dataset), "--limit", "1", "--methods",
                                     "full,reuse", "--out", str(out), "--model", str(tiny_dir), "--max-new-tokens",
                                     "2", "--warm-context", context])
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        assert data["warm_context"] == context and data["methods"]["reuse"]["recompute_fraction_mean"] == 0.0
        kls[context] = data["methods"]["reuse"]["kl_mean"]
    assert kls["none"] > 0 and kls["builtin"] > 0 and abs(kls["none"] - kls["builtin"]) > 1e-6  # other caches


@pytest.mark.parametrize("args,needle", [
    (["check-model", "no-such-model-anywhere/xyz"], "cannot load model"),
    (["bench", "quality", "--dataset", "missing.json"], "dataset file not found"),
    (["bench", "quality", "--dataset", "{bad}", "--methods", "full"], "not a JSON file"),
    (["bench", "quality", "--dataset", "{good}", "--methods", "full,fancy"], "unknown method 'fancy'"),
])
def test_bad_input_is_one_line_and_exit_1(args, needle, tmp_path, dataset, cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    args = [a.replace("{bad}", str(bad)).replace("{good}", str(dataset)) for a in args]
    one_line_error(runner.invoke(app, args), needle)


@pytest.mark.parametrize("args", [["forget", ""], ["ingest", "docs", " "], ["--cache-dir", "", "stats"],
                                  ["--config", "", "config", "show"], ["bench", "quality", "--dataset", ""]])
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(args, tmp_path, cache_dir, monkeypatch):
    """`forget "$UNSET"` would otherwise forget every file ingested from the current directory."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "an empty path names nothing" in result.output, result.output
    assert not (tmp_path / "catalog.sqlite").exists() and not cache_dir.exists()


@pytest.mark.parametrize("command", [["documents"], ["verify"], ["clear", "--yes"], ["stats"], ["query", "hi"],
                                     ["warm"]])
def test_a_cache_dir_that_is_a_file_is_one_line_and_exit_1(command, tmp_path, monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(taken))
    one_line_error(runner.invoke(app, command), f"the cache directory {taken} is a file, not a directory")
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(taken / "sub"))
    one_line_error(runner.invoke(app, command), f"lies under {taken}, a file")
    assert taken.read_text() == "a file"


@pytest.mark.parametrize("command", ["quality", "workload", "eviction", "scaling"])
def test_bench_commands_need_a_dataset(command):
    result = runner.invoke(app, ["bench", command])
    assert result.exit_code == 2 and "--dataset" in result.output


def test_corrupted_config_file_is_reported(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("model = [")
    one_line_error(runner.invoke(app, ["--config", str(bad), "config", "show"]), "not valid TOML")
    good = tmp_path / "g.toml"
    good.write_text('max_new_tokens = 5\n')
    result = runner.invoke(app, ["--config", str(good), "config", "show", "--json"])
    assert json.loads(result.stdout)["values"]["max_new_tokens"] == 5


def test_config_show_says_where_each_value_comes_from(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text('max_new_tokens = 5\nmodel = "from-file"\n')
    monkeypatch.setenv("CACHECRAFT_TOP_K", "7")
    monkeypatch.setenv("CACHECRAFT_MODEL", "from-env")
    args = ["--config", str(path), "--cache-dir", str(tmp_path / "cd"), "config", "show"]
    shown = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    assert shown["values"]["model"] == "from-env" and shown["values"]["top_k"] == 7
    assert shown["sources"] == {**{k: "default" for k in shown["values"]}, "max_new_tokens": f"file {path}",
                                "model": "environment", "top_k": "environment", "cache_dir": "flag"}
    table = runner.invoke(app, args).output
    lines = {line.split()[1]: line for line in table.splitlines() if line.startswith("│")}
    assert "environment" in lines["top_k"] and "default" in lines["policy_alpha"] and "flag" in lines["cache_dir"]


def _report_answer(order=None):
    from cachecraft.pipeline.reports import Answer, ChunkReport, Source

    sources = [Source(f"id{i}", "A rather long title of one section of the manual",
                      "/a/long/path/to/a-document-with-a-long-name.md", 0.812 - i / 10, "text") for i in range(3)]
    chunks = [ChunkReport(i, f"3fa2c1d09b7{i}" + "0" * 52, 20, "disk", f"9b7e3fa2c1d{i}" + "1" * 52, None, None,
                          None, 0.25 * i, None) for i in range(3)]
    return Answer("x", "cachecraft", 0.1, 100, 4, 0.2, chunks, request_id=3, full_prefill_estimate_s=0.0999,
                  sources=sources, retrieval_s=0.01, order=order)


def test_tables_keep_keys_whole_when_piped():
    from cli import product

    with product.console.capture() as captured:  # not a terminal: 80 columns
        product.print_report(_report_answer(), low_relevance=None)
    text = captured.get()
    assert all(f"3fa2c1d09b7{i}" in text and f"9b7e3fa2c1d{i}" in text for i in range(3)), text
    assert "-0.00" not in text and "in prompt" not in text
    # 80 columns hold no 49-character title beside the rest: it goes, and each row takes
    # the lines its file name needs (a 33-character name in what is left), not one per word
    assert "title" not in text and "A rather" not in text
    files = "".join(line.split("│")[3].strip() for line in text.splitlines() if line.startswith("│"))
    assert files == "a-document-with-a-long-name.md" * 3
    assert sum(line.startswith("│") for line in text.splitlines()) == 3 * 2  # 30 characters in 18


def test_a_wide_console_shows_the_titles_on_one_line_each():
    from rich.console import Console

    from cli import product

    wide = Console(width=200, force_terminal=False)
    original, product.console = product.console, wide
    try:
        with wide.capture() as captured:
            product.print_report(_report_answer(), low_relevance=None)
    finally:
        product.console = original
    rows = [line for line in captured.get().splitlines() if line.startswith("│")]
    assert len(rows) == 3 and all("A rather long title of one section of the manual" in row for row in rows)


def test_table_width_counts_cells_padding_and_rules():
    from rich.console import Console
    from rich.table import Table

    from cli.product import table_width

    # widest cells 3 and 2, two spaces of padding each, three rules: 3 + 2 + 4 + 3 = 12
    assert table_width(("a", "bb"), [("xyz", "c")]) == 12
    table = Table()
    table.add_column("a")
    table.add_column("bb")
    table.add_row("xyz", "c")
    console = Console(width=80)
    with console.capture() as captured:
        console.print(table)
    assert max(len(line) for line in captured.get().splitlines()) == 12


def test_the_report_says_how_many_variants_gave_way_at_their_cap_and_where_to_read_which():
    import dataclasses

    from cli import product

    displaced = [{"chunk": "3fa2c1d09b72" + "0" * 52, "variant": "ab" * 32, "hits": 1, "made_exactly": True}]
    kept = dataclasses.replace(_report_answer(), kept_exact=True, exact_wait=2, gave_way=displaced)
    with product.console.capture() as captured:
        product.print_report(kept, low_relevance=None)
    text = " ".join(captured.get().split())
    assert "kept exact" in text
    assert ("1 variant(s) of chunks at their cap gave way to this request's exact ones (`cachecraft explain 3` "
            "names them)") in text
    unrecorded = dataclasses.replace(kept, request_id=None)  # the catalog was away: nothing to explain yet
    with product.console.capture() as captured:
        product.print_report(unrecorded, low_relevance=None)
    text = " ".join(captured.get().split())
    assert "gave way to this request's exact ones" in text and "explain" not in text
    with product.console.capture() as captured:
        product.print_report(_report_answer(), low_relevance=None)
    assert "gave way" not in captured.get()


def test_the_report_pairs_each_source_with_its_chunk_where_the_prompt_held_it():
    from cli import product

    # the prompt held the third source first, then the first, then the second
    with product.console.capture() as captured:
        product.print_report(_report_answer(order=[2, 0, 1]), low_relevance=None)
    text = captured.get()
    lines = [line for line in text.splitlines() if "9b7e3fa2c1d" in line]
    assert "in prompt" in text and "cache key" not in text
    assert all(len(line) <= 80 for line in text.splitlines() if line[:1] in "┏┃┡│└")
    assert all("a-document" in line.split("│")[3] for line in lines), lines  # the file keeps its column
    # source 1 (best) sat second in the prompt, so it shows the second chunk's variant and share
    assert [line.split("9b7e3fa2c1d")[1][0] for line in lines] == ["1", "2", "0"], lines
    assert [line.split("│")[4].strip() for line in lines] == ["2", "3", "1"], lines
    assert ["25%" in lines[0], "50%" in lines[1], " 0%" in lines[2]] == [True, True, True], lines


def test_help_shows_no_bool_metavars():
    for command in ([], ["ingest"], ["warm"], ["query"], ["evict"], ["clear"], ["verify"], ["stats"],
                    ["config", "show"], ["bench", "quality"], ["bench", "scaling"], ["calibrate"]):
        result = runner.invoke(app, command + ["--help"])
        assert result.exit_code == 0 and "<bool>" not in result.output, command


def test_printed_times_never_read_minus_zero():
    from cachecraft.display import seconds
    assert seconds(-0.004) == "0.00 s" and seconds(-0.04, 1) == "0.0 s" and seconds(-0.3, 1) == "-0.3 s"
    assert seconds(None) == "-" and seconds(1.234) == "1.23 s"


def test_real_subprocess_check_model(tiny_dir, tmp_path):
    env = {**os.environ, "CACHECRAFT_CACHE_DIR": str(tmp_path / "c")}
    done = subprocess.run([sys.executable, "-m", "cli.app", "check-model", str(tiny_dir), "--prompts", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "all checks passed" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "cli.app", "bench", "quality", "--dataset", str(tmp_path / "x.json")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1
    assert bad.stderr.strip().count("\n") == 0 and "dataset file not found" in bad.stderr


def test_help_formatting_tweak_leaves_a_typer_without_rich_types_alone(monkeypatch):
    """An older typer has no ``display_type_rich``: the CLI still imports and runs."""
    from typer.core import TyperOption

    from cachecraft.cli import common

    monkeypatch.setattr(TyperOption, "display_type_rich", None)  # as if typer had none
    common._flags_without_types()  # no error, and nothing patched in
    assert TyperOption.display_type_rich is None


@pytest.mark.parametrize("request_id", ["0", "99999999999999999999999"])
def test_explain_refuses_an_id_no_catalog_can_hold(request_id, cache_dir):
    result = runner.invoke(app, ["explain", request_id])
    assert result.exit_code == 2 and "Invalid value for 'request_id'" in result.output
    assert "Traceback" not in result.output


def test_progress_in_a_log_is_a_line_per_description_and_per_tenth_passed_seconds_apart():
    import io

    from rich.console import Console

    from cachecraft.progress import QUIET_S, ProgressLines

    assert QUIET_S == 5.0  # the times below are chosen around it
    out, now = io.StringIO(), [100.0]
    with ProgressLines(Console(file=out, width=200), clock=lambda: now[0]) as bar:
        task = bar.add_task("warming chunks", total=None)
        bar.update(task, completed=1)  # no total yet: no tenth to pass
        now[0] = 102.0
        bar.update(task, completed=3, total=20)  # 3/20 passes the first tenth (2/20), 2 s in: too soon
        now[0] = 105.0
        bar.update(task, completed=3, total=20)  # 5 s after the task began: now said
        bar.update(task, completed=3, total=20)  # nothing new
        now[0] = 225.0
        bar.update(task, completed=5)  # passes the second tenth (4/20)
        bar.update(task, description="warming in context", completed=5)  # a new description, at once
        bar.update(task, completed=5.5)  # still short of the third tenth (6/20)
        now[0] = 227.0
        bar.update(task, completed=7)  # the third tenth, 2 s after the last line: too soon
        now[0] = 230.0
        bar.update(task, completed=7)  # 5 s after it
        now[0] = 231.0
        bar.update(task, advance=13)  # the end, said however soon
        bar.update(task, description="embedding", completed=0, total=97)  # the next step, from 0
        bar.update(task, completed=97)  # its own end, at once
        other = bar.add_task("items", total=4)
        now[0] = 3725.0
        bar.update(other, completed=1)  # 1/4 passes two tenths at once: one line
    assert out.getvalue().splitlines() == ["[0m05s] warming chunks 3/20", "[2m05s] warming chunks 5/20",
                                           "[2m05s] warming in context 5/20", "[2m10s] warming in context 7/20",
                                           "[2m11s] warming in context 20/20", "[2m11s] embedding 0/97",
                                           "[2m11s] embedding 97/97", "[60m25s] items 1/4"]


def test_a_spinner_in_a_log_is_a_line_per_new_text():
    import io

    from rich.console import Console

    from cachecraft.progress import StatusLines

    out, now = io.StringIO(), [10.0]
    lines = StatusLines(Console(file=out, width=200), clock=lambda: now[0])
    lines.update("embedding the corpus ...")
    now[0] = 81.5
    lines.update("embedding the corpus ...")  # the same text: no line
    lines.update("node 1 of 2: warming")
    assert out.getvalue().splitlines() == ["[0m00s] embedding the corpus ...", "[1m11s] node 1 of 2: warming"]


def test_a_table_in_a_log_is_as_wide_as_its_columns_need_and_no_wider_than_the_cap():
    import io

    from rich.console import Console
    from rich.table import Table

    from cachecraft.display import WIDEST_LOG_TABLE, print_table

    def table(columns: int) -> Table:
        made = Table()
        for i in range(columns):
            made.add_column(f"column number {i}")
        made.add_row(*[f"0.{i:03d}" for i in range(columns)])
        return made

    log = io.StringIO()
    print_table(Console(file=log, width=80), table(6))  # a file: no terminal
    lines = log.getvalue().splitlines()
    # six columns of 15 characters, each with a space either side, and seven borders
    assert {len(line) for line in lines} == {6 * 17 + 7} and all(f"0.{i:03d}" in lines[3] for i in range(6))
    log = io.StringIO()
    print_table(Console(file=log, width=80), table(20))  # 20 * 18 + 1 = 361 columns wanted
    assert {len(line) for line in log.getvalue().splitlines()} == {WIDEST_LOG_TABLE}
    screen = io.StringIO()
    print_table(Console(file=screen, width=80, force_terminal=True, color_system=None), table(6))
    assert {len(line) for line in screen.getvalue().splitlines()} == {80}  # a terminal keeps its width


def test_bench_compare_workloads_reads_two_runs_per_trace_and_writes_the_paired_result(tmp_path):
    def run(path, rows_by_label):
        rows = [{"request": n, "order": 0, "agreement_f1": f1, "ttft_s": 1.0, "method": label}
                for label, f1s in rows_by_label.items() for n, f1 in enumerate(f1s)]
        path.write_text(json.dumps({"benchmark": "workload", "requests": rows,
                                    "methods": {label: {} for label in rows_by_label}}))
        return str(path)

    both = run(tmp_path / "both.json", {"cachecraft": [0.5, 1.0], "cachecraft[asks=1]": [1.0, 1.0]})
    out = tmp_path / "compare.json"
    result = runner.invoke(app, ["bench", "compare-workloads", "--base", both, "--other", both + ":cachecraft[asks=1]",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["benchmark"] == "workload_compare" and data["agreement_f1_difference"]["mean"] == 0.25
    assert data["requests_better"] == 1 and "1 requests better, 0 worse" in result.stdout
    one_line_error(runner.invoke(app, ["bench", "compare-workloads", "--base", both, "--other", both + ":lru",
                                       "--out", str(out)]), "has no method 'lru'; it has cachecraft, cachecraft[asks=1]")
    one_line_error(runner.invoke(app, ["bench", "compare-workloads", "--base", both, "--base", both, "--other", both,
                                       "--out", str(out)]), "give one --other per --base (2 --base, 1 --other)")
    one_line_error(runner.invoke(app, ["bench", "compare-workloads", "--base", str(tmp_path / "none.json"),
                                       "--other", both, "--out", str(out)]), "cannot read")


def test_processes_a_command_starts_load_models_without_transformers_bars(monkeypatch):
    from cli.common import quiet_libraries

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    quiet_libraries()  # as every command does first
    child = subprocess.run([sys.executable, "-c", "from transformers.utils import logging; "
                            "print(logging.is_progress_bar_enabled())"],
                           env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == "False", child.stderr


def _commands(group, path=()):
    """Every (path, command) under a command group, the group itself included."""
    yield path, group
    for name, command in (getattr(group, "commands", None) or {}).items():
        yield from _commands(command, path + (name,))


def test_every_example_in_a_commands_help_stays_on_one_line_at_80_columns():
    import typer.main

    root = typer.main.get_command(app)
    narrow = CliRunner(env={"COLUMNS": "80"})
    examples = 0
    for path, command in _commands(root):
        doc = command.help or ""
        # The lines a reader copies: "Example: cachecraft ..." and the lines of an indented example.
        lines = [line.strip().replace("\\[", "[") for line in doc.splitlines()
                 if line.strip().startswith(("Example: cachecraft", "cachecraft ", "--"))]
        if not lines:
            continue
        result = narrow.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, result.output
        shown = [" ".join(line.split()) for line in result.output.splitlines()]
        assert max(len(line) for line in result.output.splitlines()) <= 80
        for line in lines:
            examples += 1
            assert any(" ".join(line.split()) in row for row in shown), (path, line, result.output)
    assert examples >= 10


def test_square_brackets_in_help_texts_are_shown_not_taken_for_markup():
    """Help is rich markup: an unescaped [asks=1] in a label vanished from `--help`."""
    import re

    import typer.main

    wide = CliRunner(env={"COLUMNS": "250"})
    brackets = 0
    for path, command in _commands(typer.main.get_command(app)):
        texts = [command.help or ""] + [getattr(param, "help", None) or "" for param in command.params]
        found = [match.group(0).replace("\\[", "[") for text in texts
                 for match in re.finditer(r"\\?\[[^\]]*\]", text)]
        if not found:
            continue
        output = wide.invoke(app, [*path, "--help"]).output
        shown = " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())
        for text in found:
            brackets += 1
            assert text in shown, (path, text)
    assert brackets >= 5


def test_reflow_joins_prose_paragraphs_and_keeps_examples_and_indented_blocks_as_written():
    from cli.common import reflow

    doc = "First\nline.\n\nSecond paragraph\nwraps  here.\n\nExample: a\nExample: b\n\n    code\n        more"
    assert reflow(doc) == ("First line.\n\nSecond paragraph wraps here.\n\nExample: a\nExample: b\n\n"
                           "    code\n        more")


def test_bench_quality_asks_a_follow_up_and_refuses_it_beside_in_context_runs(tiny_dir, dataset, tmp_path, cache_dir):
    out = tmp_path / "chat.json"
    result = runner.invoke(app, ["bench", "quality", "--dataset", str(dataset), "--limit", "1", "--methods", "reuse",
                                 "--follow-up", "Which passage says so?", "--out", str(out),
                                 "--model", str(tiny_dir), "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["follow_up"] == "Which passage says so?"
    assert "the intervals are rough over 1 item(s): use 10 or more" in " ".join(result.output.split())
    assert [r["method"] for r in data["items"]] == ["full", "reuse", "full+chat", "reuse+chat"]
    both = runner.invoke(app, ["bench", "quality", "--dataset", str(dataset), "--methods", "reuse",
                               "--follow-up", "Why?", "--in-context", "reuse", "--out", str(tmp_path / "x.json"),
                               "--model", str(tiny_dir)])
    one_line_error(both, "--follow-up is asked with the plain methods only")
