"""The pipeline end to end on a tiny model: variants, exact reuse, records."""

from __future__ import annotations

import pytest
import torch

from cachecraft.config import Config
from cachecraft.engine import blended_prefill
from cachecraft.kv import chunk_key, variant_key
from cachecraft.pipeline import Pipeline
from cachecraft.pipeline.cost import COST_PROFILE, device_label
from cachecraft.policy.loading import DEFAULT_BANDWIDTHS
from cachecraft.policy.planner import PolicyParams
from cachecraft.store import TieredStore
from tests.conftest import tiny_model

def traced(pipeline, *args, **options):
    """``pipeline.answer`` with the prefill's logits kept on the answer (read from its trace)."""
    traces = []
    answer = pipeline.answer(*args, observer=traces.append, **options)
    answer.logits = traces[0].logits
    return answer


CHUNKS = [" ".join(f"w{i}" for i in range(10 + 20 * j, 30 + 20 * j)) + "\n\n" for j in range(4)]
QUESTION = "w200 w201 w202"


@pytest.fixture
def pipeline(cache_dir):
    # float32 storage: exactness checks then see only the method, not storage rounding
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 6, "kv_dtype": "float32"}, environ={})
    lm = tiny_model("llama")
    with TieredStore(config, tiers=("cpu", "disk")) as store:
        pipe = Pipeline(config, lm=lm, store=store, policy=PolicyParams(alpha=0.5, check_layer=2))
        yield pipe


def test_miss_then_exact_variant_reuse(pipeline):
    first = traced(pipeline, CHUNKS, QUESTION)
    assert first.recompute_fraction == 1.0
    assert first.saved_s <= 0  # everything computed: no time saved, whatever the estimate says
    assert pipeline.catalog.get_request(first.request_id).num_tokens == first.prompt_tokens
    assert all(c.tier == "miss" and c.variant is None for c in first.chunks)
    again = traced(pipeline, CHUNKS, QUESTION)
    assert again.recompute_fraction == 0.0  # every chunk has a variant made under this exact prefix
    assert all(c.tier in ("cpu", "disk") and c.cfo == 0.0 for c in again.chunks)
    assert (again.logits - first.logits).abs().max() < 1e-4
    assert again.text == first.text


def test_reordered_chunks_pick_the_lowest_cfo_and_fix_some_tokens(pipeline):
    pipeline.answer(CHUNKS, QUESTION)
    reordered = [CHUNKS[1], CHUNKS[0], CHUNKS[2], CHUNKS[3]]
    answer = pipeline.answer(reordered, QUESTION)
    first, second, third, _ = answer.chunks
    assert first.variant is not None and first.cfo > 0  # made after chunk 0, now first
    assert 0 < answer.recompute_fraction < 1
    assert third.cfo is not None and third.beta_prime is not None
    record = pipeline.catalog.get_request(answer.request_id)
    assert [c.variant_key for c in record.chunks] == [c.variant for c in answer.chunks]
    assert record.method == "cachecraft@0.5" and record.chunks[0].cfo == pytest.approx(first.cfo)


def test_every_fraction_at_one_gives_full_prefill_answer(pipeline):
    pipeline.answer(CHUNKS, QUESTION)
    full = traced(pipeline, list(reversed(CHUNKS)), QUESTION, method="full")
    pipeline.policy = PolicyParams(floor=1.0, check_layer=2)
    forced = traced(pipeline, list(reversed(CHUNKS)), QUESTION)
    assert full.text == forced.text
    assert (full.logits - forced.logits).abs().max() < 1e-4


def test_warm_makes_independent_variants_once_after_the_warm_context(pipeline):
    from cachecraft.engine import Segment, blended_prefill
    from cachecraft.warm_context import SOURCE

    assert pipeline.warm(CHUNKS) == 4
    assert pipeline.warm(CHUNKS) == 0
    answer = pipeline.answer(CHUNKS, QUESTION, method="reuse")
    assert answer.recompute_fraction == 0.0 and all(c.tier != "miss" for c in answer.chunks)
    record = pipeline.store.variants_of(answer.chunks[0].chunk)[0]
    prefix_key, context_key = record.prefix
    assert answer.chunks[0].variant == record.key  # reuse takes the variant warm made
    assert pipeline.store.contains(variant_key(prefix_key, ()))
    assert pipeline.store.contains(variant_key(context_key, (prefix_key,)))  # the context itself, made once
    context_ids = pipeline._warm_context()[0]
    assert len(context_ids) == pipeline.lm.max_context // 4  # the builtin text, cut to a quarter of the window
    assert pipeline.catalog.chunk(context_key).source == SOURCE
    # the stored cache is the chunk's KV computed after the system prompt and the context
    pieces = pipeline.builder.build(CHUNKS, "warm")
    by_hand = blended_prefill(pipeline.lm.adapter, [Segment(pieces.prefix, "prefix"), Segment(context_ids),
                                                    Segment(pieces.chunks[0], save=True)]).saved[2]
    stored = pipeline.store.get(record.key, dtype=torch.float32, device=torch.device("cpu"),
                                fingerprint=pipeline.lm.fingerprint)
    assert (stored.keys - by_hand.keys).abs().max() < 1e-5 and (stored.values - by_hand.values).abs().max() < 1e-5


def test_warm_context_none_makes_caches_after_the_system_prompt_alone(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "warm_context": "none"}, environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store)
        assert pipe.warm(CHUNKS[:2]) == 2
        key = pipe.builder.build(CHUNKS[:2], "warm").chunks[0]
        records = pipe.store.variants_of(chunk_key(pipe.lm.fingerprint, key))
        assert [len(r.prefix) for r in records] == [1]  # the system prefix only


def test_explain_prints_the_recorded_plan(pipeline):
    from typer.testing import CliRunner

    from cli.app import app

    pipeline.answer(CHUNKS, QUESTION)
    answer = pipeline.answer([CHUNKS[2], CHUNKS[0], CHUNKS[1], CHUNKS[3]], QUESTION)
    runner = CliRunner()
    result = runner.invoke(app, ["explain", str(answer.request_id), "--json"])
    assert result.exit_code == 0, result.output
    import json
    data = json.loads(result.stdout)
    assert [c["variant_key"] for c in data["chunks"]] == [c.variant for c in answer.chunks]
    assert data["chunks"][0]["cfo"] == pytest.approx(answer.chunks[0].cfo)
    latest = runner.invoke(app, ["explain"])
    assert latest.exit_code == 0 and f"request {answer.request_id}" in latest.output and "CFO" in latest.output
    missing = runner.invoke(app, ["explain", "9999"])
    assert missing.exit_code == 1 and "no request with id 9999" in missing.output


def test_the_controller_raises_only_past_the_blending_cost(pipeline):
    from cachecraft.policy.loading import CostModel

    question = QUESTION + " " + " ".join(f"w{i}" for i in range(210, 230))  # a prompt of 128 tokens or more
    pipeline.answer(CHUNKS, question)
    reordered = [CHUNKS[1], CHUNKS[0], CHUNKS[2], CHUNKS[3]]
    planned = pipeline.answer(reordered, question, record=False)
    assert planned.prompt_tokens >= 128  # long enough to teach the prefill rate
    # on a CPU the reading thread shares the cores: a blended prefill's time teaches nothing
    assert pipeline.cost_model.blend_s_per_token_layer is None
    layers = pipeline.lm.adapter.num_layers
    # r_load 0.5 as in the test below (5e-4 s to load a token's layer, 1e-3 to compute it); a
    # blending cost of 2.5e-4 s per token and layer hides half the load: the floor is 0.25
    pipeline.cost_model = CostModel(1e-3, 100, layers, {"gpu": 2e5, "cpu": 2e5, "disk": 2e5},
                                    blend_s_per_token_layer=2.5e-4)
    assert pipeline.cost_model.r_hide("cpu") == pytest.approx(0.25)
    raised = pipeline.answer(reordered, question, record=False)
    tokens, before, after = fixed_tokens(planned, raised)
    assert before < 0.25 * tokens <= after + 1e-6 and after < 0.5 * tokens
    pipeline._save_cost_model()  # a timed blending cost is kept with the model
    stored = pipeline.catalog.profile(pipeline.lm.fingerprint, device_label(pipeline.lm.device), COST_PROFILE)
    assert stored["blend_s_per_token_layer"] == 2.5e-4


def fixed_tokens(planned, raised) -> tuple[int, float, float]:
    """Over the chunks ``planned`` fixes in part: their tokens, and the tokens ``planned``
    and ``raised`` recompute there."""
    fixed = [i for i, c in enumerate(planned.chunks) if 0 < c.fraction < 1]
    assert fixed, "the reordered request should fix some chunks"
    tokens = sum(planned.chunks[i].tokens for i in fixed)
    before = sum(planned.chunks[i].fraction * planned.chunks[i].tokens for i in fixed)
    after = sum(raised.chunks[i].fraction * raised.chunks[i].tokens for i in fixed)
    return tokens, before, after


def test_loading_controller_raises_recompute_on_a_slow_tier(pipeline):
    from cachecraft.policy.loading import CostModel

    pipeline.answer(CHUNKS, QUESTION)
    reordered = [CHUNKS[1], CHUNKS[0], CHUNKS[2], CHUNKS[3]]
    planned = pipeline.answer(reordered, QUESTION, record=False)
    per_token_layer = 1e-3
    kv_bytes = 100
    # r_load = bytes / (bandwidth * prefill seconds per token) = 100*L / (bw * 1e-3*L) -> 0.5 with bw = 2e5
    pipeline.cost_model = CostModel(per_token_layer, kv_bytes, pipeline.lm.adapter.num_layers,
                                    {"gpu": 2e5, "cpu": 2e5, "disk": 2e5})
    raised = pipeline.answer(reordered, QUESTION, record=False)
    # Loading of every chunk overlaps the recompute of all selected tokens, so the
    # total is what must reach r_load; the question decides where the tokens go.
    tokens, before, after = fixed_tokens(planned, raised)
    assert before < 0.5 * tokens <= after + 1e-6


def test_the_cost_model_is_measured_once_and_kept_per_model_and_device(cache_dir, monkeypatch):
    from cachecraft.pipeline import core
    from cachecraft.pipeline.cost import COST_PROFILE, device_label

    measured = []
    real = core.measure_cost_model
    monkeypatch.setattr(core, "measure_cost_model", lambda *a, **k: measured.append(1) or real(*a, **k))
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 2}, environ={})
    lm = tiny_model("llama")
    pipe = Pipeline(config, lm=lm, store=TieredStore(config, tiers=("cpu", "disk")))
    start = pipe.ensure_cost_model()
    assert measured == [1] and set(pipe.startup_s) == {"cost model"}  # lm given: no model loading
    short = pipe.answer(CHUNKS[:1], QUESTION, method="full")
    assert short.prompt_tokens < 128 and pipe.cost_model == start  # shorter than the probe: tells nothing
    long_chunks = [" ".join(f"w{i}" for i in range(10 + 60 * j, 70 + 60 * j)) + "\n\n" for j in range(3)]
    assert pipe.answer(long_chunks, QUESTION, method="full").prompt_tokens >= 128
    learned = pipe.cost_model  # a plain full prefill as long as the probe moves the rate
    assert learned.prefill_s_per_token_layer != start.prefill_s_per_token_layer
    pipe.close()  # what it learned is kept
    stored = pipe.catalog.profile(lm.fingerprint, device_label(lm.device), COST_PROFILE)
    assert stored["prefill_s_per_token_layer"] == learned.prefill_s_per_token_layer
    assert stored["probe_tokens"] == [128]  # on a CPU, one 128-token probe

    again = Pipeline(config, lm=lm, store=TieredStore(config, tiers=("cpu", "disk")))
    assert again.ensure_cost_model().prefill_s_per_token_layer == learned.prefill_s_per_token_layer
    assert measured == [1] and set(again.startup_s) == {"cost model (stored)"}
    again.close()
    other = Pipeline(config, lm=tiny_model("qwen2"), store=TieredStore(config, tiers=("cpu", "disk")))
    other.ensure_cost_model()  # another model: measured for itself
    assert measured == [1, 1]
    other.close()


@pytest.mark.parametrize("stream_kv", [True, False])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_loading_controller_times_loads_and_counts_held_caches_free(cache_dir, monkeypatch, stream_kv, tier):
    monkeypatch.setattr("cachecraft.policy.loading.MIN_OBSERVED_BYTES", 0)  # the tiny model's caches count,
    monkeypatch.setattr("cachecraft.policy.loading.FULL_WEIGHT_BYTES", 1)  # in full
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 2, "stream_kv": stream_kv},
                         environ={})
    with TieredStore(config, tiers=(tier,)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(alpha=0.5, check_layer=2))
        guessed = dict(pipe.ensure_cost_model().bandwidths)
        pipe.answer(CHUNKS, QUESTION, method="reuse")  # makes the caches
        pipe.answer(CHUNKS, QUESTION, method="reuse")  # loads them
        learned = pipe.cost_model.bandwidths
    # Streamed, a cache in the CPU tier is used where it is stored: free to load, never timed.
    held = stream_kv and tier == "cpu"
    assert guessed == dict(DEFAULT_BANDWIDTHS, **({"cpu": float("inf")} if held else {}))
    if held:
        assert learned == guessed
    else:
        assert learned[tier] != guessed[tier] and 0 < learned[tier] < float("inf")


def test_policy_comes_from_config_and_early_stop_is_recorded(cache_dir):
    from cachecraft.config import ConfigError

    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 3, "kv_dtype": "float32",
                                    "policy_alpha": 0.45, "policy_check_layer": 1, "early_stop_layers": "1, 2",
                                    "early_stop_share": 1.0}, environ={})
    assert config.early_stop_layer_list == (1, 2)
    with pytest.raises(ConfigError, match="early_stop_layers"):
        Config.from_mapping({"early_stop_layers": "one"})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store)
        assert pipe.policy.early_stop_layers == (1, 2) and pipe.policy.alpha == 0.45
        pipe.answer(CHUNKS, QUESTION)
        answer = pipe.answer(list(reversed(CHUNKS)), QUESTION)
        stopped = [c for c in answer.chunks if c.stop_layer is not None]
        assert stopped, "with share 1.0 every chunk below an even share stops early"
        assert all(c.stop_layer in (2, 3) for c in stopped)
        record = pipe.catalog.get_request(answer.request_id)
        assert [c.stop_layer for c in record.chunks] == [c.stop_layer for c in answer.chunks]


def _write_docs(root):
    words = lambda start, n: " ".join(f"w{i}" for i in range(start, start + n))  # noqa: E731
    root.mkdir()
    (root / "a.md").write_text(f"# w5 w6\n\n{words(10, 12)}.\n\n{words(30, 20)}\n", encoding="utf-8")
    (root / "b.txt").write_text(f"{words(60, 15)}\n\n{words(80, 25)}\n", encoding="utf-8")
    return root


@pytest.fixture
def corpus_pipeline(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32",
                                    "chunk_tokens": 24, "top_k": 2}, environ={})
    with TieredStore(config, tiers=("cpu", "disk")) as store:
        yield Pipeline(config, lm=tiny_model("llama"), store=store)


def test_ingest_warm_then_query_hits_every_warmed_chunk(corpus_pipeline, tmp_path):
    pipe = corpus_pipeline
    outcome = pipe.ingest([_write_docs(tmp_path / "docs")])
    report = outcome.report
    assert outcome.skipped == ()
    assert report.added == report.chunks == len(pipe.corpus) >= 4 and report.files == 2
    assert all(len(pipe.builder.encode(c.prompt_text)) <= 24 for c in pipe.corpus.chunks())
    first, second = pipe.warm_corpus(shard=(0, 2)), pipe.warm_corpus(shard=(1, 2))
    assert first.made + second.made == len(pipe.corpus)
    assert pipe.warm_corpus().skipped == len(pipe.corpus)  # resumable: nothing left to make
    for chunk in pipe.corpus.chunks():  # the catalog knows which document each cached chunk came from
        key = chunk_key(pipe.lm.fingerprint, pipe.builder.build([chunk.prompt_text], "q").chunks[0])
        assert pipe.catalog.chunk(key).source == chunk.source
    for method in ("reuse", "cachecraft"):
        answer = pipe.query("w12 w13 w14", method=method)
        assert len(answer.chunks) == len(answer.sources) == 2
        assert all(c.tier != "miss" and c.variant is not None for c in answer.chunks), method
    assert answer.sources[0].score >= answer.sources[1].score
    data = answer.to_dict()
    assert data["sources"][0]["id"] == answer.sources[0].id and data["sources"][0]["text"]
    assert data["full_prefill_estimate_s"] is not None and data["retrieval_s"] >= 0
    record = pipe.catalog.get_request(answer.request_id)
    assert [c.tier for c in record.chunks] == [c.tier for c in answer.chunks]


def test_query_in_document_order_puts_each_files_chunks_together_top_to_bottom(corpus_pipeline, tmp_path):
    pipe = corpus_pipeline
    pipe.ingest([_write_docs(tmp_path / "docs")])
    question = "w80 w81 w82 w12 w13"
    by_score = pipe.query(question, top_k=4, method="full", record=False)
    pipe.config = pipe.config.replace(retrieval_order="document")
    traces = []
    by_file = pipe.query(question, top_k=4, method="full", record=False, observer=traces.append)
    assert sorted(s.id for s in by_file.sources) == sorted(s.id for s in by_score.sources)
    position = {c.id: (c.source, c.position) for c in pipe.corpus.chunks()}
    placed = [position[s.id] for s in by_file.sources]
    files = [source for source, _ in placed]
    assert files == sorted(files, key=files.index)  # one file's chunks side by side
    assert placed == sorted(placed, key=lambda p: (files.index(p[0]), p[1]))  # in the file's order
    assert files[0] == by_score.sources[0].source  # the best chunk's file first
    assert placed != [position[s.id] for s in by_score.sources]  # the question mixes the files
    # and the prompt holds them so
    texts = {c.id: c.prompt_text for c in pipe.corpus.chunks()}
    assert traces[0].token_ids.tolist() == pipe.builder.build([texts[s.id] for s in by_file.sources],
                                                              question).token_ids


def test_query_errors_before_ingest_and_on_an_empty_question(corpus_pipeline):
    from cachecraft.prompt import PromptInputError
    from cachecraft.retrieval.snapshot import CorpusError

    with pytest.raises(PromptInputError, match="question is empty"):
        corpus_pipeline.query("   ")
    with pytest.raises(CorpusError, match="cachecraft ingest"):
        corpus_pipeline.query("w1 w2")
    with pytest.raises(CorpusError, match="cachecraft ingest"):
        corpus_pipeline.warm_corpus()
    with pytest.raises(PromptInputError, match="chunk order must be one of"):
        corpus_pipeline.answer(CHUNKS, QUESTION, chunk_order="by date")


def test_full_prefill_keeps_nothing_and_matches_the_first_miss(pipeline):
    full = traced(pipeline, CHUNKS, QUESTION, method="full")
    keys = [c.chunk for c in full.chunks]
    assert all(not pipeline.store.variants_of(key) for key in keys)  # the baseline caches nothing
    miss = traced(pipeline, CHUNKS, QUESTION)
    assert all(c.tier == "miss" for c in miss.chunks)
    assert torch.equal(miss.logits, full.logits) and miss.text == full.text  # the same one pass


def test_a_first_time_request_is_one_prefill_and_keeps_the_prefix_and_the_statistics(pipeline, monkeypatch):
    import cachecraft.pipeline.core as core

    calls = []
    monkeypatch.setattr(core, "blended_prefill", lambda *a, **k: calls.append(a[1]) or blended_prefill(*a, **k))
    answer = pipeline.answer(CHUNKS, QUESTION)
    assert len(calls) == 1 and calls[0][0].save  # the system prefix made in the request's own prefill
    assert all(c.tier == "miss" for c in answer.chunks)
    record = pipeline.store.variants_of(answer.chunks[0].chunk)[0]
    assert pipeline.store.contains(variant_key(record.prefix[0], ()))
    for report in answer.chunks:  # every new chunk-cache has the statistics the policy reads
        assert all(r.cci is not None for r in pipeline.store.variants_of(report.chunk))
    calls.clear()
    again = pipeline.answer(CHUNKS, QUESTION)
    assert len(calls) == 1 and calls[0][0].cached is not None  # the stored prefix is read, not made
    assert all(c.tier != "miss" for c in again.chunks)


@pytest.mark.parametrize("method", ["firstk", "inter", "spread"])
def test_static_selectors_recompute_their_share_of_each_warmed_chunk(pipeline, method):
    pipeline.warm(CHUNKS)
    answer = pipeline.answer(CHUNKS, QUESTION, method=method, ratio=0.25, record=False)
    sizes = [c.tokens for c in answer.chunks]
    expected = sum(-(-n // 4) for n in sizes) / sum(sizes)  # ceil(n / 4) tokens of each chunk
    assert all(c.tier != "miss" for c in answer.chunks)
    assert answer.recompute_fraction == pytest.approx(expected)
    reuse = pipeline.answer(CHUNKS, QUESTION, method="reuse", record=False)
    assert reuse.recompute_fraction == 0.0


def test_warmed_variants_record_their_cci_and_expected_saving(pipeline):
    import math

    pipeline.warm(CHUNKS)
    record = pipeline.store.variants_of(pipeline.answer(CHUNKS, QUESTION, method="reuse").chunks[0].chunk)[0]
    stats = pipeline.store.stats_of(record.key)
    context_tokens = len(pipeline._warm_context()[0])
    tokens = stats.outside.shape[1]
    # Against the warm context (the system prefix is left out, as the planner does), by hand:
    a = [float(stats.inter[layer, 1]) / (tokens * context_tokens) for layer in range(stats.inter.shape[0])]
    b = [float(stats.intra[layer]) / tokens ** 2 for layer in range(stats.intra.shape[0])]
    expected = 2 / (1 + math.exp(-(sum(a) / len(a)) / (sum(b) / len(b)))) - 1
    with pipeline.catalog.read() as tx:  # the rows in SQLite
        row, prefix_row = tx.variant(record.key), tx.variant(variant_key(record.prefix[0], ()))
    assert 0 < row.cci < 1 and row.cci == pytest.approx(expected, rel=1e-4)
    # stored as 1 - alpha * CCI, then the reuse request (nothing recomputed) moved it halfway to 1
    estimate = 1 - pipeline.policy.alpha * expected
    assert row.quality == pytest.approx(estimate + 0.5 * (1 - estimate), rel=1e-4)
    assert prefix_row.cci is None and prefix_row.quality is None  # the system prefix: nothing to fix


def test_a_mostly_fixed_chunk_is_computed_in_full_and_kept_with_its_own_statistics(pipeline):
    pipeline.warm(CHUNKS)
    pipeline.policy = PolicyParams(alpha=0.5, floor=0.6, check_layer=2)  # every plan recomputes >= 60%
    warmed = [[r.key for r in pipeline.store.variants_of(chunk_key(pipeline.lm.fingerprint, ids))]
              for ids in pipeline.builder.build(CHUNKS, QUESTION).chunks]
    first = traced(pipeline, CHUNKS, QUESTION)
    assert all(c.fraction == 1.0 and c.cfo is not None for c in first.chunks)
    assert [(c.tier, [c.variant]) for c in first.chunks] == [("cpu", w) for w in warmed], (
        "found but computed in full: a hit in the tier it was found in")
    recorded = pipeline.catalog.get_request(first.request_id)
    assert recorded.misses == 0 and recorded.hits_by_tier["cpu"] == len(CHUNKS)
    for position, report in enumerate(first.chunks):
        before = tuple(c.chunk for c in first.chunks[:position])
        kept = [r for r in pipeline.store.variants_of(report.chunk) if r.prefix[1:] == before]
        assert len(kept) == 1, "one new variant, made after the system prefix and the chunks before it"
        assert pipeline.store.stats_of(kept[0].key).inter.shape[1] == position + 1
    full = traced(pipeline, CHUNKS, QUESTION, method="full")
    assert (first.logits - full.logits).abs().max() < 1e-4
    pipeline.policy = PolicyParams(alpha=0.5, check_layer=2)
    again = pipeline.answer(list(reversed(CHUNKS)), QUESTION)  # plans over every kept variant
    assert all(c.variant is not None for c in again.chunks)


def test_stats_layer_step_samples_the_layers_a_warmed_chunk_keeps(cache_dir):
    from cachecraft.config import ConfigError

    with pytest.raises(ConfigError, match="stats_layer_step"):
        Config.from_mapping({"stats_layer_step": 0})
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32", "stats_layer_step": 2},
                         environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store)
        assert pipe.stats_layers == (1, 3)  # of the tiny model's 4 layers
        pipe.warm(CHUNKS[:1])
        record = store.variants_of(pipe.answer(CHUNKS[:1], QUESTION, method="reuse").chunks[0].chunk)[0]
        stats = store.stats_of(record.key)
        assert stats.inter.shape[0] == stats.intra.shape[0] == stats.outside.shape[0] == 2


class Recording:
    """A streamer that keeps what it was given."""

    def __init__(self):
        self.tokens, self.ends, self.notes = [], 0, []

    def put(self, value):
        self.tokens.append(value.flatten().tolist())

    def end(self):
        self.ends += 1


class Restartable(Recording):
    """A streamer that can also start over."""

    def restart(self, note):
        self.notes.append(note)


def test_a_looping_answer_is_answered_again_from_a_full_prefill(pipeline, monkeypatch):
    import dataclasses

    import cachecraft.pipeline.core as core

    pipeline.warm(CHUNKS)
    full = pipeline.answer(CHUNKS, QUESTION, method="full")
    first_try = pipeline.answer(CHUNKS, QUESTION, method="reuse", max_new_tokens=1)
    monkeypatch.setattr(core, "degenerate_repetition", lambda text: True)  # every answer "loops",
    monkeypatch.setattr(core, "RepetitionWatch", lambda: (lambda text: True))  # from its first token
    before = {c.variant: pipeline.store.info(c.variant).quality for c in first_try.chunks}
    answer = pipeline.answer(CHUNKS, QUESTION, method="reuse")
    assert answer.escalated and answer.abandoned_text == first_try.text  # the first try stopped at its first token
    for variant, quality in before.items():  # a reuse answered again saved nothing: halfway to 0
        assert pipeline.store.info(variant).quality == pytest.approx(quality / 2)
    assert answer.text == full.text and answer.new_tokens == full.new_tokens
    assert answer.recompute_fraction == 1.0 and 0 < answer.first_try_ttft_s < answer.ttft_s
    assert answer.saved_s <= 0  # two prefills: nothing saved
    assert all(c.tier in ("cpu", "disk") for c in answer.chunks)  # what the first try read
    record = pipeline.catalog.get_request(answer.request_id)
    assert record.recompute_fraction == 1.0 and record.ttft_s == pytest.approx(answer.ttft_s)
    assert record.policy["first_try_ttft_s"] == pytest.approx(answer.first_try_ttft_s)
    assert "first_try_ttft_s" not in pipeline.catalog.get_request(full.request_id).policy
    from typer.testing import CliRunner

    from cli.app import app
    said = " ".join(CliRunner().invoke(app, ["explain", str(answer.request_id)]).output.split())
    assert (f"the first answer (first token after {answer.first_try_ttft_s:.2f} s) repeated itself and was "
            "answered again from a full prefill") in said
    assert "repeated itself" not in CliRunner().invoke(app, ["explain", str(full.request_id)]).output
    assert answer.to_dict()["abandoned_text"] == first_try.text
    # full itself, the fallback turned off, and a streamer that cannot start over: no second try
    assert not pipeline.answer(CHUNKS, QUESTION, method="full").escalated
    assert not pipeline.answer(CHUNKS, QUESTION, method="reuse", streamer=Recording()).escalated
    streamer = Restartable()
    assert pipeline.answer(CHUNKS, QUESTION, method="reuse", streamer=streamer).text == full.text
    assert streamer.ends == 2 and streamer.notes == ["the answer repeated itself; answering again from a full prefill"]
    import threading

    from cachecraft.engine import GenerationOptions

    gone = threading.Event()
    gone.set()  # a client that went away: its answer is not made again
    assert not pipeline.answer(CHUNKS, QUESTION, method="reuse", generation=GenerationOptions(cancel=gone)).escalated
    pipeline.config = dataclasses.replace(pipeline.config, repetition_fallback=False)
    assert not pipeline.answer(CHUNKS, QUESTION, method="reuse").escalated


def test_only_a_long_blended_prefill_on_a_gpu_that_outlasted_its_loads_teaches_the_blending_cost():
    from types import SimpleNamespace

    from cachecraft.policy.loading import CostModel

    model = CostModel(2.5e-4, 500, 4, {"gpu": float("inf"), "cpu": 1e8, "disk": 1e7})  # 2000 bytes a token

    def learned(device: str, tokens: int, seconds: float) -> float | None:
        fake = SimpleNamespace(lm=SimpleNamespace(device=torch.device(device), max_context=4096),
                               cost_model=model, ensure_cost_model=lambda: model)
        # one chunk of 1000 tokens streamed from disk (0.2 s expected at 1e7 B/s), one held on the GPU
        prepared = SimpleNamespace(segments=[SimpleNamespace(cached=SimpleNamespace(tier="disk", num_tokens=1000)),
                                             SimpleNamespace(cached=SimpleNamespace(tier="gpu", num_tokens=500)),
                                             SimpleNamespace(cached=None)])
        Pipeline._learn_blend(fake, prepared, SimpleNamespace(num_tokens=tokens, token_layers=400), seconds)
        return fake.cost_model.blend_s_per_token_layer

    # 0.5 s, 400 token-layers at 2.5e-4 s (0.1 s): 0.4 s over 2048 tokens and 4 layers
    assert learned("cuda", 2048, 0.5) == pytest.approx(0.4 / (2048 * 4))
    assert learned("cpu", 2048, 0.5) is None  # the reading thread shares a CPU's cores
    assert learned("cuda", 2047, 0.5) is None  # shorter than the GPU's longest probe
    assert learned("cuda", 2048, 0.29) is None  # under 1.5x the 0.2 s its loads were expected to take


def test_a_looping_answer_keeps_the_full_prefills_chunks_exactly_for_the_next_ask(pipeline, tmp_path, monkeypatch):
    import cachecraft.pipeline.core as core

    # the first three chunks warmed, the last one not: the first tries compute it after
    # three reused (so not exact) chunks
    pipeline.warm(CHUNKS[:3])
    pieces = pipeline.builder.build(CHUNKS, QUESTION)
    prefix = chunk_key(pipeline.lm.fingerprint, pieces.prefix)
    keys = [chunk_key(pipeline.lm.fingerprint, ids) for ids in pieces.chunks]
    chained = [variant_key(key, (prefix, *keys[:i])) for i, key in enumerate(keys)]
    pipeline.answer(CHUNKS, QUESTION, method="reuse")  # no loop: its computed last chunk is kept
    made_after_reused = pipeline.store.get(chained[3])
    assert pipeline.store.info(chained[3]).stats is None  # not made after a full prefill's KV
    assert [pipeline.store.contains(name) for name in chained] == [False, False, False, True]
    full = traced(pipeline, CHUNKS, QUESTION, method="full")

    monkeypatch.setattr(core, "degenerate_repetition", lambda text: True)
    monkeypatch.setattr(core, "RepetitionWatch", lambda: (lambda text: True))
    looped = pipeline.answer(CHUNKS[1:] + CHUNKS[:1], QUESTION, method="reuse")
    assert looped.escalated
    # the loop's own prefill kept nothing: the first chunk, computed there after the other
    # three, has no variant made after them
    moved = [chunk_key(pipeline.lm.fingerprint, ids) for ids in pipeline.builder.build(CHUNKS[1:], "q").chunks]
    first_after = variant_key(keys[0], (prefix, *moved))
    assert pipeline.store.contains(first_after)  # the second try's, from a full prefill
    assert pipeline.answer(CHUNKS, QUESTION, method="reuse").escalated
    assert all(pipeline.store.info(name).stats == {"made_exactly": 1.0} for name in chained)
    # every chunk exact: the prefill is a full prefill's, so a loop is full's own, not answered again
    assert not pipeline.answer(CHUNKS, QUESTION).escalated
    assert pipeline.answer(CHUNKS, QUESTION, method="reuse").escalated  # warm's variants: not exact
    # the last chunk's variant, made after reused chunks, was replaced by the exact one
    exact = pipeline.store.get(chained[3])
    assert not torch.equal(exact.values, made_after_reused.values)
    config = Config.load(overrides={"cache_dir": tmp_path / "fresh", "kv_dtype": "float32"}, environ={})
    with TieredStore(config, tiers=("cpu",)) as store:  # every chunk a miss: computed exactly
        Pipeline(config, lm=pipeline.lm, store=store).answer(CHUNKS, QUESTION, method="reuse")
        reference = store.get(chained[3])
        assert all(store.info(name).stats == {"made_exactly": 1.0} for name in chained)
    assert (exact.keys - reference.keys).abs().max() < 1e-5 and (exact.values - reference.values).abs().max() < 1e-5

    monkeypatch.undo()
    again = traced(pipeline, CHUNKS, QUESTION)
    assert not again.escalated and again.recompute_fraction == 0.0
    assert [c.variant for c in again.chunks] == chained
    assert (again.logits - full.logits).abs().max() < 1e-4 and again.text == full.text


def test_make_exact_stores_an_order_as_a_full_prefill_s_kv_for_any_question(pipeline, monkeypatch):
    import dataclasses

    # the tiny model's answers repeat themselves: no second try, which would keep them exact
    monkeypatch.setattr(pipeline, "config", dataclasses.replace(pipeline.config, repetition_fallback=False))
    pipeline.warm(CHUNKS)
    blended = pipeline.answer(CHUNKS, QUESTION)
    assert not blended.reused_exact and blended.recompute_fraction < 1.0 and not blended.escalated
    assert pipeline.make_exact(CHUNKS) == len(CHUNKS)
    keys = [chunk_key(pipeline.lm.fingerprint, ids) for ids in pipeline.builder.build(CHUNKS, "q").chunks]
    prefix = chunk_key(pipeline.lm.fingerprint, pipeline.builder.build(CHUNKS, "q").prefix)
    chained = [variant_key(key, (prefix, *keys[:i])) for i, key in enumerate(keys)]
    assert all(pipeline.store.info(name).stats == {"made_exactly": 1.0} for name in chained)
    assert pipeline.make_exact(CHUNKS) == 0  # already exact: nothing computed
    for question in (QUESTION, "w210 w211"):  # the chunks come before the question: any question
        full = traced(pipeline, CHUNKS, question, method="full", record=False)
        again = traced(pipeline, CHUNKS, question)
        assert again.reused_exact and again.recompute_fraction == 0.0 and not again.kept_exact
        assert [c.variant for c in again.chunks] == chained
        assert (again.logits - full.logits).abs().max() < 1e-4 and again.text == full.text
    assert pipeline.make_exact([]) == 0


def test_make_exact_stopped_midway_keeps_what_it_stored_and_goes_on_later(pipeline):
    pipeline.warm(CHUNKS)
    layers = pipeline.lm.adapter.num_layers
    asked = []

    def stop() -> bool:  # asked before every layer: true within the second chunk's prefill
        asked.append(1)
        return len(asked) > layers + 1

    assert pipeline.make_exact(CHUNKS, should_stop=stop) == 1
    assert len(asked) == layers + 2  # the first chunk's layers, then two asks into the second
    assert pipeline.make_exact(CHUNKS) == len(CHUNKS) - 1  # goes on from the second chunk
    full = traced(pipeline, CHUNKS, QUESTION, method="full", record=False)
    again = traced(pipeline, CHUNKS, QUESTION)
    assert again.reused_exact and again.recompute_fraction == 0.0
    assert (again.logits - full.logits).abs().max() < 1e-4 and again.text == full.text
    assert pipeline.make_exact(CHUNKS[:2], should_stop=lambda: True) == 0  # stored already: nothing asked


def test_make_exact_keeps_nothing_where_new_variants_are_not_kept(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "kv_dtype": "float32"}, environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store, keep_new_variants=False)
        assert pipe.make_exact(CHUNKS) == 0 and store.usage()["cpu"].entries == 0


def test_a_chunk_warmed_after_the_system_prefix_alone_is_exact_as_the_first_chunk(cache_dir, monkeypatch):
    import cachecraft.pipeline.core as core

    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32",
                                    "warm_context": "none"}, environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(alpha=0.5, check_layer=2))
        pipe.warm(CHUNKS)
        with store.catalog.read() as tx:
            stored = [r for r in tx.stored_variants() if r.prefix != ()]  # the chunks, not the prefix
        assert len(stored) == len(CHUNKS) and all(r.stats == {"made_exactly": 1.0} for r in stored)
        monkeypatch.setattr(core, "degenerate_repetition", lambda text: True)
        monkeypatch.setattr(core, "RepetitionWatch", lambda: (lambda text: True))
        assert not pipe.answer(CHUNKS[:1], QUESTION).escalated  # one chunk, right after the prefix: exact
        assert pipe.answer(CHUNKS[:2], QUESTION).escalated  # the second was made after the prefix, not the first


def test_a_looping_answer_keeps_its_exact_chunks_past_the_cap_in_place_of_the_variant_used_least(pipeline,
                                                                                              monkeypatch):
    import cachecraft.pipeline.core as core
    from cachecraft.policy.rules import MAX_VARIANTS_PER_CHUNK

    pipeline.warm(CHUNKS)
    # the last chunk also after each of the others: four variants, at the cap
    pipeline.warm_after([(before, CHUNKS[3]) for before in CHUNKS[:3]])
    pieces = pipeline.builder.build(CHUNKS, QUESTION)
    prefix = chunk_key(pipeline.lm.fingerprint, pieces.prefix)
    keys = [chunk_key(pipeline.lm.fingerprint, ids) for ids in pieces.chunks]
    after = [variant_key(keys[3], (prefix, keys[i])) for i in range(3)]

    def variants_of_last() -> set[str]:
        return {r.key for r in pipeline.store.variants_of(keys[3]) if r.prefix and r.prefix[0] == prefix}

    before = variants_of_last()
    assert len(before) == MAX_VARIANTS_PER_CHUNK and set(after) < before
    for name, reads in zip(after, (2, 0, 1)):  # hits 2, 0 and 1: the second is used least
        for _ in range(reads):
            pipeline.store.get(name)
    chained = [variant_key(key, (prefix, *keys[:i])) for i, key in enumerate(keys)]

    monkeypatch.setattr(core, "degenerate_repetition", lambda text: True)
    monkeypatch.setattr(core, "RepetitionWatch", lambda: (lambda text: True))
    assert pipeline.answer(CHUNKS, QUESTION, method="reuse").escalated
    # the second try's exact variant took the place of the one used least; warm's stays
    assert variants_of_last() == before - {after[1]} | {chained[3]}
    assert not pipeline.store.contains(after[1])
    assert all(pipeline.store.info(name).stats == {"made_exactly": 1.0} for name in chained)
    assert not pipeline.answer(CHUNKS, QUESTION).escalated  # every chunk exact: answered once
    monkeypatch.undo()
    again = pipeline.answer(CHUNKS, QUESTION)
    assert again.recompute_fraction == 0.0 and [c.variant for c in again.chunks] == chained


def repeating_pipeline(cache_dir, after_asks: int, **overrides) -> Pipeline:
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 6, "kv_dtype": "float32",
                                    "exact_after_asks": after_asks, **overrides}, environ={})
    store = TieredStore(config, tiers=("cpu", "disk"))
    return Pipeline(config, lm=tiny_model("llama"), store=store,
                    policy=PolicyParams(alpha=0.5, check_layer=2, exact_after_asks=after_asks))


def chained_variants(pipeline, chunks) -> list[str]:
    pieces = pipeline.builder.build(chunks, QUESTION)
    prefix = chunk_key(pipeline.lm.fingerprint, pieces.prefix)
    keys = [chunk_key(pipeline.lm.fingerprint, ids) for ids in pieces.chunks]
    return [variant_key(key, (prefix, *keys[:i])) for i, key in enumerate(keys)]


def test_a_chunk_order_asked_twice_before_is_computed_in_full_once_and_then_reused_exactly(cache_dir):
    pipe = repeating_pipeline(cache_dir, 2)
    with pipe.store:
        pipe.warm(CHUNKS[:3])  # after the warm context: reused, never exact
        order = CHUNKS[2::-1]
        chained = chained_variants(pipe, order)
        full = traced(pipe, order, QUESTION, method="full")  # recorded too: an ask of this order
        first = traced(pipe, order, QUESTION)
        assert not first.kept_exact and 0 < first.recompute_fraction < 1
        assert not any(pipe.store.contains(name) for name in chained)
        traced(pipe, CHUNKS[:3], QUESTION)  # another order of the same chunks: not an ask of this one
        third = traced(pipe, order, QUESTION)  # asked twice before (full's and the first)
        assert third.kept_exact and third.recompute_fraction == 1.0
        assert all(c.fraction == 1.0 and c.tier in ("cpu", "disk") for c in third.chunks)  # found: hits at 1.0
        assert (third.logits - full.logits).abs().max() < 1e-4 and third.text == full.text
        assert all(pipe.store.info(name).stats == {"made_exactly": 1.0} for name in chained)
        fourth = traced(pipe, order, QUESTION)
        assert not fourth.kept_exact and fourth.recompute_fraction == 0.0
        assert [c.variant for c in fourth.chunks] == chained
        assert (fourth.logits - full.logits).abs().max() < 1e-4 and fourth.text == full.text
        assert pipe.catalog.get_request(fourth.request_id).recompute_fraction == 0.0
        from typer.testing import CliRunner

        from cli.app import app
        said = {n: CliRunner().invoke(app, ["explain", str(a.request_id)]) for n, a in ((3, third), (4, fourth))}
        assert all(r.exit_code == 0 and "exact after 2 ask(s)" in r.output for r in said.values())
        assert "computed in full and kept exact" in said[3].output
        assert "kept exact" not in said[4].output


def test_an_order_whose_keep_was_evicted_unused_waits_twice_as_long_and_as_long_as_the_first_after_one_used(
        cache_dir):
    pipe = repeating_pipeline(cache_dir, 2)
    with pipe.store:
        pipe.warm(CHUNKS[:3])
        order = CHUNKS[2::-1]

        def evict():
            for name in chained_variants(pipe, order):
                assert pipe.store.delete(name)

        kept = [pipe.answer(order, QUESTION) for _ in range(3)]
        assert [a.kept_exact for a in kept] == [False, False, True] and kept[2].exact_wait == 2
        evict()  # before any ask reused them: the next keep waits for four asks since this one
        later = [pipe.answer(order, QUESTION) for _ in range(5)]
        assert [a.kept_exact for a in later] == [False] * 4 + [True] and later[4].exact_wait == 4
        assert all(0 < a.recompute_fraction < 1 for a in later[:4]) and later[4].recompute_fraction == 1.0
        reused = pipe.answer(order, QUESTION)  # its variants stayed: reused exactly, nothing to earn
        assert reused.reused_exact and not reused.kept_exact and reused.recompute_fraction == 0.0
        assert not any(a.reused_exact for a in kept + later)
        evict()  # after an ask reused them: the next keep waits for two asks, as the first did
        again = [pipe.answer(order, QUESTION) for _ in range(2)]
        assert [a.kept_exact for a in again] == [False, True] and again[1].exact_wait == 2
        recorded = [pipe.catalog.get_request(a.request_id).policy for a in (later[4], reused, again[1])]
        assert [(p["kept_exact"], p.get("exact_wait"), p["reused_exact"]) for p in recorded] == [
            (True, 4, False), (False, None, True), (True, 2, False)]
        from typer.testing import CliRunner

        from cli.app import app
        said = CliRunner().invoke(app, ["explain", str(later[4].request_id)])
        assert said.exit_code == 0
        assert ("asked 4 time(s) or more since it was last kept exact, or ever, twice the setting"
                in " ".join(said.output.split()))


def test_variants_kept_exact_are_stored_with_the_asks_that_earned_them(cache_dir, monkeypatch):
    pipe = repeating_pipeline(cache_dir, 2)
    with pipe.store:
        pipe.warm(CHUNKS[:3])
        credited: dict[str, int] = {}
        put = pipe.store.put

        def recording_put(kv, **kw):
            credited[kv.variant] = kw.get("prior_uses", 0)
            return put(kv, **kw)

        monkeypatch.setattr(pipe.store, "put", recording_put)
        order = CHUNKS[2::-1]
        for _ in range(2):
            assert not pipe.answer(order, QUESTION).kept_exact
        assert all(n == 0 for n in credited.values())  # nothing kept exact yet: no credit
        assert pipe.answer(order, QUESTION).kept_exact  # asked twice before
        # each chunk computed in full is stored crediting the two asks (the limit counted)
        assert {name: credited[name] for name in chained_variants(pipe, order)} == dict.fromkeys(
            chained_variants(pipe, order), 2)


def test_a_repeated_order_reuses_its_leading_exact_chunks_and_computes_the_rest(cache_dir):
    # no warm context: each warmed chunk is exact as the first chunk of a request
    pipe = repeating_pipeline(cache_dir, 1, warm_context="none")
    with pipe.store:
        pipe.warm(CHUNKS[:3])
        chained = chained_variants(pipe, CHUNKS[:3])
        full = traced(pipe, CHUNKS[:3], QUESTION, method="full")
        again = traced(pipe, CHUNKS[:3], QUESTION)
        assert again.kept_exact
        assert [c.fraction for c in again.chunks] == [0.0, 1.0, 1.0]
        assert again.chunks[0].variant == chained[0]
        assert (again.logits - full.logits).abs().max() < 1e-4 and again.text == full.text
        assert all(pipe.store.info(name).stats == {"made_exactly": 1.0} for name in chained)


def test_exact_after_asks_zero_never_computes_a_repeated_order_in_full(cache_dir):
    pipe = repeating_pipeline(cache_dir, 0)
    with pipe.store:
        pipe.warm(CHUNKS[:3])
        answers = [pipe.answer(CHUNKS[:3], QUESTION) for _ in range(4)]
        assert not any(a.kept_exact for a in answers)
        assert all(0 < a.recompute_fraction < 1 for a in answers)


def test_a_repeated_orders_exact_chunks_take_the_place_of_the_variant_used_least_at_the_cap(cache_dir):
    from cachecraft.policy.rules import MAX_VARIANTS_PER_CHUNK

    pipe = repeating_pipeline(cache_dir, 1)
    with pipe.store:
        pipe.warm(CHUNKS)
        pipe.warm_after([(before, CHUNKS[3]) for before in CHUNKS[:3]])  # the last chunk at the cap
        pieces = pipe.builder.build(CHUNKS, QUESTION)
        prefix = chunk_key(pipe.lm.fingerprint, pieces.prefix)
        last = chunk_key(pipe.lm.fingerprint, pieces.chunks[3])
        after = [variant_key(last, (prefix, chunk_key(pipe.lm.fingerprint, ids))) for ids in pieces.chunks[:3]]
        for name, reads in zip(after, (1, 2, 0)):  # the third is used least
            for _ in range(reads):
                pipe.store.get(name)
        before = {r.key for r in pipe.store.variants_of(last)}
        assert len(before) == MAX_VARIANTS_PER_CHUNK
        pipe.answer(CHUNKS, QUESTION)
        assert pipe.answer(CHUNKS, QUESTION).kept_exact
        chained = chained_variants(pipe, CHUNKS)
        assert {r.key for r in pipe.store.variants_of(last)} == before - {after[2]} | {chained[3]}
        assert pipe.answer(CHUNKS, QUESTION).recompute_fraction == 0.0


def test_an_order_blocked_at_a_chunks_cap_is_kept_once_asked_more_than_an_exact_variant_was_reused(cache_dir):
    pipe = repeating_pipeline(cache_dir, 1, warm_context="none")
    with pipe.store:
        pipe.warm(CHUNKS)  # each after the system prompt alone: exact as a first chunk
        for before in CHUNKS[:3]:  # the last chunk kept exact after each of the others: at its cap
            pipe.answer([before, CHUNKS[3]], QUESTION)
            assert pipe.answer([before, CHUNKS[3]], QUESTION).kept_exact
            assert pipe.answer([before, CHUNKS[3]], QUESTION).reused_exact  # reused as often as it was asked
        last = chunk_key(pipe.lm.fingerprint, pipe.builder.build(CHUNKS[3:], QUESTION).chunks[0])
        stored = pipe.store.variants_of(last)
        assert len(stored) == 4 and all(r.stats == {"made_exactly": 1.0} for r in stored)
        # the three keeps reused once each, warm's by each order's first ask
        assert sorted(r.hits for r in stored) == [1, 1, 1, 3]
        order = [CHUNKS[0], CHUNKS[1], CHUNKS[3]]
        pipe.answer(order, QUESTION)
        again = pipe.answer(order, QUESTION)  # asked once before: due, but the last chunk is full
        assert not again.kept_exact and again.recompute_fraction < 1.0
        assert [c.fraction for c in again.chunks][0] == 0.0  # the first chunk: exact, reused as it is
        # the second chunk has room: with the last one left out, the order is kept exact
        shorter = pipe.answer(order[:2], QUESTION)
        assert pipe.answer(order[:2], QUESTION).kept_exact and not shorter.kept_exact
        # asked twice since (or ever), the order outweighs the keeps reused once: those after the
        # second and third chunks (the one after the first was also what its two asks reused);
        # the one of them used longest ago, after the second chunk, gives way
        third = pipe.answer(order, QUESTION)
        assert third.kept_exact and [c.fraction for c in third.chunks] == [0.0, 0.0, 1.0]
        after = [chained_variants(pipe, [before, CHUNKS[3]])[1] for before in CHUNKS[:3]]
        assert {r.key for r in pipe.store.variants_of(last)} == ({r.key for r in stored} - {after[1]}
                                                                 | {chained_variants(pipe, order)[2]})


def test_at_the_cap_an_exact_variant_reused_less_often_than_a_new_order_was_asked_gives_way_to_it(cache_dir):
    pipe = repeating_pipeline(cache_dir, 1, warm_context="none")
    with pipe.store:
        pipe.warm(CHUNKS)  # each after the system prompt alone: exact as a first chunk, the fallback
        for before in CHUNKS[:3]:  # the last chunk kept exact after each of the others: at its cap
            pipe.answer([before, CHUNKS[3]], QUESTION)
            assert pipe.answer([before, CHUNKS[3]], QUESTION).kept_exact
            if before != CHUNKS[1]:  # the keep after the second chunk is never reused
                assert pipe.answer([before, CHUNKS[3]], QUESTION).reused_exact
        after = [chained_variants(pipe, [before, CHUNKS[3]])[1] for before in CHUNKS[:3]]
        last = chunk_key(pipe.lm.fingerprint, pipe.builder.build(CHUNKS[3:], QUESTION).chunks[0])
        before = {r.key for r in pipe.store.variants_of(last)}
        assert len(before) == 4 and set(after) < before
        order = [CHUNKS[0], CHUNKS[1], CHUNKS[3]]
        assert not pipe.answer(order, QUESTION).kept_exact
        kept = pipe.answer(order, QUESTION)  # asked once before: due, and an exact variant may give way
        assert kept.kept_exact and [c.fraction for c in kept.chunks] == [0.0, 1.0, 1.0]
        chained = chained_variants(pipe, order)
        # the keep no ask reused gave way; warm's and the two reused ones stay
        assert {r.key for r in pipe.store.variants_of(last)} == before - {after[1]} | {chained[2]}
        # the answer, its record and `explain` name the variant that gave way
        assert kept.gave_way == [{"chunk": last, "variant": after[1], "hits": 0, "made_exactly": True}]
        assert pipe.catalog.get_request(kept.request_id).policy["gave_way"] == kept.gave_way
        from typer.testing import CliRunner

        from cli.app import app
        said = CliRunner().invoke(app, ["explain", str(kept.request_id)])
        assert said.exit_code == 0
        assert (f"chunk {last[:12]} was at its cap of variants: its variant {after[1][:12]} (made exactly, "
                "reused 0 time(s)) gave way to this request's exact one") in " ".join(said.output.split())
        again = pipe.answer(order, QUESTION)
        assert again.reused_exact and again.recompute_fraction == 0.0 and [c.variant for c in again.chunks] == chained
        assert again.gave_way == [] and "gave_way" not in pipe.catalog.get_request(again.request_id).policy
        # the order that lost its keep, which served no ask, waits twice as long: two asks
        lost = [pipe.answer([CHUNKS[1], CHUNKS[3]], QUESTION) for _ in range(3)]
        assert [a.kept_exact for a in lost] == [False, False, True] and lost[2].exact_wait == 2
        # earned by two asks, it outweighs the keep after the third chunk, reused once (the keep
        # after the first was also reused by the new order's first ask, the new order's by these)
        assert {r.key for r in pipe.store.variants_of(last)} == before - {after[2]} | {chained[2]}
        assert lost[2].gave_way == [{"chunk": last, "variant": after[2], "hits": 1, "made_exactly": True}]


def test_a_full_disk_costs_the_new_chunk_caches_not_the_answer(cache_dir, tmp_path, monkeypatch, caplog):
    import errno

    import diskcache

    from cachecraft.catalog import CatalogWriteError
    from cachecraft.store import verify

    def configured(where):
        return Config.load(overrides={"cache_dir": where, "max_new_tokens": 6, "kv_dtype": "float32"}, environ={})

    def full_write(self, full_path, iterator, mode, encoding=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    lm = tiny_model("llama")
    policy = PolicyParams(alpha=0.5, check_layer=2, exact_after_asks=2)  # the second ask here keeps nothing
    with TieredStore(configured(cache_dir), tiers=("disk",)) as store, \
            TieredStore(configured(tmp_path / "control"), tiers=("disk",)) as control_store:
        pipe = Pipeline(configured(cache_dir), lm=lm, store=store, policy=policy)
        control = Pipeline(configured(tmp_path / "control"), lm=lm, store=control_store, policy=policy)
        monkeypatch.setattr(diskcache.Disk, "_write", full_write)
        # every chunk a miss, each to be kept after the answer: the first put fails
        answer = pipe.answer(CHUNKS, QUESTION, method="reuse")
        assert answer.text == control.answer(CHUNKS, QUESTION, method="reuse").text
        assert answer.request_id is not None
        assert f"{len(CHUNKS) + 1} new chunk-cache(s) of this request not kept" in caplog.text
        assert "free disk space" in caplog.text
        with store.catalog.read() as tx:
            assert tx.stored_variants() == []
        monkeypatch.undo()
        pipe.warm(CHUNKS)
        control.warm(CHUNKS)
        # the chunks stored, the system prompt's cache gone: made before the prefill, not kept
        prefix = variant_key(chunk_key(lm.fingerprint, pipe.builder.build(CHUNKS, QUESTION).prefix), ())
        assert store.delete(prefix)
        monkeypatch.setattr(diskcache.Disk, "_write", full_write)
        caplog.clear()
        again = pipe.answer(CHUNKS, QUESTION)
        assert again.text == control.answer(CHUNKS, QUESTION).text
        assert all(c.tier == "disk" for c in again.chunks)
        assert "the system prompt's cache was not kept" in caplog.text
        monkeypatch.undo()

        def catalog_full(*args, **kwargs):
            raise CatalogWriteError("no space left on device writing the catalog; free disk space")

        monkeypatch.setattr(store, "put", catalog_full)  # the catalog's disk, rather than the store's
        caplog.clear()
        other = [chunk.replace("w", "v") for chunk in CHUNKS]
        assert pipe.answer(other, QUESTION).text == control.answer(other, QUESTION).text
        # the system prompt's too: the disk took none of it before
        assert f"{len(CHUNKS) + 1} new chunk-cache(s) of this request not kept" in caplog.text
        monkeypatch.undo()
    assert verify(cache_dir).ok
