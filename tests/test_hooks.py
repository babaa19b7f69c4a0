"""The engine's layer hooks: when they are called, what selectors and observers change."""

from dataclasses import replace

import pytest
import torch

from cachecraft.engine import LayerHook, PromptError, Segment, blended_prefill
from cachecraft.selection import (ChunkStatistics, DeviationCheck, QuestionAttention, TokenAttention,
                                  create_chunk_cache)
from tests.test_engine import caches_after_prefix_alone, full_segments, hf_forward, make_prompt

TOL = 1e-4


def cached_segments(prefix, chunks, question, prefix_kv, kvs, **chunk_kwargs):
    return ([Segment(prefix, "prefix", cached=prefix_kv)]
            + [Segment(c, cached=kv, **chunk_kwargs) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")])


class Recorder(LayerHook):
    """Notes every call it gets."""

    def __init__(self, layers=None):
        self.layers = layers
        self.calls = []

    def start(self, layout):
        self.calls.append(("start", layout.n_total))

    def select(self, view):
        self.calls.append(("select", view.layer))

    def observe(self, view):
        self.calls.append(("observe", view.layer))

    def finish(self, result):
        self.calls.append(("finish", result.num_tokens))


class KeepFixed(LayerHook):
    """Runs every token through layer 0, then keeps the uncached ones and ``picked`` (positions)."""

    needs_every_token = True
    layers = (0,)

    def __init__(self, picked):
        self.picked = torch.tensor(picked)

    def select(self, view):
        keep = view.must[view.active].clone()
        keep |= torch.isin(view.active, self.picked)
        return keep


class StopAfter(LayerHook):
    """At ``layer``, stops the given segments at ``stop``."""

    def __init__(self, layer, stops):
        self.layers = (layer,)
        self.stops = stops

    def observe(self, view):
        return dict(self.stops)


def test_hooks_are_called_at_their_layers_only(tiny_llama):
    prefix, chunks, question = make_prompt()
    every, some = Recorder(), Recorder(layers=(1, 3, 9))
    result = blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question), hooks=[every, some])
    layers = tiny_llama.adapter.num_layers
    assert every.calls == ([("start", result.num_tokens)]
                           + [(phase, i) for i in range(layers) for phase in ("select", "observe")]
                           + [("finish", result.num_tokens)])
    assert [c for c in some.calls if c[0] in ("select", "observe")] == [
        ("select", 1), ("observe", 1), ("select", 3), ("observe", 3)]
    probe = Recorder()
    blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question), hooks=[probe], until_layer=2)
    assert ("observe", 1) in probe.calls and ("select", 2) not in probe.calls


def test_hooks_that_decide_nothing_change_nothing(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    segments = cached_segments(prefix, chunks, question, prefix_kv, kvs, recompute=[1, 4])
    plain = blended_prefill(tiny_llama.adapter, segments)
    hooked = blended_prefill(tiny_llama.adapter, segments, hooks=[Recorder(), QuestionAttention([1, 2]),
                                                                   TokenAttention(2), ChunkStatistics()])
    assert torch.equal(plain.logits, hooked.logits)
    assert all(torch.equal(a, b) for a, b in zip(plain.values, hooked.values))
    assert torch.equal(plain.recomputed, hooked.recomputed) and plain.token_layers == hooked.token_layers


def test_a_selector_keeping_a_fixed_set_equals_segment_recompute(any_tiny):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(any_tiny, prefix, chunks)
    local = [[0, 5, 17], [], [2, 3, 30]]
    offsets = [len(prefix), len(prefix) + len(chunks[0]), len(prefix) + len(chunks[0]) + len(chunks[1])]
    picked = [o + i for o, idx in zip(offsets, local) for i in idx]
    planned = blended_prefill(any_tiny.adapter, [Segment(prefix, "prefix", cached=prefix_kv)]
                              + [Segment(c, cached=kv, recompute=idx) for c, kv, idx in zip(chunks, kvs, local)]
                              + [Segment(question, "question")])
    selected = blended_prefill(any_tiny.adapter, cached_segments(prefix, chunks, question, prefix_kv, kvs),
                               hooks=[KeepFixed(picked)])
    assert torch.equal(selected.recomputed, planned.recomputed)
    assert selected.recomputed_tokens == planned.recomputed_tokens == len(picked)
    assert (selected.logits - planned.logits).abs().max() < 1e-5  # layer 0 of cached tokens: exact, up to rounding
    others = ~planned.recomputed
    for layer in range(1, any_tiny.adapter.num_layers):
        assert torch.equal(selected.values[layer][:, others], planned.values[layer][:, others])
        assert (selected.values[layer] - planned.values[layer]).abs().max() < 1e-5


def test_an_observers_stop_ends_recomputation_of_cached_segments_only(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    segments = [Segment(prefix, "prefix", cached=prefix_kv)] + [
        Segment(c, cached=kv, recompute=range(len(c))) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")]
    stopped = blended_prefill(tiny_llama.adapter, segments, hooks=[StopAfter(1, {2: 0, 4: 1})])
    planned = blended_prefill(tiny_llama.adapter, [s if i != 2 else Segment(s.token_ids, cached=s.cached,
                                                   recompute=s.recompute, stop_layer=2)
                                                   for i, s in enumerate(segments)])
    assert torch.equal(stopped.logits, planned.logits)  # stop 0 at layer 1 means after layer 1; the question never stops
    lo = len(prefix) + len(chunks[0])
    for layer in (2, 3):
        assert torch.equal(stopped.values[layer][:, lo:lo + len(chunks[1])], kvs[1].values[layer])
    assert stopped.token_layers < blended_prefill(tiny_llama.adapter, segments).token_layers


def test_every_fraction_at_one_with_every_hook_equals_full_prefill(any_tiny):
    prefix, chunks, question = make_prompt()
    logits, _ = hf_forward(any_tiny, prefix, chunks, question)
    prefix_kv, kvs = caches_after_prefix_alone(any_tiny, prefix, chunks)
    look = QuestionAttention([1, 2])
    every_token = [Segment(prefix, "prefix", cached=prefix_kv)] + [
        Segment(c, cached=kv, recompute=range(len(c))) for c, kv in zip(chunks, kvs)] + [Segment(question, "question")]
    check_all = cached_segments(prefix, chunks, question, prefix_kv, kvs)
    for segments, hooks in ((every_token, []), (check_all, [DeviationCheck(1, 1.0)])):
        result = blended_prefill(any_tiny.adapter, segments, hooks=[*hooks, look, TokenAttention(1), Recorder()])
        assert result.recompute_fraction == 1.0
        assert (result.logits - logits).abs().max() < TOL
        assert set(look.mass) == {1, 2}


def test_create_chunk_cache_statistics_equal_the_hooks(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, _ = caches_after_prefix_alone(tiny_llama, prefix, [])
    before = [Segment(prefix, "prefix", cached=prefix_kv, key="p"), Segment(chunks[0], key="c0")]
    for layers in (None, (1, 3)):
        made = create_chunk_cache(tiny_llama.adapter, before, chunks[1], fingerprint="f", key="c1",
                                  stats_layers=layers)
        by_hook = blended_prefill(tiny_llama.adapter, [*before, Segment(chunks[1], save=True, collect_stats=True,
                                                                        key="c1")],
                                  hooks=[ChunkStatistics(layers)], fingerprint="f").saved[2]
        assert torch.equal(made.keys, by_hook.keys) and torch.equal(made.values, by_hook.values)
        assert made.prefix == by_hook.prefix == ("p", "c0")
        for name in ("outside", "inter", "intra"):
            assert torch.equal(getattr(made.stats, name), getattr(by_hook.stats, name)), (layers, name)
    bare = create_chunk_cache(tiny_llama.adapter, before, chunks[1], fingerprint="f", collect_stats=False)
    assert bare.stats is None


def test_statistics_asked_for_without_the_hook_are_an_error(tiny_llama):
    prefix, chunks, question = make_prompt()
    with pytest.raises(PromptError, match="ChunkStatistics"):
        blended_prefill(tiny_llama.adapter, full_segments(prefix, chunks, question, save=True, collect_stats=True))


def test_fused_segment_mass_equals_explicit_probabilities(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, kvs = caches_after_prefix_alone(tiny_llama, prefix, chunks)
    seen = []

    class Compare(LayerHook):
        def observe(self, view):
            for rows in (torch.ones_like(view.active, dtype=torch.bool), view.rows_of(-1), view.rows_of(2)):
                if bool(rows.any()):
                    seen.append((view.segment_mass(rows) - view.mass_per_segment(rows)).abs().max())

    blended_prefill(tiny_llama.adapter, cached_segments(prefix, chunks, question, prefix_kv, kvs,
                                                        recompute=[0, 3, 8]), hooks=[Compare()])
    assert len(seen) == 3 * tiny_llama.adapter.num_layers and max(seen) < 1e-5


def test_strided_statistics_by_hand():
    from cachecraft.selection.statistics import stats_from_rows

    # one layer; a chunk of 5 tokens after one prefix segment, sampled at tokens 0, 2 and 4
    rows = [torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]])]
    stats = stats_from_rows(rows, 1, tokens=5, stride=2)
    assert stats.outside.tolist() == [[0.25, 0.25, 0.5, 0.5, 1.0]]  # each sample stands for the tokens after it
    assert stats.inter.tolist() == [[0.25 * 2 + 0.5 * 2 + 1.0]]  # weights 2, 2 and 1 (what is left)
    assert stats.intra.tolist() == [0.75 * 2 + 0.5 * 2]
    assert float(stats.inter.sum() + stats.intra.sum()) == 5.0  # still one unit of mass per token


def test_strided_statistics_read_the_sampled_tokens_rows_exactly(tiny_llama):
    prefix, chunks, question = make_prompt()
    prefix_kv, _ = caches_after_prefix_alone(tiny_llama, prefix, [])

    def made(stride: int):
        segments = [Segment(prefix, "prefix", cached=prefix_kv, key="p"), Segment(chunks[0], key="c0"),
                    Segment(chunks[1], save=True, collect_stats=True, key="c1")]
        return blended_prefill(tiny_llama.adapter, segments, hooks=[ChunkStatistics(None, stride)],
                               fingerprint="f").saved[2].stats

    every, strided = made(1), made(3)
    tokens = len(chunks[1])
    assert strided.outside.shape == every.outside.shape == (tiny_llama.adapter.num_layers, tokens)
    sampled = list(range(0, tokens, 3))
    assert torch.allclose(strided.outside[:, sampled], every.outside[:, sampled], atol=1e-6)
    assert torch.allclose(strided.inter.sum(dim=1) + strided.intra, torch.full_like(strided.intra, tokens), atol=1e-4)
    with pytest.raises(ValueError, match="stride"):
        ChunkStatistics(None, 0)


def test_deferred_statistics_equal_the_immediate_ones_once_the_result_is_completed(tiny_llama):
    prefix, chunks, question = make_prompt()

    def made(deferred: bool):
        # nothing cached: every token runs, as on a first-time request; both chunks measured
        segments = [Segment(prefix, "prefix", save=True, key="p"),
                    Segment(chunks[0], save=True, collect_stats=True, key="c0"),
                    Segment(chunks[1], save=True, collect_stats=True, key="c1"), Segment(question, "question")]
        return blended_prefill(tiny_llama.adapter, segments, hooks=[ChunkStatistics((1, 3), 2, deferred=deferred)],
                               fingerprint="f")

    now, later = made(False), made(True)
    assert torch.equal(now.logits, later.logits)  # measuring later changes nothing the answer sees
    assert all(later.saved[i].stats is None for i in (1, 2)) and later.deferred
    later.complete()
    assert not later.deferred
    for i in (1, 2):
        assert torch.equal(now.saved[i].keys, later.saved[i].keys)
        for name in ("outside", "inter", "intra"):
            assert torch.equal(getattr(now.saved[i].stats, name), getattr(later.saved[i].stats, name)), (i, name)
    assert later.saved[0].stats is None  # the prefix asked for none
    later.complete()  # a second call has nothing left to do
    assert torch.equal(later.saved[1].stats.inter, now.saved[1].stats.inter)


def test_deferred_statistics_still_report_a_segment_nobody_measured(tiny_llama):
    prefix, chunks, question = make_prompt()
    segments = [Segment(prefix, "prefix"), Segment(chunks[0], save=True, collect_stats=True, key="c0"),
                Segment(chunks[1], save=True, collect_stats=True, key="c1"), Segment(question, "question")]

    class ForgetsOne(ChunkStatistics):
        def finish(self, result):
            super().finish(result)
            result.deferred.append(lambda: result.saved.update({2: replace(result.saved[2], stats=None)}))

    result = blended_prefill(tiny_llama.adapter, segments, hooks=[ForgetsOne(None, 1, deferred=True)])
    with pytest.raises(PromptError, match=r"segments \[2\]"):
        result.complete()
