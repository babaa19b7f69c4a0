"""What a masked attention call costs on a GPU, the first time a shape is seen and after.

Grouped-query attention (32 query heads, 8 key/value heads, head size 128, bf16) from a
scattered set of queries over a prompt, with a boolean mask, as a blended prefill calls it.
Several "requests", each with its own (queries, keys) shape, call it ``calls`` times each;
for each one prints the first call's time and the median of the rest, in milliseconds,
synchronized. MODE names the attention backend: default (torch's choice), cudnn, efficient
(keys and values expanded to every head), efficient_gqa (not expanded), math,
cudnn_norecompile (run it with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``); ``+bucket`` pads each
shape as the engine does on a GPU. SCALE is 4k or 32k.

    python benchmarks/gpu_attention_shapes.py cudnn+bucket 4k
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cachecraft.engine.attention import shape_bucket

HEADS, KV_HEADS, HEAD_DIM, QUESTION = 32, 8, 128, 30
SHAPES = {"4k": ([(97, 3981), (110, 4006), (104, 3990), (121, 4032), (99, 3977), (115, 4011)], 32),
          "32k": ([(690, 31950), (720, 32051), (705, 32010)], 8)}
BACKENDS = {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "cudnn_norecompile": [SDPBackend.CUDNN_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION], "efficient_gqa": [SDPBackend.EFFICIENT_ATTENTION],
            "math": [SDPBackend.MATH]}


def time_requests(mode: str, scale: str) -> dict:
    """One row per request: its shape, its first call and the median of its later calls (ms)."""
    device = torch.device("cuda")
    backend = mode.removesuffix("+bucket")
    backends, expand = BACKENDS[backend], backend in ("efficient", "math")
    shapes, calls = SHAPES[scale]
    out = {"mode": mode, "scale": scale, "requests": []}
    for n, end in shapes:
        if mode.endswith("+bucket"):
            n, end = shape_bucket(n), shape_bucket(end)
        q = torch.randn(1, HEADS, n, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, KV_HEADS, end, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2))
        # recomputed tokens scattered over the chunks, then the question at the end
        pos = torch.sort(torch.randperm(end - n, device=device)[:n - QUESTION]).values
        pos = torch.cat([pos, torch.arange(end - QUESTION, end, device=device)])
        mask = torch.arange(end, device=device)[None] <= pos[:, None]
        times = []
        for _ in range(calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            kk, vv = ((x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v)) if expand else (k, v))
            try:
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=not expand)
            except RuntimeError as exc:  # a backend that cannot take these inputs says why
                return {**out, "error": str(exc).splitlines()[0][:300]}
            host = time.perf_counter() - start
            torch.cuda.synchronize()
            times.append((host * 1e3, (time.perf_counter() - start) * 1e3))
        out["requests"].append({"n": n, "end": end, "first_ms": round(times[0][1], 3),
                                "repeat_ms": round(statistics.median(t[1] for t in times[1:]), 3),
                                "repeat_host_ms": round(statistics.median(t[0] for t in times[1:]), 3)})
    return out


if __name__ == "__main__":
    print(json.dumps(time_requests(sys.argv[1], sys.argv[2])))
