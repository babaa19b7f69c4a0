"""Measure the prefill cost the loading controller and the estimates start from."""

from __future__ import annotations

import statistics
import time
from typing import Mapping

import torch

from cachecraft.engine import Segment, blended_prefill
from cachecraft.kv import kv_bytes_per_token
from cachecraft.policy.loading import DEFAULT_BANDWIDTHS, CostModel


def measure_cost_model(lm, tokens: int = 128, repeats: int = 3, kv_dtype: torch.dtype = torch.float16,
                       bandwidths: Mapping[str, float] | None = None) -> CostModel:
    """Time a full prefill of ``tokens`` tokens on ``lm`` (a LoadedModel; median of
    ``repeats`` after one warm-up); KV bytes per token from its shape and ``kv_dtype``."""
    adapter = lm.adapter
    ids = [(i * 7919) % 1000 + 10 for i in range(tokens)]
    vocab = getattr(getattr(lm.model, "config", None), "vocab_size", None)
    if vocab:
        ids = [i % vocab for i in ids]
    seconds = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            blended_prefill(adapter, [Segment(ids, "question")])
            seconds.append(time.perf_counter() - start)
    elapsed = max(statistics.median(seconds[1:]), 1e-9)
    per_layer = kv_bytes_per_token(1, adapter.num_kv_heads, adapter.head_dim, kv_dtype)
    return CostModel(elapsed / tokens / adapter.num_layers, per_layer, adapter.num_layers,
                     dict(bandwidths if bandwidths is not None else DEFAULT_BANDWIDTHS))
