"""The engine and the store on CUDA: the exactness checks with 16-bit tolerances, greedy
generation from a blended cache, the gpu tier, and chunk-caches streamed onto the GPU."""

import pytest
import torch

from cachecraft.checks import DEFAULT_TOLERANCE, check_model, greedy_agrees, top_two_margins
from cachecraft.config import Config
from cachecraft.engine import Segment, blended_prefill, generate_from
from cachecraft.model.loader import wrap_model
from cachecraft.pipeline import Pipeline
from cachecraft.selection import create_chunk_cache
from cachecraft.store import LayerStream, TieredStore
from tests.conftest import ARCHS, tiny_tokenizer
from tests.store_helpers import config as store_config
from tests.test_engine import full_segments, make_prompt

pytestmark = pytest.mark.gpu

CHUNKS = [" ".join(f"w{i}" for i in range(10 + 20 * j, 30 + 20 * j)) + "\n\n" for j in range(4)]
QUESTION = "w200 w201 w202"


def cuda_model(arch: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    cls, make_config = ARCHS[arch]
    return wrap_model(f"tiny-{arch}", cls(make_config()), tiny_tokenizer(), torch.device("cuda"), dtype)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blending_is_exact_on_cuda(arch, dtype):
    lm = cuda_model(arch, dtype)
    report = check_model(lm, prompts=2, chunk_tokens=24)
    assert report.passed, report.to_dict()


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_generation_from_blended_cache_equals_plain_generate_on_cuda(arch, dtype):
    """Token for token in float32; in 16 bits up to a near tie in plain generate's own logits
    (two logits closer than twice the dtype's check tolerance, which two kernels' rounding
    may order either way)."""
    lm = cuda_model(arch, dtype)
    prefix, chunks, question = make_prompt()
    ids = torch.tensor(prefix + [t for c in chunks for t in c] + question, device="cuda")
    plain = lm.model.generate(ids[None], max_new_tokens=10, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
    want = plain.sequences[0, ids.numel():].tolist()
    result = blended_prefill(lm.adapter, full_segments(prefix, chunks, question))
    got = generate_from(lm.model, lm.tokenizer, result, max_new_tokens=10).tolist()
    if dtype == torch.float32:
        assert got == want
    else:
        assert greedy_agrees(want, top_two_margins(plain.scores), got, near_tie=2 * DEFAULT_TOLERANCE[dtype])


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_caches_streamed_onto_the_gpu_from_pinned_memory_or_disk_equal_the_same_caches_on_the_gpu(cache_dir, tier):
    lm = cuda_model("qwen2", torch.bfloat16)
    prefix = Segment([1, 5, 6, 7], "prefix")
    chunks = [list(range(10 + 9 * j, 19 + 9 * j)) for j in range(3)]
    made = [create_chunk_cache(lm.adapter, [prefix], ids, fingerprint=lm.fingerprint) for ids in chunks]
    question = Segment([200, 201, 202], "question")
    with TieredStore(store_config(cache_dir), tiers=(tier,)) as store:
        for kv in made:
            store.put(kv)
        if tier == "cpu":
            assert store._tier("cpu").get(made[0].variant).kv.keys.is_pinned()
        whole = [store.get(kv.variant, device="cuda", promote=False) for kv in made]
        readers = [store.iter_layers(kv.variant, device="cuda", promote=False) for kv in made]
        assert all(r.held() is None for r in readers)
        with LayerStream(readers) as stream:
            # copies run on a stream of their own, beside the compute stream
            assert stream._copy_stream is not None and stream._copy_stream != torch.cuda.current_stream()
            streamed = blended_prefill(lm.adapter, [prefix, *(Segment(ids, cached=kv) for ids, kv
                                                             in zip(chunks, stream.kvs)), question])
        assert stream.read_bytes[tier] > 0
    direct = blended_prefill(lm.adapter, [prefix, *(Segment(ids, cached=kv) for ids, kv in zip(chunks, whole)),
                                          question])
    assert torch.equal(streamed.logits, direct.logits)
    assert all(torch.equal(a, b) for a, b in zip(streamed.keys, direct.keys))


def _warm_and_answer(lm, cache_dir, tiers, **overrides):
    """Warm CHUNKS into a fresh store of ``tiers``, answer with ``reuse``; the answer, and
    the keys each memory tier holds after the warm."""
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 4, "repetition_fallback": False,
                                    **overrides}, environ={})
    with TieredStore(config, tiers=tiers) as store:
        pipe = Pipeline(config, lm=lm, store=store)
        pipe.warm(CHUNKS)
        held = {t: {k: store._tier(t).get(k) for k in store._tier(t).keys()} for t in tiers if t != "disk"}
        return pipe.answer(CHUNKS, QUESTION, method="reuse"), held


def test_a_pipeline_on_cuda_answers_alike_from_the_gpu_tier_and_pinned_memory(tmp_path):
    lm = cuda_model("llama", torch.bfloat16)
    on_gpu, held = _warm_and_answer(lm, tmp_path / "gpu", ("gpu", "cpu"))
    assert len(held["gpu"]) == len(CHUNKS) + 2 and not held["cpu"]  # the chunks, system prefix, warm context
    assert {c.tier for c in on_gpu.chunks} == {"gpu"}
    chunk_bytes = max(held["gpu"][c.variant].info.nbytes for c in on_gpu.chunks)
    # Room on the GPU for two chunk-caches: the others are demoted to pinned host memory.
    mixed, held = _warm_and_answer(lm, tmp_path / "small", ("gpu", "cpu"), gpu_budget_bytes=2 * chunk_bytes + 1)
    assert sum(e.info.nbytes for e in held["gpu"].values()) <= 2 * chunk_bytes + 1
    assert len(held["gpu"]) + len(held["cpu"]) == len(CHUNKS) + 2
    assert all(entry.kv.keys.is_pinned() for entry in held["cpu"].values())
    # what stays on the GPU is the eviction policy's choice; a chunk is found in either tier
    assert {c.tier for c in mixed.chunks} <= {"gpu", "cpu"} and all(c.tier != "miss" for c in mixed.chunks)
    on_host, _ = _warm_and_answer(lm, tmp_path / "cpu", ("cpu",))
    assert {c.tier for c in on_host.chunks} == {"cpu"}
    assert on_gpu.text == mixed.text == on_host.text



def test_float16_caches_under_a_bfloat16_model_assemble_alike_on_cuda(monkeypatch):
    """Chunk-caches stored in float16 (the prefix's in bfloat16) under a bfloat16 model: copied
    into place a segment at a time, or the chunks' joined and then converted (the default on
    CUDA), the prefill is the same to the bit."""
    lm = cuda_model("llama", torch.bfloat16)
    prefix, chunks, question = make_prompt()
    prefix_kv = create_chunk_cache(lm.adapter, [], prefix, fingerprint=lm.fingerprint)
    before = [Segment(prefix, "prefix", cached=prefix_kv)]
    kvs = [prefix_kv] + [create_chunk_cache(lm.adapter, before, c, fingerprint=lm.fingerprint) for c in chunks]
    kvs = [kvs[0]] + [kv.to(dtype=torch.float16) for kv in kvs[1:]]  # as a pipeline loads them
    segments = ([Segment(prefix, "prefix", cached=kvs[0])]
                + [Segment(c, cached=kv, recompute=[1, 4]) for c, kv in zip(chunks, kvs[1:])]
                + [Segment(question, "question")])
    results = []
    for setting in ((), ("cuda",)):
        monkeypatch.setattr("cachecraft.engine.blend.JOIN_THEN_CONVERT", setting)
        results.append(blended_prefill(lm.adapter, segments))
    copied, joined = results
    assert torch.equal(joined.logits, copied.logits)
    assert all(torch.equal(a, b) for a, b in zip(joined.keys + joined.values, copied.keys + copied.values))
