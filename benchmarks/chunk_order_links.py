"""How many passages come right after one of their in-context variants' neighbours?

For each item of a MuSiQue-format file, each passage's N nearest other passages by
embedding (as `bench quality --in-context --neighbours N` finds them) are the chunks it
has a variant made after. Counts, over all passages, the share that comes right after
one of them in the item's own order, in the order `chunk_order = "cache"` gives
(:func:`cachecraft.policy.ordering.cache_order`), and in the best order (exhaustive
search over orders, dynamic programming over subsets). Writes OUT (JSON), with each
item's counts under ``per_item``, and prints it.

    python benchmarks/chunk_order_links.py OUT --dataset ../shared/data/musique_dev.json --limit 30
"""

from __future__ import annotations

import argparse
import json

from cachecraft.bench.common import machine, running_code
from cachecraft.dataset import load_items
from cachecraft.evaluation import item_chunks
from cachecraft.policy.ordering import cache_order, links_kept
from cachecraft.retrieval.embed import Embedder
from cachecraft.retrieval.index import ChunkIndex


def most_links(after: list[set[int]]) -> int:
    """The most chunks any order puts right after a chunk of their ``after`` set."""
    n = len(after)
    best = {(1 << j, j): 0 for j in range(n)}  # (chunks placed, last placed) -> links
    for mask in range(1, 1 << n):
        for last in range(n):
            links = best.get((mask, last))
            if links is None:
                continue
            for j in range(n):
                if not mask >> j & 1:
                    key = (mask | 1 << j, j)
                    best[key] = max(best.get(key, -1), links + (last in after[j]))
    return max(best[((1 << n) - 1, last)] for last in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N items")
    parser.add_argument("--neighbours", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--embedder", default="minilm")
    args = parser.parse_args()
    items = load_items(args.dataset, args.skip + args.limit)[args.skip:]
    embed = Embedder(args.embedder).embed
    rows = []
    for k in args.neighbours:
        given = ordered = best = total = 0
        per_item = []
        for number, item in enumerate(items, start=args.skip):
            chunks = item_chunks(item)
            vectors = embed(chunks)
            index = ChunkIndex(vectors.shape[1])
            index.add(vectors, chunks, [str(i) for i in range(len(chunks))])
            after = [set(near) for near in index.neighbours(k)]
            counts = {"item": number, "passages": len(chunks), "given_order": links_kept(range(len(chunks)), after),
                      "cache_order": links_kept(cache_order(after), after), "best_order": most_links(after)}
            per_item.append(counts)
            given += counts["given_order"]
            ordered += counts["cache_order"]
            best += counts["best_order"]
            total += len(chunks)
        rows.append({"neighbours": k, "passages": total, "given_order": given / total,
                     "cache_order": ordered / total, "best_order": best / total, "per_item": per_item})
        print(f"{k} neighbour(s): right after one of them {given / total:.0%} in the given order, "
              f"{ordered / total:.0%} in cache_order's, {best / total:.0%} in the best")
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"benchmark": "chunk_order_links", "dataset": args.dataset, "skip": args.skip, "items": len(items),
                   "rows": rows,
                   "machine": machine(), "code": running_code()}, handle, indent=2)


if __name__ == "__main__":
    main()
