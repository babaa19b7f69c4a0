"""Static and look-ahead token selectors."""

import torch

from cachecraft.engine import Segment, blended_prefill
from cachecraft.selection import (TokenAttention, count_for, first_tokens, question_guided, spread_tokens,
                                  top_inter_attention)
from cachecraft.kv import AttentionStats
from tests.test_engine import caches_after_prefix_alone, hf_forward, make_prompt


def test_count_for_rounds_up_and_caps():
    assert count_for(0.15, 100) == 15
    assert count_for(0.151, 100) == 16
    assert count_for(0.0, 10) == 0
    assert count_for(1.0, 7) == 7


def test_top_inter_attention_by_hand():
    outside = torch.tensor([[0.1, 0.9, 0.3, 0.5], [0.3, 0.7, 0.1, 0.5]])  # layer means: .2 .8 .2 .5
    stats = AttentionStats(outside, torch.zeros(2, 1), torch.zeros(2))
    assert top_inter_attention(stats, 2).tolist() == [1, 3]
    assert first_tokens(5, 3).tolist() == [0, 1, 2]
    assert first_tokens(2, 3).tolist() == [0, 1]


def test_spread_tokens_by_hand():
    # (2i + 1) * span // (2 * count): 10 tokens, 2 picks -> 10 // 4 = 2 and 30 // 4 = 7
    assert spread_tokens(10, 2).tolist() == [2, 7]
    assert spread_tokens(10, 5).tolist() == [1, 3, 5, 7, 9]
    assert spread_tokens(10, 3, start=4).tolist() == [5, 7, 9]  # span 6: 4 + 1, 4 + 3, 4 + 5
    assert spread_tokens(4, 9).tolist() == [0, 1, 2, 3]  # capped: every token once
    assert spread_tokens(4, 0).tolist() == [] and spread_tokens(4, 2, start=4).tolist() == []


def cached_segments(lm, prefix, chunks, question):
    prefix_kv, kvs = caches_after_prefix_alone(lm, prefix, chunks)
    return ([Segment(prefix, "prefix", cached=prefix_kv)] + [Segment(c, cached=kv) for c, kv in zip(chunks, kvs)]
            + [Segment(question, "question")])


def test_question_attention_per_key_matches_eager_attention_at_layer_zero(tiny_llama):
    prefix, chunks, question = make_prompt()
    segments = cached_segments(tiny_llama, prefix, chunks, question)
    look = TokenAttention(0)
    probe = blended_prefill(tiny_llama.adapter, segments, hooks=[look], until_layer=1)
    assert probe.logits is None and len(probe.keys) == 1
    model = tiny_llama.model
    model.set_attn_implementation("eager")
    ids = torch.tensor(prefix + [t for c in chunks for t in c] + question)
    with torch.no_grad():
        attention = model(ids[None], output_attentions=True).attentions[0][0].mean(dim=0)  # [N, N]
    expected = attention[-len(question):].sum(dim=0)  # layer 0 is exact for cached tokens
    assert torch.allclose(look.mass, expected, atol=1e-5)


def test_question_guided_picks_the_most_attended_chunk_tokens(tiny_llama):
    prefix, chunks, question = make_prompt()
    segments = cached_segments(tiny_llama, prefix, chunks, question)
    look = TokenAttention(2)
    blended_prefill(tiny_llama.adapter, segments, hooks=[look], until_layer=3)
    lo = len(prefix)
    n_chunk = sum(map(len, chunks))
    mass = look.mass[lo:lo + n_chunk]
    expected = set(mass.topk(count_for(0.2, n_chunk)).indices.tolist())
    picks = question_guided(tiny_llama.adapter, segments, 2, 0.2)
    assert picks[0] is None and picks[-1] is None
    offsets, got = 0, set()
    for seg, pick in zip(segments[1:-1], picks[1:-1]):
        got |= {offsets + int(i) for i in pick}
        offsets += len(seg.token_ids)
    assert got == expected


def test_question_guided_at_full_ratio_reproduces_full_prefill(any_tiny):
    prefix, chunks, question = make_prompt()
    logits, _ = hf_forward(any_tiny, prefix, chunks, question)
    segments = cached_segments(any_tiny, prefix, chunks, question)
    for seg, pick in zip(segments, question_guided(any_tiny.adapter, segments, 2, 1.0)):
        if pick is not None:
            seg.recompute = pick
    result = blended_prefill(any_tiny.adapter, segments)
    assert result.recompute_fraction == 1.0
    assert (result.logits - logits).abs().max() < 1e-4


def test_the_policy_gives_each_chunk_its_sink_tokens_first_and_the_rest_where_the_question_looks(tiny_llama):
    """Counts 0, 5, 3 with 2 sink tokens: chunk 0 untouched; chunks 1 and 2 get tokens 0 and 1,
    then the 3 + 1 = 4 remaining tokens go, in total, to the most attended of their other
    tokens (worked out here from the question's attention at the check layer)."""
    from cachecraft.methods.policy import place_plan_tokens, sink_counts
    from cachecraft.policy.planner import ChunkPlan, RecomputePlan

    assert sink_counts([0, 5, 3, 1], 2) == [0, 2, 2, 1]
    prefix, chunks, question = make_prompt()
    segments = cached_segments(tiny_llama, prefix, chunks, question)
    look = TokenAttention(2)
    blended_prefill(tiny_llama.adapter, segments, hooks=[look], until_layer=3)
    starts = [len(prefix) + sum(map(len, chunks[:i])) for i in range(len(chunks))]
    others = torch.cat([torch.arange(starts[i] + 2, starts[i] + len(chunks[i])) for i in (1, 2)])
    expected = set(others[look.mass[others].topk(4).indices].tolist())
    counts = [0, 5, 3] + [0] * (len(chunks) - 3)
    plan = RecomputePlan(tuple(ChunkPlan(f"c{i}", "v", None, n, len(c)) for i, (n, c) in enumerate(zip(counts, chunks))))
    assert place_plan_tokens(tiny_llama.adapter, segments, plan, check_layer=2, sink_tokens=2)  # looked ahead
    picked = {i: segments[1 + i].recompute for i in range(len(chunks))}
    assert not segments[1].fixable and picked[0] is None
    assert picked[1][:2].tolist() == [0, 1] and picked[2][:2].tolist() == [0, 1]
    assert len(picked[1]) + len(picked[2]) == 8
    chosen = {starts[i] + int(t) for i in (1, 2) for t in picked[i] if int(t) >= 2}
    assert chosen == expected


def test_sink_tokens_alone_need_no_look_ahead(tiny_llama):
    from cachecraft.methods.policy import place_plan_tokens
    from cachecraft.policy.planner import ChunkPlan, RecomputePlan

    prefix, chunks, question = make_prompt()
    segments = cached_segments(tiny_llama, prefix, chunks, question)
    plan = RecomputePlan(tuple(ChunkPlan(f"c{i}", "v", None, 3, len(c)) for i, c in enumerate(chunks)))
    assert not place_plan_tokens(tiny_llama.adapter, segments, plan, check_layer=2, sink_tokens=4)
    assert all(seg.recompute.tolist() == [0, 1, 2] for seg in segments[1:-1])


def test_with_a_drift_shift_the_policy_spreads_each_chunk_s_count_after_its_sink_tokens(tiny_llama):
    """Counts 0, 5, 3 with 2 sink tokens and shift 1: chunk 0 untouched; chunk 1 (25 tokens)
    gets 0, 1 and 3 tokens spread over 2-24 (span 23: 2 + 23 // 6, 2 + 69 // 6, 2 + 115 // 6);
    chunk 2 (35 tokens) 0, 1 and one token in the middle of 2-34 (2 + 33 // 2); the drift is
    measured on the spread tokens alone; no look-ahead runs."""
    from cachecraft.methods.policy import place_plan_tokens
    from cachecraft.policy.planner import ChunkPlan, RecomputePlan

    prefix, chunks, question = make_prompt()
    segments = cached_segments(tiny_llama, prefix, chunks, question)
    counts = [0, 5, 3] + [0] * (len(chunks) - 3)
    plan = RecomputePlan(tuple(ChunkPlan(f"c{i}", "v", None, n, len(c)) for i, (n, c) in enumerate(zip(counts, chunks))))
    assert not place_plan_tokens(tiny_llama.adapter, segments, plan, check_layer=2, sink_tokens=2, drift_shift=1.0)
    assert segments[1].recompute is None and segments[1].drift_shift == 0.0
    assert segments[2].recompute.tolist() == [0, 1, 5, 13, 21] and segments[2].drift_shift == 1.0
    assert segments[3].recompute.tolist() == [0, 1, 18] and segments[3].drift_shift == 1.0
    assert (segments[2].drift_from, segments[3].drift_from) == (2, 2)  # the drift measured past the sinks


def test_with_relevance_the_spread_counts_follow_the_question_s_attention_per_chunk(tiny_llama):
    """Counts 0, 5, 3 with 2 sink tokens, shift 1 and relevance 1: the 3 + 1 = 4 spread tokens
    go to chunks 1 and 2 in proportion to the question's attention at the check layer to
    their tokens after the sinks (worked out here from that attention, rounded down, the
    token left over to the chunk furthest below its share); each is then spread after its
    sinks as without relevance, and the look-ahead ran."""
    from cachecraft.methods.policy import place_plan_tokens
    from cachecraft.policy.planner import ChunkPlan, RecomputePlan

    prefix, chunks, question = make_prompt()
    segments = cached_segments(tiny_llama, prefix, chunks, question)
    look = TokenAttention(2)
    blended_prefill(tiny_llama.adapter, segments, hooks=[look], until_layer=3)
    starts = [len(prefix) + sum(map(len, chunks[:i])) for i in range(len(chunks))]
    m1, m2 = (float(look.mass[starts[i] + 2:starts[i] + len(chunks[i])].sum()) for i in (1, 2))
    wanted = [4 * m1 / (m1 + m2), 4 * m2 / (m1 + m2)]
    shares = [int(w) for w in wanted]
    if sum(shares) < 4:
        shares[0 if wanted[0] - shares[0] >= wanted[1] - shares[1] else 1] += 1
    counts = [0, 5, 3] + [0] * (len(chunks) - 3)
    plan = RecomputePlan(tuple(ChunkPlan(f"c{i}", "v", None, n, len(c)) for i, (n, c) in enumerate(zip(counts, chunks))))
    assert place_plan_tokens(tiny_llama.adapter, segments, plan, check_layer=2, sink_tokens=2, drift_shift=1.0,
                             relevance=1.0)
    assert segments[1].recompute is None
    for i, share in zip((1, 2), shares):
        expected = [0, 1] + spread_tokens(len(chunks[i]), share, start=2).tolist()
        assert segments[1 + i].recompute.tolist() == expected and segments[1 + i].drift_shift == 1.0
