"""The store benchmark runs end to end and writes a JSON document (no timing assertions)."""

from __future__ import annotations

import json

from cachecraft.bench.common import code_identity
from cachecraft.bench.store import run_store_benchmark


def test_store_benchmark_writes_json(tmp_path):
    out = tmp_path / "bench" / "store.json"
    started_on = code_identity()  # the code the run starts on (a commit made while it runs is noted apart)
    doc = run_store_benchmark(out, cache_dir=tmp_path / "cache", num_chunks=2, num_tokens=16, num_layers=3,
                              repeats=1)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert set(doc["tiers"]) == {"cpu", "disk"}
    for tier in doc["tiers"].values():
        for name in ("put", "get_stored", "get_compute", "layers"):
            assert tier[f"{name}_gbps"] > 0
        assert tier["stored_bytes"] == 2 * 16 * 3 * 3 * 64 * 2 * 2
    assert doc["chunk"]["stored_bytes_per_token"] == 3 * 3 * 64 * 2 * 2
    assert {k: v for k, v in doc["code"].items() if k != "changed_since_start"} == started_on
    assert not any((tmp_path / "cache").glob("bench-store-*"))  # its temporary stores are gone
