"""Crash consistency: writers killed with SIGKILL at random points and at chosen points.

After every kill ``verify`` may find only what a crash legitimately leaves (a blob or a
file written before its row committed, memory-tier rows of the dead process), never a
row without bytes or damaged bytes; ``verify --repair`` makes the cache consistent, a
store opened on it reconciles the same things, and every read returns sound data.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from cachecraft.config import Config
from cachecraft.store import TieredStore, verify
from cachecraft.store.store import store_paths

from tests.store_helpers import same_kv
from tests.store_workers import CRASH_BUDGETS, CRASH_POOL, crash_at, crash_kv, crash_writer

CRASH_LEFTOVERS = {"orphan-blob", "orphan-file", "dead-owner"}
KILLS = 24


@pytest.fixture(scope="module")
def ctx():
    context = mp.get_context("forkserver")  # children start fast and never fork a busy torch
    context.set_forkserver_preload(["torch", "cachecraft.store", "tests.store_workers"])
    return context


def _wait_for(path: Path, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.is_alive(), f"writer exited early with code {proc.exitcode}"
        assert time.monotonic() < deadline, "writer never got ready"
        time.sleep(0.005)


def _read_all_sound(cache_dir: Path) -> int:
    """Open a store (it reconciles) and read every key of the pool; returns hits."""
    hits = 0
    with TieredStore(Config(cache_dir=cache_dir), tiers=("cpu", "disk"), budgets=CRASH_BUDGETS) as store:
        for i in range(CRASH_POOL):
            kv = crash_kv(i)
            got = store.get(kv.variant, promote=False)
            if got is not None:
                hits += 1
                assert same_kv(got, kv, torch.float16), f"damaged read of entry {i}"
        assert store.counters.corrupt == 0
        store.close(persist=False)
    return hits


def test_sigkill_at_random_points(cache_dir, ctx):
    rng = random.Random(7)
    ready, bad = cache_dir.parent / "ready", cache_dir.parent / "bad"
    seen_kinds: set[str] = set()
    for round_ in range(KILLS):
        proc = ctx.Process(target=crash_writer, args=(str(cache_dir), round_, str(ready), str(bad)))
        proc.start()
        _wait_for(ready, proc)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        ready.unlink()
        assert not bad.exists(), bad.read_text()
        assert proc.exitcode == -signal.SIGKILL
        report = verify(cache_dir)
        kinds = {p.kind for p in report.problems}
        seen_kinds |= kinds
        assert kinds <= CRASH_LEFTOVERS, report.to_dict()
        if round_ % 6 == 5:
            repaired = verify(cache_dir, repair=True)
            assert repaired.consistent, repaired.to_dict()
            assert verify(cache_dir).ok
    assert "dead-owner" in seen_kinds  # the kills did land while the writer held memory entries
    assert _read_all_sound(cache_dir) > 0
    final = verify(cache_dir, repair=True)
    assert final.consistent and verify(cache_dir).ok
    assert final.counts["disk_bytes"] <= CRASH_BUDGETS["disk"]


@pytest.mark.parametrize("point,leftover", [("mid_blob_write", "orphan-file"),
                                            ("after_blob_write", "orphan-blob"),
                                            ("after_commit", "orphan-blob")])
def test_crash_at_each_point_of_a_disk_write(cache_dir, ctx, point, leftover):
    proc = ctx.Process(target=crash_at, args=(str(cache_dir), point))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 137
    report = verify(cache_dir)
    assert {p.kind for p in report.problems} == {leftover}, report.to_dict()
    # a store opened on the directory reconciles the same leftovers away
    with TieredStore(Config(cache_dir=cache_dir), tiers=("disk",), budgets={"disk": 3 * 10**6}) as store:
        present = [i for i in range(4) if store.contains(crash_kv(i).variant)]
        for i in present:
            assert same_kv(store.get(crash_kv(i).variant), crash_kv(i), torch.float16)
        store.close(persist=False)
    if point == "after_commit":
        assert 3 in present and len(present) == 3  # the new entry committed, one victim evicted
    else:
        assert present == [0, 1, 2]  # the interrupted put never happened; nothing was lost
    assert verify(cache_dir).ok
    _, disk_dir, _ = store_paths(cache_dir)
    assert not [p for p in disk_dir.rglob("*.val") if p.stat().st_size < 5000]  # no half file left
