"""``cachecraft bench serve``: concurrent clients against ``cachecraft serve`` on this machine.

A Zipf trace of MuSiQue-format requests (as ``bench workload`` makes it) is sent by N
client threads at once (each takes the next request as soon as its last one is
answered), with the retrieved chunks as ``documents``, streamed, to a server started
fresh (empty cache directory) for every method and client count; the methods take turns
at each client count, so that the machine's drift over the run falls on each alike. Per
run: throughput, time to first token as the client sees it (queueing included) at the
50th, 90th and 99th percentile, the server's own TTFT, and hit rate per tier. ``full``
on the same trace is the baseline.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from cachecraft.bench.common import fresh_cache_dir, hit_shares
from cachecraft.bench.servers import free_port, stop_process
from cachecraft.bench.workload import TraceRequest

START_TIMEOUT_S = 300


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class Server:
    """``cachecraft serve`` as a subprocess on a free loopback port."""

    def __init__(self, cache_dir: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # its output goes to a file: a pipe nobody reads would fill and stall the server
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        self.log = Path(cache_dir) / "serve.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "cachecraft.cli.app", "serve", "--port",
                                          str(self.port), "--log-level", "warning"],
                                         env={**os.environ, **env, "CACHECRAFT_CACHE_DIR": str(cache_dir)},
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cachecraft serve exited: {self.log.read_text(errors='replace')[-500:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"cachecraft serve did not answer within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        stop_process(self.proc, 60)


def ask(url: str, request: TraceRequest, method: str, max_tokens: int) -> dict:
    """One streamed chat completion; client-side TTFT and total time, and the server's report."""
    body = {"messages": [{"role": "user", "content": request.question}], "documents": list(request.chunks),
            "method": method, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first = None
    report = None
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                raise RuntimeError(payload["error"]["message"])
            if first is None and payload["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - start
            report = payload.get("cachecraft", report)
    total = time.perf_counter() - start
    return {"client_ttft_s": first if first is not None else total, "total_s": total,
            "server_ttft_s": report["ttft_s"], "hits_by_tier": report["hits_by_tier"],
            "recompute_fraction": report["recompute_fraction"]}


def run_clients(url: str, trace: Sequence[TraceRequest], clients: int, method: str, max_tokens: int) -> dict:
    """The trace sent by ``clients`` threads at once; a summary and the per-request rows."""
    work: queue.Queue = queue.Queue()
    for i, request in enumerate(trace):
        work.put((i, request))
    rows: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                i, request = work.get_nowait()
            except queue.Empty:
                return
            try:
                row = {"index": i, **ask(url, request, method, max_tokens)}
            except Exception as exc:  # recorded: a failed request is a result too
                with lock:
                    errors.append(f"request {i}: {exc}")
                continue
            with lock:
                rows.append(row)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    tiers: dict[str, int] = {}
    for row in rows:
        for tier, n in row["hits_by_tier"].items():
            tiers[tier] = tiers.get(tier, 0) + n
    ttft = [r["client_ttft_s"] for r in rows]
    return {"clients": clients, "method": method, "requests": len(rows), "errors": errors, "wall_s": wall,
            "throughput_rps": len(rows) / wall if wall else None,
            "client_ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
            "server_ttft_s_median": statistics.median(r["server_ttft_s"] for r in rows) if rows else None,
            **hit_shares(tiers),
            "recompute_fraction_mean": statistics.fmean(r["recompute_fraction"] for r in rows) if rows else None,
            "rows": sorted(rows, key=lambda r: r["index"])}


def run_order(clients: Sequence[int], methods: Sequence[str]) -> list[tuple[str, int]]:
    """The (method, client count) runs in the order they are made: every method at one
    client count before the next count, the methods' order reversed at every other count,
    so that drift in this machine's speed over the run weighs on each method alike."""
    order = []
    for i, n in enumerate(clients):
        order += [(method, n) for method in (methods if i % 2 == 0 else list(reversed(methods)))]
    return order


def run_serving(trace: Sequence[TraceRequest], *, clients: Sequence[int], methods: Sequence[str], max_tokens: int,
                workdir: Path, models_dir: Path, env: dict[str, str],
                on_step: Callable[[str], None] | None = None) -> list[dict]:
    """Every (method, client count) on a fresh server (an empty cache directory whose
    ``models`` folder links to ``models_dir``, so converted models are reused), made in
    :func:`run_order`; one result per run, listed method by method, each with ``started``
    (its place in that order, from 0)."""
    made = {}
    for started, (method, n) in enumerate(run_order(clients, methods)):
        if on_step:
            on_step(f"{method}, {n} client(s)")
        cache_dir = fresh_cache_dir(workdir / f"{method}-{n}", models_dir)
        server = Server(cache_dir, {**env, "CACHECRAFT_SERVER_QUEUE": str(max(n, 1))})
        try:
            made[method, n] = {**run_clients(server.url, trace, n, method, max_tokens), "started": started}
        finally:
            server.stop()
    return [made[method, n] for method in methods for n in clients]
