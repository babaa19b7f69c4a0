"""``cachecraft bench ...``: benchmarks that write JSON results and print a table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cachecraft.display import print_table

from .common import (CONTEXT, FEW_ITEMS, METHODS_HELP, UserError, console, ensure_dir, err_console, friendly,
                     invocation, load_config, load_model_quietly, nonempty_path, progress_bar, working)

bench_app = typer.Typer(help="Benchmarks that write JSON results and print a table.",
                        context_settings=CONTEXT, no_args_is_help=True)


@bench_app.command("quality")
@friendly
def bench_quality_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file (list of {ctxs, question, answers})."),
    out: Path = typer.Option(Path("benchmarks/results/quality.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
    limit: int = typer.Option(10, min=1, help="Use the first N items (after --skip)."),
    skip: int = typer.Option(0, min=0, help="Leave out the first N items, e.g. to test on items a setting "
                                            "was not chosen on."),
    methods: str = typer.Option("full,reuse,cacheblend",
                                help="Comma-separated methods. " + METHODS_HELP + ". name@ratio sets a ratio "
                                     "within [0, 1] (alpha for cachecraft: a larger policy_alpha goes in the "
                                     "config), e.g. cacheblend@0.3."),
    ratio: Optional[float] = typer.Option(None, min=0.0, max=1.0,
                                          help="Default recompute ratio (default: config cacheblend_ratio, 0.15)."),
    max_new_tokens: int = typer.Option(32, min=1, help="Answer length for agreement and gold F1."),
    warm_context: str = typer.Option("none", help="What the chunk-caches are made after, following the system "
                                                  "prompt: none (the papers' setting), builtin (what `warm` "
                                                  "uses by default) or a text file."),
    model: Optional[str] = typer.Option(None, help="Model: smollm2, qwen2.5-coder-0.5b (the judge) or a path "
                                                   "(default: config model)."),
    rows: Optional[Path] = typer.Option(None, parser=nonempty_path,
                                        help="JSON-lines file each item's rows are appended to as it "
                                             "finishes (default: OUT with the suffix .rows.jsonl)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: items already in the rows "
                                "file are not run again (same settings required; --limit and --skip may "
                                "differ, e.g. to extend a run to more items)."),
    in_context: str = typer.Option("", "--in-context", help="Comma-separated methods run again once each "
                                   "passage also has in-context variants (its cache made after each of its "
                                   "--neighbours nearest passages by embedding, as `warm --neighbours` makes "
                                   "them), labelled METHOD+nbN and paired with the plain run."),
    neighbours: int = typer.Option(1, "--neighbours", min=1, max=8, help="Nearest passages per passage for "
                                                                         "--in-context."),
    chunk_order: Optional[str] = typer.Option(None, "--chunk-order", help="given: the passages in the item's "
                                              "order; cache: chained after the passages their variants were made "
                                              "after (then the --in-context runs are compared with full over "
                                              "that order, a row full+nbN; default: config chunk_order, given)."),
    neighbour_pool: str = typer.Option("", "--neighbour-pool", help="Where --in-context finds each passage's "
                                       "neighbours: the item's own passages (default), `corpus` (every chunk "
                                       "ingested in the cache directory, as `warm --neighbours` finds them), "
                                       "a MuSiQue-format file (all its passages), or `previous`: the chunk "
                                       "before it in its file in the ingested corpus, as `warm --previous` "
                                       "makes them (one variant per passage)."),
    follow_up: str = typer.Option("", "--follow-up", help="Then ask this question in a chat after each item's "
                                  "question and full's answer to it, with every method but the --in-context "
                                  "runs (rows METHOD+chat, each paired with full's follow-up and with its own "
                                  "first answer), e.g. 'Which passage says so? Give its title.'"),
    early_stop: str = typer.Option("", "--early-stop", help="Also run cachecraft with these early-stop layers "
                                   "(layers or depths below 1, as config early_stop_layers, e.g. 0.5 or 12,18), "
                                   "labelled cachecraft@ALPHA/E... and paired with the plain cachecraft run."),
) -> None:
    """Compare methods on the same requests: time to first token, recompute fraction,
    first-token KL, the answer-level divergence along full's answer (per-token KL and
    token agreement), answer agreement and exact match against `full`, and gold F1; every
    mean with its 95% bootstrap interval, and each method against `full` and
    `cacheblend@0.15` item by item ("better"/"worse" only where the paired interval
    excludes zero)."""

    from cachecraft.bench.common import write_result
    from cachecraft.bench.quality import RowsFileError, run_quality
    from cachecraft.dataset import load_items
    from cachecraft.evaluation import query_fit
    from cachecraft.methods import parse_methods
    from cachecraft.policy.planner import policy_settings

    config = load_config(ctx, model=model, warm_context=warm_context,
                         **({"chunk_order": chunk_order} if chunk_order is not None else {}))
    specs = parse_methods(methods, config.cacheblend_ratio if ratio is None else ratio, config.policy_alpha)
    items = load_items(dataset, limit, skip)
    rows = rows or out.with_suffix(".rows.jsonl")
    if early_stop.strip():
        from cachecraft.methods import CacheCraft

        # parsed and checked as the config's early_stop_layers is (a bad value: one ConfigError line)
        stops = config.replace(early_stop_layers=early_stop).early_stop_layer_list
        specs.append(CacheCraft(config.policy_alpha, early_stop=stops))
    if in_context.strip():
        from cachecraft.evaluation import InContext
        from cachecraft.retrieval.embed import Embedder

        again = parse_methods(in_context, config.cacheblend_ratio if ratio is None else ratio, config.policy_alpha)
        embed = Embedder(config.embedder).embed
        if neighbour_pool == "previous":
            if neighbours != 1:
                raise UserError("--neighbour-pool previous makes one variant per passage: leave --neighbours at 1")
            previous = _previous_in_corpus(config)
            specs += [InContext(m, 1, embed, previous=previous) for m in again]
        else:
            pool = _neighbour_pool(neighbour_pool, config)
            specs += [InContext(m, neighbours, embed, pool) for m in again]
    elif neighbour_pool:
        raise UserError("--neighbour-pool says where --in-context finds neighbours: add --in-context")
    if follow_up.strip() and in_context.strip():
        raise UserError("--follow-up is asked with the plain methods only: run --in-context separately")
    lm = load_model_quietly(config)
    # The policy the default method runs with (the config's, else the model's fit) and where
    # each value came from: a resumed run must use the same, and the result says which it was.
    policy, sources = policy_settings(config, query_fit(lm, config))
    settings = {"model": lm.name, "fingerprint": lm.fingerprint, "dataset": str(dataset),
                "config": {k: str(getattr(config, k)) for k in RUN_SETTINGS}, "policy": policy,
                **({"neighbour_pool": neighbour_pool} if neighbour_pool else {}),
                **({"chunk_order": config.chunk_order} if config.chunk_order != "given" else {})}
    with progress_bar() as progress:
        task = progress.add_task("items", total=len(items))
        try:
            result = run_quality(lm, config, items, specs, max_new_tokens=max_new_tokens, rows_path=rows,
                                 resume=resume, settings=settings, follow_up=follow_up.strip() or None,
                                 on_item=lambda done, total: progress.update(task, completed=done))
        except RowsFileError as exc:
            raise UserError(str(exc)) from None
    payload = {"benchmark": "quality", "command": invocation(ctx, "bench quality"), "model": lm.name,
               "fingerprint": lm.fingerprint, "dtype": str(lm.dtype).replace("torch.", ""),
               "kv_dtype": config.kv_dtype, "warm_context": config.warm_context, "dataset": str(dataset),
               "limit": len(items), "skip": skip, "rows": str(rows),
               "in_context_neighbours": neighbours if in_context.strip() else 0,
               "neighbour_pool": neighbour_pool or "item", "chunk_order": config.chunk_order,
               "follow_up": follow_up.strip() or None,
               "policy": {"values": policy, "sources": sources}, **result}
    write_result(out, payload)
    print_quality_table(result["methods"])
    print_comparisons(result["comparisons"])
    if result["comparisons"] and len(items) < FEW_ITEMS:
        console.print(f"the intervals are rough over {len(items)} item(s): use {FEW_ITEMS} or more to rely on "
                      "their verdicts", highlight=False)
    console.print(f"wrote {out} (rows: {rows})")


@bench_app.command("diagnose")
@friendly
def bench_diagnose_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file (list of {ctxs, question, answers})."),
    out: Path = typer.Option(Path("benchmarks/results/diagnose.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
    limit: int = typer.Option(6, min=1, help="Use the first N items (after --skip)."),
    skip: int = typer.Option(30, min=0, help="Leave out the first N items (default: those the yardstick "
                                             "reports on)."),
    budgets: str = typer.Option("0.05,0.15", help="Comma-separated recompute fractions for the selectors."),
    contexts: str = typer.Option("system,warm,previous",
                                 help="What each chunk's cache is made after: system (the system prompt "
                                      "alone), warm (and the warm context), previous (and the chunk before "
                                      "it in the request), other (and another chunk of the request, not "
                                      "the one before it), foreign (and a passage of the next item), related (and "
                                      "three other chunks of the request, none right before it), corpus (and "
                                      "five passages of the next item, in place of the warm context)."),
    model: Optional[str] = typer.Option(None, help="Model: smollm2, qwen2.5-coder-0.5b (the judge) or a path "
                                                   "(default: config model)."),
) -> None:
    """Why reused chunk-caches drift from a full prefill: per layer and per position in the
    chunk, the deviation of reused keys and values from full's, and answer KL, token
    agreement and first-token KL of the selectors (first tokens, CacheBlend's deviation
    check, question-guided, both, and the after-the-fact oracle) at each budget, for caches
    made after each context."""

    from cachecraft.bench.common import write_result
    from cachecraft.bench.diagnose import CONTEXTS, run_diagnose
    from cachecraft.dataset import load_items

    wanted = [c.strip() for c in contexts.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CONTEXTS]
    if unknown or not wanted:
        raise UserError(f"--contexts: unknown {', '.join(unknown) or 'nothing given'}; choose from "
                        f"{', '.join(CONTEXTS)}")
    try:
        fractions = [float(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        raise UserError(f"--budgets: {budgets!r} is not a comma-separated list of numbers") from None
    if not fractions or any(not 0.0 < b <= 1.0 for b in fractions):
        raise UserError("--budgets: give fractions within (0, 1], e.g. 0.05,0.15")
    config = load_config(ctx, model=model)
    items = load_items(dataset, limit, skip)
    lm = load_model_quietly(config)
    with progress_bar() as progress:
        task = progress.add_task("items", total=len(items))
        result = run_diagnose(lm, config, items, fractions, wanted,
                              on_item=lambda done, total: progress.update(task, completed=done))
    payload = {"benchmark": "diagnose", "command": invocation(ctx, "bench diagnose"), "model": lm.name,
               "fingerprint": lm.fingerprint, "warm_context": config.warm_context, "dataset": str(dataset),
               "limit": len(items), "skip": skip, **result}
    write_result(out, payload)
    table = Table(title="reused caches against full prefill (means over items)")
    for column in ("context", "run", "recompute", "answer KL", "token agreement", "first-token KL"):
        table.add_column(column, justify="left" if column in ("context", "run") else "right")
    for context, summary in result["summary"].items():
        for label, m in summary["runs"].items():
            table.add_row(context, label, f"{m['recompute_fraction']:.3f}", f"{m['answer_kl']:.4f}",
                          f"{m['token_agreement']:.3f}", f"{m['kl']:.4f}")
    print_table(console, table)
    console.print(f"wrote {out}")


@bench_app.command("dataset")
@friendly
def bench_dataset_cmd(
    ctx: typer.Context,
    questions: Path = typer.Option(..., parser=nonempty_path,
                                   help="Text file of questions, one per line (blank lines and lines "
                                        "starting with # are skipped)."),
    out: Path = typer.Option(..., parser=nonempty_path, help="Where to write the MuSiQue-format JSON file."),
    top_k: Optional[int] = typer.Option(None, min=1, help="Chunks retrieved per question (default: config "
                                                          "top_k, as `query` retrieves)."),
) -> None:
    """Turn questions about your ingested corpus into a MuSiQue-format file, each with the
    chunks `query` would retrieve for it (no gold answers), so `bench quality --dataset`
    measures the methods on your own documents.

    Example, after `cachecraft ingest DOCS`:

        cachecraft bench dataset --questions questions.txt --out mine.json
    """
    from cachecraft.retrieval.corpus import Corpus

    if not questions.is_file():
        raise UserError(f"--questions: no file at {questions}")
    try:
        asked = [line.strip() for line in questions.read_text(encoding="utf-8").splitlines()
                 if line.strip() and not line.strip().startswith("#")]
    except UnicodeDecodeError:
        raise UserError(f"--questions: {questions} is not UTF-8 text") from None
    if not asked:
        raise UserError(f"--questions: {questions} holds no question")
    config = load_config(ctx)
    corpus = Corpus(config.corpus_dir, config.embedder)
    if not len(corpus):
        raise UserError(f"the corpus in {config.corpus_dir} is empty: run `cachecraft ingest PATH` first")
    k = config.top_k if top_k is None else top_k
    items = [{"question": q, "answers": [],
              "ctxs": [{"title": hit.chunk.title or "", "text": hit.chunk.text, "source": hit.chunk.source}
                       for hit in corpus.search(q, k, config.retrieval_order)]} for q in asked]
    ensure_dir(out.parent)
    out.write_text(json.dumps(items, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    console.print(f"wrote {out}: {len(items)} question(s), top-{k} chunks each from {len(corpus)} in the corpus")


@bench_app.command("workload")
@friendly
def bench_workload_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file; all its passages form the corpus."),
    requests: int = typer.Option(40, min=1, help="Requests in the trace."),
    out: Path = typer.Option(Path("benchmarks/results/workload.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
    limit: int = typer.Option(20, min=1, help="Items of the dataset to pool (10 passages each)."),
    top_k: int = typer.Option(5, help="Chunks retrieved per request."),
    methods: str = typer.Option("full,prefix,reuse,cacheblend,cachecraft", help="Methods to replay the trace with."),
    cpu_budget: str = typer.Option("256MiB", help="CPU tier budget per method (far below the corpus' KV)."),
    disk_budget: str = typer.Option("1GiB", help="Disk tier budget per method."),
    zipf: float = typer.Option(1.2, min=0.0, help="Zipf exponent of item popularity."),
    seed: int = typer.Option(0, help="Trace seed."),
    max_new_tokens: int = typer.Option(32, min=1, help="Answer length."),
    evictions: str = typer.Option("", help="Also replay `cachecraft` under these eviction policies, e.g. "
                                          "lru,lfu,pgdsf,cachecraft (labelled cachecraft\\[lru] ...)."),
    exact_after_asks: str = typer.Option("", help="Also replay `cachecraft` with these settings of "
                                                  "exact_after_asks, e.g. 1,3 (labelled cachecraft\\[asks=1] ...)."),
    warm: bool = typer.Option(False, "--warm", help="Fill each chunk-cache method's store first as `cachecraft "
                                                    "warm` does (every passage, under the budgets)."),
    model: Optional[str] = typer.Option(None, help="Model: smollm2, qwen2.5-coder-0.5b (the judge) or a path "
                                                   "(default: config model)."),
    neighbours: int = typer.Option(0, min=0, max=8, help="With --warm, also make each passage's cache after "
                                   "each of its N nearest passages (in-context variants, as `warm "
                                   "--neighbours N`), so the eviction policy chooses among several variants "
                                   "per chunk."),
) -> None:
    """Replay a RAG trace (Zipf popularity, top-k retrieval over the pooled corpus) with
    each method: TTFT mean/p95, throughput, recompute, hit rate per tier, compute saved
    against `full` and `prefix`, and the variants each store kept.

    Example:

        cachecraft bench workload --model qwen2.5-coder-0.5b
            --dataset ../shared/data/musique_dev.json --limit 4 --top-k 3
            --methods full,cachecraft --evictions pgdsf,lru --warm --neighbours 1
            --cpu-budget 64MiB --disk-budget 256MiB
    """

    from cachecraft.bench.common import write_result
    from cachecraft.bench.workload import run_workload
    from cachecraft.config import parse_bytes
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    config = load_config(ctx, model=model)
    parse_methods(methods)  # unknown names fail here, before any work
    names = [m.strip() for m in methods.split(",") if m.strip()]
    policies = [e.strip() for e in evictions.split(",") if e.strip()]
    for policy in policies:
        config.replace(eviction=policy)  # unknown policies fail here
    try:
        asks = [int(n) for n in exact_after_asks.split(",") if n.strip()]
    except ValueError:
        raise UserError(f"--exact-after-asks takes whole numbers separated by commas, got {exact_after_asks!r}") \
            from None
    for n in asks:
        config.replace(exact_after_asks=n)  # negative settings fail here
    budgets = {"cpu": parse_bytes(cpu_budget), "disk": parse_bytes(disk_budget)}
    items = load_items(dataset, limit)
    ensure_dir(config.cache_dir)
    if neighbours and not warm:
        raise UserError("--neighbours makes in-context variants during the warm-up: add --warm")
    trace, corpus = _trace(items, requests, top_k, zipf, seed)
    warm_up = _warm_up(items, neighbours) if warm else None
    lm = load_model_quietly(config)
    with progress_bar() as progress:
        task = progress.add_task("requests", total=requests * (len(set(names) | {"full"}) + len(policies) + len(asks)))
        done = {"n": 0}

        def tick(method: str, n: int, total: int) -> None:
            done["n"] += 1 if n else 0  # n 0: a warm-up begins, no request done
            progress.update(task, completed=done["n"], description=f"{method} {n}/{total}" if n else method)

        result = run_workload(lm, config, trace, names, budgets=budgets, max_new_tokens=max_new_tokens,
                              evictions=policies, exact_after=asks, on_request=tick, warm=warm_up)
    write_result(out, {"benchmark": "workload", "command": invocation(ctx, "bench workload"), "model": lm.name,
                       "dataset": str(dataset), "warm": warm, "neighbours": neighbours,
                       "items": len(items), "corpus_chunks": corpus, "unique_requests": len(set(trace)),
                       "top_k": top_k, "budgets": budgets, **result})
    table = Table(title=f"workload: {requests} requests, corpus of {corpus} chunks, top-{top_k}")
    for column in ("method", "TTFT mean (s)", "TTFT p95 (s)", "req/s", "recompute", "hit rate",
                   "compute saved vs full", "vs prefix", "agreement F1", "whole-prefix reuse",
                   "chunks with 2+ variants"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, m in result["methods"].items():
        census = m.get("variants") or {}
        table.add_row(name, f"{m['ttft_s_mean']:.2f}", f"{m['ttft_s_p95']:.2f}", f"{m['throughput_rps']:.2f}",
                      f"{m['recompute_fraction_mean']:.3f}", f"{m['hit_rate']:.2f}",
                      f"{m['compute_reduction_vs_full']:.0%}",
                      f"{m['compute_reduction_vs_prefix']:.0%}" if "compute_reduction_vs_prefix" in m else "-",
                      f"{m['agreement_f1_mean']:.3f}", f"{m['whole_prefix_reuse_rate']:.2f}",
                      f"{census.get('chunks_with_several', 0)}/{census.get('chunks', 0)}" if census else "-")
    print_table(console, table)
    console.print(f"wrote {out}")


@bench_app.command("compare-workloads")
@friendly
def bench_compare_workloads_cmd(
    ctx: typer.Context,
    base: list[str] = typer.Option(..., help="A `bench workload` result and the method in it to compare against, "
                                             "as FILE or FILE:LABEL (label default cachecraft); once per trace."),
    other: list[str] = typer.Option(..., help="The same trace's run to compare, FILE or FILE:LABEL (e.g. "
                                              "run.json:cachecraft\\[asks=1]); in the order of --base."),
    out: Path = typer.Option(Path("benchmarks/results/workload_compare.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
) -> None:
    """Compare two settings of `bench workload` request by request over the same traces:
    agreement F1 with full and the total time to first token, pooled over the traces with
    95% intervals that resample whole chunk orders.

    Example:

        cachecraft bench compare-workloads
            --base s0.json --other s0.json:cachecraft\\[asks=1]
            --base s1.json --other s1.json:cachecraft\\[asks=1]
    """
    from cachecraft.bench.common import write_result
    from cachecraft.bench.workload import compare_runs, comparison_verdicts

    if len(base) != len(other):
        raise UserError(f"give one --other per --base ({len(base)} --base, {len(other)} --other)")
    runs = [(_workload_rows(b), _workload_rows(o)) for b, o in zip(base, other)]
    models = sorted({model for pair in runs for _, model in pair})
    try:
        result = compare_runs([(b_rows, o_rows) for (b_rows, _), (o_rows, _) in runs])
    except ValueError as exc:
        raise UserError(str(exc)) from None
    write_result(out, {"benchmark": "workload_compare", "command": invocation(ctx, "bench compare-workloads"),
                       "model": ", ".join(models), "base": base, "other": other, **result})
    table = Table(title=f"{len(runs)} trace(s), {result['requests']} requests in {result['clusters']} chunk orders")
    for column in ("trace (base / other)", "agreement F1", "TTFT mean (s)", "kept exact", "reused exactly"):
        table.add_column(column, justify="left" if column.startswith("trace") else "right")
    for spec, trace in zip(base, result["traces"]):
        b, o = trace["base"], trace["other"]
        table.add_row(spec, f"{b['agreement_f1']:.3f} / {o['agreement_f1']:.3f}",
                      f"{b['ttft_s_mean']:.2f} / {o['ttft_s_mean']:.2f}", f"{b['kept_exact']} / {o['kept_exact']}",
                      f"{b['reused_exact']} / {o['reused_exact']}")
    print_table(console, table)
    console.print(comparison_verdicts(result), highlight=False)
    console.print(f"wrote {out}")


def _workload_rows(spec: str) -> tuple[list[dict], str]:
    """The rows of one method in a `bench workload` result, from ``FILE`` or ``FILE:LABEL``,
    and the model that ran it."""
    path, label = spec, "cachecraft"
    if ":" in spec and not spec.endswith(".json"):
        path, _, label = spec.rpartition(":")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise UserError(f"{path} is not a JSON result") from None
    if data.get("benchmark") != "workload":
        raise UserError(f"{path} is not a `bench workload` result")
    rows = [r for r in data["requests"] if r["method"] == label]
    if not rows:
        raise UserError(f"{path} has no method {label!r}; it has {', '.join(data['methods'])}")
    return rows, str(data.get("model", "?"))


@bench_app.command("eviction")
@friendly
def bench_eviction_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file; all its passages form the corpus."),
    out: Path = typer.Option(Path("benchmarks/results/eviction_replay.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
    requests: int = typer.Option(3000, min=1, help="Requests in the trace."),
    limit: int = typer.Option(100, min=1, help="Items of the dataset to pool (10 passages each)."),
    top_k: int = typer.Option(5, help="Chunks retrieved per request."),
    budgets: str = typer.Option("0.05,0.1,0.25", help="Cache budgets as fractions of the trace's distinct "
                                                      "chunks' KV bytes."),
    policies: str = typer.Option("lru,lfu,pgdsf,decay,cachecraft", help="Eviction policies to compare."),
    zipf: float = typer.Option(1.2, min=0.0, help="Zipf exponent of item popularity."),
    seed: int = typer.Option(0, help="Trace seed."),
    shift_every: int = typer.Option(0, min=0, help="Draw the items' popularity anew every N requests "
                                                  "(interests that move on); 0: one popularity throughout."),
    model: Optional[str] = typer.Option(None, help="Model whose tokenizer and KV shape size the chunks "
                                                   "(default: config model)."),
) -> None:
    """Compare eviction policies on a long RAG trace without running the model: hit rate
    and compute saved per policy and budget. Only eviction is measured; `bench workload
    --evictions` runs the model on a short trace."""
    from cachecraft.bench.common import write_result
    from cachecraft.bench.eviction import run_replay
    from cachecraft.dataset import load_items
    from cachecraft.retrieval.embed import Embedder

    config = load_config(ctx, model=model)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise UserError("give at least one policy, e.g. lru,cachecraft")
    for name in names:
        config.replace(eviction=name)  # unknown policies fail here
    try:
        fractions = [float(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        raise UserError(f"budgets must be comma-separated fractions, got {budgets!r}") from None
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise UserError(f"budgets must be fractions within (0, 1], got {budgets!r}")
    items = load_items(dataset, limit)
    ensure_dir(config.cache_dir)
    lm = load_model_quietly(config)
    with working(f"embedding the corpus, then replaying {requests} requests ..."):
        try:
            result = run_replay(lm, items, requests=requests, top_k=top_k, zipf_s=zipf, seed=seed,
                                kv_dtype=config.kv_dtype,
                                policies=names, budget_fractions=fractions, embed=Embedder().embed,
                                shift_every=shift_every)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    write_result(out, {"benchmark": "eviction", "command": invocation(ctx, "bench eviction"), "model": lm.name,
                       "dataset": str(dataset),
                       "kv_dtype": config.kv_dtype, **result})
    table = Table(title=f"eviction: {requests} requests, {result['summary']['distinct_chunks']} distinct chunks, "
                        f"top-{top_k}")
    for column in ("budget", "policy", "hit rate", "compute saved", "evictions"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in result["rows"]:
        table.add_row(f"{r['budget_fraction']:.0%} ({r['budget_bytes'] / 2**20:.0f} MiB)", r["policy"],
                      f"{r['hit_rate']:.3f}", f"{r['compute_saved']:.1%}", str(r["evictions"]))
    print_table(console, table)
    console.print(f"wrote {out}")


def _previous_in_corpus(config) -> dict[str, str]:
    """Every ingested chunk's text -> the text of the chunk before it in its file."""
    from cachecraft.retrieval.corpus import Corpus

    corpus = Corpus(config.corpus_dir, config.embedder)
    if not len(corpus):
        raise UserError(f"--neighbour-pool previous: the corpus in {config.corpus_dir} is empty; run "
                        "`cachecraft ingest` first")
    chunks = corpus.snapshot().chunks
    return {chunks[chunk_id].prompt_text: before.prompt_text for chunk_id, before in corpus.previous_chunks().items()}


def _neighbour_pool(pool: str, config) -> list[str] | None:
    """The passages --in-context finds neighbours among (None: each item's own)."""
    if not pool:
        return None
    if pool == "corpus":
        from cachecraft.retrieval.corpus import Corpus

        chunks = [c.prompt_text for c in Corpus(config.corpus_dir, config.embedder).chunks()]
        if len(chunks) < 2:
            raise UserError(f"--neighbour-pool corpus: the corpus in {config.cache_dir} holds {len(chunks)} "
                            "chunk(s); run `cachecraft ingest` first")
        return chunks
    from cachecraft.dataset import load_items
    from cachecraft.evaluation import item_chunks

    path = Path(pool)
    if not path.is_file():
        raise UserError(f"--neighbour-pool: no file at {path} (give `corpus` or a MuSiQue-format file)")
    return [chunk for item in load_items(path) for chunk in item_chunks(item)]


# Config values a resumed bench quality run must share with the run it continues.
RUN_SETTINGS = ("system_prompt", "question_template", "kv_dtype", "dtype", "warm_context", "warm_context_tokens",
                "stats_layer_step", "check_layer", "policy_check_layer", "early_stop_layers", "early_stop_share",
                "stream_kv", "repetition_fallback")


def _with_interval(m: dict, key: str, mean_key: str, digits: int) -> str:
    interval = (m.get("intervals") or {}).get(key)
    text = f"{m[mean_key]:.{digits}f}"
    return text + (f" [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]" if interval else "")


def print_quality_table(methods: dict[str, dict]) -> None:
    """The aggregates of ``bench quality`` as a table (means with 95% intervals)."""
    table = Table(title="quality vs full prefill (same requests; [95% bootstrap interval])")
    for column in ("method", "TTFT median (s)", "speedup", "recompute", "first-token KL", "answer KL",
                   "token agreement", "agreement F1", "exact match", "gold F1", "repeats (full does not)"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for label, m in methods.items():
        if not m:
            continue
        repeats = (f"{m['repetitions']} ({m['repetitions_where_full_does_not']})" if "repetitions" in m else "-")
        if m.get("escalations"):
            repeats += f"; {m['escalations']} answered again"
        table.add_row(label, f"{m['ttft_s_median']:.2f}", f"{m['speedup_vs_full_median']:.1f}x",
                      f"{m['recompute_fraction_mean']:.3f}", _with_interval(m, "kl", "kl_mean", 4),
                      _with_interval(m, "answer_kl", "answer_kl_mean", 4),
                      _with_interval(m, "token_agreement", "token_agreement_mean", 3),
                      _with_interval(m, "agreement_f1", "agreement_f1_mean", 3),
                      f"{m['exact_match_rate']:.2f}", _with_interval(m, "gold_f1", "gold_f1_mean", 3), repeats)
    print_table(console, table)


def print_comparisons(comparisons: dict[str, dict]) -> None:
    """Each method against each baseline, item by item: the verdict per figure."""
    from cachecraft.bench.quality import verdict_phrase

    figures = (("answer_kl", "answer KL"), ("token_agreement", "token agreement"), ("kl", "first-token KL"),
               ("gold_f1", "gold F1"))
    table = Table(title="paired against a baseline: method - baseline [95% interval]; 'better'/'worse' only "
                        "where the interval excludes zero")
    for column in ("method", "against", *(name for _, name in figures)):
        table.add_column(column)
    for label, against in comparisons.items():
        for base, comparison in against.items():
            table.add_row(label, base.removeprefix("vs "), *(verdict_phrase(comparison, k) for k, _ in figures))
    print_table(console, table)


@bench_app.command("store")
@friendly
def bench_store_cmd(ctx: typer.Context,
                    out: Path = typer.Option(Path("benchmarks/results/store.json"), parser=nonempty_path,
                                             help="Where to write the JSON result."),
                    chunks: int = typer.Option(8, min=1, help="Chunks per measurement."),
                    tokens: int = typer.Option(600, min=1, help="Tokens per chunk (SmolLM2 passages are ~600)."),
                    repeats: int = typer.Option(3, min=1, help="Best of this many runs.")) -> None:
    """Put/get throughput per store tier, in GB/s, for SmolLM2-sized chunks."""
    from cachecraft.bench.store import run_store_benchmark
    config = load_config(ctx)
    with working("measuring store throughput ..."):
        result = run_store_benchmark(out, cache_dir=config.cache_dir, num_chunks=chunks, num_tokens=tokens,
                                     kv_dtype=config.kv_dtype, repeats=repeats,
                                     command=invocation(ctx, "bench store"))
    table = Table(title="store throughput (GB/s)")
    tiers = result.get("tiers", {})
    metrics = sorted({m for t in tiers.values() for m in t if m.endswith("gbps")})
    table.add_column("tier")
    for m in metrics:
        table.add_column(m, justify="right")
    for tier, values in tiers.items():
        table.add_row(tier, *(f"{values[m]:.2f}" if isinstance(values.get(m), (int, float)) else "-" for m in metrics))
    print_table(console, table)
    console.print(f"wrote {out}")


@bench_app.command("cluster")
@friendly
def bench_cluster_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file; all its passages form the corpus."),
    out: Path = typer.Option(Path("benchmarks/results/cluster.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
    nodes: int = typer.Option(3, min=1, help="Node processes (each its own cache directory)."),
    requests: int = typer.Option(36, min=1, help="Requests in the trace, dealt round-robin to the nodes."),
    limit: int = typer.Option(20, min=1, help="Items of the dataset to pool (10 passages each)."),
    top_k: int = typer.Option(3, help="Chunks retrieved per request."),
    zipf: float = typer.Option(1.2, min=0.0, help="Zipf exponent of item popularity."),
    seed: int = typer.Option(0, help="Trace seed."),
    method: str = typer.Option("cachecraft", help="Method every node answers with."),
    max_new_tokens: int = typer.Option(16, min=1, help="Answer length."),
    timed_prompts: int = typer.Option(6, min=1, help="Prompts the tier timing reads from Redis, CPU and disk."),
    redis_url: str = typer.Option("", help="An empty Redis database to share (default: a throw-away "
                                           "redis-server started for the run)."),
    catalog_url: str = typer.Option("", help="An empty PostgreSQL database to share (default: a throw-away "
                                             "PostgreSQL cluster started for the run)."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
) -> None:
    """Several node processes on this machine sharing one Redis and one PostgreSQL catalog,
    against the same nodes each on its own: hit rate per tier, prefill work saved by
    sharing, and TTFT with chunk-caches read from Redis, the CPU tier and the disk tier.
    Without --redis-url / --catalog-url it starts throw-away servers (Debian packages
    redis-server and postgresql).

    Example:

        cachecraft bench cluster --dataset musique_dev.json --nodes 3 --requests 36
    """
    import contextlib
    import tempfile

    from cachecraft.bench import servers
    from cachecraft.bench.cluster import run_cluster
    from cachecraft.bench.common import write_result
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    config = load_config(ctx, model=model)
    parse_methods(method)
    items = load_items(dataset, limit)
    ensure_dir(config.cache_dir)
    load_model_quietly(config)  # converts a bundled model once, before the nodes start
    trace, corpus = _trace(items, requests, top_k, zipf, seed)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cachecraft-cluster-")))
        try:
            if not redis_url:
                server = servers.RedisServer(workdir / "redis").start()
                stack.callback(server.stop)
                redis_url = server.url
            if not catalog_url:
                cluster = servers.PostgresCluster().start()
                stack.callback(cluster.stop)
                catalog_url = cluster.create_database()
        except servers.ServerUnavailable as exc:
            raise UserError(f"{exc}; or pass --redis-url and --catalog-url of empty databases") from None
        _require_empty(redis_url, catalog_url, workdir)
        with working("running ...") as status:
            result = run_cluster(config, trace, nodes=nodes, method=method, max_new_tokens=max_new_tokens,
                                 workdir=workdir, redis_url=redis_url, catalog_url=catalog_url,
                                 timed_prompts=timed_prompts, on_step=lambda text: status.update(text))
    write_result(out, {"benchmark": "cluster", "command": invocation(ctx, "bench cluster"), "model": config.model,
                       "dataset": str(dataset), "items": len(items), "corpus_chunks": corpus,
                       "unique_requests": len(set(trace)), "top_k": top_k, **result})
    table = Table(title=f"cluster: {nodes} nodes, {requests} requests ({len(set(trace))} distinct), top-{top_k}")
    for column in ("phase", "hit rate", "from redis", "from cpu", "from disk", "recompute", "TTFT median (s)",
                   "prefill work (token-layers)"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, m in result["phases"].items():
        by_tier = m["hit_rate_by_tier"]
        table.add_row(phase, f"{m['hit_rate']:.0%}", *(f"{by_tier.get(t, 0):.0%}" for t in ("redis", "cpu", "disk")),
                      f"{m['recompute_fraction_mean']:.3f}", f"{m['ttft_s_median']:.3f}", f"{m['token_layers']:,}")
    print_table(console, table)
    saved = result["prefill_work_saved_vs_isolated"]
    console.print(f"prefill work saved by sharing: {saved:.0%}" if saved is not None else "no prefill work recorded")
    timing = result["tier_timing"]["summary"]
    tiers = Table(title=f"TTFT of reuse by where the chunk-caches come from "
                        f"({result['tier_timing']['prompts_from_one_tier']} prompts)")
    for column in ("source", "TTFT median (s)", "vs CPU tier", "speed-up vs full"):
        tiers.add_column(column, justify="left" if column == "source" else "right")
    for source in ("redis", "cpu", "disk"):
        t = timing[source]
        tiers.add_row(source, _num(t["ttft_s_median"], 3), _num(t["vs_cpu_median"], 2, "x"),
                      _num(t["speedup_vs_full_median"], 1, "x"))
    tiers.add_row("full prefill", _num(timing["full"]["ttft_s_median"], 3), "", "")
    console.print(tiers)
    console.print(f"wrote {out}")


@bench_app.command("serve")
@friendly
def bench_serve_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file; all its passages form the corpus."),
    out: Path = typer.Option(Path("benchmarks/results/serve.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
    clients: str = typer.Option("1,2,4,8", help="Concurrent client counts to run."),
    methods: str = typer.Option("cachecraft,full", help="Methods the clients ask for (full: the baseline)."),
    requests: int = typer.Option(32, min=1, help="Requests in the trace."),
    limit: int = typer.Option(20, min=1, help="Items of the dataset to pool (10 passages each)."),
    top_k: int = typer.Option(3, help="Chunks retrieved per request (sent as documents)."),
    zipf: float = typer.Option(1.2, min=0.0, help="Zipf exponent of item popularity."),
    seed: int = typer.Option(0, help="Trace seed."),
    max_tokens: int = typer.Option(16, min=1, help="Answer length."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
) -> None:
    """Concurrent clients against `cachecraft serve` on this machine (a fresh server per
    method and client count, every method run at one client count before the next):
    throughput, client-side TTFT percentiles (queueing included) and hit rate per tier,
    with `full` on the same trace as the baseline.

    Example: cachecraft bench serve --dataset musique_dev.json --clients 1,2,4,8"""
    import tempfile

    from cachecraft.bench.common import write_result
    from cachecraft.bench.serving import run_serving
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    config = load_config(ctx, model=model)
    parse_methods(methods)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    try:
        counts = [int(c) for c in clients.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"clients must be comma-separated whole numbers, got {clients!r}") from None
    if not counts or min(counts) < 1:
        raise UserError(f"clients must be whole numbers >= 1, got {clients!r}")
    items = load_items(dataset, limit)
    ensure_dir(config.cache_dir)
    load_model_quietly(config)  # converts a bundled model once, before the servers start
    trace, corpus = _trace(items, requests, top_k, zipf, seed)
    env = {"CACHECRAFT_MODEL": config.model}
    with tempfile.TemporaryDirectory(prefix="cachecraft-serve-") as workdir, working("running ...") as status:
        runs = run_serving(trace, clients=counts, methods=names, max_tokens=max_tokens, workdir=Path(workdir),
                           models_dir=config.models_dir, env=env, on_step=lambda text: status.update(text))
    write_result(out, {"benchmark": "serve", "command": invocation(ctx, "bench serve"), "model": config.model,
                       "dataset": str(dataset), "items": len(items), "corpus_chunks": corpus,
                       "unique_requests": len(set(trace)), "top_k": top_k, "runs": runs})
    table = Table(title=f"serve: {requests} requests ({len(set(trace))} distinct), top-{top_k}")
    for column in ("method", "clients", "req/s", "TTFT p50 (s)", "p90", "p99", "server TTFT (s)", "hit rate",
                   "errors"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for r in runs:
        t = r["client_ttft_s"]
        table.add_row(r["method"], str(r["clients"]), _num(r["throughput_rps"], 2), _num(t["p50"], 2),
                      _num(t["p90"], 2), _num(t["p99"], 2), _num(r["server_ttft_s_median"], 3),
                      f"{r['hit_rate']:.0%}", str(len(r["errors"])))
    print_table(console, table)
    console.print(f"wrote {out}")


def _trace(items, requests: int, top_k: int, zipf: float, seed: int):
    """The Zipf request trace over the items' pooled passages (and the corpus size), embedded
    with the bundled MiniLM; a top_k the corpus cannot give is one line."""
    from cachecraft.bench.workload import build_trace
    from cachecraft.retrieval.embed import Embedder

    with working("embedding the corpus ..."):
        try:
            return build_trace(items, requests, top_k, zipf_s=zipf, seed=seed, embed=Embedder().embed)
        except ValueError as exc:
            raise UserError(str(exc)) from None


def _warm_up(items, neighbours: int):
    """What each store is filled with before the trace (see `bench workload --warm`)."""
    from cachecraft.bench.workload import warm_up
    from cachecraft.retrieval.embed import Embedder

    with working("finding each passage's neighbours ..."):
        return warm_up(items, neighbours, embed=Embedder().embed)


def _num(value: float | None, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _require_empty(redis_url: str, catalog_url: str, workdir: Path) -> None:
    """The shared phase must start from nothing: refuse databases that hold cachecraft data."""
    from cachecraft.catalog import Catalog
    from cachecraft.store.shared import RedisTier

    tier = RedisTier(redis_url, 1)
    try:
        held = tier.count()
        reachable = tier.available
    finally:
        tier.close()
    if not reachable:
        raise UserError(f"--redis-url {tier.where} cannot be reached")
    if held:
        raise UserError(f"--redis-url {tier.where} already holds {held} chunk-caches; give an empty database")
    with Catalog(workdir, url=catalog_url) as catalog:
        if not catalog.created:
            raise UserError(f"--catalog-url {catalog.where} already holds a catalog; give an empty database")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UserError(f"{what} must be positive, got {text!r}")
    return values


@bench_app.command("scaling")
@friendly
def bench_scaling_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file whose passages make the contexts."),
    out: Path = typer.Option(Path("benchmarks/results/scaling.json"), parser=nonempty_path,
                             help="Where to write the JSON result."),
    contexts: str = typer.Option("1000,2000,4000,7900",
                                 help="Prompt lengths in tokens for the context sweep ('' skips it)."),
    chunks: str = typer.Option("2,5,10,20", help="Chunk counts for the chunk sweep ('' skips it)."),
    fixed_context: int = typer.Option(4000, min=16, help="Prompt length of the chunk sweep."),
    chunk_tokens: int = typer.Option(512, min=16, help="Tokens per chunk in the context sweep."),
    repeats: int = typer.Option(2, min=1, help="Questions per point (averaged)."),
    methods: str = typer.Option("full,prefix,reuse,cacheblend,cachecraft",
                                help="Methods; name@ratio sets a ratio (alpha for cachecraft)."),
    prefix_shared: int = typer.Option(1, min=0, help="Chunks the `prefix` method's earlier request shared."),
    tier: str = typer.Option("cpu", help="Store tier the chunk-caches are loaded from: cpu or disk."),
    max_new_tokens: int = typer.Option(32, min=1, help="Answer length for agreement."),
    cold: bool = typer.Option(False, "--cold", help="Also time cachecraft with nothing cached ahead: the "
                              "request makes the chunk-caches and their statistics (a first question)."),
    revisit: bool = typer.Option(False, "--revisit", help="Also time cachecraft after an earlier question "
                                 "retrieved the same chunks in a shuffled order and kept their in-context caches."),
    whole_read: bool = typer.Option(False, "--whole-read", help="Also time every cache-reusing method with its "
                                    "chunk-caches read whole before the prefill, beside streaming them in."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
) -> None:
    """TTFT and peak memory against context length and number of chunks, per method,
    with agreement against `full` on the same request."""

    from cachecraft.bench.common import write_result
    from cachecraft.bench.scaling import run_scaling
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    config = load_config(ctx, model=model)
    specs = parse_methods(methods, config.cacheblend_ratio, config.policy_alpha)
    if tier not in ("cpu", "disk"):
        raise UserError(f"tier must be cpu or disk, got {tier!r}")
    context_list, chunk_list = _ints(contexts, "--contexts"), _ints(chunks, "--chunks")
    items = load_items(dataset)
    ensure_dir(config.cache_dir)
    lm = load_model_quietly(config)
    with progress_bar() as progress:
        task = progress.add_task("warming up", total=None)
        try:
            result = run_scaling(lm, config, items, specs, contexts=context_list, chunk_counts=chunk_list,
                                 fixed_context=fixed_context, chunk_tokens=chunk_tokens, repeats=repeats,
                                 prefix_shared=prefix_shared, max_new_tokens=max_new_tokens, tier=tier,
                                 cold=cold, revisit=revisit, whole_read=whole_read,
                                 on_step=lambda what, done, total: progress.update(
                                     task, description=what, completed=done, total=total))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    write_result(out, {"benchmark": "scaling", "command": invocation(ctx, "bench scaling"), "model": lm.name,
                       "fingerprint": lm.fingerprint, "dtype": str(lm.dtype).replace("torch.", ""),
                       "kv_dtype": config.kv_dtype, "dataset": str(dataset), **result})
    print_scaling_table(result)
    console.print(f"wrote {out}")


def print_scaling_table(result: dict) -> None:
    """The rows of ``bench scaling`` as one table per sweep, and the goal line."""
    from rich import box

    titles = {"context": "scaling with context length", "chunks": "scaling with the number of chunks"}
    for sweep, title in titles.items():
        rows = [r for r in result["scaling"] if r["sweep"] == sweep]
        if not rows:
            continue
        table = Table(title=f"{title} (mean over {rows[0].get('repeats', 1)} questions)", box=box.SIMPLE_HEAD,
                      pad_edge=False, collapse_padding=True)
        table.add_column("method", no_wrap=True)
        for column in ("tokens", "chunks", "TTFT s", "speedup", "agree", "KL", "recomp", "RSS MB"):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(r["method"], str(r["context_tokens"]), str(r["n_chunks"]), f"{r['ttft_s']:.2f}",
                          f"{r['speedup_vs_full']:.1f}x", f"{r['agreement_f1']:.2f}", f"{r['kl']:.3f}",
                          f"{r['recompute_fraction']:.2f}", f"{r['peak_rss_mb']:.0f}")
        print_table(console, table)
    summary = result.get("summary") or {}
    if summary.get("speedup_at_max_context") is not None:
        goal = summary["goal"]
        console.print(f"{summary['method']} at {summary['max_context_tokens']} tokens: "
                      f"{summary['speedup_at_max_context']:.1f}x faster than full, agreement "
                      f"{summary['agreement_at_max_context']:.3f} (goal >= {goal['speedup']:g}x at >= "
                      f"{goal['agreement_f1']:g}: {'met' if goal['met'] else 'not met'})")
    if summary.get("goal_revisit"):
        again = summary["goal_revisit"]
        console.print(f"{again['method']} (chunks seen before, shuffled): {again['speedup']:.1f}x faster than "
                      f"full, agreement {again['agreement_f1']:.3f} ({'met' if again['met'] else 'not met'})")


@bench_app.command("gpu")
@friendly
def bench_gpu_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., parser=nonempty_path,
                                 help="MuSiQue-format JSON file whose passages make the contexts."),
    out: Path = typer.Option(Path("benchmarks/results/gpu.json"), parser=nonempty_path,
                             help="Where to write the JSON result "
                                  "(rewritten after each shape and tier, so a stopped run keeps what it finished)."),
    shapes: str = typer.Option("llama-3.1-8b,qwen2.5-7b", help="Model shapes, built with random weights: "
                               "llama-3.1-8b, qwen2.5-7b, or tiny-llama (a few layers, to try it on a CPU)."),
    tiers: str = typer.Option("gpu,cpu,disk", help="Tiers the chunk-caches are loaded from, one sweep each "
                              "(gpu: already on the device; cpu: pinned host memory; disk)."),
    contexts: str = typer.Option("4000,8000,16000,32000", help="Prompt lengths in tokens."),
    chunk_tokens: int = typer.Option(512, min=16, help="Tokens per chunk."),
    methods: str = typer.Option("full,prefix,reuse,cacheblend@0.15",
                                help="Methods besides the fixed-fraction cachecraft runs; name@ratio sets a ratio."),
    fractions: str = typer.Option("0.02,0.05,0.10", help="Recompute fractions cachecraft runs at (its floor, "
                                  "alpha 0: random weights make its own choice meaningless); '' for none."),
    tokenizer: list[str] = typer.Option([], metavar="DIR|SHAPE=DIR",
                                        help="Tokenizer directory for every shape, or SHAPE=DIR for one "
                                        "(default: the bundled model's named by the shape). Repeatable."),
    max_new_tokens: int = typer.Option(4, min=1, help="Answer length (random weights: only the TTFT counts)."),
    repeats: int = typer.Option(1, min=1, help="Questions per point (averaged; the rows keep each one)."),
    cold: bool = typer.Option(False, "--cold", help="Also time cachecraft on a first-time request (every chunk "
                              "a miss: it makes the chunk-caches and their statistics), in the first tier's sweep."),
) -> None:
    """Time to first token and peak GPU memory of every method on 7-8B model shapes with
    random weights, with the chunk-caches in each tier. Meant for a CUDA machine (the
    config's device and dtype: bfloat16 there); tiny-llama runs anywhere.

    Example:

        cachecraft bench gpu --dataset musique_dev.json --shapes llama-3.1-8b
            --out gpu.json
    """

    from cachecraft.bench.common import write_result
    from cachecraft.bench.gpu import GPU_TIERS, SHAPES, fixed_fraction_methods, run_gpu
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    config = load_config(ctx)
    shape_list = [s.strip() for s in shapes.split(",") if s.strip()]
    unknown = [s for s in shape_list if s not in SHAPES]
    if unknown or not shape_list:
        raise UserError(f"--shapes must name shapes from {', '.join(SHAPES)}, got {shapes!r}")
    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    if not tier_list or any(t not in GPU_TIERS for t in tier_list):
        raise UserError(f"--tiers must name tiers from {', '.join(GPU_TIERS)}, got {tiers!r}")
    try:
        fraction_list = [float(f) for f in fractions.split(",") if f.strip()]
        specs = parse_methods(methods, config.cacheblend_ratio, config.policy_alpha) if methods.strip() else []
        specs += fixed_fraction_methods(fraction_list)
    except ValueError as exc:
        raise UserError(f"--fractions: {exc}") from None
    tokenizer_for = _tokenizer_source(tokenizer, config)
    items = load_items(dataset)
    ensure_dir(config.cache_dir)
    command = invocation(ctx, "bench gpu")

    def save(runs: list[dict]) -> None:
        write_result(out, {"benchmark": "gpu", "command": command, "weights": "random (timing only)",
                           "dtype": config.dtype, "kv_dtype": config.kv_dtype, "dataset": str(dataset),
                           "runs": runs})

    with progress_bar() as progress:
        task = progress.add_task("building the model", total=None)
        try:
            runs = run_gpu(shape_list, config, items, specs, tokenizer_for=tokenizer_for, tiers=tier_list,
                           contexts=_ints(contexts, "--contexts"), chunk_tokens=chunk_tokens,
                           max_new_tokens=max_new_tokens, repeats=repeats, cold=cold, on_run=save,
                           on_step=lambda what, done, total: progress.update(
                               task, description=what, completed=done, total=total))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    for run in runs:
        console.print(f"[bold]{run['shape']}[/], caches in the {run['tier']} tier")
        print_scaling_table(run)
    from cachecraft.bench.plots import gpu_speedups

    plot = gpu_speedups([json.loads(out.read_text())], out.with_suffix(".png"))
    console.print(f"wrote {out}" + (f" and {plot}" if plot else ""))


def _tokenizer_source(given: list[str], config):
    """``bundled name -> tokenizer``: from ``--tokenizer`` values (DIR, or SHAPE=DIR), else
    the bundled model's own tokenizer."""
    from cachecraft.bench.gpu import SHAPES

    every, per_shape = None, {}
    for value in given:
        shape, eq, path = value.partition("=")
        if eq:
            if shape not in SHAPES:
                raise UserError(f"--tokenizer {value!r}: unknown shape {shape!r}")
            per_shape[SHAPES[shape].tokenizer] = Path(path)
        else:
            every = Path(value)
    for path in [every, *per_shape.values()]:
        if path is not None and not path.is_dir():
            raise UserError(f"--tokenizer: {path} is not a directory")

    def tokenizer_for(bundled: str):
        from transformers import AutoTokenizer

        path = per_shape.get(bundled, every)
        if path is None:
            from cachecraft.model.loader import bundled_gguf, convert_gguf

            path = convert_gguf(bundled_gguf(bundled, config.models_dir), config.models_dir)
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    return tokenizer_for


@bench_app.command("report")
@friendly
def bench_report_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(Path("benchmarks/report"), parser=nonempty_path,
                             help="Folder for report.md and the PNG plots."),
    quality: Path = typer.Option(Path("benchmarks/results/quality_report.json"), parser=nonempty_path,
                                 help="`bench quality` result."),
    workload: Path = typer.Option(Path("benchmarks/results/workload.json"), parser=nonempty_path,
                                  help="`bench workload` result."),
    eviction: Path = typer.Option(Path("benchmarks/results/workload_eviction.json"),
                                  parser=nonempty_path,
                                  help="`bench workload --evictions ...` result comparing eviction policies."),
    replay: Path = typer.Option(Path("benchmarks/results/eviction_replay.json"),
                                parser=nonempty_path,
                                help="`bench eviction` result: the policies on a long trace, without the model."),
    also_replay: list[Path] = typer.Option([], parser=nonempty_path,
                                           help="Another `bench eviction` result (another trace seed, or "
                                                "--shift-every), with a section of its own; repeat for more."),
    also_quality: list[Path] = typer.Option([], parser=nonempty_path,
                                            help="Another `bench quality` result (another model, say), "
                                                 "with a section of its own; repeat for more."),
    diagnose: Path = typer.Option(Path("benchmarks/results/diagnose_qwen.json"),
                                  parser=nonempty_path,
                                  help="`bench diagnose` result: where reused caches drift, what selectors buy."),
    also_diagnose: list[Path] = typer.Option([], parser=nonempty_path,
                                             help="Another `bench diagnose` result; repeat for more."),
    scaling: Path = typer.Option(Path("benchmarks/results/scaling.json"), parser=nonempty_path,
                                 help="`bench scaling` result."),
    revisit: Path = typer.Option(Path("benchmarks/results/scaling_8k_revisit.json"),
                                 parser=nonempty_path,
                                 help="`bench scaling --revisit` result: chunks an earlier request saw, shuffled."),
    loading: Path = typer.Option(Path("benchmarks/results/scaling_8k_disk.json"),
                                 parser=nonempty_path,
                                 help="`bench scaling --whole-read` result: chunk-caches streamed in, or read whole."),
    tradeoff: Path = typer.Option(Path("benchmarks/results/scaling_8k_sweep.json"),
                                  parser=nonempty_path,
                                  help="`bench scaling` result at one long context over a sweep of recompute "
                                       "ratios: agreement bought against speed, next to the goal."),
    gpu_json: Optional[Path] = typer.Option(None, parser=nonempty_path,
                                            help="A result measured on a GPU, for the GPU section."),
    run: bool = typer.Option(False, "--run", help="Run the missing benchmarks first (long: see the report's "
                                                  "commands)."),
    dataset: Optional[Path] = typer.Option(None, parser=nonempty_path,
                                           help="MuSiQue-format JSON file the missing benchmarks read "
                                                "(needed with --run)."),
) -> None:
    """Plots and a Markdown report (quality vs TTFT, per-method figures, the workload,
    eviction policies, scaling, where cachecraft loses) from the benchmark JSONs."""
    import re

    from cachecraft.bench.report import write_report
    from cachecraft.bench.runs import RUNS

    sources: dict[str, Path] = {}
    for kind, first, extras in (("quality", quality, also_quality), ("diagnose", diagnose, also_diagnose),
                                ("workload", workload, []), ("eviction", eviction, []),
                                ("replay", replay, also_replay), ("scaling", scaling, []), ("revisit", revisit, []),
                                ("loading", loading, []), ("tradeoff", tradeoff, [])):
        sources[kind] = first
        for extra in extras:  # right after the first: the same figures on another model or trace
            if not extra.is_file():
                raise UserError(f"--also-{kind}: no result at {extra}")
            sources[f"{kind}:{extra.stem}"] = extra
    missing = [name for name, path in sources.items() if not path.is_file()]
    if run and missing:
        if dataset is None:
            raise UserError("--run needs --dataset: the MuSiQue-format JSON file the missing benchmarks read")
        config = load_config(ctx)
        ensure_dir(config.cache_dir)
        lm = load_model_quietly(config)
        for name in [m for m in missing if m in RUNS]:  # the workload run includes the eviction policies
            with working(f"running bench {name} ...") as status:
                RUNS[name](lm, config, dataset, sources[name], on_progress=lambda what: status.update(what))
            console.print(f"wrote {sources[name]}")
    elif missing:
        err_console.print(f"missing (their sections say how to make them, or pass --run): {', '.join(missing)}")
    path = write_report(out, sources, gpu_json, dataset=dataset)
    plots = re.findall(r"\]\(([^)]+\.png)\)", path.read_text(encoding="utf-8"))
    console.print(f"wrote {path} and {len(plots)} plots")
