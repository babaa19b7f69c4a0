"""Where a cachecraft request's time goes on a GPU: one request, profiled.

A random-weight model of a real shape (see ``cachecraft bench gpu``), a context of
``--tokens`` tokens in 512-token chunks warmed into one tier, then one request with
``cachecraft`` at a fixed recompute fraction under ``torch.profiler``, after timing two
requests in each variant (attention calls in blocks of 128 queries, as before; the
shipped code; the shipped code with cuDNN's attention left out; cached K/V copied into
place a segment at a time, as before), in turn for ``--rounds`` rounds. Prints the
request's wall time, the GPU's busy time within it, and the operators that cost most on
each side; writes them into OUT/profile.txt. ``--variants shipped`` times the shipped
code alone, ``--variants assembly`` it and the copies a segment at a time; a plain full
prefill is timed beside them either way. At ``--fraction 1`` the plan recomputes every
chunk (as the loading controller plans when recomputing beats loading); the chunk-caches
such a request makes are not kept, so each timed request recomputes everything again.

    python benchmarks/gpu_profile.py OUT --dataset data/musique_dev.json --tokenizer DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from cachecraft.bench.gpu import add_context_arguments, fixed_fraction_methods, shape_context
from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.engine import attention, blend
from cachecraft.model.loader import resolve_device
from cachecraft.pipeline import Pipeline
from cachecraft.store import TieredStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_context_arguments(parser, shape="llama-3.1-8b", tokens=32000)
    parser.add_argument("--tier", default="cpu", choices=("gpu", "cpu", "disk"))
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--variants", default="all", choices=("all", "shipped", "assembly"))
    parser.add_argument("--rounds", type=int, default=1, help="times each variant is timed, in turn")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    config = Config.load(overrides={"max_new_tokens": 1, "repetition_fallback": False})
    device = resolve_device(config.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    items = load_items(args.dataset)
    lm, chunks = shape_context(args.shape, AutoTokenizer.from_pretrained(str(args.tokenizer)), device, dtype,
                               config, items, args.tokens)
    (method,) = fixed_fraction_methods([args.fraction])
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    variants = {  # name: what the variant changes, as a context manager
        "blocks of 128 queries (before)": lambda: _query_block(128),
        "shipped": contextlib.nullcontext,
        "shipped, cuDNN attention left out": lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION,
                                                                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
        "cached K/V copied a segment at a time (before)": _copied_per_segment,
    }
    chosen = {"all": list(variants), "shipped": ["shipped"],
              "assembly": ["cached K/V copied a segment at a time (before)", "shipped"]}[args.variants]
    ttfts = {}
    with TieredStore(config, tiers=(args.tier,)) as store:
        pipe = Pipeline(config, lm=lm, store=store)
        pipe.warm(chunks)
        pipe.keep_new_variants = args.fraction < 1  # else the next request would find exact variants
        ttfts["full"] = [pipe.answer(chunks, items[i].question, method="full", record=False).ttft_s
                         for i in (1, 2, 3)]
        for round_ in range(args.rounds):  # rounds alternate the variants, so a slow spell hits them alike
            for name in chosen:
                try:
                    with variants[name]():
                        if round_ == 0:
                            pipe.answer(chunks, items[1].question, method=method, record=False)  # warm-up
                        times = [pipe.answer(chunks, items[i].question, method=method, record=False).ttft_s
                                 for i in (2, 3)]
                    ttfts.setdefault(name, []).extend(times)
                except (RuntimeError, torch.OutOfMemoryError) as exc:  # a variant that cannot run says why
                    ttfts[name] = f"failed: {str(exc).splitlines()[0]}"
        sync()
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            answer = pipe.answer(chunks, items[0].question, method=method, record=False)
            sync()
        wall = time.perf_counter() - start
        store.close(persist=False)
    events = prof.key_averages()
    gpu_busy_us = sum(e.self_device_time_total for e in events)
    summary = {"shape": args.shape, "tokens": answer.prompt_tokens, "tier": args.tier,
               "fraction": args.fraction, "recompute_fraction": answer.recompute_fraction,
               "ttft_s": answer.ttft_s, "profiled_wall_s": wall, "gpu_busy_s": gpu_busy_us / 1e6,
               "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
               "ttft_s_by_variant": ttfts}
    by_gpu = events.table(sort_by="self_device_time_total", row_limit=25)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=25)
    report = "\n\n".join([json.dumps(summary, indent=2), "by GPU time:", by_gpu, "by CPU time:", by_cpu])
    (args.out / "profile.txt").write_text(report)
    print(report)


@contextlib.contextmanager
def _query_block(block: int):
    """Masked attention calls of ``block`` queries, on either device."""
    saved = attention.CUDA_QUERY_BLOCK, attention.CPU_QUERY_BLOCK
    attention.CUDA_QUERY_BLOCK = attention.CPU_QUERY_BLOCK = block
    try:
        yield
    finally:
        attention.CUDA_QUERY_BLOCK, attention.CPU_QUERY_BLOCK = saved


@contextlib.contextmanager
def _copied_per_segment():
    """Caches stored in another dtype copied into place one segment at a time, converting."""
    saved = blend.JOIN_THEN_CONVERT
    blend.JOIN_THEN_CONVERT = ()
    try:
        yield
    finally:
        blend.JOIN_THEN_CONVERT = saved


if __name__ == "__main__":
    main()
