"""Chunk-caches averaged over several made-after contexts, reused untouched, against one.

The diagnosis (``bench diagnose``) found a reused chunk-cache's error set mostly by what
the cache was made after. If that error were like noise around the chunk's KV in a real
request, the mean of caches made after several unrelated contexts would be nearer the
real thing than any one of them. This makes each chunk's cache (pre-RoPE K and V) after:
the system prompt alone, the warm context, a passage of each of the next three items
(``foreign0``-``foreign2``), another passage of the same request (``other``) and the one
right before it (``previous``), and the element-wise means of some of these; every set is
reused untouched, and judged against the full prefill by answer KL and token agreement
(full's greedy answer of up to 32 tokens, teacher-forced), through the engine's prefill.
With ``--recompute R``, some of the sets are also judged with R of each chunk recomputed,
its first tokens (``firstk``) or CacheBlend's deviation check's picks (``cacheblend``).

    python benchmarks/averaged_contexts.py benchmarks/results/averaged_contexts_qwen2.5.json --skip 30 --limit 6
    python benchmarks/averaged_contexts.py benchmarks/results/averaged_recompute_qwen2.5.json --recompute 0.05
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cachecraft.bench.common import machine, running_code
from cachecraft.bench.diagnose import _Item, select_and_run
from cachecraft.config import Config
from cachecraft.dataset import DatasetError, load_items
from cachecraft.engine import blended_prefill
from cachecraft.evaluation import scratch_pipeline
from cachecraft.kv import ChunkKV
from cachecraft.model.bundled import ModelLoadError
from cachecraft.model.loader import load_model

MEANS = {"mean_f3": ("foreign0", "foreign1", "foreign2"), "mean_f2": ("foreign0", "foreign1"),
         "mean_sys_warm": ("system", "warm"), "mean_warm_f3": ("warm", "foreign0", "foreign1", "foreign2"),
         "mean_f3_other": ("foreign0", "foreign1", "foreign2", "other")}

RECOMPUTED = ("warm", "foreign0", "foreign1", "foreign2", "mean_f3", "previous")  # with --recompute
RECOMPUTE_SELECTORS = ("firstk", "cacheblend")


def mean_caches(sets: list[list[ChunkKV]]) -> list[ChunkKV]:
    """Per chunk, the element-wise mean of its caches in ``sets`` (K before RoPE, and V)."""
    out = []
    for parts in zip(*sets):
        first = parts[0]
        keys = torch.stack([p.keys.float() for p in parts]).mean(0).to(first.keys.dtype)
        values = torch.stack([p.values.float() for p in parts]).mean(0).to(first.values.dtype)
        out.append(ChunkKV(first.token_ids, keys, values, first.fingerprint, first.prefix,
                           prefix_tokens=first.prefix_tokens))
    return out


def item_row(pipeline, items, n: int, recompute: float | None = None) -> dict:
    """Every cache set of the module doc for item ``n``, judged (with ``recompute``, the
    sets of :data:`RECOMPUTED` also with that share recomputed, as ``set+selector@share``)."""
    it = _Item(pipeline, items[n])
    warm_ids, _ = pipeline._warm_context()
    sets = {"system": it.make_caches("system"), "warm": it.make_caches("warm", it.made_alone(warm_ids), warm_ids)}
    for f in range(3):
        sets[f"foreign{f}"] = it.make_caches("foreign", foreign=it.foreign(items[n + 1 + f]))
    sets["other"] = it.make_caches("other", system=sets["system"])
    sets["previous"] = it.make_caches("previous", system=sets["system"])
    for name, parts in MEANS.items():
        sets[name] = mean_caches([sets[p] for p in parts])
    row = {"item": items[n].index, **{name: it.judge(blended_prefill(pipeline.lm.adapter, it.segments(caches)))
                                      for name, caches in sets.items()}}
    if recompute is not None:
        check_layer = pipeline.policy.check_layer
        for name in RECOMPUTED:
            for selector in RECOMPUTE_SELECTORS:
                row[f"{name}+{selector}@{recompute:g}"] = it.judge(
                    select_and_run(it, sets[name], selector, recompute, check_layer, None))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dataset", type=Path, default=Path("../shared/data/musique_dev.json"))
    parser.add_argument("--skip", type=int, default=30)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--recompute", type=float, default=None,
                        help="also judge some sets with this share of each chunk recomputed (e.g. 0.05)")
    args = parser.parse_args()
    if args.limit < 1 or args.skip < 0:
        raise SystemExit("--limit must be at least 1 and --skip at least 0")
    if args.recompute is not None and not 0 < args.recompute <= 1:
        raise SystemExit(f"--recompute must be within (0, 1], got {args.recompute}")
    config = Config.load(None, overrides={"model": args.model})
    try:
        items = load_items(args.dataset, args.limit + 3, args.skip)
        lm = load_model(None, config)
    except (DatasetError, ModelLoadError, OSError) as exc:
        raise SystemExit(str(exc)) from None
    if len(items) < args.limit + 3:
        raise SystemExit(f"{args.dataset} needs {args.limit + 3} items after the first {args.skip}")
    rows = []
    command = (f"python benchmarks/averaged_contexts.py {args.out} --model {args.model} --dataset {args.dataset} "
               f"--skip {args.skip} --limit {args.limit}"
               + ("" if args.recompute is None else f" --recompute {args.recompute:g}"))
    with scratch_pipeline(lm, config) as pipeline:
        for n in range(args.limit):
            start = time.perf_counter()
            rows.append(item_row(pipeline, items, n, args.recompute))
            print(n, f"{time.perf_counter() - start:.0f} s",
                  {k: round(v["answer_kl"], 4) for k, v in rows[-1].items() if k != "item"}, flush=True)
            summary = {name: {key: statistics.fmean(r[name][key] for r in rows)
                              for key in ("answer_kl", "token_agreement")} for name in rows[0] if name != "item"}
            args.out.write_text(json.dumps({"benchmark": "averaged_contexts", "model": args.model, "rows": rows,
                                            "summary": summary, "machine": machine(), "code": running_code(),
                                            "command": command}, indent=1) + "\n")


if __name__ == "__main__":
    main()
