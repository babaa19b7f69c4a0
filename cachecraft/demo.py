"""The demo behind ``make demo``: ingest the sample manual, warm its chunk-caches, then
answer sample questions with ``cachecraft`` and ``full`` side by side.

The demo keeps its corpus and caches in ``<cache_dir>/demo`` so it never mixes the
sample manual into a user's own corpus; the model is the configured one.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.display import print_table, saved
from cachecraft.metrics import first_line
from cachecraft.model.loader import LoadedModel
from cachecraft.progress import bar as progress_bar, spinner

DEMO_METHODS = ("cachecraft", "full")
SAMPLE_CORPUS = Path("data/kestrel")
SAMPLE_QUESTIONS = Path("data/kestrel_questions.json")
# the project's folder, where the sample data lies beside the package (a checkout, or an
# editable install of one)
PROJECT_DIR = Path(__file__).resolve().parents[1]


def sample_paths(corpus: Path, questions: Path) -> tuple[Path, Path]:
    """The demo's corpus folder and questions file: as given, else (for the defaults) the
    project's own sample data, so the demo runs from any folder; a ``FileNotFoundError``
    naming what is missing, before anything loads."""
    def found(path: Path, default: Path, what: str, is_there) -> Path:
        if is_there(path):
            return path
        if path == default and is_there(PROJECT_DIR / default):
            return PROJECT_DIR / default
        hint = " (run the demo from the project's folder, or give --corpus and --questions)" if path == default else ""
        raise FileNotFoundError(f"the demo's {what} {path} is not there{hint}")

    return (found(corpus, SAMPLE_CORPUS, "corpus folder", Path.is_dir),
            found(questions, SAMPLE_QUESTIONS, "questions file", Path.is_file))


def demo_config(config: Config) -> Config:
    """The demo's own cache directory under the configured one."""
    return config.replace(cache_dir=config.cache_dir / "demo")


def run_demo(lm: LoadedModel, config: Config, corpus: Path, questions: Path, limit: int,
             console: Console) -> list[dict]:
    """Ingest ``corpus``, warm it, answer ``limit`` questions of ``questions`` with each of
    :data:`DEMO_METHODS`; prints tables and returns one row per question."""
    from cachecraft.pipeline import Pipeline

    items = load_items(questions, limit)
    with Pipeline(demo_config(config), lm=lm) as pipe:
        _prepare(pipe, corpus, console)
        rows = [_ask(pipe, item.question, item.answers, console) for item in items]
        last = rows[-1]["answers"]["cachecraft"]
    _print_summary(rows, console)
    _print_report(last, console)
    return rows


def _prepare(pipe, corpus: Path, console: Console) -> None:
    with progress_bar(console, time_left=False) as bar:
        task = bar.add_task(f"ingesting {corpus}", total=None)
        report = pipe.ingest([corpus], progress=lambda stage, done, total: bar.update(
            task, description=f"ingesting {corpus}: {stage}", completed=done, total=total)).report
    console.print(f"corpus: {report.chunks} chunks from {report.corpus_files} files "
                  f"({report.added} added, {report.unchanged} unchanged)")
    with progress_bar(console, time_left=False) as bar:
        task = bar.add_task("warming chunk-caches", total=None)
        warm = pipe.warm_corpus(progress=lambda done, total: bar.update(task, completed=done, total=total))
    console.print(f"chunk-caches: {warm.made} made, {warm.skipped} already cached\n")


def _ask(pipe, question: str, gold: tuple[str, ...], console: Console) -> dict:
    with spinner(console, f"answering: {question}"):
        answers = {method: pipe.query(question, method=method) for method in DEMO_METHODS}
    cc, full = answers["cachecraft"], answers["full"]
    table = Table(title=f"{question}  ({cc.prompt_tokens} prompt tokens, {len(cc.chunks)} chunks; "
                        f"expected: {gold[0] if gold else '-'})", title_justify="left")
    for column in ("method", "TTFT (s)", "recompute", "cache hits", "answer"):
        table.add_column(column, justify="left" if column in ("method", "answer") else "right",
                         overflow="fold")
    for method, answer in answers.items():
        hits = sum(c.tier != "miss" for c in answer.chunks) if method != "full" else 0
        table.add_row(method, f"{answer.ttft_s:.2f}", f"{answer.recompute_fraction:.0%}",
                      f"{hits}/{len(answer.chunks)}", first_line(answer.text))
    print_table(console, table)
    if cc.kept_exact:
        console.print("These chunks had been asked in this order twice before (an earlier run): cachecraft "
                      "computed them in full once and kept them exact, so from the next ask on they are reused "
                      "with nothing recomputed and answer as full prefill does (exact_after_asks).")
    console.print(f"cachecraft reached the first token [bold]{full.ttft_s / cc.ttft_s:.1f}x[/bold] "
                  "sooner than full prefill.\n")
    return {"question": question, "answers": answers, "speedup": full.ttft_s / cc.ttft_s}


def _print_summary(rows: list[dict], console: Console) -> None:
    speedups = [r["speedup"] for r in rows]
    same = sum(first_line(r["answers"]["cachecraft"].text) == first_line(r["answers"]["full"].text) for r in rows)
    console.print(f"[bold]{len(rows)} questions:[/bold] median speedup {statistics.median(speedups):.1f}x "
                  f"(min {min(speedups):.1f}x, max {max(speedups):.1f}x); cachecraft's answer equals full's "
                  f"on {same} of {len(rows)}.")
    kept = sum(r["answers"]["cachecraft"].kept_exact for r in rows)
    if kept:
        console.print(f"{kept} of {len(rows)} chunk orders had been asked twice before and were computed in full "
                      "once to keep them exact: run the demo again to see them reused with nothing recomputed.")


def _print_report(answer, console: Console) -> None:
    table = Table(title="cache report of the last cachecraft answer", title_justify="left")
    for column in ("source", "score", "tier", "variant", "CFO", "recompute"):
        table.add_column(column, justify="left" if column in ("source", "tier", "variant") else "right")
    for source, chunk in answer.chunk_of_source():
        table.add_row(source.title, f"{source.score:.3f}", chunk.tier, (chunk.variant or "-")[:12],
                      "-" if chunk.cfo is None else f"{chunk.cfo:.3f}", f"{chunk.fraction:.0%}")
    print_table(console, table)
    console.print(f"prefill time on this request: {saved(answer.saved_s)} (against the measured full-prefill rate). "
                  "Try `cachecraft query \"...\"` and `cachecraft stats` next.", highlight=False)

