"""Linear corrections of the reused chunk rows, fitted on full's own K/V: how close can they get?

The drift shift moves each reused chunk's cached K/V by the mean change its recomputed
tokens measure. This script asks what the best correction of that family could do at all,
with the answer known: at every layer from layer 1 up, it fits a map from the cached rows
of the chunk tokens to the rows full's prefill of the same prompt computed (an oracle: no
request has those), applies it to those rows, and lets the default request path run on
(the recomputed tokens overwrite theirs, and the drift shift moves the rest by half of
what is left between the two). The maps, each per KV head and fitted to the least squares:

- ``exact``: the rows replaced by full's (a check of the wiring: the answer KL must be 0);
- ``bias``: one shift for all reused rows of the prompt; ``chunk-bias``: one per chunk;
- ``affine``: one linear map plus shift for all reused rows (ridge toward the identity);
  ``chunk-affine``: one per chunk.

If none of them, fitted to the truth, brings the answers close to full's, no correction
fitted from a recomputed sample will. For each MuSiQue item: full (the reference, its K/V
recorded), the default ``cachecraft`` as shipped, then once per map, every answer compared
with full's. Writes OUT (JSON: per item, per map, each map paired with the shipped run,
and how much of the cached rows' squared deviation from full's each map removed) after
every item.

    python benchmarks/linear_correction.py OUT --model qwen2.5-coder-0.5b \\
        --dataset ../shared/data/musique_dev.json --skip 36 --limit 16
"""

from __future__ import annotations

import json
import statistics

import torch

import cachecraft.engine.blend as blend
from cachecraft.bench.common import (FULL_RUN, items_parser, record_item, runs_against_full, script_items,
                                    script_run, summarise_runs)
from cachecraft.evaluation import scratch_pipeline
from cachecraft.methods import parse_method
from cachecraft.model.loader import load_model

MAPS = ("exact", "bias", "chunk-bias", "affine", "chunk-affine")
KEYS = ("answer_kl", "token_agreement", "kl", "recompute_fraction", "answer")
FIRST_MAPPED_LAYER = 1  # layer 0's K/V depend on the token alone: reused exactly
# Ridge weights toward the identity, relative to the rows' mean square: a whole prompt's
# few thousand rows pin a 65 x 64 map down well; a chunk's few hundred need more pull.
RIDGE = {"affine": 1e-2, "chunk-affine": 1e-1}


def ridge_affine(cached: torch.Tensor, target: torch.Tensor, weight: float) -> torch.Tensor:
    """``cached [n, D]`` mapped by the affine map that fits ``target [n, D]`` to the least
    squares, with ``weight`` x (mean square of ``cached``) x |map - identity|^2 added."""
    x, y = cached.double(), target.double()
    n, d = x.shape
    design = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], dim=1)
    gram = design.T @ design
    lam = weight * torch.trace(gram[:d, :d]) / d
    pull = torch.zeros(d + 1, d + 1, dtype=x.dtype)
    pull[:d, :d] = torch.eye(d, dtype=x.dtype) * lam
    prior = torch.zeros(d + 1, d, dtype=x.dtype)
    prior[:d] = torch.eye(d, dtype=x.dtype) * lam
    coef = torch.linalg.solve(gram + pull, design.T @ y + prior)
    return (design @ coef).to(cached.dtype)


def corrected(cached: torch.Tensor, full: torch.Tensor, kind: str, chunks: list[tuple[int, int]],
              rows: torch.Tensor) -> torch.Tensor:
    """``cached [H_kv, N, D]`` with its ``rows`` moved toward ``full`` by the map ``kind``."""
    out = cached.clone()
    groups = [rows] if kind in ("exact", "bias", "affine") else [
        torch.arange(lo, hi, device=rows.device) for lo, hi in chunks]
    for index in groups:
        if kind == "exact":
            out[:, index] = full[:, index]
        elif kind.endswith("bias"):
            out[:, index] += (full[:, index] - cached[:, index]).mean(dim=1, keepdim=True)
        else:
            for h in range(cached.shape[0]):
                out[h, index] = ridge_affine(cached[h, index], full[h, index], RIDGE[kind])
    return out


class Oracle:
    """Records full's pre-RoPE K/V per layer (``recording``), and with ``kind`` set corrects
    the reused chunk rows of a request over the same prompt toward them."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.recording = False
        self.full: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # tokens -> layer -> K, V
        self.removed: dict[str, list[float]] = {}  # per map, per layer and side: share of the squared deviation removed
        self._layer, self._assemble = blend._layer, blend._cached_kv

    def layer(self, adapter, lay, run, hooks, layer, rope, saved):
        keys, values = self._layer(adapter, lay, run, hooks, layer, rope, saved)
        if self.recording:
            cos, sin = rope
            self.full.setdefault(lay.n_total, {})[layer] = (adapter.unrotate(keys, cos, sin), values.clone())
        return keys, values

    def cached_kv(self, adapter, lay, layer):
        keys, values = self._assemble(adapter, lay, layer)
        if self.kind is None or layer < FIRST_MAPPED_LAYER or lay.n_total not in self.full:
            return keys, values
        # Every cached chunk row, the recomputed ones too: their fresh K/V overwrite them,
        # but the drift shift measures the change from what they hold
        rows = (lay.context & ~lay.must).nonzero().squeeze(1)
        chunks = [(lo, hi) for (lo, hi), seg in zip(lay.bounds, lay.segments)
                  if seg.cached is not None and seg.role == "chunk"]
        out = []
        for cached, full in zip((keys, values), self.full[lay.n_total][layer]):
            fixed = corrected(cached, full, self.kind, chunks, rows)
            before = (cached[:, rows] - full[:, rows]).square().sum()
            after = (fixed[:, rows] - full[:, rows]).square().sum()
            self.removed.setdefault(self.kind, []).append(float(1 - after / before) if before > 0 else 0.0)
            out.append(fixed)
        return out[0], out[1]


def main() -> None:
    parser = items_parser(__doc__.splitlines()[0])
    parser.add_argument("--maps", default=",".join(MAPS), help=f"comma-separated, of {', '.join(MAPS)}")
    args = parser.parse_args()
    kinds = [k for k in args.maps.split(",") if k]
    if unknown := sorted(set(kinds) - set(MAPS)):
        parser.error(f"unknown map {', '.join(unknown)}; choose from {', '.join(MAPS)}")
    config, items = script_items(args)
    lm = load_model(None, config)
    method = parse_method("cachecraft")
    oracle = Oracle()
    blend._layer, blend._cached_kv = oracle.layer, oracle.cached_kv
    runs = ["shipped", *kinds]
    rows: list[dict] = []
    run = script_run()

    def use(label) -> None:
        if label == FULL_RUN:  # the last item's K/V are of no more use
            oracle.full = {}
        oracle.recording = label == FULL_RUN
        oracle.kind = label if label in MAPS else None

    with scratch_pipeline(lm, config) as pipe:
        pipe.ensure_cost_model()
        for item_rows in runs_against_full(pipe, items, method, runs, "map", use, KEYS):
            for row in item_rows:
                row["deviation_removed"] = statistics.fmean(oracle.removed.pop(row["map"], [0.0]))
            record_item(args, "linear_correction", run, rows, item_rows, lambda r: r["map"],
                        lambda: summarise(rows, runs))
    print(json.dumps(summarise(rows, runs)["paired"], indent=2))


def summarise(rows: list[dict], runs: list[str]) -> dict:
    """Means per run and each map paired with the shipped run, item by item, so far."""
    return summarise_runs(rows, "map", runs, "shipped", extra=("deviation_removed",))


if __name__ == "__main__":
    main()
