"""``cachecraft bench cluster``: node processes on this machine sharing one Redis and one
PostgreSQL catalog, against the same nodes each on its own.

A Zipf trace of MuSiQue-format requests (as ``bench workload`` makes it: top-k
retrieval over the pooled passages) is dealt round-robin to the nodes, each a separate
process with its own cache directory, answering through :meth:`Pipeline.answer`. It is
run twice, from empty caches each time:

- ``isolated``: every node with its own SQLite catalog and local tiers only;
- ``shared``: every node with ``redis_url`` and ``catalog_url`` set, so a chunk-cache one
  node made is found by the others.

Per phase: hit rate per tier, recompute, TTFT and the prefill work done (tokens run
through a layer, summed over requests); the work the shared phase saves is
``1 - work(shared) / work(isolated)``. Last, one process times TTFT with the same
chunk-caches read from each tier in turn (Redis, then the local CPU tier, then the local
disk tier), beside a full prefill of the same prompt, with ``reuse`` so that only where
the bytes come from differs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from cachecraft.bench.common import fresh_cache_dir, hit_shares
from cachecraft.bench.workload import TraceRequest
from cachecraft.config import Config

PHASES = ("isolated", "shared")
TIMED_TIERS = ("redis", "cpu", "disk")


@dataclass(frozen=True)
class NodeJob:
    """What one node process answers, and where it writes its rows."""

    node: int
    config: Config
    requests: tuple[TraceRequest, ...]
    method: str
    max_new_tokens: int
    out: str
    threads: int = 1


@dataclass
class PhaseResult:
    """What the nodes of one phase did."""

    rows: list[dict] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        """Hit rate per tier, recompute, TTFT, prefill work and the requests that kept their
        chunk order exact, over every node's requests."""
        tiers: dict[str, int] = {}
        for row in self.rows:
            for tier in row["tiers"]:
                tiers[tier] = tiers.get(tier, 0) + 1
        ttft = [r["ttft_s"] for r in self.rows]
        return {"requests": len(self.rows), "chunks": sum(tiers.values()), **hit_shares(tiers),
                "recompute_fraction_mean": statistics.fmean(r["recompute_fraction"] for r in self.rows),
                "ttft_s_mean": statistics.fmean(ttft), "ttft_s_median": statistics.median(ttft),
                "token_layers": sum(r["token_layers"] for r in self.rows), "wall_s": self.wall_s,
                "kept_exact_requests": sum(1 for r in self.rows if r.get("kept_exact"))}


def split(trace: Sequence[TraceRequest], nodes: int) -> list[tuple[TraceRequest, ...]]:
    """The trace dealt round-robin to ``nodes`` nodes (request i goes to node i mod n)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    return [tuple(trace[i::nodes]) for i in range(nodes)]


def run_node(job: NodeJob, barrier=None) -> None:
    """One node process: load the model, wait for the others, answer its requests and
    write one JSON row per request to ``job.out``."""
    import torch

    from cachecraft.pipeline import Pipeline

    torch.set_num_threads(job.threads)
    pipe = Pipeline(job.config)
    rows = []
    try:
        if barrier is not None:
            barrier.wait()
        for request in job.requests:
            work = {}

            def observe(trace, work=work) -> None:
                work["token_layers"] = trace.token_layers

            answer = pipe.answer(list(request.chunks), request.question, method=job.method,
                                 max_new_tokens=job.max_new_tokens, observer=observe)
            rows.append({"node": job.node, "item": request.item, "ttft_s": answer.ttft_s,
                         "recompute_fraction": answer.recompute_fraction, "prompt_tokens": answer.prompt_tokens,
                         "token_layers": work.get("token_layers", 0), "tiers": [c.tier for c in answer.chunks],
                         "kept_exact": answer.kept_exact, "answer": answer.text})
        node_id = pipe.store.node
    finally:
        pipe.close()
    Path(job.out).write_text(json.dumps({"node_id": node_id, "rows": rows}), encoding="utf-8")


def run_phase(jobs: Sequence[NodeJob], timeout_s: float = 3600.0) -> PhaseResult:
    """Run the node processes of one phase at once; raises if a node fails."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(jobs))
    procs = [ctx.Process(target=run_node, args=(job, barrier), name=f"node-{job.node}") for job in jobs]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout_s)
    wall = time.perf_counter() - start
    failed = [p.name for p in procs if p.exitcode != 0]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if failed:
        raise RuntimeError(f"node process(es) {', '.join(failed)} failed; see the messages above")
    result = PhaseResult(wall_s=wall)
    for job in jobs:
        result.rows += json.loads(Path(job.out).read_text(encoding="utf-8"))["rows"]
    return result


def time_tiers(config: Config, requests: Sequence[TraceRequest], *, max_new_tokens: int,
               on_step: Callable[[str], None] | None = None) -> dict:
    """TTFT of ``reuse`` with every chunk-cache read from Redis, from the CPU tier and from
    the disk tier, and of ``full``, on the same prompts, in this process.

    ``config`` names the shared tier, which already holds the prompts' chunk-caches, and a
    cache directory of its own that starts empty. Per prompt, in order: full; reuse from
    Redis (a fresh CPU tier, nothing on disk: each hit promoted into the CPU tier); reuse
    again, now from the CPU tier; then, the CPU tier written to disk and the store opened
    on disk alone, reuse from disk.
    """
    from cachecraft.model.loader import load_model
    from cachecraft.pipeline import Pipeline
    from cachecraft.store import TieredStore

    lm = load_model(config.model, config)
    rows = []
    for i, request in enumerate(requests):
        cache_dir = Path(config.cache_dir) / f"probe-{i}"
        probe = config.replace(cache_dir=cache_dir)
        row = {"item": request.item, "sources": {}}
        # keep_new_variants off: full's prefill must not leave chunk-caches for reuse to find
        pipe = Pipeline(probe, lm=lm, store=TieredStore(probe, tiers=("cpu", "disk")), keep_new_variants=False)
        try:
            chunks = list(request.chunks)
            pipe.answer(chunks, request.question, method="full", max_new_tokens=1, record=False)  # warm-up
            row["full_s"] = pipe.answer(chunks, request.question, method="full", max_new_tokens=max_new_tokens,
                                        record=False).ttft_s
            for source in ("redis", "cpu"):
                answer = pipe.answer(chunks, request.question, method="reuse", max_new_tokens=max_new_tokens,
                                     record=False)
                row["sources"][source] = {"ttft_s": answer.ttft_s, "tiers": sorted({c.tier for c in answer.chunks})}
        finally:
            pipe.close()  # the CPU tier is written to disk
        pipe = Pipeline(probe, lm=lm, store=TieredStore(probe, tiers=("disk",)), keep_new_variants=False)
        try:
            answer = pipe.answer(chunks, request.question, method="reuse", max_new_tokens=max_new_tokens,
                                 record=False)
            row["sources"]["disk"] = {"ttft_s": answer.ttft_s, "tiers": sorted({c.tier for c in answer.chunks})}
        finally:
            pipe.close()
        rows.append(row)
        if on_step:
            on_step(f"tier timing {i + 1}/{len(requests)}")
    clean = [r for r in rows if all(r["sources"][t]["tiers"] == [t] for t in TIMED_TIERS)]
    summary = {}
    for tier in TIMED_TIERS:
        values = [r["sources"][tier]["ttft_s"] for r in clean]
        summary[tier] = {"ttft_s_median": statistics.median(values) if values else None,
                         "speedup_vs_full_median": statistics.median(r["full_s"] / r["sources"][tier]["ttft_s"]
                                                                     for r in clean) if clean else None,
                         "vs_cpu_median": statistics.median(r["sources"][tier]["ttft_s"] / r["sources"]["cpu"]["ttft_s"]
                                                            for r in clean) if clean else None}
    summary["full"] = {"ttft_s_median": statistics.median(r["full_s"] for r in clean) if clean else None}
    return {"prompts": len(rows), "prompts_from_one_tier": len(clean), "rows": rows, "summary": summary}


def unique_requests(trace: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    """The first ``n`` distinct requests of the trace, in order."""
    return list(dict.fromkeys(trace))[:n]


def run_cluster(config: Config, trace: Sequence[TraceRequest], *, nodes: int, method: str, max_new_tokens: int,
                workdir: Path, redis_url: str, catalog_url: str, timed_prompts: int = 6,
                on_step: Callable[[str], None] | None = None) -> dict:
    """Both phases and the tier timing (see the module docstring); cache directories are made
    under ``workdir``. ``redis_url`` and ``catalog_url`` name servers this benchmark may
    fill (use empty ones: the shared phase counts on starting from nothing)."""
    from cachecraft.catalog import Catalog
    from cachecraft.catalog.stats import by_node

    parts = split(trace, nodes)
    phases: dict[str, PhaseResult] = {}
    for phase in PHASES:
        shared = phase == "shared"
        jobs = [NodeJob(n, config.replace(cache_dir=fresh_cache_dir(workdir / phase / f"node-{n}", config.models_dir),
                                          redis_url=redis_url if shared else "",
                                          catalog_url=catalog_url if shared else ""),
                        part, method, max_new_tokens, str(workdir / phase / f"node-{n}.json"))
                for n, part in enumerate(parts)]
        if on_step:
            on_step(f"{phase}: {nodes} node processes, {len(trace)} requests")
        (workdir / phase).mkdir(parents=True, exist_ok=True)
        phases[phase] = run_phase(jobs)
    if on_step:
        on_step("tier timing")
    timing = time_tiers(config.replace(cache_dir=fresh_cache_dir(workdir / "timing", config.models_dir),
                                       redis_url=redis_url, catalog_url=""),
                        unique_requests(trace, timed_prompts), max_new_tokens=max_new_tokens, on_step=on_step)
    with Catalog(workdir, url=catalog_url) as catalog:
        catalog_nodes = by_node(catalog)
    summaries = {phase: result.summary() for phase, result in phases.items()}
    isolated, shared = summaries["isolated"]["token_layers"], summaries["shared"]["token_layers"]
    return {"nodes": nodes, "requests": len(trace), "method": method,
            "phases": summaries, "prefill_work_saved_vs_isolated": 1 - shared / isolated if isolated else None,
            "tier_timing": timing, "catalog_by_node": catalog_nodes,
            "rows": {phase: result.rows for phase, result in phases.items()}}
