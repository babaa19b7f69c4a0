"""A tier slower to load than to recompute: is a request over its caches as fast as a full prefill?

A random-weight model of a `bench gpu` shape (default the tiny Llama one, which runs on a
CPU), a context of ``--tokens`` tokens in 512-token chunks warmed into the disk tier, and
a cost model that says the disk loads at ``--disk-bandwidth`` bytes/s: so slow that
recomputing every chunk beats loading it. Then, per question, in a fresh pipeline each (as
a new process would meet them): a full prefill, cachecraft over the warm caches, and
cachecraft on a first-time request (an empty store). Prints and writes (OUT, JSON) the
times to first token and their medians.

    python benchmarks/slow_tier.py OUT --dataset data/musique_dev.json --tokenizer DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from cachecraft.bench.common import machine, running_code
from cachecraft.bench.gpu import add_context_arguments, shape_context
from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.pipeline import Pipeline
from cachecraft.policy.loading import CostModel
from cachecraft.store import TieredStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_context_arguments(parser, shape="tiny-llama", tokens=8000)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--disk-bandwidth", type=float, default=1e4)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    config = Config.load(overrides={"max_new_tokens": 1, "repetition_fallback": False,
                                    "cache_dir": tempfile.mkdtemp(prefix="slow-tier-")})
    items = load_items(args.dataset)
    lm, chunks = shape_context(args.shape, AutoTokenizer.from_pretrained(str(args.tokenizer)), torch.device("cpu"),
                               torch.float32, config, items, args.tokens)

    def fresh(store: TieredStore) -> Pipeline:
        pipe = Pipeline(config, lm=lm, store=store, keep_new_variants=False)
        # 1 ms a token and layer to recompute, 100 bytes a token and layer to load
        pipe.cost_model = CostModel(1e-3, 100, lm.adapter.num_layers,
                                    {"gpu": float("inf"), "cpu": 1e9, "disk": args.disk_bandwidth})
        return pipe

    times: dict[str, list[float]] = {"full": [], "first-time request": [], "warm caches": []}
    recompute = []
    questions = [items[i].question for i in range(1, args.questions + 1)]
    with TieredStore(config, tiers=("disk",)) as store:
        fresh(store).warm(chunks)
        for question in questions:
            times["full"].append(fresh(store).answer(chunks, question, method="full", record=False).ttft_s)
            answer = fresh(store).answer(chunks, question, method="cachecraft", record=False)
            times["warm caches"].append(answer.ttft_s)
            recompute.append(answer.recompute_fraction)
    with TieredStore(config.replace(cache_dir=tempfile.mkdtemp(prefix="slow-tier-cold-")), tiers=("disk",)) as empty:
        for question in questions:
            times["first-time request"].append(
                fresh(empty).answer(chunks, question, method="cachecraft", record=False).ttft_s)
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {"benchmark": "slow_tier", "machine": machine(), "code": running_code(), "shape": args.shape,
              "tokens": args.tokens, "disk_bandwidth": args.disk_bandwidth, "ttft_s": times,
              "median_ttft_s": medians, "recompute_fraction": recompute,
              "vs_full": {name: medians[name] / medians["full"] for name in medians}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, values in times.items():
        print(f"{name:20s} median {medians[name]:.3f} s ({medians[name] / medians['full']:.2f}x full's time) "
              f"{[round(v, 3) for v in values]}")


if __name__ == "__main__":
    main()
