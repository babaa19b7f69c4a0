"""Load a causal LM: the bundled default, a local directory, a ``.gguf`` file or a hub id.

GGUF files are dequantised once and written as safetensors into the cache directory's
``models/`` folder, so later loads take seconds. Every loaded model carries a
fingerprint (architecture, config, weights, tokenizer, dtype) that keys its caches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from cachecraft.config import Config
from cachecraft.model.adapter import ArchAdapter
from cachecraft.model.bundled import BUNDLED, ModelLoadError, gguf_path

log = logging.getLogger(__name__)

_GGUF_PATCH = threading.Lock()  # the module attributes patched during a conversion are process-wide

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for the engine: HF model, tokenizer, adapter and identity."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    adapter: ArchAdapter
    fingerprint: str
    device: torch.device
    dtype: torch.dtype

    @property
    def max_context(self) -> int:
        """Longest prompt (in tokens) the engine accepts for this model."""
        return self.adapter.max_context


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available; use device = 'cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def bundled_gguf(name: str, models_dir: Path) -> Path:
    """Path of a bundled model's GGUF file, found without importing its packages; a model
    split over several packages is assembled (once, checksummed) into ``models_dir``."""
    return gguf_path(BUNDLED[name], models_dir)


def _file_identity(path: Path) -> str:
    """Cheap identity of a weights file: size plus hashes of its head and tail."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _make_models_dir(models_dir: Path) -> None:
    """Create the converted-model cache, or say in one line why it cannot be."""
    if models_dir.is_symlink() and not models_dir.exists():
        raise ModelLoadError(f"the model cache {models_dir} is a link to {os.readlink(models_dir)}, which does not "
                             "exist: create that folder or remove the link")
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create the model cache {models_dir}: {exc.strerror}") from None


def convert_gguf(gguf_path: Path, models_dir: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors model directory; return it.

    The directory is written under a temporary name and renamed into place, so a
    crash never leaves a half-written model behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_model

    target = models_dir / f"{gguf_path.stem}-{_file_identity(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    _make_models_dir(models_dir)
    log.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    folder, filename = str(gguf_path.parent), gguf_path.name
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=models_dir))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        (staging / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        save_model(model, str(staging / "model.safetensors"))
        tokenizer.save_pretrained(staging)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        os.replace(staging, target)
    except FileExistsError:
        pass  # another process converted it first
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """For one conversion, parse each GGUF file once and build gguf's tensor-name map once.

    transformers parses the file's header three times (config, tokenizer, weights: 8 s
    each for SmolLM2, most of it the vocabulary) and rebuilds the name map for every
    module it walks (10 s); the dequantising itself takes 4 s. Both objects are only read
    from, so sharing them changes no byte of the result.
    """
    import gguf

    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    # two conversions in one process take turns, so each puts back the originals
    with _GGUF_PATCH, _gguf_bar_obeys_transformers():
        make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map
            readers.clear()


@contextmanager
def _gguf_bar_obeys_transformers() -> Iterator[None]:
    """transformers draws the GGUF conversion's bar with tqdm itself, past its own switch for
    progress bars (``disable_progress_bar``, which the command line turns off); while that
    switch is off, so is this bar (in a log it was a run of carriage-return updates)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    original = getattr(gguf_utils, "tqdm", None)
    if original is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def model_fingerprint(model: torch.nn.Module, tokenizer, dtype: torch.dtype) -> str:
    """Identity of (architecture, config, weights, tokenizer, compute dtype).

    Weights are identified by a strided sample of every parameter, which is cheap
    for large models and still changes whenever the weights do in practice.
    """
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "_commit_hash", "architectures", "transformers_version", "dtype",
                     "torch_dtype", "quantization_config"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.state_dict().items():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].to(device="cpu", dtype=torch.float32)
        h.update(name.encode())
        h.update(str(tuple(param.shape)).encode())
        h.update(sample.numpy().tobytes())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    h.update(str(dtype).encode())
    return h.hexdigest()[:24]


def wrap_model(name: str, model: torch.nn.Module, tokenizer, device: torch.device,
               dtype: torch.dtype) -> LoadedModel:
    """Adapt an already-built HF model (tests build tiny ones from configs)."""
    model = model.to(device=device, dtype=dtype).eval()
    adapter = ArchAdapter(model)  # raises UnsupportedArchitecture with the reason
    return LoadedModel(name, model, tokenizer, adapter, model_fingerprint(model, tokenizer, dtype),
                       device, dtype)


def load_model(name: str | None = None, config: Config | None = None) -> LoadedModel:
    """Load ``name``: a bundled name (``smollm2``, ``qwen2.5-coder-0.5b``), a local HF directory,
    a ``.gguf`` path or a hub id."""
    config = config or Config.load()
    name = name or config.model
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    path = Path(name).expanduser()
    converted = True  # a folder this cache made from a GGUF file (made again when deleted)
    if name in BUNDLED:
        local = convert_gguf(bundled_gguf(name, config.models_dir), config.models_dir)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        try:
            local = convert_gguf(path.resolve(), config.models_dir)
        except (ValueError, KeyError, OSError) as exc:  # not GGUF, cut short, or a layout we cannot convert
            raise ModelLoadError(f"cannot read the GGUF file {path}: {_first_line(exc)}") from None
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
        local, converted = path, False
    elif path.exists():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    else:
        return _load_from_hub(name, device, dtype)
    try:
        tokenizer, model = _from_pretrained(str(local), dtype, local_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file fails in many libraries' own ways
        if converted:
            raise ModelLoadError(f"cannot load the model {name!r} from its conversion {local}: {_first_line(exc)}; "
                                 "delete that folder and it is converted again") from None
        raise ModelLoadError(f"cannot load the model directory {local}: {_first_line(exc)}") from None
    return wrap_model(name, model, tokenizer, device, dtype)


def _load_from_hub(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A hub id, from the local Hugging Face cache, else from the hub where the network allows."""
    try:
        tokenizer, model = _from_pretrained(name, dtype, local_only=True)
    except (OSError, ValueError):
        if not _hub_reachable():
            raise ModelLoadError(
                f"cannot load model {name!r}: not a bundled name ({', '.join(sorted(BUNDLED))}), a local model "
                "directory or a .gguf file, and not in the local Hugging Face cache (the hub is unreachable)") \
                from None
        try:
            tokenizer, model = _from_pretrained(name, dtype, local_only=False)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load model {name!r} from the hub: {_first_line(exc)}") from None
    return wrap_model(name, model, tokenizer, device, dtype)


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _from_pretrained(source: str, dtype: torch.dtype, local_only: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    return tokenizer, model


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the model hub answers at all (offline machines fail fast instead of retrying)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False
