"""Method definitions: what each one reuses and recomputes."""

import pytest

from cachecraft.engine import Segment, blended_prefill
from cachecraft.policy.planner import PolicyParams
from cachecraft.methods import MethodSpec, UnknownMethod, build_segments, parse_methods, variant_info
from cachecraft.prompt import PromptPieces
from cachecraft.selection import create_chunk_cache
from tests.test_engine import hf_forward, make_prompt


def test_parse_methods():
    specs = parse_methods("full, cacheblend@0.3,qguided", 0.1)
    assert [s.label for s in specs] == ["full", "cacheblend@0.3", "qguided@0.1"]
    assert specs[1].layer == 1 and specs[2].layer == 8
    with pytest.raises(UnknownMethod, match="fancy"):
        parse_methods("full,fancy", 0.1)
    with pytest.raises(UnknownMethod, match="ratio"):
        parse_methods("cacheblend@2", 0.1)


def cached_pieces(lm):
    prefix, chunks, question = make_prompt()
    pieces = PromptPieces(tuple(prefix), tuple(map(tuple, chunks)), tuple(question))
    prefix_kv = create_chunk_cache(lm.adapter, [], prefix, fingerprint=lm.fingerprint, key="sys")
    before = [Segment(prefix, "prefix", cached=prefix_kv, key="sys")]
    kvs = [create_chunk_cache(lm.adapter, before, c, fingerprint=lm.fingerprint) for c in chunks]
    return (prefix, chunks, question), pieces, prefix_kv, kvs


def test_variant_info_drops_the_system_prefix(tiny_llama):
    _, _, _, kvs = cached_pieces(tiny_llama)
    info = variant_info(kvs[0])
    assert kvs[0].prefix == ("sys",) and kvs[0].prefix_tokens == (8,)
    assert info.prefix == () and info.inter.shape == (4, 0) and info.chunk_tokens == 30


def test_cachecraft_leaves_the_first_chunk_alone_and_fixes_the_rest(tiny_llama):
    _, pieces, prefix_kv, kvs = cached_pieces(tiny_llama)
    segments, check = build_segments(MethodSpec("cachecraft", 0.4, check_layer=2), pieces, prefix_kv, kvs,
                                     tiny_llama.adapter)
    assert check is None
    first, second, third = segments[1:4]
    assert first.recompute is None or len(first.recompute) == 0  # exact: cached right after the system prefix
    # cfo = 0.4 * cci_prior 0.5 = 0.2 -> ceil(0.2 * 25) + ceil(0.2 * 35) = 5 + 7 tokens, placed by the question
    assert sum(len(s.recompute) for s in (second, third) if s.recompute is not None) == 12


def test_cachecraft_with_full_alpha_is_exact(tiny_llama):
    parts, pieces, prefix_kv, kvs = cached_pieces(tiny_llama)
    logits, _ = hf_forward(tiny_llama, *parts)
    policy = PolicyParams(alpha=1.0, cci_prior=1.0, check_layer=2)
    segments, _ = build_segments(MethodSpec("cachecraft", 1.0), pieces, prefix_kv, kvs, tiny_llama.adapter, policy)
    result = blended_prefill(tiny_llama.adapter, segments)
    assert result.recomputed_tokens == sum(map(len, parts[1][1:]))  # all but the exact first chunk
    assert (result.logits - logits).abs().max() < 1e-4
