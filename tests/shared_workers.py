"""Node processes the shared-tier test starts (importable by a forkserver child)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cachecraft.config import Config
from cachecraft.store import TieredStore

from tests.store_helpers import make_kv, same_kv


def node_kv(node: int, j: int):
    """Entry ``j`` of node ``node``; the same bytes in every process."""
    return make_kv(7000 + 100 * node + j, layers=2, tokens=16)


def node_worker(cache_dir: str, redis_url: str, budget: int, node: int, nodes: int, count: int,
                barrier, out: str) -> None:
    """One node: put its entries, then read every node's; record any damaged read."""
    torch.set_num_threads(1)
    config = Config(cache_dir=Path(cache_dir), redis_url=redis_url, redis_budget_bytes=budget)
    errors, hits = [], 0
    with TieredStore(config, tiers=("cpu",), budgets={"cpu": 10**9}, reconcile=False) as store:
        barrier.wait(timeout=120)
        for j in range(count):
            store.put(node_kv(node, j))
        barrier.wait(timeout=120)
        for other in range(nodes):
            for j in range(count):
                kv = node_kv(other, j)
                got = store.shared.get(kv.variant)  # the shared tier itself, not the local copy
                if got is None:
                    continue
                hits += 1
                if not same_kv(got[1], kv, torch.float16):
                    errors.append(kv.variant)
        counters = store.shared.counters.to_dict()
    Path(out).write_text(json.dumps({"errors": errors, "hits": hits, "counters": counters}))
