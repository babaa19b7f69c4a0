"""The judge model (Qwen2.5-Coder-0.5B-Instruct), for real: assembled, converted once, exact.

Runs wherever its six packages are installed (`make install-judge`; CI does), else skips.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from cachecraft.config import Config
from cachecraft.model import bundled
from cachecraft.model.bundled import BUNDLED, ModelLoadError, locate_part
from cachecraft.model.loader import load_model
from cli.app import app

JUDGE = BUNDLED["qwen2.5-coder-0.5b"]


def _not_installed() -> str | None:
    try:
        for index in range(len(JUDGE.parts)):
            locate_part(JUDGE, index)
    except ModelLoadError as exc:
        return str(exc)
    return None


NOT_INSTALLED = _not_installed()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(NOT_INSTALLED is not None, reason=f"judge model not installed: {NOT_INSTALLED}")]


@pytest.fixture(scope="module")
def judge_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("judge-cache")


@pytest.fixture(scope="module")
def judge(judge_cache):
    return load_model(JUDGE.name, Config.load(overrides={"cache_dir": judge_cache}, environ={}))


def test_judge_is_assembled_and_converted_once(judge, judge_cache, monkeypatch):
    models = judge_cache / "models"
    assembled = models / JUDGE.assembled_name
    assert sorted(p.name for p in models.iterdir() if p.is_file()) == [assembled.name]
    assert len([p for p in models.iterdir() if p.is_dir()]) == 1
    digest = hashlib.sha256()
    with assembled.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    assert assembled.stat().st_size == JUDGE.size and digest.hexdigest() == JUDGE.sha256

    config = judge.model.config
    assert config.model_type == "qwen2" and config.num_hidden_layers == 24
    assert config.num_attention_heads == 14 and judge.adapter.num_kv_heads == 2
    assert "<|im_start|>assistant" in judge.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)

    import transformers

    original = transformers.AutoModelForCausalLM.from_pretrained

    def no_gguf(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the GGUF was dequantised again"
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    monkeypatch.setattr(bundled, "locate_part", lambda *a: pytest.fail("the parts were read again"))
    mtime = assembled.stat().st_mtime_ns
    again = load_model(JUDGE.name, Config.load(overrides={"cache_dir": judge_cache}, environ={}))
    assert again.fingerprint == judge.fingerprint and assembled.stat().st_mtime_ns == mtime


def test_cli_check_model_passes_on_the_judge(judge, judge_cache, monkeypatch):
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(judge_cache))
    result = CliRunner().invoke(app, ["check-model", JUDGE.name, "--prompts", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["passed"] and report["model"] == JUDGE.name
    assert max(r["max_abs_diff"] for r in report["results"]) < 1e-4
