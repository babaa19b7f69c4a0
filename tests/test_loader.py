"""Model loading, fingerprints and unsupported architectures."""

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from cachecraft.config import Config
from cachecraft.model.adapter import UnsupportedArchitecture
from cachecraft.model.loader import ModelLoadError, load_model, wrap_model
from tests.conftest import tiny_model, tiny_tokenizer


def test_fingerprint_changes_with_weights_architecture_and_dtype():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == tiny_model("llama", seed=0).fingerprint
    assert tiny_model("qwen2").fingerprint != a.fingerprint
    half = wrap_model("x", tiny_model("llama", seed=0).model, tiny_tokenizer(), torch.device("cpu"), torch.bfloat16)
    assert half.fingerprint != a.fingerprint


def test_unsupported_architecture_is_named_with_the_reason():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedArchitecture, match="'gpt2' is not supported: .*absolute position"):
        wrap_model("gpt2", model, tiny_tokenizer(), torch.device("cpu"), torch.float32)


def test_local_directory_loads_with_same_fingerprint(tmp_path, cache_dir):
    lm = tiny_model("qwen3")
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), Config.load(environ={}))
    assert loaded.fingerprint == lm.fingerprint
    assert loaded.adapter.has_qk_norm


def test_bad_model_names_are_explained(tmp_path, cache_dir):
    config = Config.load(environ={})
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"), config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"), config)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="neither a model directory"):
        load_model(str(tmp_path / "file.txt"), config)


def test_damaged_model_files_are_one_error_naming_the_file(tmp_path, cache_dir):
    config = Config.load(environ={})
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=r"cannot read the GGUF file .*fake.gguf: .*GGUF magic"):
        load_model(str(fake), config)
    lm = tiny_model("llama")
    for damage in ("config", "weights", "no weights"):
        folder = tmp_path / damage.replace(" ", "-")
        lm.model.save_pretrained(folder)
        lm.tokenizer.save_pretrained(folder)
        if damage == "config":
            (folder / "config.json").write_text("{not json")
        elif damage == "weights":
            (folder / "model.safetensors").write_bytes(b"\xff" * 64)
        else:
            (folder / "model.safetensors").unlink()
        with pytest.raises(ModelLoadError, match=f"cannot load the model directory {folder}: "):
            load_model(str(folder), config)


def test_a_broken_link_for_the_model_cache_is_one_clear_error(tmp_path):
    from cachecraft.model.loader import convert_gguf

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))  # never read past its identity: the cache fails first
    models = tmp_path / "models"
    models.symlink_to(tmp_path / "gone")
    with pytest.raises(ModelLoadError, match=r"is a link to .*gone, which does not exist"):
        convert_gguf(gguf, models)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ModelLoadError, match="cannot create the model cache"):
        convert_gguf(gguf, blocker / "models")


def _tiny_gguf(path: Path) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_conversion_reads_each_gguf_file_once_and_puts_gguf_back(tmp_path):
    import gguf

    from cachecraft.model.loader import _gguf_read_once

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file, however named: parsed once
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert first.tensors[0].data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    with pytest.raises(RuntimeError), _gguf_read_once():
        raise RuntimeError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_the_gguf_conversion_bar_is_off_while_transformers_bars_are_off():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from cachecraft.model.loader import _gguf_read_once

    original, was_enabled = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        with _gguf_read_once():
            assert gguf_utils.tqdm is original  # bars on: the conversion's bar too
        hf_logging.disable_progress_bar()  # what the command line does
        with _gguf_read_once():
            assert gguf_utils.tqdm(range(3)).disable
            assert list(gguf_utils.tqdm(range(3), desc="x")) == [0, 1, 2]
        assert gguf_utils.tqdm is original
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
