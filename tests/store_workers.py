"""Processes the crash and concurrency tests start (importable by a forkserver child)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from cachecraft.catalog import RequestChunk, RequestRecord
from cachecraft.config import Config
from cachecraft.store import TieredStore
from cachecraft.store.codec import encode
from cachecraft.store.tiers import entry_nbytes

from tests.store_helpers import make_kv, same_kv

CRASH_POOL = 20


def crash_kv(i: int):
    """Entry ``i`` of the crash test's pool; the same bytes in every process."""
    return make_kv(5000 + i, layers=4, heads=2, tokens=64, head_dim=32, prefix=(f"p{i % 4}",))


CRASH_ENTRY = entry_nbytes(crash_kv(0).to(torch.float16))
CRASH_BLOB = len(encode(crash_kv(0).to(torch.float16)).data)
CRASH_BUDGETS = {"cpu": 3 * CRASH_ENTRY, "disk": 8 * CRASH_ENTRY}


def crash_writer(cache_dir: str, seed: int, ready: str, bad: str) -> None:
    """Put, get and delete at random until killed; reopen the store now and then."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    config = Config(cache_dir=Path(cache_dir))
    pool = [crash_kv(i) for i in range(CRASH_POOL)]
    while True:
        store = TieredStore(config, tiers=("cpu", "disk"), budgets=CRASH_BUDGETS)
        Path(ready).touch()
        for _ in range(rng.randint(5, 40)):
            kv = rng.choice(pool)
            op = rng.random()
            if op < 0.6:
                store.put(kv)
            elif op < 0.9:
                got = store.get(kv.variant, promote=rng.random() < 0.5)
                if got is not None and not same_kv(got, kv, torch.float16):
                    Path(bad).write_text(f"damaged read of {kv.variant}")
                    os._exit(3)
            else:
                store.delete(kv.variant)
        store.close(persist=rng.random() < 0.7)


def crash_at(cache_dir: str, point: str) -> None:
    """Fill a disk-only store, then die (``os._exit``) at one point of the next put."""
    import diskcache

    from cachecraft.store.tiers import DiskTier

    config = Config(cache_dir=Path(cache_dir))
    store = TieredStore(config, tiers=("disk",), budgets={"disk": 3 * CRASH_BLOB + 100})
    for i in range(3):
        store.put(crash_kv(i))
    if point == "mid_blob_write":
        def write(self, full_path, iterator, mode, encoding=None):
            os.makedirs(os.path.dirname(full_path), exist_ok=True)
            with open(full_path, mode) as f:
                f.write(next(iter(iterator))[:1000])
            os._exit(137)
        diskcache.Disk._write = write
    elif point == "after_blob_write":
        original = DiskTier.write

        def write_then_die(self, blob_id, blob):
            original(self, blob_id, blob)
            os._exit(137)
        DiskTier.write = write_then_die
    elif point == "after_commit":
        def die(self, blob_id):
            os._exit(137)
        DiskTier.delete = die  # the first deletion follows the COMMIT that evicted a victim
    else:
        raise ValueError(point)
    store.put(crash_kv(3))
    os._exit(0)  # not reached


def conc_kv(worker: int, j: int):
    """Entry ``j`` of worker ``worker`` (worker -1: the entries every worker shares)."""
    return make_kv(20000 + 100 * (worker + 1) + j, layers=2, heads=2, tokens=32, head_dim=16,
                   prefix=(f"w{worker}",))


def concurrent_worker(cache_dir: str, worker: int, n_own: int, n_shared: int, barrier, out: str) -> None:
    """Write own and shared entries, read the others', record requests, close (persist)."""
    torch.set_num_threads(1)
    rng = random.Random(worker)
    entry = entry_nbytes(conc_kv(0, 0).to(torch.float16))
    store = TieredStore(Config(cache_dir=Path(cache_dir)), tiers=("cpu", "disk"),
                        budgets={"cpu": 2 * entry, "disk": 2**34})
    barrier.wait(timeout=120)  # a sibling that died must not leave this one waiting for ever
    errors, seen = [], 0
    for j in range(n_own):
        kv = conc_kv(worker, j)
        store.put(kv, source=f"worker-{worker}")
        store.put(conc_kv(-1, j % n_shared))
        for other in range(4):
            want = conc_kv(other, rng.randrange(n_own)) if other != worker else conc_kv(-1, rng.randrange(n_shared))
            got = store.get(want.variant, promote=rng.random() < 0.5)
            if got is not None:
                seen += 1
                if not same_kv(got, want, torch.float16):
                    errors.append(f"damaged read of {want.variant}")
        store.catalog.record_request(RequestRecord(
            f"q-{worker}-{j}", "cachecraft", (RequestChunk(0, kv.chunk, kv.variant, "cpu"), RequestChunk(1, "x")),
            recompute_fraction=0.1, ttft_s=0.5, full_prefill_s=1.0))
    store.close(persist=True)
    Path(out).write_text(json.dumps({"errors": errors, "seen": seen}))
