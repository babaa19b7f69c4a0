"""Measure the prefill cost the loading controller and the estimates start from, and
keep it in the catalog per model and device so later processes start from it."""

from __future__ import annotations

import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from cachecraft.engine import Segment, blended_prefill
from cachecraft.kv import kv_bytes_per_token
from cachecraft.policy.loading import DEFAULT_BANDWIDTHS, CostModel


# Prompt sizes the start-up measurement times, per device type. On a CPU a prefill's time
# grows in proportion from a few hundred tokens, so one short prompt tells the rate. On a
# GPU a short one is bound by kernel launches and host work: on an H100, with Llama-3.1-8B's
# shape, the rate a 128-token prefill gave made the loading controller recompute 13-50% of
# chunks it loaded from disk (its choices imply 0.3-1.3 ms a token, against 45-50 us for
# full prefills of 4k-32k tokens), and the request took 3-4x longer than a full prefill,
# where recomputing every chunk keeps up with one. There the rate is the slope between two
# longer prompts: what one more token costs, launches left out.
PROBE_TOKENS: dict[str, tuple[int, ...]] = {"cpu": (128,), "cuda": (1024, 2048)}


def probe_sizes(device: torch.device | str, max_context: int) -> tuple[int, ...]:
    """The prompt sizes the start-up measurement times on ``device`` (:data:`PROBE_TOKENS`),
    none longer than the model's window of ``max_context`` tokens."""
    return _within_window(PROBE_TOKENS.get(torch.device(device).type, PROBE_TOKENS["cpu"]), max_context)


def _within_window(sizes: Sequence[int], max_context: int) -> tuple[int, ...]:
    """``sizes`` cut to the model's window, each once, shortest first."""
    return tuple(sorted({min(n, max_context) for n in sizes}))


def teaches_rate(tokens: int, device: torch.device | str, max_context: int) -> bool:
    """Whether a timed full prefill of ``tokens`` tokens on ``device`` may move the prefill
    rate: only one at least as long as the longest start-up probe there. A short one on a
    GPU times launches and host work: in `bench gpu`, the 32-token warm-up requests moved
    the rate from 26 us a token to 74-154 us."""
    return tokens >= max(probe_sizes(device, max_context))


def per_token_seconds(sizes: Sequence[int], seconds: Sequence[float]) -> float:
    """Prefill seconds per token from timings of prompts of ``sizes`` tokens: one size, its
    average; several, the slope between the shortest and the longest (the average of the
    longest where timing noise makes the slope zero or negative)."""
    assert sizes and len(sizes) == len(seconds), "one timing per size"
    (n0, t0), (n1, t1) = min(zip(sizes, seconds)), max(zip(sizes, seconds))
    if n1 > n0 and t1 > t0:
        return (t1 - t0) / (n1 - n0)
    return max(t1, 1e-9) / n1


def measure_cost_model(lm, tokens: int | Sequence[int] | None = None, repeats: int = 3,
                       kv_dtype: torch.dtype = torch.float16,
                       bandwidths: Mapping[str, float] | None = None) -> CostModel:
    """Time full prefills of ``tokens`` tokens on ``lm`` (a LoadedModel; per size, the
    median of ``repeats`` after one warm-up; default :func:`probe_sizes` for its device),
    rate by :func:`per_token_seconds`; KV bytes per token from its shape and ``kv_dtype``.
    No size is longer than the model's window."""
    adapter = lm.adapter
    if tokens is None:
        sizes = probe_sizes(lm.device, lm.max_context)
    else:
        sizes = _within_window((tokens,) if isinstance(tokens, int) else tokens, lm.max_context)
    vocab = getattr(getattr(lm.model, "config", None), "vocab_size", None)
    medians = []
    with torch.inference_mode():
        for size in sizes:
            ids = [(i * 7919) % 1000 + 10 for i in range(size)]
            if vocab:
                ids = [i % vocab for i in ids]
            seconds = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                blended_prefill(adapter, [Segment(ids, "question")])
                if lm.device.type == "cuda":  # the kernels run after the call returns: time them, not their launch
                    torch.cuda.synchronize(lm.device)
                seconds.append(time.perf_counter() - start)
            medians.append(statistics.median(seconds[1:]))
    per_layer = kv_bytes_per_token(1, adapter.num_kv_heads, adapter.head_dim, kv_dtype)
    return CostModel(per_token_seconds(sizes, medians) / adapter.num_layers, per_layer, adapter.num_layers,
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


def cost_profile(model: CostModel, probe_tokens: Sequence[int] = ()) -> dict[str, Any]:
    """What of ``model`` is worth keeping: the prefill rate, its shape, the probe sizes its
    rate was first measured at, each timed tier's bandwidth (assumed and infinite ones
    are left out: they are not measurements) and the blending cost once timed."""
    profile = {"prefill_s_per_token_layer": model.prefill_s_per_token_layer,
               "kv_bytes_per_token_layer": model.kv_bytes_per_token_layer, "num_layers": model.num_layers,
               "probe_tokens": [int(n) for n in probe_tokens],
               "bandwidths": {t: model.bandwidths[t] for t in sorted(model.timed)
                              if math.isfinite(model.bandwidths.get(t, math.inf))}}
    if model.blend_s_per_token_layer is not None:
        profile["blend_s_per_token_layer"] = model.blend_s_per_token_layer
    return profile


def cost_model_from_profile(profile: Mapping[str, Any] | None, num_layers: int, kv_bytes_per_token_layer: int,
                            bandwidths: Mapping[str, float],
                            probe_tokens: Sequence[int] | None = None) -> CostModel | None:
    """The cost model a stored :func:`cost_profile` describes, starting from ``bandwidths``
    for untimed tiers; None when there is none, it was measured for another shape, or (given
    ``probe_tokens``) its rate was measured at other probe sizes: a GPU's rate stored before
    the probes were longer was the launch-bound one, so it is measured again."""
    if not profile:
        return None
    try:
        rate = float(profile["prefill_s_per_token_layer"])
        same_shape = (int(profile["num_layers"]) == num_layers
                      and int(profile["kv_bytes_per_token_layer"]) == kv_bytes_per_token_layer)
        same_probe = probe_tokens is None or [int(n) for n in profile.get("probe_tokens") or ()] == list(probe_tokens)
        timed = {str(t): float(b) for t, b in dict(profile.get("bandwidths") or {}).items()}
        blend = profile.get("blend_s_per_token_layer")
        blend = float(blend) if blend is not None else None
    except (KeyError, TypeError, ValueError):
        return None
    if blend is not None and not (blend >= 0 and math.isfinite(blend)):
        blend = None
    if not same_shape or not same_probe or not rate > 0 or not math.isfinite(rate):
        return None
    timed = {t: b for t, b in timed.items() if b > 0 and math.isfinite(b) and math.isfinite(bandwidths.get(t, 0.0))}
    return CostModel(rate, kv_bytes_per_token_layer, num_layers, {**bandwidths, **timed}, frozenset(timed), blend)
