"""Does the drift shift bring the reused K/V closer to full's, and does the answer follow?

For each MuSiQue item: full prefill (the reference), then each chunk's cache made after the
system prompt and the builtin warm context (as `warm` makes them), then blended prefills with
the judge's shipped placement (5% of each chunk rounded down: its first 16 tokens, the rest
spread) and each share of the drift shift given, by the plain mean. A share is ``K/V``: the
keys move by K of the measured mean change and the values by V (the engine moves both by one
share; this script scales the values' move after, which is exact for the mean since it is
linear in its share). Per share: the relative deviation from full's K and V of the chunk
tokens not recomputed, layer by layer, and the answer KL, token agreement and first-token KL
along full's answer. Writes OUT (JSON) and prints a line per item and share.

    python benchmarks/shift_error.py OUT --dataset ../shared/data/musique_dev.json --skip 36 --limit 6 \\
        --shares 0/0,0.25/0.25,0.5/0.5,0.75/0.75,1/1
"""

from __future__ import annotations

import argparse
import json

import torch

from cachecraft.bench.common import machine, running_code
from cachecraft.bench.diagnose import _Item, relative_deviation
from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.engine import Segment, blend, blended_prefill
from cachecraft.evaluation import scratch_pipeline
from cachecraft.model.loader import load_model
from cachecraft.selection import first_tokens, spread_tokens

SINK_TOKENS, FLOOR = 16, 0.05  # the judge's shipped fit

_engine_shift = blend._shift_drift
Share = tuple[float, float]  # at the first layer and at the last (equal: one share at every layer)


class _Shares:
    """The keys' and values' shares for the prefill under way; the layer its next shift is at."""

    keys: Share = (1.0, 1.0)
    values: Share = (1.0, 1.0)
    layout = None
    layer = 0


def share_at(share: Share, layer: int, num_layers: int) -> float:
    """``share`` at ``layer``: in a straight line from its first value at layer 0 to its
    second at the last layer."""
    first, last = share
    return first + (last - first) * layer / max(1, num_layers - 1)


def _shift_by_layer(lay, active, keys, values, k, v) -> None:
    """The engine's shift at the whole share, then the keys' and values' moves scaled by
    this layer's shares. The engine shifts once a layer, in order, on one layout a prefill."""
    if _Shares.layout is not lay:
        _Shares.layout, _Shares.layer = lay, 0
    layer, _Shares.layer = _Shares.layer, _Shares.layer + 1
    before_keys, before_values = keys.clone(), values.clone()
    _engine_shift(lay, active, keys, values, k, v)
    keys.copy_(before_keys + (keys - before_keys) * share_at(_Shares.keys, layer, lay.num_layers))
    values.copy_(before_values + (values - before_values) * share_at(_Shares.values, layer, lay.num_layers))


def parse_shares(text: str) -> list[tuple[Share, Share]]:
    """``K/V`` pairs, comma-separated (``0.5`` alone: both); K and V are a number or ``A:B``
    (from A at the first layer to B at the last)."""
    def share(part: str) -> Share:
        first, _, last = part.partition(":")
        return float(first), float(last or first)

    pairs = []
    for part in text.split(","):
        k, _, v = part.partition("/")
        pairs.append((share(k), share(v or k)))
    return pairs


def share_name(share: Share) -> str:
    """``0.5``, or ``1:0.25`` for a share that changes with depth."""
    first, last = share
    return f"{first:g}" if first == last else f"{first:g}:{last:g}"


def pair_name(keys: Share, values: Share) -> str:
    """``K/V`` as the results name it, e.g. ``0.5/0.5`` or ``1/1:0``."""
    return f"{share_name(keys)}/{share_name(values)}"


def placement(spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each chunk's recomputed tokens as the shipped fit places them."""
    picks = []
    for a, b in spans:
        n = b - a
        count = int(FLOOR * n)
        sink = min(SINK_TOKENS, count)
        picks.append(torch.cat([first_tokens(n, sink), spread_tokens(n, count - sink, start=sink)]))
    return picks


def run_item(pipeline, item, shares: list[tuple[Share, Share]]) -> dict:
    """One item's figures for every share."""
    it = _Item(pipeline, item)
    warm_ids, _ = pipeline._warm_context()
    warm_kv = blended_prefill(it.adapter, [it.prefix(), Segment(warm_ids, "chunk", save=True)]).saved[1]
    caches = it.make_caches("warm", warm_kv, warm_ids)
    picks = placement(it.spans)
    reused = torch.zeros(len(it.token_ids), dtype=torch.bool)
    for (a, b), p in zip(it.spans, picks):
        reused[a:b] = True
        reused[a + p] = False
    row = {"item": item.index, "shares": {}}
    for k_share, v_share in shares:
        _Shares.keys, _Shares.values, _Shares.layout = k_share, v_share, None
        shifts = any(k_share + v_share)
        segments = [it.prefix(), *(Segment(ids, "chunk", cached=kv, recompute=p, drift_shift=1.0 if shifts else 0.0,
                                           drift_from=SINK_TOKENS)
                                   for ids, kv, p in zip(it.pieces.chunks, caches, picks)),
                    Segment(it.pieces.question, "question")]
        result = blended_prefill(it.adapter, segments)
        k_dev = [float(relative_deviation(k[:, reused], f[:, reused]).mean()) for k, f in zip(result.keys, it.full_keys)]
        v_dev = [float(relative_deviation(v[:, reused], f[:, reused]).mean())
                 for v, f in zip(result.values, it.full_values)]
        name = pair_name(k_share, v_share)
        row["shares"][name] = {"k": k_dev, "v": v_dev, **it.judge(result)}
        print(f"item {item.index} share {name}: answer KL {row['shares'][name]['answer_kl']:.4f}, K deviation "
              f"{sum(k_dev[1:]) / (len(k_dev) - 1):.4f}, V deviation {sum(v_dev[1:]) / (len(v_dev) - 1):.4f}",
              flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--skip", type=int, default=36)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--shares", default="0/0,0.25/0.25,0.5/0.5,0.75/0.75,1/1")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    args = parser.parse_args()
    try:
        shares = parse_shares(args.shares)
    except ValueError:
        parser.error(f"--shares: give K/V pairs of numbers or A:B, comma-separated (e.g. 0.5/0.5,1/0.5,1:0.25), "
                     f"got {args.shares!r}")
    if any(x < 0 for pair in shares for share in pair for x in share):
        parser.error(f"--shares: a share is at least 0, got {args.shares!r}")
    config = Config.load(overrides={"model": args.model})
    lm = load_model(config=config)
    items = load_items(args.dataset, args.skip + args.limit)[args.skip:]
    blend._shift_drift = _shift_by_layer
    rows = []
    with scratch_pipeline(lm, config, fitted=False) as pipeline:
        for item in items:
            rows.append(run_item(pipeline, item, shares))
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"benchmark": "shift_error", "model": args.model, "dataset": args.dataset, "skip": args.skip,
                   "limit": len(items), "shares": [pair_name(k, v) for k, v in shares], "rows": rows,
                   "machine": machine(), "code": running_code()}, handle, indent=2)


if __name__ == "__main__":
    main()
