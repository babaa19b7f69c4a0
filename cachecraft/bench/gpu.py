"""``cachecraft bench gpu``: every method's time to first token on models of real size.

Real weights of 7-8B models cannot be had everywhere a GPU can, and time does not
depend on what the weights are, so the models here are built from their published
shapes with random weights (their answers mean nothing; ``full`` and ``prefix`` still
agree with each other). Each shape runs the context sweep of ``bench scaling``
(:func:`cachecraft.bench.scaling.run_scaling`, so every request goes through the
pipeline; the methods of a request share one store warmed once) once per store tier
the chunk-caches are loaded from: ``gpu`` (already on
the device), ``cpu`` (pinned host memory) and ``disk``. ``cachecraft`` runs at fixed
recompute fractions (its floor, with alpha 0): on random weights the policy's own
choice of how much to recompute would be meaningless. The repetition fallback is off:
random weights answer in loops. Rotary scaling of the real
configurations is left out; it changes no cost.

The text comes from a MuSiQue-format file, tokenized by a bundled model's tokenizer
(the judge's for Qwen2.5 shapes: the same tokenizer; SmolLM2's for Llama shapes,
whose vocabulary it fits) or by one given with ``tokenizer``.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.kv import kv_bytes_per_token
from cachecraft.methods import CacheCraft, Method, Prefix
from cachecraft.model.loader import LoadedModel, wrap_model

DEFAULT_CONTEXTS = (4000, 8000, 16000, 32000)
GPU_TIERS = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class Shape:
    """A published model configuration: the architecture and the sizes that set its cost."""

    arch: str  # "llama" or "qwen2"
    dims: dict = field(default_factory=dict)
    tokenizer: str = "smollm2"  # the bundled model whose tokenizer fits the vocabulary


SHAPES: dict[str, Shape] = {
    "llama-3.1-8b": Shape("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False), "smollm2"),
    "qwen2.5-7b": Shape("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                      num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                      max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False), "qwen2.5-coder-0.5b"),
    # A few layers of the same kind, small enough for a CPU: for trying the command anywhere.
    "tiny-llama": Shape("llama", dict(vocab_size=49152, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8192, tie_word_embeddings=False), "smollm2"),
}


def random_model(shape_name: str, tokenizer, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> LoadedModel:
    """``shape_name`` (a key of :data:`SHAPES`) with random weights, built directly on
    ``device`` in ``dtype`` (an 8B model first built in float32 on the host would take
    minutes and 32 GB)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = SHAPES[shape_name]
    if len(tokenizer) > shape.dims["vocab_size"]:
        raise ValueError(f"the tokenizer's {len(tokenizer)} tokens do not fit {shape_name}'s vocabulary "
                         f"of {shape.dims['vocab_size']}")
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.arch]
    specials = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    config = config_class(**shape.dims, **specials)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return wrap_model(shape_name, model, tokenizer, device, dtype)


def add_context_arguments(parser, shape: str, tokens: int) -> None:
    """The arguments of the one-request scripts in ``benchmarks/``: OUT, ``--dataset``,
    ``--tokenizer``, ``--shape`` and ``--tokens`` (for :func:`shape_context`)."""
    from pathlib import Path

    parser.add_argument("out", type=Path, help="where the results go")
    parser.add_argument("--dataset", type=Path, required=True, help="MuSiQue-format file of passages")
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory for the shape")
    parser.add_argument("--shape", default=shape, choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=tokens, help="context length in tokens")


def shape_context(shape_name: str, tokenizer, device: torch.device, dtype: torch.dtype, config: Config,
                  items: Sequence[QAItem], tokens: int,
                  chunk_tokens: int = 512) -> tuple[LoadedModel, list[str]]:
    """A random-weight model of ``shape_name`` and a context of about ``tokens`` tokens of
    ``items``' passages cut into ``chunk_tokens``-token chunks (as `bench scaling` cuts
    them, the first item's question closing it): what the one-request scripts in
    ``benchmarks/`` time."""
    from cachecraft.bench.scaling import Point, cut_chunks, passage_stream
    from cachecraft.prompt import builder_for

    lm = random_model(shape_name, tokenizer, device, dtype)
    builder = builder_for(lm.tokenizer, config)
    point = Point("context", tokens, round(tokens / chunk_tokens))
    return lm, cut_chunks(builder, passage_stream(builder, items, 0, tokens), items[0].question, point)


def fixed_fraction_methods(fractions: Sequence[float]) -> list[Method]:
    """``cachecraft`` recomputing ``f`` of every cached chunk, for each ``f``: its floor, with alpha 0."""
    bad = [f for f in fractions if not 0.0 < f <= 1.0]
    if bad:
        raise ValueError(f"recompute fractions must be in (0, 1], got {bad}")
    return [CacheCraft(0.0, floor=f) for f in fractions]


def run_gpu(shapes: Sequence[str], config: Config, items: Sequence[QAItem], specs: Sequence[Method], *,
            tokenizer_for: Callable[[str], object], tiers: Sequence[str] = GPU_TIERS,
            contexts: Sequence[int] = DEFAULT_CONTEXTS, chunk_tokens: int = 512, max_new_tokens: int = 4,
            repeats: int = 1, cold: bool = False, on_step: Callable[[str, int, int], None] | None = None,
            on_run: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One ``bench scaling`` context sweep per (shape, tier), on ``config``'s device and
    dtype, ``repeats`` questions a point; returns
    ``[{"shape", "tier", "layers", "parameters", "kv_bytes_per_token", **sweep}]``.
    ``prefix`` (which loads nothing from a tier) runs with the first tier only; ``full``
    runs with every tier, as each sweep's own reference. With ``cold``, the first tier's
    sweep also times cachecraft on a first-time request (every chunk a miss), which loads
    nothing, so one tier tells it all. ``on_run(runs so far)`` is
    called after each sweep, so a long run can be saved as it goes."""
    from cachecraft.bench.scaling import run_scaling
    from cachecraft.model.loader import resolve_device, resolve_dtype

    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    # Random weights answer in loops; answering those again from a full prefill would time
    # the fallback rather than the method.
    config = config.replace(repetition_fallback=False)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    runs: list[dict] = []
    for shape_name in shapes:
        lm = random_model(shape_name, tokenizer_for(SHAPES[shape_name].tokenizer), device, dtype)
        kv_bytes = kv_bytes_per_token(lm.adapter.num_layers, lm.adapter.num_kv_heads, lm.adapter.head_dim,
                                      config.kv_dtype)
        facts = {"shape": shape_name, "layers": lm.adapter.num_layers,
                 "parameters": sum(p.numel() for p in lm.model.parameters()), "kv_bytes_per_token": kv_bytes}
        for i, tier in enumerate(tiers):
            mine = [s for s in specs if i == 0 or not isinstance(s, Prefix)]
            step = (lambda what, done, total, _s=shape_name, _t=tier:
                    on_step(f"{_s} {_t}: {what}", done, total)) if on_step else None
            result = run_scaling(lm, config, items, mine, contexts=contexts, chunk_counts=(),
                                 chunk_tokens=chunk_tokens, repeats=repeats, max_new_tokens=max_new_tokens,
                                 tier=tier, share_warm=True, cold=cold and i == 0,
                                 on_step=step)
            runs.append({**facts, "tier": tier, **result})
            if on_run:
                on_run(runs)
        del lm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return runs
