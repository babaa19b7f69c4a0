"""The bundled SmolLM2-135M: exactness, generation hand-off and bad input, for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cachecraft.checks import check_model
from cachecraft.config import Config
from cachecraft.engine import Segment, blended_prefill, generate_from
from cachecraft.model.bundled import BUNDLED, gguf_path
from cachecraft.model.loader import load_model
from cachecraft.prompt import PromptBuilder
from cli.app import app

pytestmark = pytest.mark.slow
MUSIQUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("real-cache")


@pytest.fixture(scope="module")
def smollm2(real_cache):
    return load_model("smollm2", Config.load(overrides={"cache_dir": real_cache}, environ={}))


def test_conversion_is_cached_and_not_repeated(smollm2, real_cache, monkeypatch):
    converted = list((real_cache / "models").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    import transformers

    original = transformers.AutoModelForCausalLM.from_pretrained

    def no_gguf(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the GGUF was dequantised again"
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    again = load_model("smollm2", Config.load(overrides={"cache_dir": real_cache}, environ={}))
    assert again.fingerprint == smollm2.fingerprint
    assert smollm2.adapter.num_layers == 30 and smollm2.adapter.num_kv_heads == 3


def test_converted_weights_are_the_gguf_files_own(smollm2, real_cache):
    """The conversion (its header parsed once, the name map built once) puts each GGUF
    tensor, dequantised by gguf itself, under the right name, bit for bit."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(gguf_path(BUNDLED["smollm2"], real_cache / "models"))
    expected = {t.name: t for t in reader.tensors if t.name in ("token_embd.weight", "blk.3.ffn_down.weight")}
    converted = next((real_cache / "models").iterdir()) / "model.safetensors"
    with safe_open(str(converted), "pt") as stored:  # the embedding is tied: stored once, as lm_head
        for gguf_name, name in (("token_embd.weight", "lm_head.weight"),
                                ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight")):
            tensor = expected[gguf_name]
            want = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
            got = stored.get_tensor(name)
            assert torch.equal(got, want.reshape(got.shape)), name


def test_check_model_passes_on_smollm2(smollm2):
    report = check_model(smollm2, prompts=2)
    assert report.passed, report.to_dict()
    assert max(r.max_abs_diff for r in report.results) < 1e-4


def test_stop_strings_and_generation_match_plain_generate(smollm2):
    builder = PromptBuilder(smollm2.tokenizer, "You are a helpful assistant.")
    pieces = builder.build(["Paris\nParis is the capital and largest city of France.\n\n"],
                           "What is the capital of France?")
    segments = ([Segment(pieces.prefix, "prefix")] + [Segment(c) for c in pieces.chunks]
                + [Segment(pieces.question, "question")])
    ids = torch.tensor(pieces.token_ids)[None]
    plain = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   temperature=None, top_p=None, top_k=None)[0, ids.shape[1]:]
    ours = generate_from(smollm2.model, smollm2.tokenizer, blended_prefill(smollm2.adapter, segments),
                         max_new_tokens=12)
    assert ours.tolist() == plain.tolist()
    text = smollm2.tokenizer.decode(ours, skip_special_tokens=True)
    stop = text.split()[1]
    stopped = generate_from(smollm2.model, smollm2.tokenizer, blended_prefill(smollm2.adapter, segments),
                            max_new_tokens=12, stop_strings=[stop])
    decoded = smollm2.tokenizer.decode(stopped, skip_special_tokens=True)
    assert decoded.rstrip().endswith(stop) and len(stopped) < len(ours)


def test_cli_check_model_and_too_long_prompt(real_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(real_cache))
    runner = CliRunner()
    result = runner.invoke(app, ["check-model", "smollm2", "--prompts", "1"])
    assert result.exit_code == 0, result.output
    long_item = [{"ctxs": [{"title": "t", "text": "word " * 9000}], "question": "why?", "answers": ["x"]}]
    path = tmp_path / "long.json"
    path.write_text(json.dumps(long_item))
    result = runner.invoke(app, ["bench", "quality", "--dataset", str(path), "--limit", "1",
                                 "--out", str(tmp_path / "q.json")])  # never the repository's results
    assert result.exit_code == 1 and "context window of 8192" in result.output and "Traceback" not in result.output


@pytest.mark.skipif(not MUSIQUE.is_file(), reason="shared MuSiQue data not present")
def test_quality_bench_on_one_musique_item(real_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(real_cache))
    out = tmp_path / "q.json"
    result = CliRunner().invoke(app, ["bench", "quality", "--dataset", str(MUSIQUE), "--limit", "1",
                                      "--methods", "full,reuse,cacheblend", "--out", str(out),
                                      "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    methods = json.loads(out.read_text())["methods"]
    assert methods["full"]["kl_mean"] == 0.0 and methods["full"]["agreement_f1_mean"] == 1.0
    assert abs(methods["cacheblend@0.15"]["recompute_fraction_mean"] - 0.15) < 0.01
    assert methods["reuse"]["kl_mean"] > 0.0
    assert json.loads(out.read_text())["items"][0]["tokens"] > 5000
