"""Methods as registered objects: parsing, what each one recomputes, exactness at 1.0.

Every test here answers through the pipeline (the one request path), over chunk-caches
made by ``warm`` after the system prefix alone."""

from __future__ import annotations

import pytest
import torch

from cachecraft.config import Config
from cachecraft.evaluation import answer_traced
from cachecraft.methods import (METHODS, REGISTRY, CacheCraft, Method, UnknownMethod, methods_help, parse_method,
                                parse_methods)
from cachecraft.pipeline import Pipeline
from cachecraft.policy.planner import PolicyParams
from cachecraft.store import TieredStore
from cli.common import METHODS_HELP
from tests.conftest import tiny_model

CHUNKS = [" ".join(f"w{i}" for i in range(10 + 20 * j, 30 + 20 * j)) + "\n\n" for j in range(3)]  # 20 tokens each
QUESTION = "w200 w201 w202"


def test_parse_method_labels_ratios_and_errors():
    methods = parse_methods("full, cacheblend@0.3,qguided,cachecraft", ratio=0.1, alpha=0.05)
    assert [m.label for m in methods] == ["full", "cacheblend@0.3", "qguided@0.1", "cachecraft@0.05"]
    assert parse_method("cacheblend").label == "cacheblend@0.15"  # the method's own default
    assert parse_method("cachecraft").ratio == PolicyParams().alpha
    for text, needle in (("fancy", "unknown method 'fancy'"), ("cacheblend@2", "within"),
                         ("reuse@0.3", "takes no ratio"), ("cacheblend@x", "not a number")):
        with pytest.raises(UnknownMethod, match=needle):
            parse_method(text)
    with pytest.raises(UnknownMethod, match="no method"):
        parse_methods(" , ")


def test_every_method_is_its_own_registered_class_and_help_marks_the_experimental_ones():
    assert METHODS == ("full", "prefix", "reuse", "cacheblend", "cachecraft", "qguided", "inter", "firstk", "spread")
    assert len(set(REGISTRY.values())) == len(METHODS) and all(issubclass(c, Method) for c in REGISTRY.values())
    experimental = {name for name, cls in REGISTRY.items() if cls.experimental}
    assert experimental == {"qguided", "inter", "firstk", "spread"}
    assert methods_help().count("(experimental)") == 4 and "qguided (experimental)" in methods_help()
    assert METHODS_HELP == methods_help()  # the CLI's copy, kept free of torch imports


@pytest.fixture
def pipeline(cache_dir):
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32",
                                    "warm_context": "none"}, environ={})
    with TieredStore(config, tiers=("cpu",)) as store:
        yield Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(check_layer=2),
                       keep_new_variants=False)


def test_cachecraft_leaves_the_first_chunk_alone_and_fixes_the_rest(pipeline):
    pipeline.warm(CHUNKS)
    answer = pipeline.answer(CHUNKS, QUESTION, method=CacheCraft(0.4))
    first, second, third = answer.chunks
    assert first.cfo == 0.0 and first.fraction == 0.0  # exact: cached right after the system prefix
    # cfo = 0.4 * cci_prior 0.5 * (1 - 0) = 0.2 -> ceil(0.2 * 20) = 4 tokens each, placed by the question
    assert second.cfo == pytest.approx(0.2) and third.cfo == pytest.approx(0.2)
    assert answer.recompute_fraction == pytest.approx(8 / 60)


@pytest.mark.parametrize("method,share", [("firstk@0.25", 0.25), ("inter@0.25", 0.25), ("qguided@0.25", 0.25),
                                          ("spread@0.25", 0.25), ("cacheblend@0.25", 0.25), ("reuse", 0.0)])
def test_fixed_ratio_methods_recompute_their_share(pipeline, method, share):
    pipeline.warm(CHUNKS)
    answer = pipeline.answer(CHUNKS, QUESTION, method=method)
    assert answer.method == method and answer.recompute_fraction == pytest.approx(share)
    if method.startswith("firstk"):  # the first 5 tokens of every chunk
        assert all(c.fraction == pytest.approx(0.25) for c in answer.chunks)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_fraction_at_one_equals_a_full_prefill_through_the_pipeline(cache_dir, arch):
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "kv_dtype": "float32"},
                         environ={})
    reordered = CHUNKS[::-1]
    with TieredStore(config, tiers=("cpu",)) as store:
        pipe = Pipeline(config, lm=tiny_model(arch), store=store, policy=PolicyParams(floor=1.0, check_layer=2),
                        keep_new_variants=False)
        pipe.warm(CHUNKS)
        full, full_trace = answer_traced(pipe, reordered, QUESTION, "full")
        for method in ("cachecraft", CacheCraft(None, drift_shift=1.0),
                       CacheCraft(None, drift_shift=1.0, relevance=1.0), CacheCraft(None, pool=1.0),
                       "cacheblend@1.0", "qguided@1.0", "firstk@1.0", "inter@1.0", "spread@1.0"):
            answer, trace = answer_traced(pipe, reordered, QUESTION, method)
            assert answer.recompute_fraction == 1.0, method
            assert (trace.logits - full_trace.logits).abs().max() < 1e-4, method
            assert answer.text == full.text, method


def test_prefix_reuses_exact_blocks_of_an_earlier_request_and_matches_full(pipeline):
    full, full_trace = answer_traced(pipeline, CHUNKS, QUESTION, "full")
    first, first_trace = answer_traced(pipeline, CHUNKS, QUESTION, "prefix")
    again, again_trace = answer_traced(pipeline, CHUNKS, QUESTION, "prefix")
    assert first.recompute_fraction == 1.0 and again.recompute_fraction < 0.1
    assert again_trace.token_layers < first_trace.token_layers / 5
    assert torch.allclose(again_trace.logits, full_trace.logits, atol=1e-4) and again.text == full.text
