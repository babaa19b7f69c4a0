"""The policy's floor pooled by need, on the judge with in-context variants.

With in-context variants (each passage's cache also made after its nearest passages) and
the chained order, about three passages in four find a variant made after the passage
right before them: its CFO is 0, yet the floor still recomputes its share of it. Pooling
(the policy's ``pool``) gives that share, in part or in full, to the passages whose
variant was made elsewhere, in proportion to CFO x tokens, at the same total. This runs
the shipped policy with each pool against the policy unpooled, through the one request
path (``run_quality``: ``full``, the policy without in-context variants, ``full`` in the
chained order, and the policy with them at each pool), and pairs every pooled run with
the unpooled one item by item.

    python benchmarks/pooled_floor.py benchmarks/results/pooled_floor_qwen2.5.json --skip 30 --limit 6
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cachecraft.bench.common import write_result
from cachecraft.bench.plots import quality_intervals
from cachecraft.bench.quality import RowsFileError, paired_figures, rows_by_method, run_quality
from cachecraft.config import Config
from cachecraft.dataset import DatasetError, load_items
from cachecraft.evaluation import InContext
from cachecraft.methods import CacheCraft
from cachecraft.model.bundled import ModelLoadError
from cachecraft.model.loader import load_model
from cachecraft.policy.calibrate import CalibrationError, parse_numbers
from cachecraft.retrieval.embed import Embedder


def paired_with_unpooled(result: dict, unpooled: str) -> dict:
    """Each pooled method's quality figures against ``unpooled``, item by item."""
    by = rows_by_method(result["items"])
    return {label: paired_figures(by, label, unpooled) for label in by if "/P" in label}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON result (a PNG and a rows file beside it)")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dataset", type=Path, default=Path("../shared/data/musique_dev.json"))
    parser.add_argument("--skip", type=int, default=30, help="items left out first (default: those reported on)")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--neighbours", type=int, default=2, help="in-context variants per passage")
    parser.add_argument("--pools", default="0.5,1", help="comma-separated pools within [0, 1]")
    parser.add_argument("--resume", action="store_true", help="keep the items the rows file already has")
    args = parser.parse_args()
    if args.limit < 1 or args.skip < 0 or not 1 <= args.neighbours <= 8:
        raise SystemExit("--limit must be at least 1, --skip at least 0 and --neighbours within [1, 8]")
    try:
        pools = parse_numbers(args.pools, "pools", 0.0, 1.0)
    except CalibrationError as exc:
        raise SystemExit(str(exc)) from None
    config = Config.load(None, overrides={"model": args.model, "warm_context": "builtin", "chunk_order": "cache"})
    try:
        items = load_items(args.dataset, args.limit, args.skip)
        lm = load_model(None, config)
    except (DatasetError, ModelLoadError, OSError) as exc:
        raise SystemExit(str(exc)) from None
    embed = Embedder(config.embedder).embed
    alpha = config.policy_alpha
    unpooled = InContext(CacheCraft(alpha), args.neighbours, embed)
    methods = [CacheCraft(alpha), unpooled,
               *(InContext(CacheCraft(alpha, pool=p), args.neighbours, embed) for p in pools)]
    command = (f"python benchmarks/pooled_floor.py {args.out} --model {args.model} --dataset {args.dataset} "
               f"--skip {args.skip} --limit {args.limit} --neighbours {args.neighbours} --pools {args.pools}")
    settings = {"benchmark": "pooled_floor", "model": lm.name, "fingerprint": lm.fingerprint,
                "neighbours": args.neighbours, "chunk_order": "cache"}
    try:
        result = run_quality(lm, config, items, methods, rows_path=args.out.with_suffix(".rows.jsonl"),
                             resume=args.resume, settings=settings,
                             on_item=lambda done, total: print(f"item {done}/{total}", flush=True))
    except RowsFileError as exc:
        raise SystemExit(str(exc)) from None
    payload = {"benchmark": "pooled_floor", "command": command, "model": lm.name, "fingerprint": lm.fingerprint,
               "dataset": str(args.dataset), "limit": len(items), "skip": args.skip,
               "in_context_neighbours": args.neighbours, "chunk_order": "cache", **result,
               "vs_unpooled": paired_with_unpooled(result, unpooled.label)}
    write_result(args.out, payload)
    quality_intervals(payload, args.out.with_suffix(".png"))
    for label, m in result["methods"].items():
        print(f"{label:32s} recompute {m['recompute_fraction_mean']:.3f}  answer KL {m['answer_kl_mean']:.3f}  "
              f"agreement {m['token_agreement_mean']:.3f}  {m['speedup_vs_full_median']:.1f}x")
    for label, figures in payload["vs_unpooled"].items():
        kl = figures["answer_kl"]
        print(f"{label} against {unpooled.label}: answer KL {kl['mean']:+.3f} [{kl['low']:+.3f}, {kl['high']:+.3f}]")


if __name__ == "__main__":
    main()
