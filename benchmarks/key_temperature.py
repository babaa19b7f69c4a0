"""A temperature on the attention to reused chunks: does it bring the answers closer to full's?

Caches made without the chunks before them are off from full's; one reading of the
parallel-encoding literature is that the attention a later token pays to such chunks is
too flat or too sharp, and that scaling the logits it gives them (a temperature) puts part
of the difference right at no recompute. Scaling a key scales every logit a query gives
it, so this script multiplies the reused (not recomputed) chunk rows' keys by a factor at
every layer from layer 1 up (layer 0's are exact) while a request is prefilled; the scaled
keys then stay in the KV that the question, the answer and the teacher-forced comparison
read. The warm caches are made unscaled. Everything else is the default request path:
for each MuSiQue item, full (the reference), then the default ``cachecraft`` once per
factor (1.0 is the shipped policy as it is), every answer compared with full's. Writes OUT
(JSON: per item, per factor, and each factor paired with 1.0) after every item.

    python benchmarks/key_temperature.py OUT --model qwen2.5-coder-0.5b \\
        --dataset ../shared/data/musique_dev.json --skip 36 --limit 8 --factors 1.0,0.9,1.05,1.1
"""

from __future__ import annotations

import json

import cachecraft.engine.blend as blend
from cachecraft.bench.common import (items_parser, record_item, runs_against_full, script_items, script_run,
                                    summarise_runs)
from cachecraft.evaluation import scratch_pipeline
from cachecraft.methods import parse_method
from cachecraft.model.loader import load_model

KEYS = ("answer_kl", "token_agreement", "kl", "recompute_fraction", "ttft_s", "gold_f1", "answer")
FIRST_SCALED_LAYER = 1  # layer 0's K/V depend on the token alone: reused exactly


class KeyScale:
    """Wraps the engine's assembly of cached K/V so the reused chunk rows' keys come out
    multiplied by ``factor`` (1.0: untouched)."""

    def __init__(self) -> None:
        self.factor = 1.0
        self._assemble = blend._cached_kv

    def __call__(self, adapter, lay, layer):
        keys, values = self._assemble(adapter, lay, layer)
        if self.factor != 1.0 and layer >= FIRST_SCALED_LAYER:
            keys[:, lay.context & ~lay.must] *= self.factor  # rows running this layer are overwritten after
        return keys, values


def main() -> None:
    parser = items_parser(__doc__.splitlines()[0])
    parser.add_argument("--factors", default="1.0,0.9,1.05,1.1", help="key factors, comma-separated; 1.0 is added")
    args = parser.parse_args()
    factors = list(dict.fromkeys([1.0, *(float(x) for x in args.factors.split(","))]))
    config, items = script_items(args)
    lm = load_model(None, config)
    method = parse_method("cachecraft")
    scale = KeyScale()
    blend._cached_kv = scale
    rows: list[dict] = []
    run = script_run()

    def use(factor) -> None:
        scale.factor = factor if isinstance(factor, float) else 1.0  # caches and full's answer: unscaled

    with scratch_pipeline(lm, config) as pipe:
        pipe.ensure_cost_model()
        for item_rows in runs_against_full(pipe, items, method, factors, "factor", use, KEYS):
            record_item(args, "key_temperature", run, rows, item_rows, lambda r: f"x{r['factor']:g}",
                        lambda: summarise(rows, factors))
    print(json.dumps(summarise(rows, factors)["paired"], indent=2))


def summarise(rows: list[dict], factors: list[float]) -> dict:
    """Means per factor and each factor paired with 1.0, item by item, so far."""
    return summarise_runs(rows, "factor", factors, 1.0, name=lambda factor: f"{factor:g}")


if __name__ == "__main__":
    main()
