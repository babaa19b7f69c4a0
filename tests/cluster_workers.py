"""Node processes of the cluster tests: each its own cache directory, all sharing one
Redis and one PostgreSQL catalog (importable by a forkserver child)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from cachecraft.catalog import RequestChunk, RequestRecord
from cachecraft.config import Config
from cachecraft.store import TieredStore

from tests.store_helpers import make_kv, same_kv

POOL = 24
BUDGETS = {"cpu": 4 * 2**16, "disk": 2**30}


def pool_kv(i: int):
    """Entry ``i`` of the pool every node draws from; the same bytes in every process."""
    return make_kv(9000 + i, layers=4, heads=2, tokens=32, head_dim=16, prefix=("sys",))


def _config(cache_dir: str, redis_url: str, catalog_url: str) -> Config:
    return Config(cache_dir=Path(cache_dir), redis_url=redis_url, catalog_url=catalog_url)


def cluster_node(cache_dir: str, redis_url: str, catalog_url: str, seed: int, rounds: int, barrier,
                 out: str) -> None:
    """Put, read and record requests over the shared pool; every read is checked bit for bit."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    pool = [pool_kv(i) for i in range(POOL)]
    errors, tiers = [], {}
    with TieredStore(_config(cache_dir, redis_url, catalog_url), tiers=("cpu", "disk"), budgets=BUDGETS) as store:
        barrier.wait(timeout=120)  # a sibling that died must not leave this one waiting for ever
        for _ in range(rounds):
            i = rng.randrange(POOL)
            tier = store.locate(pool[i].variant)
            got = store.get(pool[i].variant)
            if got is None:
                store.put(pool[i])
            elif not same_kv(got, pool[i], store.stored_dtype):
                errors.append(pool[i].variant)
            tiers[tier or "miss"] = tiers.get(tier or "miss", 0) + 1
            chunk = RequestChunk(0, pool[i].chunk, pool[i].variant if tier else None, tier or "miss")
            store.catalog.record_request(RequestRecord("q", "reuse", (chunk,), 0.0, 0.01, 0.1, node=store.node))
        counters = store.shared.counters.to_dict()
        node = store.node
    Path(out).write_text(json.dumps({"errors": errors, "tiers": tiers, "counters": counters, "node": node}))


def cluster_writer(cache_dir: str, redis_url: str, catalog_url: str, ready: str) -> None:
    """Put the pool over and over (disk, Redis and the catalog all written) until killed."""
    torch.set_num_threads(1)
    pool = [pool_kv(i) for i in range(POOL)]
    with TieredStore(_config(cache_dir, redis_url, catalog_url), tiers=("cpu", "disk"), budgets=BUDGETS) as store:
        n = 0
        while True:
            store.put(pool[n % POOL])
            n += 1
            if n == 3:
                Path(ready).write_text("ready")
