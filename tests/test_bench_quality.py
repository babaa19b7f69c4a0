"""bench quality's store: a run longer than the store's budget keeps the caches it measures."""

from __future__ import annotations

import torch

from cachecraft.bench.quality import run_quality, warm_chunks
from cachecraft.config import DEFAULT_QUESTION_TEMPLATE, Config
from cachecraft.dataset import load_items
from cachecraft.methods import MethodSpec
from cachecraft.prompt import PromptBuilder
from cachecraft.selection import create_chunk_cache
from cachecraft.store import TieredStore
from cachecraft.store.tiers import entry_nbytes

SYSTEM = "w3 w4 w5"


def _stored_bytes(lm, item) -> tuple[int, int]:
    """Bytes the CPU tier charges for the system prefix and for one item's chunk-caches."""
    builder = PromptBuilder(lm.tokenizer, SYSTEM, DEFAULT_QUESTION_TEMPLATE)
    pieces = builder.build([PromptBuilder.chunk_text(text, title) for title, text in item.passages], item.question)
    prefix = create_chunk_cache(lm.adapter, [], pieces.prefix, fingerprint=lm.fingerprint,
                                collect_stats=False).to(torch.float16)
    chunks = warm_chunks(lm, pieces, prefix, torch.float16)
    return entry_nbytes(prefix), sum(entry_nbytes(kv) for kv in chunks)


def test_a_run_longer_than_the_budget_keeps_the_caches_of_the_item_it_measures(tiny_llama, dataset, tmp_path):
    items = load_items(dataset)
    sizes = [_stored_bytes(tiny_llama, item) for item in items]
    prefix_bytes, item_bytes = sizes[0]
    assert max(size for _, size in sizes) < 1.5 * item_bytes
    # Room for the prefix and one item's caches, not for two items': the second item's
    # caches, which have no hits yet, would be the first to be evicted to make room.
    config = Config.load(overrides={"cache_dir": tmp_path / "scratch",
                                    "cpu_budget_bytes": prefix_bytes + int(1.5 * item_bytes)})
    with TieredStore(config, tiers=("cpu",)) as store:
        result = run_quality(tiny_llama, items, [MethodSpec("full"), MethodSpec("reuse")], system_prompt=SYSTEM,
                             max_new_tokens=2, store=store)
        usage = store.usage()["cpu"]
        assert (usage.entries, usage.bytes) == (1, prefix_bytes)  # only the shared system prefix is left
        assert store.counters.evictions == 0
        store.close(persist=False)
    assert [(r["item"], r["method"]) for r in result["items"]] == [(0, "full"), (0, "reuse"), (1, "full"), (1, "reuse")]
    assert result["methods"]["reuse"]["recompute_fraction_mean"] == 0.0
