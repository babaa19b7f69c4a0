"""Hand a prefilled KV to ``transformers``' ``generate``.

The cache given to ``generate`` holds every prompt token but the last; ``generate``
then runs the last prompt token itself over that cache, which reproduces the
prefill's last-position logits, and continues with any decoding settings
(greedy, sampling, stop strings, streamers).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from cachecraft.engine.blend import BlendResult


def to_transformers_cache(result: BlendResult, model_config, drop_last: int = 1) -> DynamicCache:
    """A ``DynamicCache`` with the prompt's KV (RoPE applied), minus the last ``drop_last``
    tokens. The result's per-layer tensors are released as they are handed over, so
    the request's KV exists once."""
    cache = DynamicCache(config=model_config)
    keep = result.num_tokens - drop_last
    for layer in range(len(result.keys)):
        k, v = result.keys[layer], result.values[layer]
        cache.update(k[None, :, :keep], v[None, :, :keep], layer)
        result.keys[layer] = result.values[layer] = None  # type: ignore[assignment]
    return cache


@torch.inference_mode()
def generate_from(model, tokenizer, result: BlendResult, *, max_new_tokens: int = 32,
                  do_sample: bool = False, streamer=None, stop_strings: list[str] | None = None,
                  **generate_kwargs: Any) -> torch.Tensor:
    """Continue generation from a prefill; returns only the new token ids ``[n_new]``."""
    ids = result.token_ids[None]
    cache = to_transformers_cache(result, model.config)
    kwargs = dict(generate_kwargs)
    if stop_strings:
        kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
    if not do_sample:
        kwargs.setdefault("temperature", None)
        kwargs.setdefault("top_p", None)
        kwargs.setdefault("top_k", None)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=max_new_tokens, do_sample=do_sample, streamer=streamer,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **kwargs)
    return out[0, ids.shape[1]:]


@torch.inference_mode()
def teacher_forced_logits(model, keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: torch.Tensor,
                          forced_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[n, vocab]`` (float32) at each position of ``forced_ids`` after a
    prefill (``keys``/``values`` per layer ``[H_kv, N, D]`` with RoPE applied, ``token_ids``
    the prompt ``[N]``): row 0 predicts ``forced_ids[0]`` from the prompt, row i predicts
    ``forced_ids[i]`` after ``forced_ids[:i]``. As in :func:`generate_from`, the last prompt
    token runs again over the cache of the others; the given tensors are not changed."""
    n = token_ids.numel()
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[None, :, :n - 1], v[None, :, :n - 1], layer)
    inputs = torch.cat([token_ids[-1:], forced_ids[:-1].to(token_ids.device)])[None]  # [1, n_forced]
    mask = torch.ones(1, n - 1 + inputs.shape[1], dtype=torch.long, device=token_ids.device)
    out = model(input_ids=inputs, attention_mask=mask, past_key_values=cache, use_cache=True)
    return out.logits[0].float()
