"""The ``cachecraft`` command.

Every command reads the effective configuration (defaults < TOML file from
``--config``/``CACHECRAFT_CONFIG`` < ``CACHECRAFT_*`` variables < flags). A user error
prints one line and exits with code 1.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from cachecraft.config import named_drift_estimator
from cachecraft.display import print_table, saved as saved_text, seconds

from . import STARTED

from .bench import bench_app
from .serve import register as register_serve
from .common import (CONTEXT, FEW_ITEMS, METHODS_HELP, UserError, console, err_console, friendly, invocation,
                     load_config, load_model_quietly, nonempty_path, progress_bar, quiet_libraries,
                     shared_tier_failures_reported_here, summarize_commands, working)

app = typer.Typer(help="cachecraft: reuse per-chunk KV caches for RAG, recompute only what matters.",
                  context_settings=CONTEXT, no_args_is_help=True, add_completion=False)
config_app = typer.Typer(help="Inspect the effective configuration.", context_settings=CONTEXT,
                         no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(config_app, name="config")


@app.callback()
def main_options(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", parser=nonempty_path,
                                          help="TOML config file (else $CACHECRAFT_CONFIG)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir",
                                             parser=nonempty_path,
                                             help="Cache directory (else $CACHECRAFT_CACHE_DIR or the user cache "
                                                  "dir)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details."),
) -> None:
    """Chunk-cache manager for RAG. Try `cachecraft demo`, or your own documents:
    `cachecraft ingest docs/`, `cachecraft warm`, `cachecraft query "QUESTION"`."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    quiet_libraries()
    ctx.obj = {"config_path": config, "overrides": {"cache_dir": cache_dir}}


@app.command("check-model")
@friendly
def check_model_cmd(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="A bundled name (smollm2, qwen2.5-coder-0.5b), a local HF model "
                                          "directory, a .gguf file or a hub id."),
    prompts: int = typer.Option(3, min=1, help="How many generated prompts to check."),
    tolerance: Optional[float] = typer.Option(None, min=0.0, help="Max |logit difference| allowed (default by "
                                                                  "dtype; 1e-4 in float32)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Check that blending is exact on MODEL: fractions at 1.0 and exact-prefix reuse must
    reproduce a full prefill, and greedy generation from a blended cache must match
    plain `generate`. Exit code 0 only if every check holds."""
    from cachecraft.checks import check_model
    config = load_config(ctx, model=model)
    lm = load_model_quietly(config, model)
    with working("checking ..."):
        report = check_model(lm, prompts=prompts, tolerance=tolerance)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        table = Table(title=f"check-model {model} ({report.dtype}, tolerance {report.tolerance:g})")
        table.add_column("check")
        table.add_column("max |logit diff|", justify="right")
        table.add_column("result")
        for r in report.results:
            value = "-" if r.name == "generate" else f"{r.max_abs_diff:.2e}"
            table.add_row(r.name, value, "[green]ok[/green]" if r.passed else "[red]FAIL[/red]")
        print_table(console, table)
        console.print("[green]all checks passed[/green]" if report.passed else "[red]some checks failed[/red]")
    raise typer.Exit(0 if report.passed else 1)


@app.command("calibrate")
@friendly
def calibrate_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file (list of {ctxs, question, answers})."),
    limit: int = typer.Option(20, help="Use N items (after --skip)."),
    skip: int = typer.Option(0, min=0, help="Leave out the first N items: fit on items kept apart from the ones "
                                            "you report results on."),
    budget: Optional[float] = typer.Option(None, help="Recompute budget (share of chunk tokens, within (0, 1]): "
                                                      "the candidate with the lowest answer KL within it (the "
                                                      "config's own settings stay unless measurably beaten). "
                                                      "Default 0.05 unless --target-kl is given."),
    target_kl: Optional[float] = typer.Option(None, "--target-kl", help="Answer-KL target: the candidate with the "
                                                                        "least recompute that reaches it."),
    alphas: str = typer.Option("0.05,0.1,0.15,0.2,0.3,0.5", help="Comma-separated candidate alphas within [0, 1]."),
    check_layers: Optional[str] = typer.Option(None, "--check-layers",
                                               help="Comma-separated candidate check layers: whole numbers are "
                                                    "layers, fractions below 1 depths (e.g. 0.2,0.27,0.4); "
                                                    "default: the config's policy_check_layer only."),
    floors: Optional[str] = typer.Option(None, help="Comma-separated candidate floors: the least share of each "
                                                    "reused chunk recomputed (e.g. 0,0.03,0.05); default: the "
                                                    "config's policy_floor only."),
    sink_tokens: Optional[str] = typer.Option(None, "--sink-tokens",
                                              help="Comma-separated candidate counts of each chunk's first "
                                                   "tokens recomputed first (e.g. 0,4,16); default: the config's "
                                                   "policy_sink_tokens only."),
    drift_shifts: Optional[str] = typer.Option(None, "--drift-shifts",
                                               help="Comma-separated candidate drift shifts within [0, 2]: 0 "
                                                    "gives the rest of a chunk's count to the question's "
                                                    "choice, above 0 spreads it over the chunk and moves the "
                                                    "other tokens by that share of the drift measured on "
                                                    "them (e.g. 0,1); default: the config's "
                                                    "policy_drift_shift only."),
    drift_estimators: Optional[str] = typer.Option(None, "--drift-estimators",
                                                   help="Comma-separated, how a drift shift turns the "
                                                        "changes it measures into a chunk's move: mean, median "
                                                        "(resists a few tokens that drifted far), shrunk (the "
                                                        "mean shrunk toward no move where they disagree), "
                                                        "pooled (each chunk's mean shrunk toward the prompt's); "
                                                        "default: the config's policy_drift_estimator only."),
    relevances: Optional[str] = typer.Option(None, "--relevances",
                                             help="Comma-separated candidate relevances within [0, 1]: with a "
                                                  "drift shift, the share of the spread tokens given out again "
                                                  "in proportion to the question's attention to each chunk "
                                                  "(e.g. 0,0.5,1); default: the config's policy_relevance only."),
    max_new_tokens: int = typer.Option(32, min=1, help="Answer length the divergence is measured along."),
    warm_context: Optional[str] = typer.Option(None, help="What the chunk-caches are made after, following the "
                                                        "system prompt: builtin, none or a text file (default: "
                                                        "config warm_context, as `warm` makes them)."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    out: Optional[Path] = typer.Option(None, parser=nonempty_path,
                                       help="Also write the result (every candidate, the chosen one, each "
                                            "answer's figures item by item for paired comparisons, the "
                                            "command, date, machine and code) to this JSON file, as the "
                                            "benchmarks do."),
) -> None:
    """Fit the policy to a model: run `full` and `cachecraft` with every candidate alpha
    (and check layer, floor, sink tokens, drift shift and estimator, relevance) on a
    MuSiQue-format file, measure the answer-level divergence from full prefill along full's
    answer, and keep the candidate with the lowest divergence within the recompute budget
    (or the least recompute that reaches --target-kl). Under a budget the config's own
    settings, where among the candidates, stay unless another candidate is measurably
    better item by item (a paired 95% interval below 0). The result is stored in the catalog
    against the model's fingerprint: `query` and the LlamaIndex engine use it wherever the
    config leaves policy_alpha, policy_check_layer, policy_floor, policy_sink_tokens,
    policy_drift_shift, policy_drift_estimator and policy_relevance at their defaults;
    `config show` and `explain` say so. The chunk-caches are made the way `warm` makes them.

    Example:

        cachecraft calibrate --dataset musique_dev.json --skip 30 --limit 20
            --budget 0.05 --floors 0,0.03 --sink-tokens 0,8
    """

    from cachecraft.bench.common import write_result
    from cachecraft.calibration import calibrate, store_fitted
    from cachecraft.catalog import Catalog
    from cachecraft.dataset import load_items
    from cachecraft.intervals import NO_DIFFERENCE, verdict
    from cachecraft.policy.calibrate import (CalibrationError, Goal, parse_alphas, parse_check_layers, parse_floors,
                                             parse_drift_estimators, parse_drift_shifts, parse_relevances,
                                             parse_sink_tokens)

    try:
        candidates = parse_alphas(alphas)
        layers = parse_check_layers(check_layers) if check_layers is not None else None
        floor_list = parse_floors(floors) if floors is not None else None
        sink_list = parse_sink_tokens(sink_tokens) if sink_tokens is not None else None
        shift_list = parse_drift_shifts(drift_shifts) if drift_shifts is not None else None
        estimator_list = parse_drift_estimators(drift_estimators) if drift_estimators is not None else None
        relevance_list = parse_relevances(relevances) if relevances is not None else None
        goal = Goal(budget=0.05 if budget is None and target_kl is None else budget, target_kl=target_kl)
    except CalibrationError as exc:
        raise UserError(str(exc)) from None
    if limit < 1:
        raise UserError(f"limit must be >= 1, got {limit}")
    config = load_config(ctx, model=model, **({} if warm_context is None else {"warm_context": warm_context}))
    items = load_items(dataset, skip + limit)[skip:]
    if not items:
        raise UserError(f"{dataset} has no items after the first {skip}")
    lm = load_model_quietly(config)
    with progress_bar() as progress:
        task = progress.add_task("items", total=len(items))
        result = calibrate(lm, config, items, candidates, goal, layers, floor_list, sink_list, shift_list,
                           estimator_list, relevances=relevance_list, max_new_tokens=max_new_tokens,
                           on_item=lambda done, total: progress.update(task, completed=done))
    with Catalog(config.cache_dir, url=config.catalog_url or None) as catalog:
        stored = store_fitted(catalog, lm.fingerprint, result, model=config.model, dataset=str(dataset),
                              skip=skip, items=len(items), warm_context=config.warm_context)
    document = {**result.to_dict(), "stored": stored, "fingerprint": lm.fingerprint}
    if out is not None:
        write_result(out, {"benchmark": "calibrate", "command": invocation(ctx, "calibrate"), "model": config.model,
                           "dataset": str(dataset), "skip": skip, "limit": len(items), **document})
        (err_console if as_json else console).print(f"wrote {out}", highlight=False)  # stdout stays one JSON
    if as_json:
        print(json.dumps(document, indent=2))
        return
    table = Table(title=f"calibrate {config.model} on {len(items)} item(s) from #{skip} ({result.goal.describe()}; "
                        f"full TTFT median {seconds(result.full_ttft_s)})")
    against = result.versus_chosen()
    for column in ("alpha", "check layer", "floor", "sink tokens", "drift shift", "relevance", "recompute", "answer KL",
                   "vs chosen (paired 95%)", "token agreement", "agreement F1", "first-token KL", "TTFT median (s)"):
        table.add_column(column, justify="right", no_wrap=column.startswith("vs chosen"))
    for r in result.rows:
        mark = " *" if r is result.chosen else ""
        d = against.get(r.label)
        table.add_row(f"{r.alpha:g}{mark}", f"{r.check_layer:g}", f"{r.floor:g}", str(r.sink_tokens),
                      f"{r.drift_shift:g}" + ("" if r.drift_estimator == "mean" else f" {r.drift_estimator}"),
                      f"{r.relevance:g}", f"{r.recompute:.3f}", f"{r.answer_kl:.4f}",
                      "" if d is None else f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]",
                      f"{r.token_agreement:.3f}", f"{r.agreement:.3f}", f"{r.kl:.4f}", f"{r.ttft_s:.2f}")
    print_table(console, table)
    if against and len(items) < FEW_ITEMS:  # a bootstrap over 2 items is [the smaller, the larger difference]
        console.print(f"the intervals are rough over {len(items)} item(s): use {FEW_ITEMS} or more to rely on them",
                      highlight=False)
    untold = [label for label, d in against.items() if verdict(d, lower_is_better=True) == NO_DIFFERENCE]
    if untold:  # the choice is by the mean; say where the items could not tell candidates apart
        console.print(f"{len(untold)} of the {len(against)} other candidate(s) are not measurably worse than the "
                      f"chosen one on answer KL over these {len(items)} item(s) (their paired interval holds 0): "
                      "more items would tell them apart", highlight=False)
    chosen = result.chosen
    goal_budget = result.goal.budget
    overlooked = goal_budget is not None and any(r.answer_kl < chosen.answer_kl and r.recompute <= goal_budget
                                                 for r in result.rows)
    if overlooked and result.kept_incumbent():
        console.print("kept the config's own settings: no candidate within the budget with a lower mean answer KL "
                      f"was measurably better item by item over these {len(items)} item(s)", highlight=False)
    picked = (f"chosen: policy_alpha {chosen.alpha:g}, policy_check_layer {chosen.check_layer:g}, policy_floor "
              f"{chosen.floor:g}, policy_sink_tokens {chosen.sink_tokens}, policy_drift_shift {chosen.drift_shift:g}"
              f"{'' if chosen.drift_estimator == 'mean' else f' ({chosen.drift_estimator})'}, policy_relevance "
              f"{chosen.relevance:g} (recompute {chosen.recompute:.3f}, answer KL {chosen.answer_kl:.4f})")
    missed = "" if result.reached else f"[yellow]no candidate met the {result.goal.describe()}[/yellow]; "
    console.print(missed + picked, highlight=False)
    console.print(f"stored for {config.model} (fingerprint {lm.fingerprint}) in the catalog at {catalog.where}; "
                  "used where the config leaves these settings at their defaults", highlight=False)


@app.command("demo")
@friendly
def demo_cmd(
    ctx: typer.Context,
    corpus: Path = typer.Option(Path("data/kestrel"), parser=nonempty_path,
                                help="Folder of .md/.txt documents to ingest (default: the project's sample "
                                     "manual)."),
    questions: Path = typer.Option(Path("data/kestrel_questions.json"), parser=nonempty_path,
                                   help="MuSiQue-format file; its questions (and gold answers) are asked."),
    limit: int = typer.Option(4, min=1, help="How many questions to answer."),
) -> None:
    """Ingest the sample manual, warm its chunk-caches, then answer a few questions with
    `cachecraft` and `full` side by side: time to first token, recompute, cache hits,
    answers, and the cache report of the last answer. Uses <cache_dir>/demo, so your own
    corpus is left alone.

    Example: cachecraft demo --limit 2
    """
    from cachecraft.demo import run_demo, sample_paths
    config = load_config(ctx)
    corpus, questions = sample_paths(corpus, questions)
    lm = load_model_quietly(config)
    run_demo(lm, config, corpus, questions, limit, console)


@app.command("ingest")
@friendly
def ingest_cmd(
    ctx: typer.Context,
    paths: list[Path] = typer.Argument(..., parser=nonempty_path,
                                       help="Files (.txt, .md, .markdown, .html, .htm, .pdf, .docx) or "
                                            "directories (read recursively, hidden files skipped)."),
    model: Optional[str] = typer.Option(None, help="Generator whose tokenizer measures chunks (default: config model)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Add documents to the corpus in the cache directory: split each into chunks of at
    most chunk_tokens generator tokens (at paragraphs, else sentences, else words), embed
    them (embedder, default the bundled MiniLM) and index them for `cachecraft query`.
    Identical chunks are stored once; ingesting a changed file again replaces its chunks,
    and a directory ingested again also drops the files gone from it. Large files are
    read and chunked piece by piece. A path that does not exist stops the command before
    anything is read (a typo is not half an ingest). A file that cannot be read (type,
    encoding, damage, permissions) is skipped and listed with its reason, and the others
    are ingested. The exit code is 1 when a skipped file is a problem: one named on the
    command line, or one of a type that is read but could not be; files of other types
    met in a directory are listed but do not fail the command, so `ingest docs/ && warm`
    warms what was read.

    Example: cachecraft ingest docs/ notes.md   (then: cachecraft warm)
    """
    from .product import open_pipeline
    config = load_config(ctx, model=model)
    missing = [str(p) for p in paths if not os.path.lexists(p)]
    if missing:  # told before the model loads and the cache directory is made
        raise UserError(f"no such file or directory: {', '.join(missing)}")
    with open_pipeline(config) as pipe, progress_bar() as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task("reading and chunking (bytes)" if stage == "reading" else
                                            "embedding (chunks)", total=None)
            bar.update(tasks[stage], completed=done, total=total)

        outcome = pipe.ingest(paths, progress=progress)
    report = outcome.report
    if as_json:
        print(json.dumps(outcome.to_dict(), indent=2))
    else:
        console.print(f"chunks added {report.added}, unchanged {report.unchanged}, removed {report.removed} "
                      f"({report.files} file(s) read); corpus: {report.chunks} chunks from {report.corpus_files} "
                      "file(s)", highlight=False)
        if outcome.skipped:
            ignored = len(outcome.skipped) - len(outcome.failed)
            console.print(f"[yellow]{len(outcome.skipped)} file(s) skipped[/yellow]"
                          + (f" ({ignored} of another type, in a directory)" if ignored else "") + ":")
            for skipped in outcome.skipped:
                console.print(f"  {skipped.path}: {skipped.reason}", highlight=False, markup=False, soft_wrap=True)
    if outcome.failed:
        raise typer.Exit(1)


@app.command("documents")
@friendly
def documents_cmd(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """List the files ingested into the corpus, each with its number of distinct chunks.

    Example: cachecraft documents
    """
    from cachecraft.retrieval.corpus import Corpus
    config = load_config(ctx)
    corpus = Corpus(config.corpus_dir, config.embedder)
    documents = corpus.documents()
    if as_json:
        print(json.dumps([{"path": path, "chunks": count} for path, count in documents.items()], indent=2))
        return
    for path, count in documents.items():
        console.print(f"{count:6d}  {path}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"{len(documents)} file(s), {len(corpus)} distinct chunk(s)"
                  + ("" if documents else "; add some with `cachecraft ingest PATH`"), highlight=False)


@app.command("forget")
@friendly
def forget_cmd(
    ctx: typer.Context,
    paths: list[Path] = typer.Argument(..., parser=nonempty_path,
                                       help="Files as ingested, directories (every ingested file under "
                                            "them), or bare file names naming one ingested file; they "
                                            "need not exist any more."),
    keep_caches: bool = typer.Option(False, "--keep-caches", help="Leave the chunk-caches of their chunks in "
                                                                  "the store (eviction drops them in time); "
                                                                  "opens no store, so a catalog server may be "
                                                                  "away."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Drop files from the corpus: their chunks leave the index (a chunk another file also
    holds stays) and, unless --keep-caches, their chunk-caches leave every tier. Nothing
    changes when a path names no ingested file (`cachecraft documents` lists them).

    Example: cachecraft forget docs/old-manual.md
    Example: cachecraft forget docs/archive/
    """
    from cachecraft.pipeline.documents import forget_documents
    from cachecraft.retrieval.corpus import Corpus
    from cachecraft.store import TieredStore
    config = load_config(ctx)
    if not config.corpus_dir.exists():
        raise UserError(f"the corpus in {config.cache_dir} is empty: nothing to forget")
    # --keep-caches opens no store, so a catalog or Redis server that is away does not matter
    with shared_tier_failures_reported_here(), nullcontext() if keep_caches else TieredStore(config) as store:
        outcome = forget_documents(Corpus(config.corpus_dir, config.embedder), store, paths)
    if as_json:
        print(json.dumps(outcome.to_dict(), indent=2))
        return
    report = outcome.report
    console.print(f"forgot {len(report.files)} file(s) and {report.removed} chunk(s)"
                  + ("" if outcome.evicted is None else f", evicted {outcome.evicted} chunk-cache variant(s)")
                  + f"; corpus: {report.chunks} chunks from {report.corpus_files} file(s)", highlight=False)


@app.command("warm")
@friendly
def warm_cmd(
    ctx: typer.Context,
    workers: int = typer.Option(1, "--workers", "-w", min=1, help="Processes, each warming a disjoint share of "
                                "the chunks with cores // N torch threads (with --neighbours, all make "
                                "their own caches before any makes variants)."),
    neighbours: Optional[int] = typer.Option(None, "--neighbours", "-n", min=0, max=8,
                                             help="Also make each chunk's cache after each of its N nearest "
                                                  "chunks in the index (in-context variants: a query that "
                                                  "retrieves both reuses it with its real context). Default: "
                                                  "config warm_neighbours (0). Costs N more prefills of one "
                                                  "chunk (the neighbour comes from its own cache) and N more "
                                                  "caches per chunk."),
    previous: Optional[bool] = typer.Option(None, "--previous/--no-previous",
                                            help="Also make each chunk's cache after the chunk before it in "
                                                 "its file (an in-context variant that a query in "
                                                 "--retrieval-order document reuses where it retrieves both). "
                                                 "Default: config warm_previous (off). Costs one more prefill "
                                                 "of one chunk and one more cache per chunk."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Make the chunk-cache of every ingested chunk ahead of time (after the system prompt
    and the warm context, config warm_context), so a query that retrieves it starts from
    a hit. Chunks already cached are skipped and each cache is on disk as soon as it is
    made, so an interrupted warm resumes where it stopped; run it again after each ingest.

    Example: cachecraft warm --workers 2
    Example: cachecraft warm --neighbours 1
    Example: cachecraft warm --previous
    """
    from .product import count_kept, warm_in_process, warm_in_workers, warm_mark
    config = load_config(ctx, model=model)
    if neighbours is not None:
        config = config.replace(warm_neighbours=neighbours)
    if previous is not None:
        config = config.replace(warm_previous=previous)
    _require_corpus(config)  # before the model loads
    mark = warm_mark(config)
    totals = warm_in_process(config) if workers == 1 else warm_in_workers(config, workers)
    made = totals.made + totals.in_context
    totals.kept = count_kept(config, mark, made)
    if as_json:
        print(json.dumps(totals.__dict__, indent=2))
    else:
        extra = f"; in-context variants made {totals.in_context}" if config.warms_in_context else ""
        console.print(f"chunk-caches made {totals.made}, skipped {totals.skipped} (already cached), "
                      f"of {totals.total} chunks{extra}", highlight=False)
    if totals.kept < made:
        err_console.print(f"[yellow]warning:[/yellow] only {totals.kept} of the {made} chunk-caches made are "
                          f"still stored: the disk tier's budget ({_size(config.disk_budget_bytes)}) evicted the "
                          "others; raise disk_budget_bytes (CACHECRAFT_DISK_BUDGET_BYTES) and warm again",
                          highlight=False, soft_wrap=True)


@app.command("query")
@friendly
def query_cmd(
    ctx: typer.Context,
    question: str = typer.Argument(..., help="The question, in quotes."),
    method: str = typer.Option("cachecraft", help="The method. " + METHODS_HELP + ". name@ratio sets a ratio "
                               "within [0, 1] (alpha for cachecraft: a larger policy_alpha goes in the config), "
                               "e.g. cacheblend@0.3; prefix reuses prompts kept in this process's memory only."),
    top_k: Optional[int] = typer.Option(None, "--top-k", "-k", min=1, help="Chunks to retrieve (default: config "
                                        "top_k, 3)."),
    max_new_tokens: Optional[int] = typer.Option(None, min=1, help="Answer length limit (default: config)."),
    chunk_order: Optional[str] = typer.Option(None, "--chunk-order", help="given: the chunks best first; cache: "
                                              "each chunk placed right after a chunk one of its caches was made "
                                              "after, where it has one (see warm --neighbours; default: config "
                                              "chunk_order, given; with --server, the server's)."),
    retrieval_order: Optional[str] = typer.Option(None, "--retrieval-order", help="score: the retrieved chunks "
                                                  "best first; document: each file's chunks together, in the "
                                                  "file's order, where its best chunk ranks (default: config "
                                                  "retrieval_order, score; with --server, the server's)."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (no streaming, no table)."),
    server: Optional[str] = typer.Option(None, help="Ask a running `cachecraft serve` at this URL instead of "
                                                    "loading everything here (default: config server, "
                                                    "CACHECRAFT_SERVER)."),
) -> None:
    """Answer QUESTION from the ingested corpus: retrieve the top-k chunks, reuse their
    chunk-caches (recomputing only what the method decides), stream the answer as it is
    generated, then report the sources with their scores, what the cache did for each
    chunk, the time to first token and the estimated prefill time saved.

    Example: cachecraft query "Who founded the company?" --top-k 4
    """
    from cachecraft.methods import parse_method

    from .product import (LOW_RELEVANCE, cap_new_tokens, check_question_length, open_pipeline, print_report,
                          streamer_for, warn_low_relevance)
    if not question.strip():
        raise UserError("the question is empty")
    config = load_config(ctx, model=model, **({"server": server} if server is not None else {}),
                         **({"chunk_order": chunk_order} if chunk_order is not None else {}),
                         **({"retrieval_order": retrieval_order} if retrieval_order is not None else {}))
    if config.server:  # the server has the model, corpus and tiers loaded (and checks the method)
        if model is not None:
            raise UserError(f"--model does not apply with a server: {config.server} answers with the model it "
                            "loaded (`cachecraft serve --model`)")
        from .serve import remote_answer, remote_query
        result = remote_query(config, question, method=method, top_k=top_k, max_new_tokens=max_new_tokens,
                              as_json=as_json, retrieval_order=retrieval_order, chunk_order=chunk_order)
        command_s = time.perf_counter() - STARTED
        if as_json:
            print(json.dumps({**result, "command_s": command_s, "server": config.server}, indent=2))
            return
        print_report(remote_answer(result), LOW_RELEVANCE if config.embedder == "minilm" else None,
                     command_s=command_s, server=config.server)
        return
    parse_method(method)  # an unknown method fails here, before the model loads
    check_question_length(config, question)
    _require_corpus(config)
    with open_pipeline(config) as pipe:
        top_k = config.top_k if top_k is None else top_k
        max_new_tokens = cap_new_tokens(pipe, question, top_k, max_new_tokens or config.max_new_tokens)
        streamer = None if as_json else streamer_for(pipe.lm.tokenizer)
        answer = pipe.query(question, top_k=top_k, method=method, streamer=streamer, max_new_tokens=max_new_tokens)
        startup_s = dict(pipe.startup_s)
    command_s = time.perf_counter() - STARTED  # the store is closed too: what the user waited for
    threshold = LOW_RELEVANCE if config.embedder == "minilm" else None  # chosen for MiniLM's scores
    if as_json:
        print(json.dumps({**answer.to_dict(), "command_s": command_s, "startup_s": startup_s}, indent=2))
        warn_low_relevance(answer, threshold)
        return
    print_report(answer, threshold, command_s=command_s, startup_s=startup_s)


def _require_corpus(config) -> None:
    """Fail before loading a model when there is nothing to retrieve from."""
    from cachecraft.retrieval.corpus import Corpus
    if not len(Corpus(config.corpus_dir, config.embedder)):
        raise UserError(f"nothing ingested in {config.cache_dir}: run `cachecraft ingest PATH` first")


register_serve(app)  # listed after query in --help


@app.command("evict")
@friendly
def evict_cmd(
    ctx: typer.Context,
    chunk: Optional[str] = typer.Option(None, help="Chunk key, or its first characters (the 'cache key' column "
                                        "of `cachecraft query`, or `cachecraft explain`): drop all its variants."),
    variant: Optional[str] = typer.Option(None, help="Variant key, or its first characters (the 'variant' "
                                          "column of `cachecraft explain`): drop that one variant; its chunk's "
                                          "others stay."),
    source: Optional[str] = typer.Option(None, help="A document as ingested (path, or file name when it names "
                                         "one): drop the chunk-caches of every chunk that came from it."),
    tier: Optional[str] = typer.Option(None, help="gpu, cpu or disk: drop that tier's entries."),
    everything: bool = typer.Option(False, "--all", help="Drop every chunk-cache this node holds (and, with "
                                                         "redis_url, their copies in Redis; other nodes' stay)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Drop chunk-caches from the store. The catalog keeps their history (hits, requests);
    a dropped chunk is computed again, in context, the next time it is retrieved. With
    redis_url set, --chunk, --variant and --source also drop the copies in Redis; when it
    does not answer, the exit code is 1 and the same command, run again later, finishes.

    Example: cachecraft evict --chunk 3fa2c1d09b7e
    Example: cachecraft evict --variant 9c04e1b7a2d5
    Example: cachecraft evict --source docs/manual.md
    """
    from cachecraft.catalog import TIERS
    from cachecraft.store import TieredStore
    if (chunk is not None) + (variant is not None) + (source is not None) + (tier is not None) + everything != 1:
        raise UserError("give exactly one of --chunk ID, --variant ID, --source FILE, --tier TIER or --all")
    if tier is not None and tier not in TIERS:
        raise UserError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    with shared_tier_failures_reported_here(), TieredStore(load_config(ctx)) as store:
        report = store.evict(chunk=chunk, variant=variant, source=source, tier=tier, everything=everything)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console.print(report.note or f"evicted {len(report.removed)} chunk-cache variant(s)", highlight=False)
    if report.unreached:  # what this node holds is gone; say what may be left, and fail
        err_console.print(f"[red]error:[/red] the shared tier at {escape(report.unreached)} did not answer, so "
                          "its copies may stay; run the same evict again once it is back", highlight=False)
        raise typer.Exit(1)


@app.command("clear")
@friendly
def clear_cmd(
    ctx: typer.Context,
    corpus: bool = typer.Option(False, "--corpus", help="Also delete the ingested corpus and its index."),
    shared: bool = typer.Option(False, "--shared", help="Also empty what every node shares: all rows of the "
                                "catalog_url database and every entry of the redis_url tier. Stop the other "
                                "nodes first."),
    node: Optional[str] = typer.Option(None, "--node", metavar="ID",
                                       help="Only drop the catalog_url rows of another node, one gone for good "
                                       "(the start of its id, from the node column of `cachecraft stats`); "
                                       "nothing of this directory is touched."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    force: bool = typer.Option(False, "--force", help="With --yes: delete for --shared or --node even when "
                               "other nodes look alive (without it, --yes refuses then)."),
) -> None:
    """Delete every chunk-cache and the catalog (requests, statistics) of the cache
    directory. Converted models, the config file and, unless --corpus, the ingested corpus
    stay. Other cachecraft processes using the directory must be stopped first.

    With catalog_url set (a catalog several nodes share), only this node's rows go
    (its placements, the requests it answered): chunks, variants and their statistics
    stay for the other nodes, as do the shared tier's entries. --shared empties those
    too. Before --shared or --node deletes, the other nodes that answered a request in
    the last 10 minutes or hold chunk-caches in memory are named: they may still be
    running, and deleting their rows under them loses their work. Asked, you decide;
    with --yes the command refuses while any looks alive, unless --force.

    Examples: cachecraft clear --yes
    On a cluster, with every node stopped: cachecraft clear --shared --yes
    A node gone for good: cachecraft clear --node 3f9a1c
    """
    from cachecraft.config import hide_password
    from cachecraft.store import destroy
    config = load_config(ctx)
    if node is not None:
        _forget_node(config, node, corpus=corpus, shared=shared, yes=yes, force=force)
        return
    if shared and not (config.catalog_url or config.redis_url):
        raise UserError("--shared empties the catalog_url database and the redis_url tier that nodes share; "
                        "neither is set, so run clear without it")
    what = "every chunk-cache and the catalog" + (" and the corpus" if corpus else "")
    where = str(config.cache_dir)
    if shared:
        servers = [f"the catalog at {hide_password(config.catalog_url)}"] if config.catalog_url else []
        servers += [f"the shared tier at {hide_password(config.redis_url)}"] if config.redis_url else []
        where += " and everything every node stored in " + " and ".join(servers)
    elif config.catalog_url:
        what = "this node's chunk-caches and catalog rows" + (" and the corpus" if corpus else "")
    if shared and config.catalog_url:
        _check_other_nodes(config, yes=yes, force=force)
    if not yes:
        note = " (stop every other node first)" if shared else ""
        typer.confirm(f"Delete {what} in {where}{note}?", abort=True)
    report = destroy(config.cache_dir, catalog_url=config.catalog_url or None,
                     redis_url=config.redis_url or None, shared=shared)
    removed = report.anything
    if corpus and config.corpus_dir.exists():
        from cachecraft.retrieval.corpus import Corpus
        Corpus(config.corpus_dir, config.embedder).erase()
        removed = True
    if not removed:
        console.print(f"nothing to delete in {where}", highlight=False)
        return
    counts = []
    if report.catalog_rows:
        rows = report.catalog_rows
        counts.append(f"{rows.get('entries', 0)} placement(s), {rows.get('requests', 0)} request(s)"
                      + (f", {rows.get('variants', 0)} variant(s) of {rows.get('chunks', 0)} chunk(s), "
                         f"{rows.get('nodes', 0)} node(s)" if shared else "") + " from the catalog")
    if shared and config.redis_url:
        counts.append(f"{report.shared_entries} entr{'y' if report.shared_entries == 1 else 'ies'} "
                      "from the shared tier")
    console.print(f"deleted {what} in {where}" + (f" ({'; '.join(counts)})" if counts else ""), highlight=False)
    kept = (["chunks, variants and their statistics stay in the shared catalog for the other nodes"]
            if config.catalog_url else []) + (["the shared tier keeps its entries"] if config.redis_url else [])
    if kept and not shared:
        console.print(", and ".join(kept) + "; clear --shared empties " + ("them" if len(kept) > 1 else "it"),
                      highlight=False)


def _forget_node(config, node: str, *, corpus: bool, shared: bool, yes: bool, force: bool) -> None:
    """``clear --node``: another node's rows of the shared catalog."""
    from cachecraft.config import hide_password
    from cachecraft.store.maintenance import MIN_PREFIX, forget_node
    if corpus or shared:
        raise UserError("--node drops another node's catalog rows only; give it without --corpus and --shared")
    if not config.catalog_url:
        raise UserError("--node drops a node's rows from a catalog several nodes share; catalog_url is not set")
    where = hide_password(config.catalog_url)
    if len(node.strip()) >= MIN_PREFIX:  # a shorter one is refused below, with the reason
        _check_other_nodes(config, node.strip().lower(), yes=yes, force=force)
    if not yes:
        typer.confirm(f"Delete the rows of node {node.strip()}... from the catalog at {where}?", abort=True)
    name, rows = forget_node(config.cache_dir, config.catalog_url, node)
    console.print(f"deleted node {name} from the catalog at {where} ({rows['entries']} placement(s), "
                  f"{rows['requests']} request(s)); chunks, variants and their statistics stay", highlight=False)


def _check_other_nodes(config, prefix: str = "", *, yes: bool, force: bool) -> None:
    """Before ``clear --shared`` or ``--node`` deletes: name the other nodes (those whose id
    starts with ``prefix``) that answered a request lately or hold chunk-caches in memory,
    since this node cannot see whether their processes still run. Asked, the user decides;
    with ``--yes`` and no ``--force`` a node that looks alive refuses the deletion, so a
    script never deletes a running node's rows under it."""
    from cachecraft.store.maintenance import ACTIVE_WITHIN_S, active_nodes
    alive = [n for n in active_nodes(config.cache_dir, config.catalog_url) if n.node.lower().startswith(prefix)]
    if not alive:
        return
    said = (f"{len(alive)} other node(s) may still be running (a request in the last "
            f"{ACTIVE_WITHIN_S / 60:.0f} min, or chunk-caches held in memory): "
            + "; ".join(n.describe() for n in alive))
    if yes and not force:
        raise UserError(f"{said}; nothing was deleted: stop them first, or add --force to delete anyway")
    console.print(said, highlight=False)


@app.command("verify")
@friendly
def verify_cmd(ctx: typer.Context,
               repair: bool = typer.Option(False, "--repair", help="Fix what is found: drop rows without bytes, "
                                           "delete bytes without rows, remove damaged entries."),
               as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """Walk the whole cache and report every inconsistency: the catalog (the SQLite file, or
    this node's rows of a PostgreSQL catalog_url), the disk tier and, with redis_url set,
    every entry of the shared tier. Exit code 0 when the cache is consistent (or was
    repaired), 1 otherwise."""
    from cachecraft.store import verify
    config = load_config(ctx)
    report = verify(config.cache_dir, repair=repair, catalog_url=config.catalog_url or None,
                    redis_url=config.redis_url or None, redis_budget_bytes=config.redis_budget_bytes)
    if as_json:
        print(report.to_json(indent=2))
    else:
        table = Table(title=f"verify {config.cache_dir}")
        table.add_column("problem")
        table.add_column("entry", overflow="fold")
        table.add_column("detail", overflow="fold")
        table.add_column("repaired")
        for p in report.problems:
            table.add_row(p.kind, p.target, p.detail, "yes" if p.repaired else "no")
        if report.problems:
            print_table(console, table)
        counts = ", ".join(f"{k}: {v}" for k, v in report.counts.items())
        state = "[green]consistent[/green]" if report.consistent else "[red]inconsistent[/red] (run with --repair)"
        console.print("; ".join(part for part in (f"{len(report.problems)} problem(s)", counts, state) if part))
    raise typer.Exit(0 if report.consistent else 1)


@app.command("explain")
@friendly
def explain_cmd(ctx: typer.Context,
                request_id: Optional[int] = typer.Argument(None, min=1, max=2**63 - 1,
                                                          help="Request id (default: the latest)."),
                as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """Why a request was planned the way it was: per chunk the variant used and its tier,
    CCI, beta', Cache Fix Overhead, recompute fraction and stop layer."""
    import dataclasses

    from cachecraft.catalog import Catalog
    config = load_config(ctx)
    with Catalog(config.cache_dir, url=config.catalog_url or None) as catalog:
        if request_id is None:
            request_id = catalog.last_request_id()
            if request_id is None:
                raise UserError(f"no request recorded yet in {config.cache_dir}")
        record = catalog.get_request(request_id)
    if record is None:
        raise UserError(f"no request with id {request_id} in {config.cache_dir}")
    from cachecraft.catalog.stats import saved_seconds
    saved_s = saved_seconds(record.full_prefill_s, record.ttft_s, record.recompute_fraction)
    if as_json:
        print(json.dumps({**dataclasses.asdict(record), "saved_s": saved_s}, indent=2, default=str))
        return

    def fmt(value: float | None, pattern: str = "{:.3f}") -> str:
        return "-" if value is None else pattern.format(value)

    table = Table(title=f"request {record.id}: {record.method}, recompute {fmt(record.recompute_fraction, '{:.1%}')}, "
                        f"TTFT {fmt(record.ttft_s, '{:.2f}')} s, prefill time {saved_text(saved_s)}")
    for column in ("#", "chunk", "variant", "tier", "CCI", "beta'", "CFO", "fraction", "stop layer"):
        table.add_column(column, justify="right" if column not in ("chunk", "variant", "tier") else "left",
                         no_wrap=column in ("chunk", "variant", "tier"))
    for c in record.chunks:
        table.add_row(str(c.position), c.chunk_key[:12], (c.variant_key or "-")[:12], c.tier, fmt(c.cci),
                      fmt(c.beta_prime), fmt(c.cfo), fmt(c.fraction, "{:.1%}"),
                      "-" if c.stop_layer is None else str(c.stop_layer))
    print_table(console, table)
    if record.policy:
        policy, origin = record.policy, record.policy.get("sources", {})
        console.print(f"policy: alpha {policy.get('alpha')} ({origin.get('policy_alpha', '?')}), check layer "
                      f"{policy.get('check_layer')} of {policy.get('num_layers')} "
                      f"({origin.get('policy_check_layer', '?')}), floor {policy.get('floor', 0)} "
                      f"({origin.get('policy_floor', '?')}), sink tokens {policy.get('sink_tokens', 0)} "
                      f"({origin.get('policy_sink_tokens', '?')}), drift shift {policy.get('drift_shift', 0)} "
                      f"({origin.get('policy_drift_shift', '?')})"
                      f"{_drift_estimator_words(policy)}, relevance {policy.get('relevance', 0)} "
                      f"({origin.get('policy_relevance', '?')}), early stop at "
                      f"{policy.get('early_stop_layers') or 'none'}{_exact_after_asks_words(policy)}",
                      highlight=False)
        if policy.get("first_try_ttft_s") is not None:
            console.print(f"the first answer (first token after {policy['first_try_ttft_s']:.2f} s) repeated itself "
                          "and was answered again from a full prefill: the table shows the first answer's plan, "
                          "the TTFT and recompute above are the kept answer's", highlight=False)
        if policy.get("kept_exact"):
            console.print(_kept_exact_words(policy), highlight=False)
        for displaced in policy.get("gave_way", ()):
            console.print(_gave_way_words(displaced), highlight=False)


def _kept_exact_words(policy: dict) -> str:
    """What ``explain`` says of a request that kept its chunk order exact: the asks it
    waited for, and why where that was longer than the setting."""
    after = policy.get("exact_after_asks")
    wait = policy.get("exact_wait", after)  # recorded before waits were: the setting
    longer = ""
    if after and wait and wait > after:
        times = "twice" if wait == 2 * after else f"{wait // after} times"
        longer = f", {times} the setting, as the keep before it was evicted before any ask reused it"
    return (f"this chunk order was asked {wait} time(s) or more since it was last kept exact, or ever{longer}: "
            "its chunks not stored exactly were computed in full and kept exact")


def _gave_way_words(displaced: dict) -> str:
    """What ``explain`` says of a variant deleted at its chunk's cap for the request's exact one."""
    made = "made exactly" if displaced["made_exactly"] else "not made exactly"
    return (f"chunk {displaced['chunk'][:12]} was at its cap of variants: its variant {displaced['variant'][:12]} "
            f"({made}, reused {displaced['hits']} time(s)) gave way to this request's exact one")


def _exact_after_asks_words(policy: dict) -> str:
    """``, exact after N asks`` for a request's recorded policy (nothing for one recorded
    before the setting existed)."""
    if "exact_after_asks" not in policy:
        return ""
    after = policy["exact_after_asks"]
    return ", exact after asks off" if not after else f", exact after {after} ask(s)"


def _drift_estimator_words(policy: dict) -> str:
    """`` by the <estimator>`` for a request's drift shift, where not the mean."""
    estimator = named_drift_estimator(policy)
    return {"median": " by the median", "shrunk": " by the shrunk mean", "pooled": " by the pooled mean"}.get(
        estimator, "")


@app.command("stats")
@friendly
def stats_cmd(ctx: typer.Context, top: int = typer.Option(10, min=1, help="How many top chunks to list."),
              as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
              server: Optional[str] = typer.Option(None, help="Ask a running `cachecraft serve` at this URL "
                                                              "(default: config server, CACHECRAFT_SERVER).")) -> None:
    """What the cache is doing: hit rates per tier, bytes per tier against budgets, top
    chunks, variants per chunk, recompute fractions and prefill time saved."""
    from cachecraft.catalog import Catalog
    from cachecraft.catalog.stats import summary
    config = load_config(ctx, **({"server": server} if server is not None else {}))
    if config.server:
        from .serve import remote_stats
        data = remote_stats(config, top)
        if as_json:
            print(json.dumps(data, indent=2, default=str))
        else:
            _print_stats(data)
        return
    catalog = Catalog(config.cache_dir, url=config.catalog_url or None)
    try:
        data = summary(catalog, top=top)
    finally:
        catalog.close()
    budgets = {"gpu": config.gpu_budget_bytes, "cpu": config.cpu_budget_bytes, "disk": config.disk_budget_bytes}
    for tier, usage in data["tiers"].items():
        usage["budget_bytes"] = budgets.get(tier)
    if config.redis_url or data["hit_rates"]["hits_by_tier"].get("redis"):
        data["tiers"]["redis"] = _shared_usage(config)
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    _print_stats(data)


def _shared_usage(config) -> dict:
    """Entries and bytes the shared tier holds now, read from Redis (None where it cannot be
    read: no ``redis_url``, or the server is down)."""
    usage = {"tier": "redis", "entries": None, "bytes": None, "budget_bytes": config.redis_budget_bytes}
    if not config.redis_url:
        return usage
    try:
        from cachecraft.store.shared import RedisTier
        tier = RedisTier(config.redis_url, config.redis_budget_bytes)
    except (ImportError, ValueError):
        return usage
    try:
        entries, held = tier.count(), tier.used()
        if tier.available:  # an unreachable server reads as 0: say unknown instead
            usage.update(entries=entries, bytes=held)
    finally:
        tier.close()
    return usage


def _source_or_preview(chunk: dict) -> str:
    """A chunk's document (file name only: the column is narrow), else its first words."""
    source = chunk["source"]
    if source and ("/" in source or "\\" in source):
        source = Path(source).name
    return " ".join((source or chunk["preview"] or "").split())[:60]


def _print_stats(data: dict) -> None:
    counts, rates = data["counts"], data["hit_rates"]
    console.print(f"{counts['chunks']} chunks, {counts['variants']} variants ({counts['live_variants']} stored), "
                  f"{counts['requests']} requests")
    tiers = _table("bytes per tier", "tier", "entries", "bytes", "budget", "used", "hits", "hit share")
    for tier, usage in data["tiers"].items():
        budget, held = usage["budget_bytes"], usage["bytes"]
        used = f"{held / budget:.0%}" if budget and held is not None else "-"
        tiers.add_row(tier, "?" if usage["entries"] is None else str(usage["entries"]),
                      "?" if held is None else _size(held), _size(budget), used,
                      str(rates["hits_by_tier"].get(tier, 0)), f"{rates['hit_rate_by_tier'].get(tier, 0):.0%}")
    tiers.add_row("miss", "", "", "", "", str(rates["misses"]), f"{1 - rates['hit_rate']:.0%}" if rates["chunks"] else "-")
    print_table(console, tiers)
    if data["by_node"]:
        nodes = _table("requests by node (one catalog, several cache directories)", "node", "cache directory",
                       "requests", "chunk hit rate", "from redis")
        for row in data["by_node"]:
            nodes.add_row(row["node"], f"{row['host']}:{row['cache_dir']}", str(row["requests"]),
                          _fraction(row["hit_rate"] if row["chunks"] else None),
                          _fraction(row["hit_rate_by_tier"]["redis"] if row["chunks"] else None))
        print_table(console, nodes)
    methods = _table("requests by method", "method", "requests", "chunk hit rate", "recompute (mean)",
                     "TTFT (mean)", "prefill time saved")
    for row in data["by_method"]:
        methods.add_row(row["method"], str(row["requests"]), _fraction(row["hit_rate"]),
                        _fraction(row["recompute_mean"]),
                        seconds(row["ttft_s_mean"]), saved_text(row["saved_s"], 1))
    print_table(console, methods)
    top = _table("top chunks", "chunk", "hits", "variants (stored)", "saves per reuse", "tokens", "source / preview")
    for chunk in data["top_chunks"]:
        top.add_row(chunk["chunk_key"][:12], str(chunk["hits"]), f"{chunk['variants']} ({chunk['live_variants']})",
                    _fraction(chunk.get("best_saving")), str(chunk["num_tokens"]), _source_or_preview(chunk))
    print_table(console, top)
    dist = data["recompute_fraction"]
    histogram = _table("recompute fraction per request", "range", "requests", "")
    widest = max((n for _, _, n in dist["histogram"]), default=0) or 1
    for low, high, n in dist["histogram"]:
        histogram.add_row(f"{low:.1f}-{high:.1f}", str(n), "#" * round(30 * n / widest))
    print_table(console, histogram)
    saved = data["prefill_time_saved"]
    basis = (f"full prefill timed at {saved['full_s_per_1k_tokens']:.2f} s per 1k prompt tokens by the recorded "
             "`full` requests" if saved["basis"] == "measured" else "full prefill estimated by the cost model; "
             "no `full` request recorded to time it")
    console.print(f"prefill time {saved_text(saved['saved_s'], 1)} over {saved['requests']} requests "
                  f"({seconds(saved['full_prefill_s'], 1)} of full prefill against {seconds(saved['ttft_s'], 1)} "
                  f"spent; {basis})", highlight=False)


def _table(title: str, *columns: str) -> Table:
    """A table whose first column (a key: tier, method, chunk key) is never wrapped."""
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 or column.startswith("source") else "right",
                         no_wrap=i == 0, overflow="fold")
    return table


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@config_app.command("show")
@friendly
def config_show_cmd(ctx: typer.Context,
                    as_json: bool = typer.Option(False, "--json", help="Print one JSON document: values and "
                                                 "sources.")) -> None:
    """Print the effective configuration and where each value comes from: default, the
    config file, the environment (CACHECRAFT_<KEY>) or a flag."""
    from cachecraft.config import Config
    from cachecraft.policy.planner import policy_settings
    config = load_config(ctx)
    values = config.to_dict()
    obj = ctx.obj or {}
    sources = dict.fromkeys(values, "default")
    for source, layer in Config.layers(obj.get("config_path"), overrides=obj.get("overrides")):
        sources.update(dict.fromkeys(layer, source))
    fitted = _fitted_policy(config)
    if fitted is not None:  # what `calibrate` fitted for this model, where the config keeps the default
        fitted_values, fitted_sources = policy_settings(config, fitted)
        when = (fitted.get("fitted") or {}).get("date", "")
        for key, origin in fitted_sources.items():
            if origin == "calibrated":
                values[key] = fitted_values[key]
                shipped = (fitted.get("fitted") or {}).get("source") == "shipped"
                sources[key] = (f"calibrated for {config.model}" + (f" on {when[:10]}" if when else "")
                                + (" (shipped with cachecraft)" if shipped else ""))
    if as_json:
        print(json.dumps({"values": values, "sources": sources}, indent=2))
        return
    table = Table(title="effective configuration")
    table.add_column("key", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("source", overflow="fold")
    for key, value in values.items():
        table.add_row(key, str(value), sources[key])
    print_table(console, table)


def _fitted_policy(config) -> dict | None:
    """The newest policy profile `calibrate` stored for ``config.model`` (by name: showing
    the configuration loads no model), else the one shipped for a bundled model, or None;
    an unreadable catalog is skipped."""
    from cachecraft.catalog import Catalog, CatalogError, catalog_path
    from cachecraft.policy.calibrate import POLICY_PROFILE
    from cachecraft.policy.shipped import shipped_fit

    if not config.catalog_url and not catalog_path(config.cache_dir).is_file():
        return shipped_fit(config.model)  # nothing calibrated, and showing the configuration creates no catalog
    try:
        with Catalog(config.cache_dir, url=config.catalog_url or None) as catalog, catalog.read() as tx:
            found = [value for _, _, kind, value in tx.profiles() if kind == POLICY_PROFILE
                     and (value.get("fitted") or {}).get("model") == config.model]
    except CatalogError:
        found = []
    return max(found, key=lambda v: str((v.get("fitted") or {}).get("date", "")), default=None) or \
        shipped_fit(config.model)


summarize_commands(app, config_app, bench_app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
