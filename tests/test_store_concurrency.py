"""Four processes writing and reading one cache directory at once lose and damage nothing."""

from __future__ import annotations

import json
import multiprocessing as mp

import torch

from cachecraft.catalog import Catalog, stats
from cachecraft.config import Config
from cachecraft.store import TieredStore, verify

from tests.process_helpers import run_to_end
from tests.store_helpers import same_kv
from tests.store_workers import conc_kv, concurrent_worker

WORKERS, OWN, SHARED = 4, 25, 4


def test_four_processes_share_one_cache_directory(cache_dir, tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "cachecraft.store", "tests.store_workers"])
    barrier = ctx.Barrier(WORKERS)
    outs = [tmp_path / f"worker-{w}.json" for w in range(WORKERS)]
    procs = [ctx.Process(target=concurrent_worker, args=(str(cache_dir), w, OWN, SHARED, barrier, str(outs[w])))
             for w in range(WORKERS)]
    assert run_to_end(procs, 240) == [0] * WORKERS
    results = [json.loads(o.read_text()) for o in outs]
    assert [r["errors"] for r in results] == [[]] * WORKERS  # no damaged read, ever
    assert sum(r["seen"] for r in results) > 0  # and the workers did read each other's entries

    report = verify(cache_dir)
    assert report.ok, report.to_dict()
    expected = [conc_kv(w, j) for w in range(WORKERS) for j in range(OWN)] + [conc_kv(-1, j) for j in range(SHARED)]
    with TieredStore(Config(cache_dir=cache_dir), tiers=("disk",)) as store:
        for kv in expected:  # every entry made it to disk, bit for bit
            assert same_kv(store.get(kv.variant), kv, torch.float16), kv.variant
        store.close(persist=False)
    with Catalog(cache_dir) as catalog:
        counts = report.counts
        assert counts["chunks"] == counts["variants"] == len(expected)
        assert counts["requests"] == WORKERS * OWN  # no lost rows
        assert counts["disk_entries"] == len(expected) and counts["cpu_entries"] == 0
        rates = stats.hit_rates(catalog)
        assert (rates.chunks, rates.hits, rates.misses) == (2 * WORKERS * OWN, WORKERS * OWN, WORKERS * OWN)
        sources = {catalog.chunk(conc_kv(w, 0).chunk).source for w in range(WORKERS)}
        assert sources == {f"worker-{w}" for w in range(WORKERS)}
