"""Blended prefill: cached KV for most tokens, fresh KV for the tokens that matter.

One loop serves every prefill path:

- full prefill: no segment is cached, every token runs through every layer;
- chunk-cache creation: a full prefill that also returns the pre-RoPE KV and the
  attention statistics of chosen segments;
- blended prefill: cached segments contribute their stored KV; only the recomputed
  set (selected tokens, plus every uncached token) runs through the layers, and its
  fresh K/V overwrite the cached rows.

Layer 0's K/V depend only on token embeddings, so a cached token's layer-0 K/V are
exact; a token that is recomputed still starts at layer 0 because its hidden state
after layer 0 feeds layer 1. The active set only shrinks as layers go up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from cachecraft.engine.attention import _AttentionPlan, _mass_per_key, _mass_per_segment, _SegmentMass
from cachecraft.kv import AttentionStats, ChunkKV
from cachecraft.model.adapter import ArchAdapter

ROLES = ("prefix", "chunk", "question")


class LayerSource(Protocol):
    """Anything that can hand the engine one layer of cached KV at a time."""

    num_tokens: int

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PromptError(ValueError):
    """The prompt cannot be prefilled as given (empty, too long, inconsistent)."""


@dataclass
class Segment:
    """One run of the prompt: the system prefix, a chunk, or the question.

    ``cached``: stored KV for these tokens (None: compute them). ``recompute``: local
    indices of cached tokens to recompute anyway. ``stop_layer``: layers at or above
    it keep the cached KV even for recomputed tokens. ``fixable``: whether a deviation
    check may pick tokens here (chunks only). ``save``/``collect_stats``: return this (uncached)
    segment's KV / attention statistics as a :class:`ChunkKV`.
    """

    token_ids: Sequence[int]
    role: str = "chunk"
    cached: LayerSource | None = None
    recompute: Sequence[int] | torch.Tensor | None = None
    stop_layer: int | None = None
    fixable: bool = True
    save: bool = False
    collect_stats: bool = False
    key: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PromptError(f"segment role must be one of {ROLES}, got {self.role!r}")
        if len(self.token_ids) == 0:
            raise PromptError(f"empty {self.role} segment")
        if self.cached is not None and self.cached.num_tokens != len(self.token_ids):
            raise PromptError(
                f"cached KV has {self.cached.num_tokens} tokens but the {self.role} segment has "
                f"{len(self.token_ids)}")
        if (self.save or self.collect_stats) and self.cached is not None:
            raise PromptError("save/collect_stats need a segment that is computed in full (not cached)")


@dataclass(frozen=True)
class DeviationCheck:
    """CacheBlend's HKVD selection: at ``layer`` compute fresh K/V for every token and
    keep the ``ratio`` of fixable cached tokens whose ``kind`` ("v" or "k") deviates most."""

    layer: int = 1
    ratio: float = 0.15
    kind: str = "v"

    def __post_init__(self) -> None:
        assert self.layer >= 1, "the deviation check needs layer >= 1 (layer 0 KV is context-free)"
        assert 0.0 <= self.ratio <= 1.0, f"ratio must be within [0, 1], got {self.ratio}"
        assert self.kind in ("k", "v"), f"kind must be 'k' or 'v', got {self.kind!r}"


@dataclass
class BlendResult:
    """What a prefill produced.

    ``keys``/``values``: per layer ``[H_kv, N, D]``, keys *after* RoPE (ready for a
    transformers Cache). ``logits``: last position ``[vocab]``. ``saved``: per segment
    index, the ChunkKV of segments marked ``save``. ``question_attention``: per
    observed layer, the mass the last segment's tokens put on each segment;
    ``token_attention``: the same per key token ``[N]``. After ``until_layer`` the
    result holds only the layers computed and ``logits`` is None.
    """

    token_ids: torch.Tensor
    logits: torch.Tensor | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    saved: dict[int, ChunkKV] = field(default_factory=dict)
    question_attention: dict[int, torch.Tensor] = field(default_factory=dict)
    token_attention: dict[int, torch.Tensor] = field(default_factory=dict)
    recomputed_tokens: int = 0
    context_tokens: int = 0
    recomputed: torch.Tensor | None = None  # [N] bool: token computed fresh at layer 1 or above
    token_layers: int = 0  # work done: tokens run through a layer, summed over layers
    recompute_work: float = 0.0
    seconds: float = 0.0

    @property
    def recompute_fraction(self) -> float:
        """Recomputed context tokens / context tokens (chunks only)."""
        return self.recomputed_tokens / self.context_tokens if self.context_tokens else 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


def _segment_bounds(segments: Sequence[Segment]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for seg in segments:
        bounds.append((start, start + len(seg.token_ids)))
        start += len(seg.token_ids)
    return bounds


def _select_top_deviation(fresh: torch.Tensor, cached: torch.Tensor, candidates: torch.Tensor,
                          ratio: float) -> torch.Tensor:
    """Indices (into ``candidates``) of the ``ratio`` rows with the largest squared deviation."""
    if candidates.numel() == 0 or ratio <= 0:
        return torch.empty(0, dtype=torch.long, device=fresh.device)
    deviation = (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))  # [n_candidates]
    count = min(candidates.numel(), math.ceil(ratio * candidates.numel()))
    return deviation.topk(count).indices


@torch.inference_mode()
def blended_prefill(adapter: ArchAdapter, segments: Sequence[Segment], *,
                    deviation_check: DeviationCheck | None = None,
                    observe_layers: Sequence[int] = (), token_attention_layers: Sequence[int] = (),
                    until_layer: int | None = None, fingerprint: str = "",
                    max_context: int | None = None,
                    on_question_attention: Callable[[int, torch.Tensor], dict[int, int]] | None = None,
                    stats_layers: Sequence[int] | None = None) -> BlendResult:
    """Prefill ``segments`` in order, reusing cached KV where given; see module doc.

    ``observe_layers``/``token_attention_layers``: layers at which to report the
    question's attention per segment / per key token. ``until_layer``: stop after
    the layers below it (a cheap look-ahead pass; no logits). ``on_question_attention``:
    called at each observed layer with the question's mass per segment; it may return
    ``{segment index: stop layer}`` to stop recomputing cached segments early.
    ``stats_layers``: the layers ``collect_stats`` segments gather statistics at (every
    layer when None; each one costs about one more attention pass)."""
    t0 = time.perf_counter()
    if not segments:
        raise PromptError("nothing to prefill: no segments")
    if segments[-1].cached is not None:
        raise PromptError("the last segment (the question) must be computed, not cached")
    num_layers = adapter.num_layers
    device = adapter.embed_tokens.weight.device
    dtype = adapter.embed_tokens.weight.dtype
    bounds = _segment_bounds(segments)
    n_total = bounds[-1][1]
    limit = max_context or adapter.max_context
    if n_total > limit:
        raise PromptError(f"prompt has {n_total} tokens, more than the model's context window of {limit}")
    token_ids = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long, device=device)
    positions = torch.arange(n_total, device=device)
    starts = torch.tensor([b[0] for b in bounds], device=device)

    # Per token: layer at which it stops being recomputed (num_layers = never stops),
    # and whether it must be computed because nothing is cached for it.
    stop_at = torch.full((n_total,), num_layers, dtype=torch.long, device=device)
    must = torch.zeros(n_total, dtype=torch.bool, device=device)
    forced = torch.zeros(n_total, dtype=torch.bool, device=device)
    fixable = torch.zeros(n_total, dtype=torch.bool, device=device)
    context = torch.zeros(n_total, dtype=torch.bool, device=device)
    for seg, (lo, hi) in zip(segments, bounds):
        context[lo:hi] = seg.role == "chunk"
        if seg.cached is None:
            must[lo:hi] = True
            continue
        if seg.stop_layer is not None:
            stop_at[lo:hi] = max(0, min(num_layers, int(seg.stop_layer)))
        if seg.fixable and seg.role == "chunk":
            fixable[lo:hi] = True
        if seg.recompute is not None:
            local = torch.as_tensor(seg.recompute, dtype=torch.long, device=device)
            if local.numel() and (int(local.min()) < 0 or int(local.max()) >= hi - lo):
                raise PromptError(f"recompute index out of range for a segment of {hi - lo} tokens")
            forced[lo + local] = True
    stop_at[must] = num_layers
    recomputed = must | forced

    if deviation_check is not None and deviation_check.layer < num_layers:
        active = positions.clone()  # everything runs until the check layer
    else:
        deviation_check = None
        active = positions[must | forced]
    hidden = adapter.embed(token_ids[active])
    cos_all, sin_all = adapter.rope(positions, hidden)
    observe = set(observe_layers)
    q_lo, q_hi = bounds[-1]

    out_keys: list[torch.Tensor] = []
    out_values: list[torch.Tensor] = []
    saved_k = {i: [] for i, s in enumerate(segments) if s.save}
    saved_v = {i: [] for i, s in enumerate(segments) if s.save}
    stats_rows = {i: [] for i, s in enumerate(segments) if s.collect_stats}
    stats_at = set(range(num_layers)) if stats_layers is None else {int(x) for x in stats_layers}
    if stats_rows and not stats_at & set(range(num_layers)):
        raise PromptError(f"statistics were asked for at layers {sorted(stats_at)}, none of the "
                          f"model's {num_layers}")
    in_stats = torch.zeros(n_total, dtype=torch.bool, device=device)
    for i in stats_rows:
        in_stats[bounds[i][0]:bounds[i][1]] = True
    segment_mass = (_SegmentMass(bounds, adapter.num_kv_heads, adapter.head_dim, device, dtype)
                    if stats_rows else None)
    stats_plan = stats_plan_for = None
    question_attention: dict[int, torch.Tensor] = {}
    token_attention: dict[int, torch.Tensor] = {}
    work = total_work = 0

    plan = None
    gqa = adapter.num_heads != adapter.num_kv_heads
    token_layers = set(token_attention_layers)
    last_layer = num_layers if until_layer is None else max(1, min(num_layers, until_layer))
    for layer in range(last_layer):
        alive = stop_at[active] > layer
        if not bool(alive.all()):
            active, hidden = active[alive], hidden[alive]
            plan = None
        q, k, v = adapter.qkv(layer, hidden)  # q [H, n, D]; k, v [H_kv, n, D]

        # Assemble this layer's pre-RoPE K and V for the whole prompt.
        keys = torch.empty(adapter.num_kv_heads, n_total, adapter.head_dim, device=device, dtype=dtype)
        values = torch.empty_like(keys)
        for seg, (lo, hi) in zip(segments, bounds):
            if seg.cached is not None:
                ck, cv = seg.cached.layer(layer)
                keys[:, lo:hi] = ck  # converted to the compute dtype and device in the copy
                values[:, lo:hi] = cv
        keep = None
        if deviation_check is not None and layer == deviation_check.layer:
            candidates = (fixable & ~forced & ~must)[active]
            cand_idx = candidates.nonzero().squeeze(1)
            picked = _select_top_deviation(
                (v if deviation_check.kind == "v" else k)[:, cand_idx],
                (values if deviation_check.kind == "v" else keys)[:, active[cand_idx]],
                cand_idx, deviation_check.ratio)
            keep = (must | forced)[active]
            keep[cand_idx[picked]] = True
            recomputed[active[cand_idx[picked]]] = True
            deviation_check = None
        keys[:, active] = k
        values[:, active] = v
        for i in saved_k:
            lo, hi = bounds[i]
            saved_k[i].append(keys[:, lo:hi].clone())
            saved_v[i].append(values[:, lo:hi])
        if keep is not None and not bool(keep.all()):
            # Fresh K/V of every token were computed at the check layer and are kept;
            # from here on only the selected tokens run.
            q, active, hidden = q[:, keep], active[keep], hidden[keep]
            plan = None

        keys = adapter.rotate(keys, cos_all, sin_all)
        q = adapter.rotate(q, cos_all[active], sin_all[active])
        plan = plan or _AttentionPlan(active, n_total)
        attn = plan.attend(q, keys, values, adapter.scaling, gqa)
        hidden = hidden + adapter.attn_output(layer, attn)
        hidden = adapter.mlp_residual(layer, hidden)
        work += int(context[active].sum())
        total_work += int(active.numel())

        if stats_rows and layer in stats_at:
            rows = in_stats[active]
            if bool(rows.all()):
                stats_pos, mass = active, segment_mass(q, keys, plan, adapter.scaling, gqa)
            else:
                stats_pos = active[rows]
                if stats_plan_for is not active:
                    stats_plan, stats_plan_for = _AttentionPlan(stats_pos, n_total), active
                mass = segment_mass(q[:, rows], keys, stats_plan, adapter.scaling, gqa)
            for i in stats_rows:
                lo, hi = bounds[i]
                stats_rows[i].append(mass[(stats_pos >= lo) & (stats_pos < hi)])
        if layer in observe or layer in token_layers:
            rows = (active >= q_lo) & (active < q_hi)
            if layer in observe:
                question_attention[layer] = _mass_per_segment(
                    q[:, rows], keys, active[rows], starts, adapter.scaling).sum(dim=0)
                if on_question_attention is not None:
                    for i, stop in on_question_attention(layer, question_attention[layer]).items():
                        if segments[i].cached is not None:
                            lo, hi = bounds[i]
                            stop_at[lo:hi] = stop_at[lo:hi].clamp(max=max(int(stop), layer + 1))
            if layer in token_layers:
                token_attention[layer] = _mass_per_key(q[:, rows], keys, active[rows], adapter.scaling)
        out_keys.append(keys)
        out_values.append(values)

    logits = None
    if last_layer == num_layers:
        last = (active == n_total - 1).nonzero()
        assert last.numel() == 1, "the last token must be computed through every layer"
        logits = adapter.logits(hidden[last[0]])[0]

    saved = {}
    for i in saved_k:
        seg = segments[i]
        stats = _stats_from_rows(stats_rows.get(i), i, bounds[i]) if seg.collect_stats else None
        prefix = tuple(s.key for s in segments[:i])
        saved[i] = ChunkKV(tuple(int(t) for t in seg.token_ids), torch.stack(saved_k[i]),
                           torch.stack(saved_v[i]), fingerprint, prefix, stats,
                           prefix_tokens=tuple(len(s.token_ids) for s in segments[:i]))

    context_tokens = int(context.sum())
    return BlendResult(token_ids, logits, out_keys, out_values, saved, question_attention, token_attention,
                       recomputed_tokens=int((recomputed & context & (stop_at > 0)).sum()),
                       recomputed=(recomputed & (stop_at > 0)).cpu(), token_layers=total_work,
                       context_tokens=context_tokens,
                       recompute_work=work / (context_tokens * num_layers) if context_tokens else 0.0,
                       seconds=time.perf_counter() - t0)


def _stats_from_rows(rows: list[torch.Tensor] | None, index: int, bound: tuple[int, int]) -> AttentionStats:
    """Turn per-layer ``[T, S]`` masses into the chunk's :class:`AttentionStats`."""
    assert rows, "statistics were requested but not gathered"
    mass = torch.stack(rows).float().cpu()  # [L, T, S]
    return AttentionStats(outside=mass[:, :, :index].sum(dim=-1), inter=mass[:, :, :index].sum(dim=1),
                          intra=mass[:, :, index].sum(dim=1))


def sampled_layers(num_layers: int, step: int) -> tuple[int, ...]:
    """Every ``step``-th layer, ending each run of ``step`` (``step - 1``, ``2 * step - 1``,
    ...; at least one layer): where statistics are gathered when not at every layer.
    Layer 0, whose attention differs most from the rest, is left out unless ``step`` is 1."""
    assert num_layers >= 1 and step >= 1, f"need num_layers >= 1 and step >= 1, got {num_layers}, {step}"
    return tuple(range(min(step, num_layers) - 1, num_layers, step))


def create_chunk_cache(adapter: ArchAdapter, before: Sequence[Segment], chunk_ids: Sequence[int], *,
                       fingerprint: str, key: str = "", collect_stats: bool = True,
                       stats_layers: Sequence[int] | None = None) -> ChunkKV:
    """The KV of ``chunk_ids`` computed after the segments ``before`` (system prefix,
    perhaps earlier chunks, cached or not), with those rows dropped, plus its
    attention statistics (at ``stats_layers``, every layer when None)."""
    chunk = Segment(chunk_ids, "chunk", save=True, collect_stats=collect_stats, key=key)
    result = blended_prefill(adapter, [*before, chunk], fingerprint=fingerprint, stats_layers=stats_layers)
    return result.saved[len(before)]
