"""What `ingest`, `warm` and `query` need besides argument parsing: opening the
pipeline, progress bars, parallel warm workers and the query report."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
from dataclasses import dataclass
from typing import Sequence

from rich.table import Table

from cachecraft.config import Config

from .common import UserError, console, err_console, load_model_quietly, progress_bar

def open_pipeline(config: Config, tiers: Sequence[str] | None = None):
    """Model (behind a spinner) + store + catalog, as a :class:`Pipeline` to close after use."""
    from cachecraft.pipeline import Pipeline
    from cachecraft.store import TieredStore

    lm = load_model_quietly(config)
    return Pipeline(config, lm=lm, store=TieredStore(config, tiers=tiers))


# -- warm ------------------------------------------------------------------------------------

@dataclass
class WarmTotals:
    """made / skipped / total over every worker; ``kept``: of those made, how many are
    still stored when the warm ends (the disk budget may have evicted some)."""

    made: int = 0
    skipped: int = 0
    total: int = 0
    in_context: int = 0  # variants made after a neighbouring chunk (warm_neighbours)
    kept: int | None = None


def warm_mark(config: Config) -> int:
    """The catalog's newest tier event before a warm (see :func:`count_kept`)."""
    from cachecraft.catalog import Catalog

    with Catalog(config.cache_dir) as catalog, catalog.read() as tx:
        return tx.last_event_id()


def count_kept(config: Config, mark: int, made: int) -> int:
    """Of ``made`` chunk-caches put since ``mark``, how many are still stored: each put of
    a corpus chunk's variant since then that no tier holds now was evicted (by the
    budget) after it was made."""
    from cachecraft.catalog import Catalog
    from cachecraft.retrieval.corpus import Corpus

    sources = set(Corpus(config.corpus_dir, config.embedder).snapshot().files)
    with Catalog(config.cache_dir) as catalog, catalog.read() as tx:
        put = {e.variant_key for e in tx.events(kind="put", since_id=mark)}
        stored = {r.variant_key for r in tx.entries()}
        lost = 0
        for key in put - stored:
            variant = tx.variant(key)
            chunk = tx.chunk(variant.chunk_key) if variant is not None else None
            lost += chunk is not None and chunk.source in sources
    return max(made - lost, 0)


def warm_in_process(config: Config) -> WarmTotals:
    """Warm every chunk in this process, with a progress bar."""
    with open_pipeline(config, tiers=("disk",)) as pipe, progress_bar() as bar:
        task = bar.add_task("warming chunks", total=None)
        report = pipe.warm_corpus(progress=lambda done, total: bar.update(task, completed=done, total=total))
    return WarmTotals(report.made, report.skipped, report.total, report.in_context)


def warm_in_workers(config: Config, workers: int) -> WarmTotals:
    """Warm with ``workers`` processes, each a shard of the corpus and cores // workers torch threads."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    # with neighbours, every worker makes its own caches before any makes variants
    ready = context.Barrier(workers)
    procs = [context.Process(target=_warm_worker, args=(config, (i, workers), threads, messages, ready), daemon=True)
             for i in range(workers)]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, messages)
    finally:
        for proc in procs:  # only on an error or an interrupt are any still running
            if proc.is_alive():
                proc.terminate()
            proc.join()


def _collect(procs: list, messages) -> WarmTotals:
    totals, seen, finished = WarmTotals(), {}, set()
    with progress_bar() as bar:
        task = bar.add_task(f"warming chunks ({len(procs)} workers)", total=None)
        while len(finished) < len(procs):
            try:
                kind, shard, *rest = messages.get(timeout=0.5)
            except queue_module.Empty:
                _check_alive(procs, finished)
                continue
            if kind == "error":
                raise UserError(f"warm worker {shard}: {rest[0]}")
            if kind == "progress":
                seen[shard] = rest
            else:
                finished.add(shard)
                totals.made, totals.skipped = totals.made + rest[0], totals.skipped + rest[1]
                totals.total += rest[2]
                totals.in_context += rest[3]
            known = len(seen) == len(procs)
            bar.update(task, completed=sum(d for d, _ in seen.values()),
                       total=sum(t for _, t in seen.values()) if known else None)
    return totals


def _check_alive(procs: list, finished: set) -> None:
    for shard, proc in enumerate(procs):
        if shard not in finished and proc.exitcode is not None:
            raise UserError(f"warm worker {shard} stopped (exit code {proc.exitcode}) before it finished; "
                            "run `cachecraft warm` again to resume")


def _warm_worker(config: Config, shard: tuple[int, int], threads: int, messages, ready) -> None:
    """One warm process: its shard of the corpus, reported through ``messages``; it waits
    at the barrier ``ready`` between its own caches and its in-context variants."""
    import torch

    from .common import _user_errors, quiet_libraries

    quiet_libraries()
    torch.set_num_threads(threads)
    index = shard[0]
    try:
        from cachecraft.model.loader import load_model
        from cachecraft.pipeline import Pipeline
        from cachecraft.store import TieredStore

        with Pipeline(config, lm=load_model(None, config), store=TieredStore(config, tiers=("disk",))) as pipe:
            report = pipe.warm_corpus(progress=lambda done, total: messages.put(("progress", index, done, total)),
                                      shard=shard, between=ready.wait)
        messages.put(("done", index, report.made, report.skipped, report.total, report.in_context))
    except _user_errors() as exc:
        messages.put(("error", index, str(exc)))
    except Exception as exc:  # the parent shows one line; the worker's traceback goes to its stderr
        messages.put(("error", index, f"{type(exc).__name__}: {exc}"))
        raise


# -- query -----------------------------------------------------------------------------------

LARGEST_CONTEXT = 32768  # the largest context window of a bundled model (qwen2.5-coder-0.5b)
# Tokenizers of these models average about 4 characters per token on English text, so a
# question longer than 4 characters per token of the window cannot fit in it beside the
# system prompt and the retrieved chunks; the exact count is made once the model loads.
CHARS_PER_TOKEN = 4


def context_hint(model: str) -> int:
    """The context window of ``model`` as far as it is known without loading it: a bundled
    model's, a local model directory's ``config.json``, else :data:`LARGEST_CONTEXT`."""
    import json
    from pathlib import Path

    from cachecraft.model.bundled import BUNDLED

    if model in BUNDLED and BUNDLED[model].context_tokens:
        return BUNDLED[model].context_tokens
    try:
        settings = json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8"))
        return int(settings.get("max_position_embeddings") or LARGEST_CONTEXT)
    except (OSError, ValueError, TypeError, AttributeError):
        return LARGEST_CONTEXT


def check_question_length(config: Config, question: str) -> None:
    """Refuse, before the model loads, a question that cannot fit in the model's context."""
    window = context_hint(config.model)
    if len(question) > CHARS_PER_TOKEN * window:
        raise UserError(f"the question is too long: {len(question):,} characters, more than the {window:,}-token "
                        f"context of {config.model} holds (about {CHARS_PER_TOKEN} characters per token); "
                        "shorten it")


def cap_new_tokens(pipe, question: str, top_k: int, requested: int) -> int:
    """``requested`` answer tokens, or fewer where the prompt leaves less room in the
    model's context (then a one-line notice on stderr)."""
    hits = pipe.corpus.search(question, top_k)
    pieces = pipe.builder.build([h.chunk.prompt_text for h in hits], question, max_tokens=pipe.lm.max_context)
    room = pipe.lm.max_context - pieces.num_tokens
    if requested <= room:
        return requested
    if room < 1:
        raise UserError(f"the prompt takes {pieces.num_tokens} tokens, the whole {pipe.lm.max_context}-token "
                        "context of the model: no room left for an answer; ask a shorter question or use a "
                        "smaller --top-k")
    err_console.print(f"max_new_tokens {requested} capped at {room}: the model's context window is "
                      f"{pipe.lm.max_context} tokens and the prompt takes {pieces.num_tokens}", highlight=False)
    return room

def streamer_for(tokenizer):
    """Prints answer tokens to stdout as generate makes them; when the pipeline answers
    again (an answer that looped), a note on stderr and the new answer on a line of its own."""
    from transformers import TextStreamer

    class Restartable(TextStreamer):
        def restart(self, note: str) -> None:
            err_console.print(f"[yellow]{note}[/yellow]", highlight=False, soft_wrap=True)

    return Restartable(tokenizer, skip_prompt=True, skip_special_tokens=True)


# Cosine similarity of the bundled all-MiniLM-L6-v2 below which the best source is taken
# as unrelated to the question. On the sample manual (data/kestrel), its 20 first sample
# questions scored 0.46-0.82 against their best paragraph, while emoji-only questions
# scored about 0.16 and off-topic ones (the weather, a joke, France's capital) 0.11-0.33.
LOW_RELEVANCE = 0.35


def print_report(answer, low_relevance: float | None = LOW_RELEVANCE, *, command_s: float | None = None,
                 startup_s: dict[str, float] | None = None, server: str | None = None) -> None:
    """Sources with scores and what the cache did for each chunk, then the timings (with the
    whole command's time and its start-up work when given); a warning when the best source
    scores below ``low_relevance`` (None: no check)."""
    from cachecraft.display import saved, seconds, startup

    table = Table(title=f"{answer.method}: {len(answer.sources)} source(s)")
    # sources come in retrieval's order (best first, or by file with retrieval_order "document");
    # with chunk_order "cache" the prompt held them in another order, shown where the chunk's
    # key would be (the variant names the cache; 80 columns hold no more)
    moved = bool(answer.order)
    columns = ("#", "score", "title", "file", "in prompt" if moved else "cache key", "tier", "variant", "recompute")
    rows = [(str(i + 1), f"{source.score:.3f}", source.title, os.path.basename(source.source),
             str(chunk.position + 1) if moved else chunk.chunk[:12], chunk.tier, (chunk.variant or "-")[:12],
             f"{chunk.fraction:.0%}") for i, (source, chunk) in enumerate(answer.chunk_of_source())]
    if table_width(columns, rows) > console.width:
        # a title folded into a narrow column takes a line per word and hides the rest of
        # the row; the file names the source as well, so the title goes first
        columns, rows = columns[:2] + columns[3:], [row[:2] + row[3:] for row in rows]
    for column in columns:
        table.add_column(column, justify="right" if column in ("#", "score", "in prompt", "recompute") else "left",
                         overflow="fold", no_wrap=column not in ("title", "file"))
    for row in rows:
        table.add_row(*row)
    console.print(table)  # folds to the console (80 columns piped), keys kept whole
    console.print(f"TTFT {seconds(answer.ttft_s)} (retrieval {seconds(answer.retrieval_s)} apart); "
                  f"{answer.prompt_tokens} prompt tokens, {answer.new_tokens} new; recomputed "
                  f"{answer.recompute_fraction:.0%} of the context; prefill time {saved(answer.saved_s)} "
                  f"(against this machine's measured full-prefill rate); request {answer.request_id}",
                  highlight=False)
    if answer.escalated:
        console.print(f"the first answer (first token after {seconds(answer.first_try_ttft_s)}) repeated itself and "
                      "was answered again from a full prefill; TTFT above is the kept answer's", highlight=False)
    if answer.kept_exact:
        console.print("these chunks had been asked in this order before: they were computed in full and kept "
                      "exact, so the next ask in this order reuses them exactly (exact_after_asks)", highlight=False)
    if answer.gave_way:
        which = "" if answer.request_id is None else f" (`cachecraft explain {answer.request_id}` names them)"
        console.print(f"{len(answer.gave_way)} variant(s) of chunks at their cap gave way to this request's exact "
                      f"ones{which}", highlight=False)
    if command_s is not None and server is not None:
        console.print(f"whole command {seconds(command_s)}; answered by the server at {server}", highlight=False)
    elif command_s is not None:
        console.print(f"whole command {seconds(command_s)}; start-up {seconds(sum((startup_s or {}).values()))} "
                      f"of it ({startup(startup_s or {})})", highlight=False)
    warn_low_relevance(answer, low_relevance)


def table_width(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> int:
    """The width a rich table with these headers and cells takes unfolded: each column as
    wide as its widest cell, one space of padding on each side and a rule between and
    around the columns."""
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows)]
    return sum(widths) + 3 * len(widths) + 1


def warn_low_relevance(answer, threshold: float | None = LOW_RELEVANCE) -> bool:
    """One line on stderr when no source scores ``threshold`` or more: the corpus likely
    does not answer the question. Whether it warned."""
    best = max((s.score for s in answer.sources), default=None)
    if threshold is None or best is None or best >= threshold:
        return False
    err_console.print(f"[yellow]low relevance:[/yellow] the best source scores {best:.2f} (below {threshold:.2f}); "
                      "the documents may not answer this question", highlight=False, soft_wrap=True)
    return True
