"""Measure the prefill cost the loading controller and the estimates start from, and
keep it in the catalog per model and device so later processes start from it."""

from __future__ import annotations

import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Mapping

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
            if lm.device.type == "cuda":  # the kernels run after the call returns: time them, not their launch
                torch.cuda.synchronize(lm.device)
            seconds.append(time.perf_counter() - start)
    elapsed = max(statistics.median(seconds[1:]), 1e-9)
    per_layer = kv_bytes_per_token(1, adapter.num_kv_heads, adapter.head_dim, kv_dtype)
    return CostModel(elapsed / tokens / adapter.num_layers, per_layer, adapter.num_layers,
                     dict(bandwidths if bandwidths is not None else DEFAULT_BANDWIDTHS))


COST_PROFILE = "cost_model"  # the catalog's model-profile kind for it


def device_label(device: torch.device | str) -> str:
    """What a cost measurement holds for: the GPU's name, or the CPU's model and torch's
    thread count (a catalog shared by several machines keeps one per kind of machine)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"[:64]
    return f"{device.type}:{torch.get_num_threads()}t:{cpu_name()}"[:64]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_profile(model: CostModel) -> dict[str, Any]:
    """What of ``model`` is worth keeping: the prefill rate, its shape and each timed tier's
    bandwidth (assumed and infinite ones are left out: they are not measurements)."""
    return {"prefill_s_per_token_layer": model.prefill_s_per_token_layer,
            "kv_bytes_per_token_layer": model.kv_bytes_per_token_layer, "num_layers": model.num_layers,
            "bandwidths": {t: model.bandwidths[t] for t in sorted(model.timed)
                           if math.isfinite(model.bandwidths.get(t, math.inf))}}


def cost_model_from_profile(profile: Mapping[str, Any] | None, num_layers: int, kv_bytes_per_token_layer: int,
                            bandwidths: Mapping[str, float]) -> CostModel | None:
    """The cost model a stored :func:`cost_profile` describes, starting from ``bandwidths``
    for untimed tiers; None when there is none, or it was measured for another shape."""
    if not profile:
        return None
    try:
        rate = float(profile["prefill_s_per_token_layer"])
        same_shape = (int(profile["num_layers"]) == num_layers
                      and int(profile["kv_bytes_per_token_layer"]) == kv_bytes_per_token_layer)
        timed = {str(t): float(b) for t, b in dict(profile.get("bandwidths") or {}).items()}
    except (KeyError, TypeError, ValueError):
        return None
    if not same_shape or not rate > 0 or not math.isfinite(rate):
        return None
    timed = {t: b for t, b in timed.items() if b > 0 and math.isfinite(b) and math.isfinite(bandwidths.get(t, 0.0))}
    return CostModel(rate, kv_bytes_per_token_layer, num_layers, {**bandwidths, **timed}, frozenset(timed))
