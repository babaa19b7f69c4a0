"""The ``cachecraft`` command.

Every command reads the effective configuration (defaults < TOML file from
``--config``/``CACHECRAFT_CONFIG`` < ``CACHECRAFT_*`` variables < flags). A user error
prints one line and exits with code 1.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from cachecraft.config import Config, ConfigError

CONTEXT = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(help="cachecraft: reuse per-chunk KV caches for RAG, recompute only what matters.",
                  context_settings=CONTEXT, no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Benchmarks that write JSON results and print a table.",
                        context_settings=CONTEXT, no_args_is_help=True)
config_app = typer.Typer(help="Inspect the effective configuration.", context_settings=CONTEXT,
                         no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(config_app, name="config")

console = Console()
err_console = Console(stderr=True)


class UserError(Exception):
    """An error the user can fix; shown as one line."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from cachecraft.dataset import DatasetError
    from cachecraft.engine import PromptError
    from cachecraft.methods import UnknownMethod
    from cachecraft.model.adapter import UnsupportedArchitecture
    from cachecraft.model.loader import ModelLoadError
    from cachecraft.catalog import CatalogError
    from cachecraft.prompt import PromptInputError
    from cachecraft.store import StoreError
    return (UserError, ConfigError, DatasetError, PromptError, UnknownMethod, UnsupportedArchitecture,
            ModelLoadError, PromptInputError, StoreError, CatalogError, FileNotFoundError, PermissionError)


def friendly(func: Callable) -> Callable:
    """Turn known user errors into one line on stderr and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except _user_errors() as exc:
            err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


@app.callback()
def main_options(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", help="TOML config file (else $CACHECRAFT_CONFIG)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir",
                                             help="Cache directory (else $CACHECRAFT_CACHE_DIR or the user cache dir)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details."),
) -> None:
    """Chunk-cache manager for RAG. Start with `cachecraft demo` or `cachecraft check-model smollm2`."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    _quiet_libraries()
    ctx.obj = {"config_path": config, "overrides": {"cache_dir": cache_dir}}


def load_config(ctx: typer.Context, **overrides: Any) -> Config:
    """The effective config for this invocation."""
    obj = ctx.obj or {}
    merged = {**obj.get("overrides", {}), **overrides}
    return Config.load(obj.get("config_path"), overrides=merged)


def _ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the cache directory {path}: {exc.strerror}") from None
    return path


def _load_model(config: Config, name: str | None = None):
    from cachecraft.model.loader import load_model
    with console.status(f"loading model {name or config.model} ..."):
        return load_model(name, config)


@app.command("check-model")
@friendly
def check_model_cmd(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="smollm2, a local HF model directory, a .gguf file or a hub id."),
    prompts: int = typer.Option(3, min=1, help="How many generated prompts to check."),
    tolerance: Optional[float] = typer.Option(None, help="Max |logit difference| allowed (default by dtype; 1e-4 in float32)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Check that blending is exact on MODEL: fractions at 1.0 and exact-prefix reuse must
    reproduce a full prefill, and greedy generation from a blended cache must match
    plain `generate`. Exit code 0 only if every check holds."""
    from cachecraft.checks import check_model
    config = load_config(ctx, model=model)
    lm = _load_model(config, model)
    with console.status("checking ..."):
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
        console.print(table)
        console.print("[green]all checks passed[/green]" if report.passed else "[red]some checks failed[/red]")
    raise typer.Exit(0 if report.passed else 1)


@bench_app.command("quality")
@friendly
def bench_quality_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., help="MuSiQue-format JSON file (list of {ctxs, question, answers})."),
    out: Path = typer.Option(Path("benchmarks/results/quality.json"), help="Where to write the JSON result."),
    limit: int = typer.Option(10, min=1, help="Use the first N items."),
    methods: str = typer.Option("full,reuse,cacheblend",
                                help="Comma-separated methods: full, prefix, reuse, cacheblend, inter, firstk, "
                                     "qguided, cachecraft; name@ratio sets a ratio (alpha for cachecraft), "
                                     "e.g. cacheblend@0.3."),
    ratio: Optional[float] = typer.Option(None, min=0.0, max=1.0,
                                          help="Default recompute ratio (default: config cacheblend_ratio, 0.15)."),
    max_new_tokens: int = typer.Option(32, min=1, help="Answer length for agreement and gold F1."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
) -> None:
    """Compare methods on the same requests: time to first token, recompute fraction,
    first-token KL and answer agreement against `full`, and gold F1."""
    from rich.progress import Progress

    from cachecraft.bench.common import write_result
    from cachecraft.bench.quality import run_quality
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods
    from cachecraft.model.loader import DTYPES
    from cachecraft.store import TieredStore

    config = load_config(ctx, model=model)
    specs = parse_methods(methods, config.cacheblend_ratio if ratio is None else ratio, config.policy_alpha)
    items = load_items(dataset, limit)
    lm = _load_model(config)
    scratch = Path(tempfile.mkdtemp(prefix="bench-quality-", dir=_ensure_dir(config.cache_dir)))
    try:
        with TieredStore(config.replace(cache_dir=scratch), tiers=("cpu",)) as store, \
                Progress(console=err_console, transient=True) as progress:
            task = progress.add_task("requests", total=len(items))
            result = run_quality(lm, items, specs, system_prompt=config.system_prompt,
                                 question_template=config.question_template,
                                 kv_dtype=DTYPES[config.kv_dtype], max_new_tokens=max_new_tokens,
                                 on_item=lambda done, total: progress.update(task, completed=done), store=store)
            store.close(persist=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    command = "cachecraft bench quality " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "cachecraft bench quality"
    payload = {"benchmark": "quality", "command": command, "model": lm.name,
               "fingerprint": lm.fingerprint, "dtype": str(lm.dtype).replace("torch.", ""),
               "kv_dtype": config.kv_dtype, "dataset": str(dataset), "limit": len(items), **result}
    write_result(out, payload)
    print_quality_table(result["methods"])
    console.print(f"wrote {out}")


@bench_app.command("workload")
@friendly
def bench_workload_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., help="MuSiQue-format JSON file; all its passages form the corpus."),
    requests: int = typer.Option(40, min=1, help="Requests in the trace."),
    out: Path = typer.Option(Path("benchmarks/results/workload.json"), help="Where to write the JSON result."),
    limit: int = typer.Option(20, min=1, help="Items of the dataset to pool (10 passages each)."),
    top_k: int = typer.Option(5, help="Chunks retrieved per request."),
    methods: str = typer.Option("full,prefix,reuse,cacheblend,cachecraft", help="Methods to replay the trace with."),
    cpu_budget: str = typer.Option("256MiB", help="CPU tier budget per method (far below the corpus' KV)."),
    disk_budget: str = typer.Option("1GiB", help="Disk tier budget per method."),
    zipf: float = typer.Option(1.2, min=0.0, help="Zipf exponent of item popularity."),
    seed: int = typer.Option(0, help="Trace seed."),
    max_new_tokens: int = typer.Option(32, min=1, help="Answer length."),
) -> None:
    """Replay a RAG trace (Zipf popularity, top-k retrieval over the pooled corpus) with
    each method: TTFT mean/p95, throughput, recompute, hit rate per tier, and compute
    saved against `full` and `prefix`."""
    from rich.progress import Progress

    from cachecraft.bench.common import write_result
    from cachecraft.bench.workload import build_trace, run_workload
    from cachecraft.config import parse_bytes
    from cachecraft.dataset import load_items
    from cachecraft.methods import MethodSpec
    from cachecraft.retrieval.embed import Embedder

    config = load_config(ctx)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    for name in names:
        MethodSpec(name)  # unknown names fail here, before any work
    budgets = {"cpu": parse_bytes(cpu_budget), "disk": parse_bytes(disk_budget)}
    items = load_items(dataset, limit)
    _ensure_dir(config.cache_dir)
    with console.status("embedding the corpus ..."):
        embedder = Embedder()
        try:
            trace, corpus = build_trace(items, requests, top_k, zipf_s=zipf, seed=seed, embed=embedder.embed)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    lm = _load_model(config)
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("requests", total=requests * (len(set(names) | {"full"})))
        done = {"n": 0}

        def tick(method: str, n: int, total: int) -> None:
            done["n"] += 1
            progress.update(task, completed=done["n"], description=f"{method} {n}/{total}")

        result = run_workload(lm, config, trace, names, budgets=budgets, max_new_tokens=max_new_tokens,
                              on_request=tick)
    command = "cachecraft bench workload " + " ".join(sys.argv[3:])
    write_result(out, {"benchmark": "workload", "command": command, "model": lm.name, "dataset": str(dataset),
                       "items": len(items), "corpus_chunks": corpus, "unique_requests": len(set(trace)),
                       "top_k": top_k, "budgets": budgets, **result})
    table = Table(title=f"workload: {requests} requests, corpus of {corpus} chunks, top-{top_k}")
    for column in ("method", "TTFT mean (s)", "TTFT p95 (s)", "req/s", "recompute", "hit rate",
                   "compute saved vs full", "vs prefix", "agreement F1"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, m in result["methods"].items():
        table.add_row(name, f"{m['ttft_s_mean']:.2f}", f"{m['ttft_s_p95']:.2f}", f"{m['throughput_rps']:.2f}",
                      f"{m['recompute_fraction_mean']:.3f}", f"{m['hit_rate']:.2f}",
                      f"{m['compute_reduction_vs_full']:.0%}",
                      f"{m['compute_reduction_vs_prefix']:.0%}" if "compute_reduction_vs_prefix" in m else "-",
                      f"{m['agreement_f1_mean']:.3f}")
    console.print(table)
    console.print(f"wrote {out}")


def print_quality_table(methods: dict[str, dict]) -> None:
    """The aggregates of ``bench quality`` as a table."""
    table = Table(title="quality vs full prefill (same requests)")
    for column in ("method", "TTFT median (s)", "speedup", "recompute", "KL", "agreement F1",
                   "exact match", "gold F1", "RSS growth / KV (MB)"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for label, m in methods.items():
        if not m:
            continue
        table.add_row(label, f"{m['ttft_s_median']:.2f}", f"{m['speedup_vs_full_median']:.1f}x",
                      f"{m['recompute_fraction_mean']:.3f}", f"{m['kl_mean']:.4f}",
                      f"{m['agreement_f1_mean']:.3f}", f"{m['exact_match_rate']:.2f}",
                      f"{m['gold_f1_mean']:.3f}",
                      f"{m.get('rss_growth_mb_max', float('nan')):.0f} / {m['kv_mb_mean']:.0f}")
    console.print(table)


@app.command("calibrate")
@friendly
def calibrate_cmd(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., help="MuSiQue-format JSON file (list of {ctxs, question, answers})."),
    limit: int = typer.Option(20, help="Use the first N items."),
    target: float = typer.Option(0.95, help="Answer agreement with full prefill to keep (token F1, within (0, 1])."),
    alphas: str = typer.Option("0.05,0.1,0.15,0.2,0.3,0.5", help="Comma-separated candidate alphas within [0, 1]."),
    out: Optional[Path] = typer.Option(None, help="TOML config file to write policy_alpha into (default: the "
                                                  "--config/$CACHECRAFT_CONFIG file, else <cache_dir>/config.toml)."),
    max_new_tokens: int = typer.Option(32, min=1, help="Answer length for agreement."),
    model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
) -> None:
    """Fit policy_alpha: the smallest recompute whose answers agree with full prefill at
    TARGET or better, on a MuSiQue-format file; writes it to the config file, keeping
    the other keys there."""
    from rich.progress import Progress

    from cachecraft.config import CONFIG_ENV, default_config_file
    from cachecraft.dataset import load_items
    from cachecraft.model.loader import DTYPES
    from cachecraft.policy.calibrate import CalibrationError, calibrate, check_target, parse_alphas, write_config_value

    try:
        candidates, target = parse_alphas(alphas), check_target(target)
    except CalibrationError as exc:
        raise UserError(str(exc)) from None
    if limit < 1:
        raise UserError(f"limit must be >= 1, got {limit}")
    obj = ctx.obj or {}
    config_file = out or obj.get("config_path") or os.environ.get(CONFIG_ENV) or \
        default_config_file(obj.get("overrides"))
    config = load_config(ctx, model=model)
    items = load_items(dataset, limit)
    lm = _load_model(config)
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("requests", total=len(items))
        result = calibrate(lm, items, candidates, target, system_prompt=config.system_prompt,
                           question_template=config.question_template, kv_dtype=DTYPES[config.kv_dtype],
                           max_new_tokens=max_new_tokens,
                           on_item=lambda done, total: progress.update(task, completed=done))
    table = Table(title=f"calibrate policy_alpha on {len(items)} item(s) (target agreement {target:g}; "
                        f"full TTFT median {result.full_ttft_s:.2f} s)")
    for column in ("alpha", "recompute", "agreement F1", "KL", "TTFT median (s)"):
        table.add_column(column, justify="right")
    for r in result.rows:
        mark = " *" if r is result.chosen else ""
        table.add_row(f"{r.alpha:g}{mark}", f"{r.recompute:.3f}", f"{r.agreement:.3f}", f"{r.kl:.4f}",
                      f"{r.ttft_s:.2f}")
    console.print(table)
    chosen = result.chosen
    if result.reached:
        console.print(f"chosen policy_alpha = {chosen.alpha:g}: the smallest recompute ({chosen.recompute:.3f}) "
                      f"with agreement {chosen.agreement:.3f} >= {target:g}")
    else:
        console.print(f"[yellow]no alpha reached agreement {target:g}[/yellow]; chosen policy_alpha = "
                      f"{chosen.alpha:g}, the best agreement ({chosen.agreement:.3f})")
    written = write_config_value(config_file, "policy_alpha", chosen.alpha)
    console.print(f"wrote policy_alpha = {chosen.alpha:g} to {written}")


@app.command("demo")
@friendly
def demo_cmd(
    ctx: typer.Context,
    questions: Path = typer.Option(Path("data/demo.json"),
                                   help="MuSiQue-format file with sample passages and questions."),
    limit: int = typer.Option(3, min=1, help="How many questions to answer."),
) -> None:
    """Answer a few questions over sample passages with `full` and `cacheblend` side by
    side, printing each one's time to first token and answer."""
    from cachecraft.demo import run_demo
    config = load_config(ctx)
    lm = _load_model(config)
    run_demo(lm, config, questions, limit, console)


@app.command("verify")
@friendly
def verify_cmd(ctx: typer.Context,
               repair: bool = typer.Option(False, "--repair", help="Fix what is found: drop rows without bytes, "
                                           "delete bytes without rows, remove damaged entries."),
               as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """Walk the whole cache (catalog and disk tier) and report every inconsistency.
    Exit code 0 when the cache is consistent (or was repaired), 1 otherwise."""
    from cachecraft.store import verify
    config = load_config(ctx)
    report = verify(config.cache_dir, repair=repair)
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
            console.print(table)
        counts = ", ".join(f"{k}: {v}" for k, v in report.counts.items())
        state = "[green]consistent[/green]" if report.consistent else "[red]inconsistent[/red] (run with --repair)"
        console.print(f"{len(report.problems)} problem(s); {counts}; {state}")
    raise typer.Exit(0 if report.consistent else 1)


@app.command("explain")
@friendly
def explain_cmd(ctx: typer.Context,
                request_id: Optional[int] = typer.Argument(None, help="Request id (default: the latest)."),
                as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """Why a request was planned the way it was: per chunk the variant used and its tier,
    CCI, beta', Cache Fix Overhead, recompute fraction and stop layer."""
    import dataclasses

    from cachecraft.catalog import Catalog
    config = load_config(ctx)
    catalog = Catalog(config.cache_dir)
    try:
        if request_id is None:
            with catalog.read() as tx:
                ids = tx.request_ids(limit=1)
            if not ids:
                raise UserError(f"no request recorded yet in {config.cache_dir}")
            request_id = ids[0]
        record = catalog.get_request(request_id)
    finally:
        catalog.close()
    if record is None:
        raise UserError(f"no request with id {request_id} in {config.cache_dir}")
    if as_json:
        print(json.dumps(dataclasses.asdict(record), indent=2, default=str))
        return

    def fmt(value: float | None, pattern: str = "{:.3f}") -> str:
        return "-" if value is None else pattern.format(value)

    table = Table(title=f"request {record.id}: {record.method}, recompute {fmt(record.recompute_fraction, '{:.1%}')}, "
                        f"TTFT {fmt(record.ttft_s, '{:.2f}')} s")
    for column in ("#", "chunk", "variant", "tier", "CCI", "beta'", "CFO", "fraction", "stop layer"):
        table.add_column(column, justify="right" if column not in ("chunk", "variant", "tier") else "left")
    for c in record.chunks:
        table.add_row(str(c.position), c.chunk_key[:12], (c.variant_key or "-")[:12], c.tier, fmt(c.cci),
                      fmt(c.beta_prime), fmt(c.cfo), fmt(c.fraction, "{:.1%}"),
                      "-" if c.stop_layer is None else str(c.stop_layer))
    console.print(table)


@app.command("stats")
@friendly
def stats_cmd(ctx: typer.Context, top: int = typer.Option(10, min=1, help="How many top chunks to list."),
              as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """What the cache is doing: hit rates per tier, bytes per tier against budgets, top
    chunks, variants per chunk, recompute fractions and prefill time saved."""
    from cachecraft.catalog import Catalog
    from cachecraft.catalog.stats import summary
    config = load_config(ctx)
    catalog = Catalog(config.cache_dir)
    try:
        data = summary(catalog, top=top)
    finally:
        catalog.close()
    budgets = {"gpu": config.gpu_budget_bytes, "cpu": config.cpu_budget_bytes, "disk": config.disk_budget_bytes}
    for tier, usage in data["tiers"].items():
        usage["budget_bytes"] = budgets.get(tier)
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    counts = data["counts"]
    console.print(f"{counts['chunks']} chunks, {counts['variants']} variants ({counts['live_variants']} stored), "
                  f"{counts['requests']} requests")
    table = Table(title="tiers")
    for column in ("tier", "entries", "bytes", "budget"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for tier, usage in data["tiers"].items():
        table.add_row(tier, str(usage.get("entries", 0)), _size(usage.get("bytes", 0)), _size(usage["budget_bytes"]))
    console.print(table)
    console.print_json(json.dumps({k: data[k] for k in ("hit_rates", "recompute_fraction", "prefill_time_saved")},
                                  default=str))


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@bench_app.command("store")
@friendly
def bench_store_cmd(ctx: typer.Context,
                    out: Path = typer.Option(Path("benchmarks/results/store.json"), help="Where to write the JSON result."),
                    chunks: int = typer.Option(8, min=1, help="Chunks per measurement."),
                    tokens: int = typer.Option(600, min=1, help="Tokens per chunk (SmolLM2 passages are ~600)."),
                    repeats: int = typer.Option(3, min=1, help="Best of this many runs.")) -> None:
    """Put/get throughput per store tier, in GB/s, for SmolLM2-sized chunks."""
    from cachecraft.store import run_store_benchmark
    config = load_config(ctx)
    with console.status("measuring store throughput ..."):
        result = run_store_benchmark(out, cache_dir=config.cache_dir, num_chunks=chunks, num_tokens=tokens,
                                     kv_dtype=config.kv_dtype, repeats=repeats)
    table = Table(title="store throughput (GB/s)")
    tiers = result.get("tiers", {})
    metrics = sorted({m for t in tiers.values() for m in t if m.endswith("gbps")})
    table.add_column("tier")
    for m in metrics:
        table.add_column(m, justify="right")
    for tier, values in tiers.items():
        table.add_row(tier, *(f"{values[m]:.2f}" if isinstance(values.get(m), (int, float)) else "-" for m in metrics))
    console.print(table)
    console.print(f"wrote {out}")


@config_app.command("show")
@friendly
def config_show_cmd(ctx: typer.Context,
                    as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """Print the effective configuration and where it comes from."""
    config = load_config(ctx)
    values = config.to_dict()
    if as_json:
        print(json.dumps(values, indent=2))
        return
    table = Table(title="effective configuration")
    table.add_column("key")
    table.add_column("value")
    for key, value in values.items():
        table.add_row(key, str(value))
    console.print(table)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
