"""The prefix-caching baseline."""

import torch

from cachecraft.engine import blended_prefill
from cachecraft.methods import prefix_segments, remember_prefix
from cachecraft.prefix_cache import PrefixCache, block_keys
from cachecraft.prompt import PromptPieces
from tests.test_engine import hf_forward, make_prompt


def test_block_keys_chain():
    a = block_keys("fp", [1, 2, 3, 4, 5], 2)
    b = block_keys("fp", [1, 2, 9, 4], 2)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_keys("fp", [9, 2, 3, 4], 2)[1] != a[1]  # same block, different parent
    assert block_keys("other", [1, 2], 2) != block_keys("fp", [1, 2], 2)


def test_lru_evicts_leaves_before_roots():
    cache = PrefixCache("fp", block_size=2, budget_bytes=3 * 32)  # a block: k and v of [1, 1, 2, 2] float32
    kv = [torch.randn(1, 8, 2)]
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], kv, kv)  # four blocks -> one evicted
    assert len(cache) == 3
    hit = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert hit is not None and hit.num_tokens == 6  # the leaf went, the chain's head stayed


def test_prefix_method_reuses_exact_blocks_and_matches_full(tiny_llama):
    prefix, chunks, question = make_prompt()
    pieces = PromptPieces(tuple(prefix), tuple(map(tuple, chunks)), tuple(question))
    logits, _ = hf_forward(tiny_llama, prefix, chunks, question)
    cache = PrefixCache(tiny_llama.fingerprint, block_size=4)
    first_segments = prefix_segments(pieces, cache.match(pieces.token_ids, limit=pieces.num_tokens - 1))
    assert all(s.cached is None for s in first_segments)
    first = blended_prefill(tiny_llama.adapter, first_segments)
    assert remember_prefix(cache, tiny_llama.adapter, first) == pieces.num_tokens // 4
    again = prefix_segments(pieces, cache.match(pieces.token_ids, limit=pieces.num_tokens - 1))
    cached = sum(len(s.token_ids) for s in again if s.cached is not None)
    assert cached == ((pieces.num_tokens - 1) // 4) * 4
    result = blended_prefill(tiny_llama.adapter, again)
    assert result.recompute_fraction < 0.1
    assert (result.logits - logits).abs().max() < 1e-4
    assert [s.role for s in again][:2] == ["prefix", "chunk"]
