"""The engine against the model's own forward pass, on tiny random models of each architecture."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TextIteratorStreamer

from cachecraft.engine import PromptError, Segment, blended_prefill, generate_from, sampled_layers
from cachecraft.engine.attention import _AttentionPlan, shape_bucket
from cachecraft.selection import ChunkStatistics, DeviationCheck, QuestionAttention, create_chunk_cache
from tests.conftest import tiny_model

TOL = 1e-4
SIZES = [8, 30, 25, 35, 9]  # prefix, three chunks, question


def make_prompt(seed: int = 1, sizes=SIZES, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in sizes]
    return parts[0], parts[1:-1], parts[-1]


def full_segments(prefix, chunks, question, **chunk_kwargs):
    return [Segment(prefix, "prefix")] + [Segment(c, **chunk_kwargs) for c in chunks] + [Segment(question, "question")]


def caches_after_prefix_alone(lm, prefix, chunks):
    prefix_kv = create_chunk_cache(lm.adapter, [], prefix, fingerprint=lm.fingerprint)
    before = [Segment(prefix, "prefix", cached=prefix_kv)]
    return prefix_kv, [create_chunk_cache(lm.adapter, before, c, fingerprint=lm.fingerprint) for c in chunks]


def hf_forward(lm, prefix, chunks, question):
    ids = torch.tensor(prefix + [t for c in chunks for t in c] + question)
    with torch.no_grad():
        out = lm.model(ids[None], use_cache=True)
    return out.logits[0, -1], out["cache"] if "cache" in out.keys() else out.past_key_values


def test_full_prefill_matches_model_logits_and_kv(any_tiny):
    prefix, chunks, question = make_prompt()
    logits, past = hf_forward(any_tiny, prefix, chunks, question)
    result = blended_prefill(any_tiny.adapter, full_segments(prefix, chunks, question))
    assert (result.logits - logits).abs().max() < TOL
    for layer in range(any_tiny.adapter.num_layers):
        assert (result.keys[layer] - past.layers[layer].keys[0]).abs().max() < TOL
        assert (result.values[layer] - past.layers[layer].values[0]).abs().max() < TOL
    assert result.recompute_fraction == 1.0


def test_every_fraction_at_one_reproduces_full_prefill(any_tiny):
    prefix, chunks, question = make_prompt()
    logits, past = hf_forward(any_tiny, prefix, chunks, question)
    prefix_kv, kvs = caches_after_prefix_alone(any_tiny, prefix, chunks)
    segments = ([Segment(prefix, "prefix", cached=prefix_kv)]
                + [Segment(c, cached=kv, recompute=range(len(c))) for c, kv in zip(chunks, kvs)]
                + [Segment(question, "question")])
    result = blended_prefill(any_tiny.adapter, segments)
    assert (result.logits - logits).abs().max() < TOL
    last = any_tiny.adapter.num_layers - 1
    assert (result.values[last] - past.layers[last].values[0]).abs().max() < TOL
    assert result.recompute_fraction == 1.0


def test_cacheblend_ratio_one_reproduces_full_prefill(any_tiny):
    prefix, chunks, question = make_prompt()
    logits, _ = hf_forward(any_tiny, prefix, chunks, question)
    prefix_kv, kvs = caches_after_prefix_alone(any_tiny, prefix, chunks)
    segments = ([Segment(prefix, "prefix", cached=prefix_kv)]
                + [Segment(c, cached=kv) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")])
    result = blended_prefill(any_tiny.adapter, segments, hooks=[DeviationCheck(1, 1.0)])
    assert (result.logits - logits).abs().max() < TOL


def test_exact_prefix_variants_need_no_recompute(any_tiny):
    prefix, chunks, question = make_prompt()
    logits, _ = hf_forward(any_tiny, prefix, chunks, question)
    saved = blended_prefill(any_tiny.adapter, full_segments(prefix, chunks, question, save=True)).saved
    prefix_kv = create_chunk_cache(any_tiny.adapter, [], prefix, fingerprint=any_tiny.fingerprint)
    segments = ([Segment(prefix, "prefix", cached=prefix_kv)]
                + [Segment(c, cached=saved[i + 1]) for i, c in enumerate(chunks)] + [Segment(question, "question")])
    result = blended_prefill(any_tiny.adapter, segments)
    assert result.recompute_fraction == 0.0
    assert (result.logits - logits).abs().max() < TOL


def test_caches_in_any_mix_of_dtypes_assemble_to_the_same_prefill(tiny_llama, monkeypatch):
    # Caches in the dtype most rows are stored in are joined by one concatenation a layer
    # (then converted, where JOIN_THEN_CONVERT allows); the others are copied into place,
    # converting. float64 holds float32 values exactly, so every way must agree to the bit.
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    wide = torch.float64

    def prefill(prefix_dtype, chunk_dtype, join_then_convert):
        monkeypatch.setattr("cachecraft.engine.blend.JOIN_THEN_CONVERT", join_then_convert)
        segments = ([Segment(prefix, "prefix", cached=prefix_kv.to(dtype=prefix_dtype))]
                    + [Segment(c, cached=kv.to(dtype=chunk_dtype), recompute=[1, 4]) for c, kv in zip(chunks, kvs)]
                    + [Segment(question, "question")])
        return blended_prefill(tiny_llama.adapter, segments)

    copied = prefill(wide, wide, ())  # every cache copied into place
    assert kvs[0].keys.dtype == torch.float32
    for ways in [(torch.float32, torch.float32, ()), (wide, wide, ("cpu",)), (torch.float32, wide, ("cpu",)),
                 (wide, torch.float32, ())]:
        other = prefill(*ways)
        assert torch.equal(other.logits, copied.logits), ways
        assert all(torch.equal(a, b) for a, b in zip(other.keys + other.values, copied.keys + copied.values)), ways


def test_reuse_without_recompute_is_not_exact(tiny_llama):
    prefix, chunks, question = make_prompt()
    logits, _ = hf_forward(tiny_llama, prefix, chunks, question)
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    segments = ([Segment(prefix, "prefix", cached=prefix_kv)]
                + [Segment(c, cached=kv) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")])
    result = blended_prefill(tiny_llama.adapter, segments)
    assert result.recompute_fraction == 0.0
    assert (result.logits - logits).abs().max() > 1e-3


def test_layer_zero_kv_of_cached_tokens_is_context_free(tiny_llama):
    prefix, chunks, question = make_prompt()
    full = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question, save=True))
    _, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    for i, kv in enumerate(kvs):
        in_context = full.saved[i + 1]
        assert torch.allclose(kv.keys[0], in_context.keys[0], atol=1e-6)
        assert torch.allclose(kv.values[0], in_context.values[0], atol=1e-6)
        if i == 0:  # made after the prefix alone in both runs: identical at every layer
            assert torch.allclose(kv.values[1], in_context.values[1], atol=1e-6)
        else:
            assert not torch.allclose(kv.values[1], in_context.values[1], atol=1e-4)


def test_recomputed_rows_are_fresh_and_others_keep_cached_kv(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    picked = [0, 5, 17]
    segments = ([Segment(prefix, "prefix", cached=prefix_kv), Segment(chunks[0], cached=kvs[0]),
                 Segment(chunks[1], cached=kvs[1], recompute=picked), Segment(chunks[2], cached=kvs[2])]
                + [Segment(question, "question")])
    result = blended_prefill(tiny_llama.adapter, segments)
    start = len(prefix) + len(chunks[0])  # chunk 1 now follows chunk 0, unlike when it was cached
    layer = 2
    values = result.values[layer][:, start:start + len(chunks[1])]
    cached = kvs[1].values[layer]
    others = [i for i in range(len(chunks[1])) if i not in picked]
    assert torch.equal(values[:, others], cached[:, others])
    for i in picked:
        assert not torch.allclose(values[:, i], cached[:, i], atol=1e-5)
    assert result.recomputed_tokens == len(picked)
    assert result.context_tokens == sum(map(len, chunks))


class _Stored:
    """A stand-in cache for layout tests (never read)."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens

    def layer(self, index: int):
        raise AssertionError("not read here")


def _shift_by_hand(segments, active, k, v):
    """Lay out ``segments`` (9 tokens), K zeros and V ones in every cached row, and shift
    them with the fresh ``k`` and ``v`` of the ``active`` tokens (one KV head, 2 dims)."""
    from cachecraft.engine.blend import _shift_drift
    from cachecraft.engine.layout import make_layout

    lay = make_layout(segments, 2, 100, torch.device("cpu"))
    keys, values = torch.zeros(1, 9, 2), torch.ones(1, 9, 2)
    _shift_drift(lay, torch.tensor(active), keys, values, torch.tensor([k]), torch.tensor([v]))
    return lay, keys, values


def test_drift_shift_by_hand():
    """A chunk at positions 2-5 with shift 0.5, tokens 3 and 5 recomputed: every row of the
    chunk moves by half the mean of their fresh - cached; the prefix and question rows and a
    chunk without a shift stay as they were."""
    from cachecraft.engine.layout import make_layout

    segments = [Segment([1, 2], "prefix"), Segment([3, 4, 5, 6], cached=_Stored(4), drift_shift=0.5),
                Segment([7, 8], cached=_Stored(2)), Segment([9], "question")]
    # active: the prefix, tokens 3 and 5, token 7 of the other chunk, the question
    lay, keys, values = _shift_by_hand(segments, [0, 1, 3, 5, 7, 8],
                                       k=[[9., 9.], [9., 9.], [2., 0.], [4., 2.], [5., 5.], [9., 9.]],
                                       v=[[9., 9.], [9., 9.], [3., 3.], [1., 1.], [5., 5.], [9., 9.]])
    assert lay.shifted.tolist() == [2, 3, 4, 5] and lay.segment_of.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 3]
    # keys: drift ([2, 0] + [4, 2]) / 2 = [3, 1], half of it [1.5, 0.5]; values: ([2, 2] + [0, 0]) / 2 = [1, 1]
    assert keys[0, 2:6].tolist() == [[1.5, 0.5]] * 4 and values[0, 2:6].tolist() == [[1.5, 1.5]] * 4
    assert keys[0, [0, 1, 6, 7, 8]].eq(0).all() and values[0, [0, 1, 6, 7, 8]].eq(1).all()
    assert make_layout(segments[:1] + segments[2:], 2, 100, torch.device("cpu")).shift is None


def test_drift_shift_leaves_the_first_tokens_out_of_the_mean_by_hand():
    """The same chunk with ``drift_from=1``: token 2 (its first) and token 4 are recomputed,
    only token 4's drift counts; a chunk whose only recomputed token is before drift_from
    stays as stored."""
    segments = [Segment([1, 2], "prefix"), Segment([3, 4, 5, 6], cached=_Stored(4), drift_shift=1.0, drift_from=1),
                Segment([7, 8], cached=_Stored(2), drift_shift=1.0, drift_from=2), Segment([9], "question")]
    # active: the prefix, tokens 2 and 4, token 6 of the other chunk, the question
    lay, keys, values = _shift_by_hand(segments, [0, 1, 2, 4, 6, 8],
                                       k=[[9., 9.], [9., 9.], [8., 8.], [2., 4.], [5., 5.], [9., 9.]],
                                       v=[[9., 9.], [9., 9.], [8., 8.], [0., 3.], [5., 5.], [9., 9.]])
    assert lay.samples_drift.tolist() == [True, True, False, True, True, True, False, False, True]
    # keys: token 4 alone, [2, 4] - [0, 0]; values: 1 + ([0, 3] - [1, 1]) (token 2's 8s left out)
    assert keys[0, 2:6].tolist() == [[2., 4.]] * 4 and values[0, 2:6].tolist() == [[0., 3.]] * 4
    assert keys[0, [0, 1, 6, 7, 8]].eq(0).all() and values[0, [0, 1, 6, 7, 8]].eq(1).all()
    with pytest.raises(PromptError, match="drift_from must be >= 0"):
        Segment([3, 4], cached=_Stored(2), drift_shift=1.0, drift_from=-1)


def test_drift_shift_moves_the_other_rows_by_the_drift_of_the_recomputed_ones(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    picked = [0, 5, 17]
    segments = ([Segment(prefix, "prefix", cached=prefix_kv), Segment(chunks[0], cached=kvs[0]),
                 Segment(chunks[1], cached=kvs[1], recompute=picked, drift_shift=0.5),
                 Segment(chunks[2], cached=kvs[2])] + [Segment(question, "question")])
    result = blended_prefill(tiny_llama.adapter, segments)
    plain = blended_prefill(tiny_llama.adapter, [*segments[:2], Segment(chunks[1], cached=kvs[1], recompute=picked),
                                                 *segments[3:]])
    start = len(prefix) + len(chunks[0])
    others = [i for i in range(len(chunks[1])) if i not in picked]
    for layer in range(1, tiny_llama.adapter.num_layers):
        values = result.values[layer][:, start:start + len(chunks[1])]
        cached = kvs[1].values[layer]
        drift = (values[:, picked] - cached[:, picked]).mean(dim=1, keepdim=True)
        assert torch.allclose(values[:, others], cached[:, others] + 0.5 * drift, atol=1e-6)
        assert drift.abs().max() > 1e-3
        assert torch.equal(result.values[layer][:, len(prefix):start], kvs[0].values[layer])  # no shift asked
    assert result.recomputed_tokens == plain.recomputed_tokens == len(picked)  # the shift recomputes nothing
    assert (result.logits - plain.logits).abs().max() > 1e-4


def test_drift_shift_by_median_by_hand():
    """The chunk at positions 2-5 with half the median shift, tokens 2, 3 and 5 recomputed:
    per dimension, the middle of their three changes, not the mean that token 5's outlier
    would drag; the other chunk stays as stored."""
    segments = [Segment([1, 2], "prefix"),
                Segment([3, 4, 5, 6], cached=_Stored(4), drift_shift=0.5, drift_estimator="median"),
                Segment([7, 8], cached=_Stored(2)), Segment([9], "question")]
    lay, keys, values = _shift_by_hand(segments, [0, 1, 2, 3, 5, 8],
                                       k=[[9., 9.], [9., 9.], [1., 10.], [2., 0.], [30., 1.], [9., 9.]],
                                       v=[[9., 9.], [9., 9.], [1., 1.], [5., -3.], [2., 2.], [9., 9.]])
    assert lay.shift_estimator == "median"
    # keys: medians of (1, 2, 30) and (10, 0, 1) are 2 and 1, half of them [1, 0.5];
    # values: changes (0, 4, 1) and (0, -4, 1), medians 1 and 0, so 1 + [0.5, 0]
    assert keys[0, 2:6].tolist() == [[1., 0.5]] * 4 and values[0, 2:6].tolist() == [[1.5, 1.]] * 4
    assert keys[0, [0, 1, 6, 7, 8]].eq(0).all() and values[0, [0, 1, 6, 7, 8]].eq(1).all()
    mixed = [*segments[:2], Segment([7, 8], cached=_Stored(2), drift_shift=0.5), segments[3]]
    with pytest.raises(PromptError, match="must all take one drift estimator"):
        _shift_by_hand(mixed, [0, 1, 8], k=[[0., 0.]] * 3, v=[[0., 0.]] * 3)
    with pytest.raises(PromptError, match="drift_estimator must be one of"):
        Segment([3, 4], cached=_Stored(2), drift_shift=0.5, drift_estimator="mode")


# Two shifting chunks, two measuring tokens each. Changes (fresh - cached) of the first
# chunk's tokens 2 and 3: [0, 4] and [4, 4], mean [2, 4]; of the second's tokens 6 and 7:
# [-2, 2] and [-2, -2], mean [-2, 0]. Squared deviations from their own chunk's mean sum to
# 8 per dimension over 2 degrees of freedom: variance 4, noise in each mean 4 / 2 = 2.
_AGREEMENT_CHANGES = [[0., 4.], [4., 4.], [-2., 2.], [-2., -2.]]


def _shift_by_agreement_by_hand(estimator):
    segments = [Segment([1, 2], "prefix"), Segment([3, 4, 5, 6], cached=_Stored(4), drift_shift=1.0,
                                                   drift_estimator=estimator),
                Segment([7, 8], cached=_Stored(2), drift_shift=1.0, drift_estimator=estimator), Segment([9], "question")]
    fresh = [[9., 9.]] * 2 + _AGREEMENT_CHANGES + [[9., 9.]]
    # K is cached as 0 and V as 1, so V's fresh rows are 1 + the same changes
    lay, keys, values = _shift_by_hand(segments, [0, 1, 2, 3, 6, 7, 8], k=fresh,
                                       v=[[x + 1 for x in row] for row in fresh])
    assert lay.shift_estimator == estimator
    assert keys[0, [0, 1, 8]].eq(0).all() and values[0, [0, 1, 8]].eq(1).all()
    return keys[0], values[0] - 1


def test_drift_shift_shrunk_toward_no_move_by_hand():
    """``shrunk``: each mean m moves by m * m^2 / (m^2 + 2): first chunk [2 * 4/6, 4 * 16/18]
    = [4/3, 32/9]; second [-2 * 4/6, 0] = [-4/3, 0] (0 / 2 is 0)."""
    keys, moved = _shift_by_agreement_by_hand("shrunk")
    for rows in (keys, moved):
        assert rows[2:6].tolist() == [pytest.approx([4 / 3, 32 / 9])] * 4
        assert rows[6:8].tolist() == [pytest.approx([-4 / 3, 0.0])] * 2


def test_drift_shift_pooled_toward_the_prompts_mean_by_hand():
    """``pooled``: the prompt's mean change g = [0, 2] (the four tokens'); the chunks' means
    are 2 from it in each dimension, 4 squared against noise 2, so t2 = 4 - 2 = 2 and
    f = 2 / (2 + 2) = 1/2: first chunk [0 + (2 - 0) / 2, 2 + (4 - 2) / 2] = [1, 3], second
    [0 + (-2 - 0) / 2, 2 + (0 - 2) / 2] = [-1, 1]."""
    keys, moved = _shift_by_agreement_by_hand("pooled")
    for rows in (keys, moved):
        assert rows[2:6].tolist() == [pytest.approx([1.0, 3.0])] * 4
        assert rows[6:8].tolist() == [pytest.approx([-1.0, 1.0])] * 2


def test_drift_shift_by_agreement_with_one_token_a_chunk_is_the_mean():
    """With one measuring token a chunk there is no disagreement to measure (no degree of
    freedom): ``shrunk`` moves by the plain mean, and ``pooled``, whose chunks then differ
    by more than no noise, by each chunk's own."""
    for estimator in ("shrunk", "pooled"):
        segments = [Segment([1, 2], "prefix"),
                    Segment([3, 4, 5, 6], cached=_Stored(4), drift_shift=0.5, drift_estimator=estimator),
                    Segment([7, 8], cached=_Stored(2), drift_shift=0.5, drift_estimator=estimator),
                    Segment([9], "question")]
        _, keys, _ = _shift_by_hand(segments, [0, 3, 7, 8], k=[[9., 9.], [2., -4.], [6., 2.], [9., 9.]],
                                    v=[[9., 9.]] * 4)
        assert keys[0, 2:6].tolist() == [[1., -2.]] * 4 and keys[0, 6:8].tolist() == [[3., 1.]] * 2


@pytest.mark.parametrize("estimator", ["mean", "median", "shrunk", "pooled"])
def test_drift_shift_with_every_token_recomputed_is_full_prefill_and_without_any_is_reuse(any_tiny, estimator):
    prefix, chunks, question = make_prompt()
    logits, _ = hf_forward(any_tiny, prefix, chunks, question)
    prefix_kv, kvs = caches_after_prefix_alone(any_tiny, prefix, chunks)
    every = blended_prefill(any_tiny.adapter, [Segment(prefix, "prefix", cached=prefix_kv)]
                            + [Segment(c, cached=kv, recompute=range(len(c)), drift_shift=1.0,
                                       drift_estimator=estimator)
                               for c, kv in zip(chunks, kvs)] + [Segment(question, "question")])
    assert (every.logits - logits).abs().max() < TOL and every.recompute_fraction == 1.0
    none = blended_prefill(any_tiny.adapter, [Segment(prefix, "prefix", cached=prefix_kv)]
                           + [Segment(c, cached=kv, drift_shift=1.0, drift_estimator=estimator)
                              for c, kv in zip(chunks, kvs)]
                           + [Segment(question, "question")])
    reuse = blended_prefill(any_tiny.adapter, [Segment(prefix, "prefix", cached=prefix_kv)]
                            + [Segment(c, cached=kv) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")])
    assert torch.equal(none.logits, reuse.logits)


def test_stop_layer_zero_equals_plain_reuse_and_partial_stop_keeps_cached_above(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)

    def run(stop):
        segments = ([Segment(prefix, "prefix", cached=prefix_kv)]
                    + [Segment(c, cached=kv, recompute=range(len(c)), stop_layer=stop) for c, kv in zip(chunks, kvs)]
                    + [Segment(question, "question")])
        return blended_prefill(tiny_llama.adapter, segments)

    reuse = blended_prefill(tiny_llama.adapter, [Segment(prefix, "prefix", cached=prefix_kv)]
                            + [Segment(c, cached=kv) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")])
    assert torch.allclose(run(0).logits, reuse.logits, atol=1e-6)
    partial, full = run(2), run(None)
    lo, hi = len(prefix), len(prefix) + len(chunks[0])
    assert torch.allclose(partial.values[1][:, lo:hi], full.values[1][:, lo:hi], atol=1e-6)
    assert torch.equal(partial.values[2][:, lo:hi], kvs[0].values[2])
    assert 0 < partial.recompute_work < full.recompute_work


def test_deviation_check_picks_the_most_deviating_tokens(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    full = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
    ratio = 0.2
    lo = len(prefix)
    cached_v1 = torch.cat([kv.values[1] for kv in kvs], dim=1)
    fresh_v1 = full.values[1][:, lo:lo + cached_v1.shape[1]]
    deviation = (fresh_v1 - cached_v1).pow(2).sum(dim=(0, 2))
    count = math.ceil(ratio * deviation.numel())
    expected = set(deviation.topk(count).indices.tolist())
    segments = ([Segment(prefix, "prefix", cached=prefix_kv)]
                + [Segment(c, cached=kv) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")])
    result = blended_prefill(tiny_llama.adapter, segments, hooks=[DeviationCheck(1, ratio)])
    assert result.recomputed_tokens == count
    blended_v2 = result.values[2][:, lo:lo + cached_v1.shape[1]]
    cached_v2 = torch.cat([kv.values[2] for kv in kvs], dim=1)
    changed = {i for i in range(cached_v2.shape[1]) if not torch.equal(blended_v2[:, i], cached_v2[:, i])}
    assert changed == expected


def test_attention_statistics_match_eager_attention(tiny_llama):
    prefix, chunks, question = make_prompt()
    model = tiny_llama.model
    model.set_attn_implementation("eager")
    ids = torch.tensor(prefix + chunks[0] + chunks[1])
    with torch.no_grad():
        attentions = model(ids[None], output_attentions=True).attentions
    probs = torch.stack([a[0].mean(dim=0) for a in attentions])  # [L, N, N]
    before = [Segment(prefix, "prefix", key="p"), Segment(chunks[0], key="c0")]
    kv = create_chunk_cache(tiny_llama.adapter, before, chunks[1], fingerprint=tiny_llama.fingerprint, key="c1")
    a, b = len(prefix), len(prefix) + len(chunks[0])
    rows = probs[:, b:]
    assert kv.prefix == ("p", "c0")
    assert torch.allclose(kv.stats.outside, rows[:, :, :b].sum(-1), atol=1e-5)
    assert torch.allclose(kv.stats.inter[:, 0], rows[:, :, :a].sum((-1, -2)), atol=1e-4)
    assert torch.allclose(kv.stats.inter[:, 1], rows[:, :, a:b].sum((-1, -2)), atol=1e-4)
    assert torch.allclose(kv.stats.intra, rows[:, :, b:].sum((-1, -2)), atol=1e-4)
    assert torch.allclose(kv.stats.intra + kv.stats.inter.sum(-1), torch.full((4,), float(len(chunks[1]))))


def test_statistics_at_sampled_layers_are_those_layers_rows(tiny_llama):
    assert sampled_layers(30, 4) == (3, 7, 11, 15, 19, 23, 27)
    assert sampled_layers(2, 4) == (1,) and sampled_layers(3, 1) == (0, 1, 2)
    prefix, chunks, question = make_prompt()
    before = [Segment(prefix, "prefix", key="p"), Segment(chunks[0], key="c0")]
    every = create_chunk_cache(tiny_llama.adapter, before, chunks[1], fingerprint=tiny_llama.fingerprint, key="c1")
    some = create_chunk_cache(tiny_llama.adapter, before, chunks[1], fingerprint=tiny_llama.fingerprint, key="c1",
                              stats_layers=(1, 3))
    for name in ("outside", "inter", "intra"):
        assert torch.equal(getattr(some.stats, name), getattr(every.stats, name)[[1, 3]]), name
    assert torch.equal(some.keys, every.keys) and torch.equal(some.values, every.values)  # the KV is the same
    with pytest.raises(PromptError, match="none of the model's 4"):
        create_chunk_cache(tiny_llama.adapter, before, chunks[1], fingerprint=tiny_llama.fingerprint,
                           stats_layers=(7,))


def test_statistics_are_the_same_whether_the_prefix_is_cached_or_computed(tiny_llama):
    # A cold request: prefix cached, every chunk computed with statistics. Nearly every
    # position is active, so attention (and the statistics) take the dense padded path.
    prefix, chunks, question = make_prompt()
    prefix_kv, _ = caches_after_prefix_alone(tiny_llama, prefix, [])
    computed = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question, save=True,
                                                                 collect_stats=True), hooks=[ChunkStatistics()])
    segments = full_segments(prefix, chunks, question, save=True, collect_stats=True)
    segments[0] = Segment(prefix, "prefix", cached=prefix_kv)
    cold = blended_prefill(tiny_llama.adapter, segments, hooks=[ChunkStatistics()])
    assert (cold.logits - computed.logits).abs().max() < TOL
    for i in range(1, len(chunks) + 1):
        for name in ("outside", "inter", "intra"):
            assert torch.allclose(getattr(cold.saved[i].stats, name), getattr(computed.saved[i].stats, name),
                                  atol=1e-5), (i, name)


@pytest.mark.parametrize("bucket", [False, True])
def test_attention_plan_paths_agree_with_masked_attention(bucket):
    g = torch.Generator().manual_seed(0)
    n_total, heads, kv_heads, dim = 300, 4, 2, 8
    q, k, v = (torch.randn(h, n_total, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    keys, values = (x.repeat_interleave(heads // kv_heads, dim=0) for x in (k, v))
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(dim)
    scores.masked_fill_(torch.ones(n_total, n_total, dtype=torch.bool).triu(1), float("-inf"))
    reference = scores.softmax(-1) @ values
    scattered = torch.randperm(n_total, generator=g)[:120].sort().values
    for active, path in ((torch.arange(n_total), "full"), (torch.arange(20, n_total), "dense"), (scattered, "blocks")):
        plan = _AttentionPlan(active, n_total, block=32, bucket=bucket)
        assert path == ("full" if plan.full else "dense" if plan.dense else "blocks")
        out = plan.attend(q[:, active], k, v, 1 / math.sqrt(dim), gqa=True)
        assert (out - reference[:, active]).abs().max() < 1e-5, path


def test_question_attention_is_reported_per_segment(tiny_llama):
    prefix, chunks, question = make_prompt()
    look = QuestionAttention([1, 3])
    blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question), hooks=[look])
    assert set(look.mass) == {1, 3}
    mass = look.mass[3]
    assert mass.shape == (len(chunks) + 2,)
    assert mass.sum().item() == pytest.approx(len(question), rel=1e-5)


def test_greedy_generation_from_blended_cache_equals_plain_generate(any_tiny):
    prefix, chunks, question = make_prompt()
    ids = torch.tensor(prefix + [t for c in chunks for t in c] + question)
    plain = any_tiny.model.generate(ids[None], max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.numel():]
    result = blended_prefill(any_tiny.adapter, full_segments(prefix, chunks, question))
    assert generate_from(any_tiny.model, any_tiny.tokenizer, result, max_new_tokens=10).tolist() == plain.tolist()


def test_the_cache_goes_under_the_name_the_model_takes(any_tiny):
    """transformers renamed ``past_key_values`` to ``cache`` (the old name is deprecated and
    goes in 5.40): the name comes from the model's forward, so the handoff warns of nothing
    here and keeps working on releases with either name."""
    import warnings

    from cachecraft.engine.handoff import cache_argument, teacher_forced_logits

    class Before(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
            return input_ids

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None):
            return input_ids

    assert cache_argument(Before()) == "past_key_values"
    assert cache_argument(Renamed()) == "cache"
    prefix, chunks, question = make_prompt()
    result = blended_prefill(any_tiny.adapter, full_segments(prefix, chunks, question))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        again = blended_prefill(any_tiny.adapter, full_segments(prefix, chunks, question))  # the handoff takes the tensors
        new = generate_from(any_tiny.model, any_tiny.tokenizer, result, max_new_tokens=4)
        teacher_forced_logits(any_tiny.model, again.keys, again.values, again.token_ids, new)


def _generated(lm, cache, ids, new: int):
    from cachecraft.engine.handoff import cache_argument

    return lm.model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True, **{cache_argument(lm.model): cache})


def test_decoding_writes_into_room_kept_for_the_answer_with_the_same_scores(any_tiny):
    """The handed-over cache keeps room for the answer: every decoded token's K/V go into
    storage allocated once (transformers' own layers copy the whole cache at each token),
    and each token's scores equal those over transformers' own cache exactly. Sliding-window
    layers are left to transformers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from cachecraft.engine.handoff import GrowingLayer, to_transformers_cache

    prefix, chunks, question = make_prompt()
    ids = torch.tensor(prefix + [t for c in chunks for t in c] + question)
    result = blended_prefill(any_tiny.adapter, full_segments(prefix, chunks, question))
    plain = DynamicCache(config=any_tiny.model.config)
    for layer, (k, v) in enumerate(zip(result.keys, result.values)):
        plain.update(k[None, :, :-1].clone(), v[None, :, :-1].clone(), layer)
    cache = to_transformers_cache(result, any_tiny.model.config, room=13)
    full_attention = [type(layer) is DynamicLayer for layer in plain.layers]
    assert [isinstance(layer, GrowingLayer) for layer in cache.layers] == full_attention
    assert any(full_attention) != bool(getattr(any_tiny.model.config, "sliding_window", None))
    rooms = [layer._rooms[0] for layer in cache.layers if isinstance(layer, GrowingLayer)]

    ours, theirs = _generated(any_tiny, cache, ids, 12), _generated(any_tiny, plain, ids, 12)
    assert ours.sequences.tolist() == theirs.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores))
    growing = [layer for layer in cache.layers if isinstance(layer, GrowingLayer)]
    assert all(layer._rooms[0] is room and layer.keys.data_ptr() == room.data_ptr()
               for layer, room in zip(growing, rooms))
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(cache.layers, plain.layers))


def test_growing_layer_appends_grows_and_survives_crops_and_batch_changes_by_hand():
    from cachecraft.engine.handoff import GrowingLayer

    def tokens(start: int, n: int, batch: int = 1) -> torch.Tensor:  # [batch, 2 heads, n, 2]
        return torch.arange(start, start + batch * 2 * n * 2, dtype=torch.float32).reshape(batch, 2, n, 2)

    layer = GrowingLayer(room=4)
    a, b, c = tokens(0, 3), tokens(100, 1), tokens(200, 2)
    keys, values = layer.update(a, -a)
    assert torch.equal(keys, a) and torch.equal(values, -a) and layer._rooms[0].shape[-2] == 4
    start = layer._rooms[0].data_ptr()
    keys, _ = layer.update(b, -b)
    assert torch.equal(keys, torch.cat([a, b], dim=-2)) and keys.data_ptr() == start
    keys, values = layer.update(c, -c)  # 6 tokens in room for 4: half as much again
    assert layer._rooms[0].shape[-2] == 9 and layer.get_seq_length() == 6
    assert torch.equal(keys, torch.cat([a, b, c], dim=-2)) and torch.equal(values, -keys)
    start = layer._rooms[0].data_ptr()
    layer.crop(-2)
    d = tokens(300, 1)
    keys, values = layer.update(d, -d)  # cropped rows are written over, in the same room
    assert torch.equal(keys, torch.cat([a, b, d], dim=-2)) and torch.equal(values, -keys)
    assert keys.data_ptr() == start
    layer.batch_repeat_interleave(2)  # replaces the tensors: the next update moves them
    e = tokens(400, 1, batch=2)
    keys, values = layer.update(e, -e)
    expected = torch.cat([torch.cat([a, b, d], dim=-2).repeat_interleave(2, dim=0), e], dim=-2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert keys.data_ptr() == layer._rooms[0].data_ptr() != start
    layer.reset()
    keys, _ = layer.update(b, -b)
    assert torch.equal(keys, b) and layer.get_seq_length() == 1


def test_room_set_aside_for_the_answer_stops_at_the_models_positions(tiny_llama):
    from cachecraft.engine.handoff import to_transformers_cache

    prefix, chunks, question = make_prompt()  # 107 tokens; the tiny models have 1024 positions
    for asked, expected in ((10, 106 + 10), (10**6, 1024)):
        result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
        cache = to_transformers_cache(result, tiny_llama.model.config, room=asked)
        assert {layer._rooms[0].shape[-2] for layer in cache.layers} == {expected}


def test_growing_layer_starts_on_releases_whose_initializer_takes_the_keys_alone():
    from cachecraft.engine.handoff import GrowingLayer

    class KeysAlone(GrowingLayer):
        def lazy_initialization(self, key_states):
            super().lazy_initialization(key_states, key_states)

    keys = torch.ones(1, 2, 3, 4)
    for layer in (GrowingLayer(room=5), KeysAlone(room=5)):
        got, values = layer.update(keys, -keys)
        assert torch.equal(got, keys) and torch.equal(values, -keys) and layer._rooms[0].shape[-2] == 5


def test_sampling_and_streaming_from_blended_cache(tiny_llama):
    prefix, chunks, question = make_prompt()
    ids = torch.tensor(prefix + [t for c in chunks for t in c] + question)
    torch.manual_seed(7)
    plain = tiny_llama.model.generate(ids[None], max_new_tokens=8, do_sample=True, top_k=50,
                                      pad_token_id=0)[0, ids.numel():]
    result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
    torch.manual_seed(7)
    sampled = generate_from(tiny_llama.model, tiny_llama.tokenizer, result, max_new_tokens=8, do_sample=True,
                            top_k=50)
    assert sampled.tolist() == plain.tolist()

    streamer = TextIteratorStreamer(tiny_llama.tokenizer, skip_prompt=True)
    result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
    new = generate_from(tiny_llama.model, tiny_llama.tokenizer, result, max_new_tokens=6, streamer=streamer)
    streamed = "".join(streamer)
    assert streamed.split() == tiny_llama.tokenizer.decode(new).split()


def test_stopping_criteria_end_generation(tiny_llama):
    from transformers import StoppingCriteria, StoppingCriteriaList

    prefix, chunks, question = make_prompt()
    result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
    free = generate_from(tiny_llama.model, tiny_llama.tokenizer, result, max_new_tokens=12).tolist()
    stop_id = free[2]

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_id

    result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
    stopped = generate_from(tiny_llama.model, tiny_llama.tokenizer, result, max_new_tokens=12,
                            stopping_criteria=StoppingCriteriaList([StopAt()])).tolist()
    assert stopped == free[:free.index(stop_id) + 1]


def test_bad_prompts_raise_prompt_error(tiny_llama):
    prefix, chunks, question = make_prompt()
    adapter = tiny_llama.adapter
    with pytest.raises(PromptError, match="no segments"):
        blended_prefill(adapter, [])
    with pytest.raises(PromptError, match="empty"):
        Segment([], "chunk")
    kv = create_chunk_cache(adapter, [], prefix, fingerprint=tiny_llama.fingerprint)
    with pytest.raises(PromptError, match="question"):
        blended_prefill(adapter, [Segment(prefix, "prefix", cached=kv)])
    with pytest.raises(PromptError, match="context window"):
        blended_prefill(adapter, [Segment(list(range(3, 300)) * 4, "question")])
    with pytest.raises(PromptError, match="out of range"):
        blended_prefill(adapter, [Segment(prefix, "prefix", cached=kv, recompute=[99]), Segment(question, "question")])
    with pytest.raises(PromptError, match="tokens but"):
        Segment(question, cached=kv)
    with pytest.raises(PromptError, match="drift_shift must be >= 0"):
        Segment(question, drift_shift=-0.5)


def test_mistral_sliding_window_caps_the_context():
    lm = tiny_model("mistral")
    assert lm.max_context == 512
    with pytest.raises(PromptError, match="512"):
        blended_prefill(lm.adapter, [Segment(list(range(3, 300)) * 2, "question")])


def test_early_termination_callback_stops_a_segment(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)

    def segments():
        return ([Segment(prefix, "prefix", cached=prefix_kv)]
                + [Segment(c, cached=kv, recompute=range(len(c))) for c, kv in zip(chunks, kvs)]
                + [Segment(question, "question")])

    seen = []

    def stop_chunk_two(layer, mass):
        seen.append((layer, mass.clone()))
        return {2: layer + 1}

    stopped = blended_prefill(tiny_llama.adapter, segments(), hooks=[QuestionAttention([1], on_mass=stop_chunk_two)])
    planned = blended_prefill(tiny_llama.adapter, [s if i != 2 else Segment(s.token_ids, cached=s.cached,
                                                   recompute=s.recompute, stop_layer=2)
                                                   for i, s in enumerate(segments())])
    assert [layer for layer, _ in seen] == [1] and seen[0][1].shape == (5,)
    assert torch.allclose(stopped.logits, planned.logits, atol=1e-6)
    lo = len(prefix) + len(chunks[0])
    assert torch.equal(stopped.values[2][:, lo:lo + len(chunks[1])], kvs[1].values[2])


def test_work_is_counted_in_token_layers(tiny_llama):
    prefix, chunks, question = make_prompt()
    n = len(prefix) + sum(map(len, chunks)) + len(question)
    layers = tiny_llama.adapter.num_layers
    assert blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question)).token_layers == n * layers
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    reuse = blended_prefill(tiny_llama.adapter, [Segment(prefix, "prefix", cached=prefix_kv)]
                            + [Segment(c, cached=kv, recompute=[0, 1], stop_layer=2) for c, kv in zip(chunks, kvs)]
                            + [Segment(question, "question")])
    assert reuse.token_layers == len(question) * layers + 2 * len(chunks) * 2


def test_until_ends_generation_once_the_answer_text_satisfies_it(tiny_llama):
    prefix, chunks, question = make_prompt()
    result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
    free = generate_from(tiny_llama.model, tiny_llama.tokenizer, result, max_new_tokens=12).tolist()
    seen: list[str] = []

    def third_call(text: str) -> bool:
        seen.append(text)
        return len(seen) == 3

    result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question))
    stopped = generate_from(tiny_llama.model, tiny_llama.tokenizer, result, max_new_tokens=12,
                            until=third_call).tolist()
    assert stopped == free[:3]  # asked after each new token, the answer's text alone
    assert seen == [tiny_llama.tokenizer.decode(free[:n], skip_special_tokens=True) for n in (1, 2, 3)]


def test_masked_attention_gives_the_same_result_in_any_block_size():
    """The GPU's one large block and the CPU's small blocks compute the same attention."""
    g = torch.Generator().manual_seed(3)
    q, keys, values = (torch.randn(4, 300, 16, generator=g), torch.randn(2, 300, 16, generator=g),
                       torch.randn(2, 300, 16, generator=g))
    active = torch.sort(torch.randperm(300, generator=g)[:90]).values
    outs = [_AttentionPlan(active, 300, block=b).attend(q[:, active], keys, values, 0.25, True) for b in (7, 128, 4096)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.allclose(outs[1], outs[2], atol=1e-6)
    assert len(_AttentionPlan(active, 300).blocks) == 1  # on the CPU: blocks of 128 queries


def test_shape_buckets_round_up_to_a_few_sizes_per_power_of_two():
    # step max(64, 2**(floor(log2 n) - 3)): 64 up to 1023, then 128, 256, ...
    assert [shape_bucket(n) for n in (1, 64, 65, 97, 700, 1023, 1024, 1025, 4006, 4096, 32051)] == \
        [64, 64, 128, 128, 704, 1024, 1024, 1152, 4096, 4096, 32768]
    assert shape_bucket(5, smallest=8) == 8 and shape_bucket(9, smallest=8) == 16


def test_a_bucketed_plan_pads_every_call_to_bucket_sizes():
    """90 scattered queries over 300 keys in blocks of 50: the first block's 50 rows become
    64 and its keys (up to its last query) a multiple of 64; the padded rows repeat the last
    real row's mask, and no row sees a key past its own position."""
    active = torch.sort(torch.randperm(300, generator=torch.Generator().manual_seed(5))[:90]).values
    plan = _AttentionPlan(active, 300, block=50, bucket=True)
    assert [(lo, hi, rows) for lo, hi, rows, _, _ in plan.blocks] == [(0, 50, 64), (50, 90, 64)]
    for lo, hi, rows, end, mask in plan.blocks:
        want_end = -(-(int(active[hi - 1]) + 1) // 64) * 64
        assert end == want_end and mask.shape == (rows, end)
        assert torch.equal(mask.sum(dim=1)[:hi - lo], active[lo:hi] + 1)
        assert torch.equal(mask[hi - lo:], mask[hi - lo - 1].expand(rows - (hi - lo), -1))
    assert plan.key_rows == max(end for *_, end, _ in plan.blocks)
    assert _AttentionPlan(torch.arange(300), 300, bucket=True).key_rows == 320


def byte_level_tokenizer(clean_up: bool):
    """A small byte-level BPE tokenizer (GPT-2's kind), trained here on a few lines."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["Café crème, naïve façade: déjà vu.", "git rebase -i HEAD~3 \u2014 then push!",
                             "The answer is 42. Isn't it? Yes, it's 42 \U0001F600."] * 20, vocab_size=300,
                            min_frequency=1, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, clean_up_tokenization_spaces=clean_up)


ANSWER = ("Café crème , naïve façade: déjà vu .\nThe answer is 42 . Isn't it ? Yes, it 's 42 \U0001F600 .\n\n"
          "git rebase -i HEAD~3 \u2014 then push ! " * 12)


def cleaned_up(text: str) -> str:
    """Spaces before punctuation taken out, as tokenizers that clean up spaces do."""
    for mark in (" .", " ,", " 's", " !", " ?"):
        text = text.replace(mark, mark[1:])
    return text


@pytest.mark.parametrize("clean_up", [False, True], ids=["spaces kept", "spaces cleaned up"])
def test_answer_text_equals_a_whole_decode_at_every_token_and_decodes_little(clean_up):
    """Byte-level pieces decoded after a settled point join up to the whole decode at every
    length, multi-byte characters split across tokens included; a tokenizer that cleans
    up spaces before punctuation (which a piece cannot see across its start) settles at
    line breaks only. Each call decodes the tokens since the last settled point, not the
    whole answer."""
    from cachecraft.engine.handoff import AnswerText

    tokenizer = byte_level_tokenizer(clean_up)
    ids = torch.tensor(tokenizer.encode(ANSWER))
    decoded, real = [], tokenizer.decode

    def decode(piece, **named):
        decoded.append(len(piece))
        return cleaned_up(real(piece, **named)) if clean_up else real(piece, **named)

    tokenizer.decode = decode
    text = AnswerText(tokenizer)
    for n in range(1, ids.numel() + 1):
        whole = real(ids[:n], skip_special_tokens=True)
        assert text(ids[:n]) == (cleaned_up(whole) if clean_up else whole), n
    assert text.joins and text.settled > 0  # no mismatch was ever found
    assert sum(decoded) < 0.2 * ids.numel() ** 2 / 2  # a whole decode each call: n^2 / 2 tokens


def test_answer_text_of_other_tokenizers_is_a_whole_decode(tiny_llama):
    """A tokenizer that is not byte-level (the word-level one here joins pieces with a
    space) is decoded whole on every call."""
    from cachecraft.engine.handoff import AnswerText

    tokenizer = tiny_llama.tokenizer
    ids = torch.tensor(tokenizer.encode(" ".join(f"w{i % 9}" for i in range(40))))
    text = AnswerText(tokenizer)
    assert not text.joins
    for n in range(1, ids.numel() + 1):
        assert text(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=True)
