"""ChunkKV keys and serialisation."""

import pytest
import torch

from cachecraft.kv import AttentionStats, ChunkKV, chunk_key, kv_bytes_per_token, variant_key


def make_kv(fingerprint="fp", tokens=(5, 6, 7), prefix=("a",)):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, len(tokens), 4, generator=g)
    values = torch.randn(2, 3, len(tokens), 4, generator=g)
    stats = AttentionStats(torch.rand(2, len(tokens)), torch.rand(2, len(prefix)), torch.rand(2))
    return ChunkKV(tokens, keys, values, fingerprint, prefix, stats)


def test_keys_depend_on_fingerprint_tokens_and_prefix():
    assert chunk_key("a", [1, 2]) != chunk_key("b", [1, 2])
    assert chunk_key("a", [1, 2]) != chunk_key("a", [2, 1])
    assert chunk_key("a", [1, 2]) == chunk_key("a", (1, 2))
    assert variant_key("c", ["x", "y"]) != variant_key("c", ["y", "x"])
    assert variant_key("c", ["xy"]) != variant_key("c", ["x", "y"])
    assert make_kv().chunk == chunk_key("fp", (5, 6, 7))


def test_round_trip_through_tensors_is_bit_identical():
    kv = make_kv()
    tensors, meta = kv.to_tensors()
    assert set(tensors) >= {"k.0", "k.1", "v.0", "v.1", "token_ids"}
    back = ChunkKV.from_tensors(tensors, meta)
    assert back.token_ids == kv.token_ids and back.prefix == kv.prefix and back.chunk == kv.chunk
    assert torch.equal(back.keys, kv.keys) and torch.equal(back.values, kv.values)
    assert torch.equal(back.stats.outside, kv.stats.outside)
    assert back.variant == kv.variant


def test_shape_mismatch_is_rejected():
    with pytest.raises(AssertionError, match="rows"):
        ChunkKV((1, 2), torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), "fp")


def test_dtype_conversion_and_nbytes():
    kv = make_kv().to(torch.float16)
    assert kv.keys.dtype == torch.float16
    assert kv.nbytes == 2 * 2 * 3 * 3 * 4 * 2
    assert kv.layer(1)[0].shape == (3, 3, 4)
    per_token = kv_bytes_per_token(2, 3, 4, "float16")
    assert per_token == 2 * 2 * 3 * 4 * 2 and kv.nbytes == per_token * kv.num_tokens
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16) == 23040  # SmolLM2-135M, per token
