"""Shared fixtures: a temporary cache directory and tiny random-weight models."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from cachecraft.model.loader import LoadedModel, wrap_model

VOCAB = 320
SPECIALS = ["<unk>", "<s>", "</s>"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**COMMON)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=512)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON, head_dim=32)),
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: words ``w0 .. wN`` and a few specials."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(VOCAB - len(SPECIALS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<unk>")


def tiny_model(arch: str, seed: int = 0) -> LoadedModel:
    """A random-weight model of ``arch`` in float32 on the CPU."""
    torch.manual_seed(seed)
    cls, make_config = ARCHS[arch]
    model = cls(make_config())
    return wrap_model(f"tiny-{arch}", model, tiny_tokenizer(), torch.device("cpu"), torch.float32)


@pytest.fixture(autouse=True)
def hermetic_user_dirs(tmp_path_factory, monkeypatch):
    """No test reads or writes the real user cache directory or a user config file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    monkeypatch.delenv("CACHECRAFT_CONFIG", raising=False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory, also exported as CACHECRAFT_CACHE_DIR."""
    path = tmp_path / "cache"
    monkeypatch.setenv("CACHECRAFT_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama saved as a Hugging Face model directory."""
    path = tmp_path_factory.mktemp("tiny") / "llama"
    lm = tiny_model("llama")
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def dataset(tmp_path):
    """A two-item MuSiQue-format file in the tiny tokenizer's words."""
    words = lambda start, n: " ".join(f"w{i}" for i in range(start, start + n))  # noqa: E731
    items = [{"ctxs": [{"title": "w1", "text": words(10 + 7 * j + i, 30)} for j in range(3)],
              "question": words(100 + i, 5), "answers": [words(200, 2)]} for i in range(2)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(items))
    return path


@pytest.fixture(params=sorted(ARCHS))
def any_tiny(request) -> LoadedModel:
    return tiny_model(request.param)


@pytest.fixture
def tiny_llama() -> LoadedModel:
    return tiny_model("llama")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
