"""Decoding speed from a handed-over cache: transformers' own layers against room kept.

transformers' ``DynamicLayer`` appends each decoded token by concatenating, so every token
copies the whole cache (at 6k tokens in float32, 276 MB a token for SmolLM2, 147 MB for
Qwen2.5-0.5B). The handoff's :class:`cachecraft.engine.handoff.GrowingLayer` writes the
token into room kept for the answer. This prefills one MuSiQue item's prompt (its ten
passages and question, as ``answer`` builds it) once per model, then decodes N greedy
tokens from the same prefill both ways, alternating, R times; it checks that both give the
same tokens and writes OUT (JSON, tokens a second and their ratio per repeat) and OUT with
``.png``.

    python benchmarks/decode_room.py benchmarks/results/decode_room.json --models smollm2 qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import DynamicCache

from cachecraft.bench.common import machine, running_code
from cachecraft.config import Config
from cachecraft.dataset import DatasetError, load_items
from cachecraft.engine import Segment, blended_prefill
from cachecraft.engine.handoff import cache_argument, to_transformers_cache
from cachecraft.evaluation import item_chunks, scratch_pipeline
from cachecraft.model.bundled import ModelLoadError
from cachecraft.model.loader import load_model


def handed_over(result, model, new: int, room: bool) -> DynamicCache:
    """The prompt's KV (all but the last token) as the handoff gives it, with room for
    ``new`` tokens (``room``), or in transformers' own layers; ``result`` is left whole."""
    if room:
        return to_transformers_cache(replace(result, keys=list(result.keys), values=list(result.values)),
                                     model.config, room=new + 1)
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(zip(result.keys, result.values)):
        cache.update(k[None, :, :-1], v[None, :, :-1], layer)
    return cache


@torch.inference_mode()
def decode(model, tokenizer, result, new: int, room: bool) -> tuple[list[int], float]:
    """``new`` greedy tokens after the prefill ``result``; the tokens and seconds taken."""
    ids = result.token_ids[None]
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, temperature=None, top_p=None, top_k=None,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                         **{cache_argument(model): handed_over(result, model, new, room)})
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder-0.5b"])
    parser.add_argument("--dataset", type=Path, default=Path("../shared/data/musique_dev.json"))
    parser.add_argument("--item", type=int, default=40, help="which item of the dataset (from 0)")
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.new_tokens < 1 or args.repeats < 1:
        raise SystemExit("--new-tokens and --repeats must be at least 1")
    try:
        items = load_items(args.dataset, 1, args.item)
    except (DatasetError, OSError) as exc:
        raise SystemExit(str(exc)) from None
    if not items:
        raise SystemExit(f"{args.dataset} has no item {args.item}")
    rows = []
    for name in args.models:
        config = Config.load(None, overrides={"model": name})
        try:
            lm = load_model(None, config)
        except ModelLoadError as exc:
            raise SystemExit(str(exc)) from None
        with scratch_pipeline(lm, config) as pipeline:
            pieces = pipeline.builder.build(item_chunks(items[0]), items[0].question, max_tokens=lm.max_context)
            segments = [Segment(pieces.prefix, "prefix"), *(Segment(c, "chunk") for c in pieces.chunks),
                        Segment(pieces.question, "question")]
            result = blended_prefill(lm.adapter, segments)
            runs = []
            for _ in range(args.repeats):
                plain, plain_s = decode(lm.model, lm.tokenizer, result, args.new_tokens, room=False)
                kept, kept_s = decode(lm.model, lm.tokenizer, result, args.new_tokens, room=True)
                if plain != kept:
                    raise SystemExit(f"{name}: the two caches decoded different tokens")
                runs.append({"plain_tokens_per_s": args.new_tokens / plain_s,
                             "room_tokens_per_s": args.new_tokens / kept_s, "ratio": plain_s / kept_s})
        row = {"model": name, "prompt_tokens": result.num_tokens, "dtype": str(lm.dtype).replace("torch.", ""),
               "new_tokens": args.new_tokens, "runs": runs,
               "median_ratio": statistics.median(r["ratio"] for r in runs)}
        rows.append(row)
        print(json.dumps(row))
        del lm, result
    command = ("python benchmarks/decode_room.py " + " ".join(
        [str(args.out), "--models", *args.models, "--dataset", str(args.dataset), "--item", str(args.item),
         "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]))
    args.out.write_text(json.dumps({"benchmark": "decode_room", "rows": rows, "machine": machine(),
                                    "code": running_code(), "command": command}, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))


def plot(rows, path: Path) -> None:
    """Median tokens a second per model, both ways."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for shift, key, label in ((-width / 2, "plain_tokens_per_s", "transformers' own layers"),
                              (width / 2, "room_tokens_per_s", "room kept for the answer")):
        ax.bar([i + shift for i in range(len(rows))],
               [statistics.median(r[key] for r in row["runs"]) for row in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [f"{row['model']}\n{row['prompt_tokens']} prompt tokens" for row in rows])
    ax.set_ylabel("greedy tokens a second (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
