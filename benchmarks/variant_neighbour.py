"""In-context variants made after the neighbour's stored cache, against after a fresh neighbour.

`warm --neighbours N` makes each chunk's cache after each of its N nearest chunks. It used to
compute the neighbour afresh after the system prompt (a prefill of both chunks); it now takes
the neighbour's own stored cache, the one `warm` made and a request that puts the neighbour
first reuses, so only the chunk is computed. This script measures both ways on the same items
through the one request path: for each MuSiQue item, full (the reference), the default
`cachecraft` with the caches `warm` makes, then with one in-context variant per passage (its
nearest passage by embedding among the item's own) made the new way, then the same variants
made the old way (this script keeps a copy of it) and the same method again. Per way: the
time to make the variants, and the answer KL, token agreement and first-token KL along full's
answer. Writes OUT (JSON, with every answer's figures) after every item and prints a line
per item; ``--resume`` keeps the items OUT holds and runs the rest.

    python benchmarks/variant_neighbour.py OUT --model qwen2.5-coder-0.5b \\
        --dataset ../shared/data/musique_dev.json --skip 36 --limit 8
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

from cachecraft.bench.common import (answer_means, items_parser, paired_figures, running_code, script_items,
                                    write_script_result)
from cachecraft.engine import Segment, blended_prefill
from cachecraft.evaluation import InContext, _answer_row, item_chunks, scratch_pipeline
from cachecraft.kv import chunk_key
from cachecraft.methods import Full, parse_method
from cachecraft.model.loader import load_model
from cachecraft.retrieval.embed import Embedder
from cachecraft.selection import ChunkStatistics

KEYS = ("item", "method", "answer_kl", "token_agreement", "kl", "recompute_fraction", "ttft_s", "gold_f1", "answer")
NEW, OLD = "after stored neighbour", "after fresh neighbour"


def fresh_neighbour_variants(pipe, pairs) -> None:
    """The earlier way: each ``(before, chunk)`` pair's chunk cached right after the system
    prefix and ``before``, both computed."""
    pieces = pipe.builder.build([text for pair in pairs for text in pair], "warm")
    prefix_key = chunk_key(pipe.lm.fingerprint, pieces.prefix)
    prefix = Segment(pieces.prefix, "prefix", cached=pipe._prefix_kv(pieces, prefix_key), key=prefix_key)
    keys = [chunk_key(pipe.lm.fingerprint, ids) for ids in pieces.chunks]
    for i in range(0, len(keys), 2):
        segments = [prefix, Segment(pieces.chunks[i], "chunk", key=keys[i]),
                    Segment(pieces.chunks[i + 1], "chunk", save=True, collect_stats=True, key=keys[i + 1])]
        pipe._put(blended_prefill(pipe.lm.adapter, segments, fingerprint=pipe.lm.fingerprint,
                                  hooks=[ChunkStatistics(pipe.stats_layers)]).saved[2])


def drop_in_context(pipe, chunks) -> int:
    """Remove the variants of ``chunks`` made after one of them (the in-context ones)."""
    keys = {chunk_key(pipe.lm.fingerprint, ids) for ids in pipe.builder.build(chunks, "x").chunks}
    removed = 0
    for key in keys:
        for record in pipe.store.variants_of(key):
            if len(record.prefix) == 2 and record.prefix[1] in keys:
                removed += bool(pipe.store.delete(record.key))
    return removed


def main() -> None:
    parser = items_parser(__doc__.splitlines()[0])
    parser.add_argument("--resume", action="store_true", help="keep the items OUT already holds, run the rest")
    args = parser.parse_args()
    config, items = script_items(args)
    lm = load_model(None, config)
    method = parse_method("cachecraft")
    nearest = InContext(method, 1, Embedder().embed).nearest
    rows, timing, runs = [], [], []
    if args.resume and args.out.exists():
        kept = json.loads(args.out.read_text())
        rows, timing = kept["per_item"], kept["timing"]
        runs = kept.get("runs") or [{key: kept[key] for key in ("command", "date", "code")}]
    done = {t["item"] for t in timing}
    runs.append({"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "code": running_code(), "items": [i.index for i in items if i.index not in done]})
    with scratch_pipeline(lm, config) as pipe:
        pipe.ensure_cost_model()
        for item in items:
            if item.index in done:
                continue
            chunks = item_chunks(item)
            pipe.warm(chunks)
            full, reference = _answer_row(pipe, item, chunks, Full(), None, 32, None, None)
            plain, _ = _answer_row(pipe, item, chunks, method, reference, 32, None, None)
            pairs = [(other, chunk) for chunk, near in zip(chunks, nearest(chunks)) for other in near]
            gc.collect()
            start = time.perf_counter()
            made = pipe.warm_after(pairs)
            new_s = time.perf_counter() - start
            new, _ = _answer_row(pipe, item, chunks, method, reference, 32, None, None)
            dropped = drop_in_context(pipe, chunks)
            gc.collect()
            start = time.perf_counter()
            fresh_neighbour_variants(pipe, pairs)
            old_s = time.perf_counter() - start
            old, _ = _answer_row(pipe, item, chunks, method, reference, 32, None, None)
            pipe.forget(chunks)
            for row, label in ((full, "full"), (plain, method.label), (new, NEW), (old, OLD)):
                rows.append({**{k: row.get(k) for k in KEYS}, "method": label})
            timing.append({"item": item.index, "variants": made, "dropped": dropped, "new_s": new_s, "old_s": old_s})
            print(f"item {item.index}: {made} variants, {new_s:.1f} s after the stored neighbour, {old_s:.1f} s after "
                  f"a fresh one; answer KL {new['answer_kl']:.4f} against {old['answer_kl']:.4f} (plain "
                  f"{plain['answer_kl']:.4f})", flush=True)
            result = summarise(rows, timing, method.label)  # written after every item: a stopped run keeps them
            write_script_result(args, "variant_neighbour", runs=runs, items=len(timing), **result)
    if timing:
        result = summarise(rows, timing, method.label)
        print(json.dumps({k: result[k] for k in ("summary", "paired", "variant_time")}, indent=2))


def summarise(rows: list[dict], timing: list[dict], plain: str) -> dict:
    """Means per way, the paired differences and the variants' making time, so far."""

    def of(label: str, key: str) -> list[float]:
        return [r[key] for r in rows if r["method"] == label]

    summary = {label: {**answer_means(lambda key: of(label, key)),
                       "ttft_s_median": statistics.median(of(label, "ttft_s"))}
               for label in ("full", plain, NEW, OLD)}
    comparisons = []
    for a, b in ((NEW, OLD), (NEW, plain), (OLD, plain)):
        comparisons.append({"method": a, "against": b,
                            **paired_figures(lambda key: of(a, key), lambda key: of(b, key))})
    variant_time = {"new_s": sum(t["new_s"] for t in timing), "old_s": sum(t["old_s"] for t in timing)}
    variant_time["ratio"] = variant_time["new_s"] / variant_time["old_s"]
    return {"summary": summary, "paired": comparisons, "variant_time": variant_time, "timing": timing,
            "per_item": rows}


if __name__ == "__main__":
    main()
