"""Default runs of the benchmarks, for ``bench report --run``.

They call the functions the ``bench`` commands call (``run_quality``,
``run_workload``, ``run_scaling``) with the settings of :data:`COMMANDS`, and write
the same JSON the command would, recording that command.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable

from cachecraft.bench.common import with_settings, write_result
from cachecraft.config import Config
from cachecraft.model.loader import LoadedModel

QUALITY_METHODS = ("full,prefix,reuse,cacheblend@0.05,cacheblend@0.15,cacheblend@0.3,cacheblend@0.5,"
                   "cachecraft@0.05,cachecraft@0.08,cachecraft@0.15,cachecraft@0.3")
WORKLOAD_METHODS = "full,prefix,reuse,cacheblend,cachecraft"
EVICTIONS = ("lru", "lfu", "pgdsf", "cachecraft")
REVISIT_METHODS = "full,prefix,reuse,cachecraft"
LOADING_METHODS = "full,reuse,cachecraft"
TRADEOFF_METHODS = ("full,reuse,cacheblend@0.15,cacheblend@0.5,cachecraft@0.08,qguided@0.05,qguided@0.1,"
                    "qguided@0.2,qguided@0.4,qguided@0.7")
COMMANDS = {
    "quality": f"cachecraft bench quality --dataset {{dataset}} --limit {{limit}} --methods {QUALITY_METHODS} "
               "--out {out}",
    "workload": "cachecraft bench workload --dataset {dataset} --limit {limit} --requests {requests} --top-k {top_k} "
                f"--evictions {','.join(EVICTIONS)} --out {{out}}",
    "eviction": "cachecraft bench workload --dataset {dataset} --limit {limit} --requests {requests} "
                "--top-k {top_k} --methods full --evictions " + ",".join(EVICTIONS)
                + " --cpu-budget {cpu_budget} --disk-budget {disk_budget} --max-new-tokens 4 --out {out}",
    "replay": "cachecraft bench eviction --dataset {dataset} --out {out}",
    "scaling": "cachecraft bench scaling --dataset {dataset} --out {out}",
    "revisit": "cachecraft bench scaling --dataset {dataset} --contexts {contexts} --chunks '' --repeats {repeats} "
               "--chunk-tokens {chunk_tokens} --max-new-tokens {max_new_tokens} "
               f"--methods {REVISIT_METHODS} --revisit --out {{out}}",
    "loading": "cachecraft bench scaling --dataset {dataset} --contexts {contexts} --chunks '' --repeats {repeats} "
               "--chunk-tokens {chunk_tokens} --max-new-tokens {max_new_tokens} --tier {tier} "
               f"--methods {LOADING_METHODS} --whole-read --out {{out}}",
    "tradeoff": "cachecraft bench scaling --dataset {dataset} --contexts {contexts} --chunks '' --repeats {repeats} "
                "--chunk-tokens {chunk_tokens} --max-new-tokens {max_new_tokens} "
                f"--methods {TRADEOFF_METHODS} --out {{out}}",
    "diagnose": "cachecraft bench diagnose --model qwen2.5-coder-0.5b --dataset {dataset} --skip {skip} "
                "--limit {limit} --out {out}",
}
Progress = Callable[[str], None]


DEFAULTS = {"quality": {"limit": 10}, "workload": {"limit": 20, "requests": 40, "top_k": 5},
            "eviction": {"limit": 20, "requests": 40, "top_k": 3, "cpu_budget": "32MiB", "disk_budget": "128MiB"},
            "replay": {}, "scaling": {},
            "revisit": {"contexts": 7900, "repeats": 6, "chunk_tokens": 512, "max_new_tokens": 32},
            "loading": {"contexts": 7900, "repeats": 6, "chunk_tokens": 512, "max_new_tokens": 32, "tier": "disk"},
            "tradeoff": {"contexts": 7900, "repeats": 6, "chunk_tokens": 512, "max_new_tokens": 32},
            "diagnose": {"skip": 30, "limit": 6}}
SCALING_FLAGS = {"chunk_counts": "chunks"}


def command(name: str, out: Path, dataset: Path | str, **settings) -> str:
    """The ``bench`` command line that makes result ``name`` at ``out`` from ``dataset`` with ``settings``."""
    text = COMMANDS[name].format(dataset=dataset, out=out, **{**DEFAULTS[name], **settings})
    if name == "scaling":  # its settings are the command's flags
        for key, value in settings.items():
            value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            text += f" --{SCALING_FLAGS.get(key, key).replace('_', '-')} {shlex.quote(str(value))}"
    return text


def _payload(name: str, lm: LoadedModel, config: Config, dataset: Path, out: Path, **settings) -> dict:
    return {"benchmark": name, "command": with_settings(command(name, out, dataset, **settings), config),
            "model": lm.name, "fingerprint": lm.fingerprint, "dtype": str(lm.dtype).replace("torch.", ""),
            "dataset": str(dataset)}


def run_quality_default(lm: LoadedModel, config: Config, dataset: Path, out: Path,
                        on_progress: Progress | None = None, limit: int = 10) -> Path:
    """``bench quality`` with the ratio sweep the report's trade-off plot needs."""
    from cachecraft.bench.quality import run_quality
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    items = load_items(dataset, limit)
    specs = parse_methods(QUALITY_METHODS, config.cacheblend_ratio, config.policy_alpha)
    result = run_quality(lm, config.replace(warm_context="none"), items, specs,  # the command's default
                         on_item=lambda done, total: on_progress and on_progress(f"quality: item {done}/{total}"))
    payload = {**_payload("quality", lm, config, dataset, out, limit=limit), "kv_dtype": config.kv_dtype,
               "limit": len(items), **result}
    return write_result(out, payload)


def run_workload_default(lm: LoadedModel, config: Config, dataset: Path, out: Path,
                         on_progress: Progress | None = None, requests: int = 40, limit: int = 20, top_k: int = 5,
                         embed: Callable | None = None) -> Path:
    """``bench workload`` with its default trace and budgets, plus the eviction policies."""
    from cachecraft.bench.workload import build_trace, run_workload
    from cachecraft.config import parse_bytes
    from cachecraft.dataset import load_items

    items = load_items(dataset, limit)
    if embed is None:
        from cachecraft.retrieval.embed import Embedder
        embed = Embedder().embed
    trace, corpus = build_trace(items, requests, top_k, embed=embed)
    budgets = {"cpu": parse_bytes("256MiB"), "disk": parse_bytes("1GiB")}
    result = run_workload(lm, config, trace, WORKLOAD_METHODS.split(","), budgets=budgets, evictions=EVICTIONS,
                          on_request=lambda method, n, total: on_progress and on_progress(
                              f"workload: {method} {n}/{total}"))
    payload = {**_payload("workload", lm, config, dataset, out, limit=limit, requests=requests, top_k=top_k),
               "items": len(items), "corpus_chunks": corpus,
               "unique_requests": len(set(trace)), "top_k": top_k, "budgets": budgets, **result}
    return write_result(out, payload)


def run_replay_default(lm: LoadedModel, config: Config, dataset: Path, out: Path,
                       on_progress: Progress | None = None, requests: int = 3000, limit: int = 100, top_k: int = 5,
                       embed: Callable | None = None) -> Path:
    """``bench eviction`` with its defaults: the policies on a long trace, without the model."""
    from cachecraft.bench.eviction import run_replay
    from cachecraft.dataset import load_items

    if embed is None:
        from cachecraft.retrieval.embed import Embedder
        embed = Embedder().embed
    on_progress and on_progress(f"eviction: replaying {requests} requests")
    result = run_replay(lm, load_items(dataset, limit), requests=requests, top_k=top_k, zipf_s=1.2, seed=0,
                        kv_dtype=config.kv_dtype, embed=embed)
    payload = {**_payload("replay", lm, config, dataset, out), "benchmark": "eviction", "kv_dtype": config.kv_dtype,
               **result}
    return write_result(out, payload)


def run_scaling_default(lm: LoadedModel, config: Config, dataset: Path, out: Path,
                        on_progress: Progress | None = None, **settings) -> Path:
    """``bench scaling`` with its defaults (``settings`` override them, for tests)."""
    from cachecraft.bench.scaling import run_scaling
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    specs = parse_methods("full,prefix,reuse,cacheblend,cachecraft", config.cacheblend_ratio, config.policy_alpha)
    result = run_scaling(lm, config, load_items(dataset), specs, on_step=lambda what, done, total: on_progress and
                         on_progress(f"scaling: {done}/{total} {what}"), **settings)
    payload = {**_payload("scaling", lm, config, dataset, out, **settings), "kv_dtype": config.kv_dtype, **result}
    return write_result(out, payload)


def run_revisit_default(lm: LoadedModel, config: Config, dataset: Path, out: Path,
                        on_progress: Progress | None = None, **settings) -> Path:
    """``bench scaling --revisit`` at one long context: the methods after an earlier
    request saw the same chunks shuffled, next to caches made ahead. ``settings``
    override :data:`DEFAULTS` (``contexts``, ``repeats``, ``chunk_tokens``, ``max_new_tokens``)."""
    return _run_long_context("revisit", REVISIT_METHODS, lm, config, dataset, out, on_progress, settings,
                             revisit=True)


def run_loading_default(lm: LoadedModel, config: Config, dataset: Path, out: Path,
                        on_progress: Progress | None = None, **settings) -> Path:
    """``bench scaling --whole-read`` at one long context from the disk tier: chunk-caches
    streamed in during the prefill next to the same caches read whole before it.
    ``settings`` override :data:`DEFAULTS` (as for the revisit run, plus ``tier``)."""
    return _run_long_context("loading", LOADING_METHODS, lm, config, dataset, out, on_progress, settings,
                             whole_read=True)


def run_tradeoff_default(lm: LoadedModel, config: Config, dataset: Path, out: Path,
                         on_progress: Progress | None = None, **settings) -> Path:
    """``bench scaling`` at one long context over a sweep of recompute ratios (CacheBlend's
    check and the question-guided choice) next to full, reuse and the policy: what each
    share of recomputed tokens buys in agreement. ``settings`` as for the revisit run."""
    return _run_long_context("tradeoff", TRADEOFF_METHODS, lm, config, dataset, out, on_progress, settings)


def _run_long_context(name: str, methods: str, lm: LoadedModel, config: Config, dataset: Path, out: Path,
                      on_progress: Progress | None, settings: dict, **flags) -> Path:
    from cachecraft.bench.scaling import run_scaling
    from cachecraft.dataset import load_items
    from cachecraft.methods import parse_methods

    settings = {**DEFAULTS[name], **settings}
    specs = parse_methods(methods, config.cacheblend_ratio, config.policy_alpha)
    extra = {"tier": settings["tier"]} if "tier" in settings else {}
    result = run_scaling(lm, config, load_items(dataset), specs, contexts=[settings["contexts"]], chunk_counts=[],
                         chunk_tokens=settings["chunk_tokens"], repeats=settings["repeats"],
                         max_new_tokens=settings["max_new_tokens"], **extra, **flags,
                         on_step=lambda what, done, total: on_progress and on_progress(
                             f"{name}: {done}/{total} {what}"))
    payload = {**_payload(name, lm, config, dataset, out, **settings), "benchmark": "scaling",
               "kv_dtype": config.kv_dtype, **result}
    return write_result(out, payload)


RUNS = {"quality": run_quality_default, "workload": run_workload_default, "replay": run_replay_default,
        "scaling": run_scaling_default, "revisit": run_revisit_default, "loading": run_loading_default,
        "tradeoff": run_tradeoff_default}
