"""``cachecraft bench store``: put/get throughput per tier for SmolLM2-sized chunks.

Each tier is measured alone (a store with only that tier, a budget large enough for
every chunk), through the store's real paths: dtype conversion, checksums, catalog
rows. Throughput is stored KV bytes (K and V in ``kv_dtype``) per second. Chunks are
made in ``compute_dtype`` (as a prefill would make them) on the tier's device, so put
includes the conversion to ``kv_dtype`` and get includes the conversion back.
Disk reads right after writes come mostly from the OS page cache; the figures are an
upper bound for a cold SSD.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Sequence

import torch

from cachecraft.bench.common import running_code
from cachecraft.config import Config, default_cache_dir
from cachecraft.kv import ChunkKV, kv_bytes_per_token
from cachecraft.store import TieredStore

log = logging.getLogger(__name__)


def _make_chunks(n: int, tokens: int, layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: str, seed: int) -> list[ChunkKV]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        shape = (layers, heads, tokens, head_dim)
        keys = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
        values = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
        token_ids = tuple(int(t) for t in torch.randint(0, 49152, (tokens,), generator=g))
        out.append(ChunkKV(token_ids, keys, values, f"bench-{seed}", prefix=(f"bench-prefix-{i}",)))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _measure_tier(tier: str, root: Path, chunks: list[ChunkKV], kv_dtype: str,
                  compute_dtype: torch.dtype, device: str, repeats: int) -> dict:
    stored_bytes = sum(c.keys.numel() * 2 * torch.empty((), dtype=getattr(torch, kv_dtype)).element_size()
                       for c in chunks)
    budget = 4 * stored_bytes + 2**24
    config = Config(cache_dir=root / f"{tier}-{uuid.uuid4().hex[:8]}", kv_dtype=kv_dtype)
    times: dict[str, list[float]] = {"put": [], "get_stored": [], "get_compute": [], "layers": []}
    with TieredStore(config, tiers=(tier,), budgets={tier: budget}) as store:
        for _ in range(repeats):
            for c in chunks:
                store.delete(c.variant)
            _sync(device)
            t0 = time.perf_counter()
            for c in chunks:
                assert store.put(c) == tier, f"chunk did not land in the {tier} tier"
            _sync(device)
            times["put"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for c in chunks:
                assert store.get(c.variant, device=device, promote=False) is not None
            _sync(device)
            times["get_stored"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for c in chunks:
                assert store.get(c.variant, dtype=compute_dtype, device=device, promote=False) is not None
            _sync(device)
            times["get_compute"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for c in chunks:
                reader = store.iter_layers(c.variant, dtype=compute_dtype, device=device, promote=False)
                with reader:
                    for _k, _v in reader:
                        pass
            _sync(device)
            times["layers"].append(time.perf_counter() - t0)
        store.close(persist=False)
    result = {"stored_bytes": stored_bytes}
    for name, values in times.items():
        best = min(values)
        result[f"{name}_gbps"] = stored_bytes / best / 1e9
        result[f"{name}_seconds_best"] = best
        result[f"{name}_seconds_median"] = statistics.median(values)
    return result


def run_store_benchmark(out_path: str | Path | None, *, cache_dir: str | Path | None = None,
                        tiers: Sequence[str] | None = None, num_chunks: int = 8, num_tokens: int = 600,
                        num_layers: int = 30, num_kv_heads: int = 3, head_dim: int = 64,
                        kv_dtype: str = "float16", compute_dtype: str = "float32", repeats: int = 3,
                        seed: int = 0, command: str | None = None) -> dict:
    """Measure put/get throughput (GB/s) per tier; writes the result as JSON to ``out_path``
    (with ``command``, the line that made it, when given).

    Defaults are SmolLM2-135M-sized chunks (30 layers, 3 KV heads, head dim 64, 600
    tokens). The stores live in a temporary folder inside ``cache_dir`` (default: the
    configured cache directory, so the disk figures are for that disk), removed after.
    """
    assert num_chunks >= 1 and repeats >= 1, "need at least one chunk and one repeat"
    cuda = torch.cuda.is_available()
    tiers = list(tiers) if tiers else (["gpu"] if cuda else []) + ["cpu", "disk"]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = base / f"bench-store-{uuid.uuid4().hex[:8]}"
    compute = getattr(torch, compute_dtype)
    results: dict[str, dict] = {}
    try:
        for tier in tiers:
            device = "cuda" if tier == "gpu" else "cpu"
            chunks = _make_chunks(num_chunks, num_tokens, num_layers, num_kv_heads, head_dim, compute,
                                  device, seed)
            log.info("benchmarking the %s tier: %d chunks of %d tokens", tier, num_chunks, num_tokens)
            results[tier] = _measure_tier(tier, root, chunks, kv_dtype, compute, device, repeats)
            del chunks
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype)
    doc = {
        "benchmark": "store",
        **({"command": command} if command else {}),
        "chunk": {"num_tokens": num_tokens, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
                  "head_dim": head_dim, "kv_dtype": kv_dtype, "compute_dtype": compute_dtype,
                  "stored_bytes_per_token": per_token, "stored_bytes_per_chunk": per_token * num_tokens},
        "num_chunks": num_chunks,
        "repeats": repeats,
        "tiers": results,
        "definitions": {
            "put_gbps": f"stored bytes / seconds to put chunks made in {compute_dtype} (conversion included)",
            "get_stored_gbps": f"get in {kv_dtype} (a fresh copy) onto the tier's compute device",
            "get_compute_gbps": f"get converted to {compute_dtype}",
            "layers_gbps": f"iter_layers to {compute_dtype}, layer by layer",
            "figures": "best of the repeats; medians alongside",
        },
        "notes": ["disk reads follow the writes, so they mostly hit the OS page cache"],
        "environment": {"torch": torch.__version__, "cuda": cuda, "platform": platform.platform(),
                        "python": platform.python_version(), "cpu_count": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(),
                        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                        "device": torch.cuda.get_device_name(0) if cuda else None},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "code": running_code(),
    }
    if out_path is not None:
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return doc
