"""Blended prefill: cached KV for most tokens, fresh KV for the tokens that matter.

One loop serves every prefill path:

- full prefill: no segment is cached, every token runs through every layer;
- chunk-cache creation: a full prefill that also returns the pre-RoPE KV of chosen
  segments (and, through a hook, their attention statistics);
- blended prefill: cached segments contribute their stored KV; only the recomputed
  set (selected tokens, plus every uncached token) runs through the layers, and its
  fresh K/V overwrite the cached rows.

Choosing tokens and watching attention are hooks the caller passes in
(:mod:`cachecraft.engine.hooks`; the implementations live in
:mod:`cachecraft.selection`). Layer 0's K/V depend only on token embeddings, so a
cached token's layer-0 K/V are exact; a token that is recomputed still starts at
layer 0 because its hidden state after layer 0 feeds layer 1. The running set only
shrinks as layers go up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from cachecraft.engine.attention import _AttentionPlan
from cachecraft.engine.hooks import LayerHook, LayerView
from cachecraft.engine.layout import Layout, LayerSource, PromptError, Segment, make_layout  # noqa: F401
from cachecraft.kv import ChunkKV
from cachecraft.model.adapter import ArchAdapter


@dataclass
class BlendResult:
    """What a prefill produced.

    ``keys``/``values``: per layer ``[H_kv, N, D]``, keys *after* RoPE (ready for a
    transformers Cache). ``logits``: last position ``[vocab]``. ``saved``: per segment
    index, the ChunkKV of segments marked ``save``. After ``until_layer`` the result
    holds only the layers computed and ``logits`` is None.
    """

    token_ids: torch.Tensor
    logits: torch.Tensor | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    saved: dict[int, ChunkKV] = field(default_factory=dict)
    recomputed_tokens: int = 0
    context_tokens: int = 0
    recomputed: torch.Tensor | None = None  # [N] bool: token computed fresh at layer 1 or above
    token_layers: int = 0  # work done: tokens run through a layer, summed over layers
    recompute_work: float = 0.0
    seconds: float = 0.0
    deferred: list[Callable[[], None]] = field(default_factory=list, repr=False)  # see complete()

    @torch.inference_mode()
    def complete(self) -> None:
        """Run the work hooks put off until after the first token (a deferred
        :class:`~cachecraft.selection.ChunkStatistics` attaches the statistics of the
        chunks saved here); call it before reading ``saved``. Runs each piece once."""
        while self.deferred:
            self.deferred.pop(0)()

    @property
    def recompute_fraction(self) -> float:
        """Recomputed context tokens / context tokens (chunks only)."""
        return self.recomputed_tokens / self.context_tokens if self.context_tokens else 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


@dataclass
class _Running:
    """The tokens still running through the layers, and the work they have done."""

    active: torch.Tensor  # [n] positions, sorted
    hidden: torch.Tensor  # [n, hidden]
    plan: _AttentionPlan | None = None
    context_work: int | torch.Tensor = 0  # context tokens run through a layer, summed over layers
    work: int = 0  # all tokens run through a layer, summed over layers

    def keep(self, mask: torch.Tensor) -> None:
        self.active, self.hidden, self.plan = self.active[mask], self.hidden[mask], None


@torch.inference_mode()
def blended_prefill(adapter: ArchAdapter, segments: Sequence[Segment], *, hooks: Sequence[LayerHook] = (),
                    until_layer: int | None = None, fingerprint: str = "",
                    max_context: int | None = None) -> BlendResult:
    """Prefill ``segments`` in order, reusing cached KV where given; see module doc.

    ``hooks``: selectors and observers called inside the layer loop.
    ``until_layer``: stop after the layers below it (a cheap look-ahead pass; no logits)."""
    t0 = time.perf_counter()
    hooks = list(hooks)
    device = adapter.embed_tokens.weight.device
    lay = make_layout(segments, adapter.num_layers, max_context or adapter.max_context, device)
    for hook in hooks:
        hook.start(lay)
    at = _hook_layers(hooks, lay.num_layers)
    positions = torch.arange(lay.n_total, device=device)
    everything = any(h.needs_every_token and layers for h, layers in zip(hooks, at))
    active = positions.clone() if everything else positions[lay.must | lay.forced]
    run = _Running(active, adapter.embed(lay.token_ids[active]))
    rope = adapter.rope(positions, run.hidden)
    saved = {i: ([], []) for i, s in enumerate(segments) if s.save}
    out_keys: list[torch.Tensor] = []
    out_values: list[torch.Tensor] = []
    last_layer = lay.num_layers if until_layer is None else max(1, min(lay.num_layers, until_layer))
    for layer in range(last_layer):
        here = [h for h, layers in zip(hooks, at) if layer in layers]
        keys, values = _layer(adapter, lay, run, here, layer, rope, saved)
        out_keys.append(keys)
        out_values.append(values)
    logits = _last_logits(adapter, lay, run) if last_layer == lay.num_layers else None
    result = _result(lay, run, logits, out_keys, out_values, _saved_kv(lay, saved, fingerprint))
    for hook in hooks:
        hook.finish(result)
    if result.deferred:  # the statistics come when the result is completed
        result.deferred.append(lambda: _check_statistics(lay, result))
    else:
        _check_statistics(lay, result)
    result.seconds = time.perf_counter() - t0
    return result


def _hook_layers(hooks: Sequence[LayerHook], num_layers: int) -> list[set[int]]:
    """The model layers each hook is called at."""
    every = set(range(num_layers))
    return [every if h.layers is None else every & {int(x) for x in h.layers} for h in hooks]


def _layer(adapter: ArchAdapter, lay: Layout, run: _Running, hooks: Sequence[LayerHook], layer: int,
           rope: tuple[torch.Tensor, torch.Tensor],
           saved: dict[int, tuple[list, list]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer: drop stopped tokens, assemble K/V, let selectors narrow the running
    set, attend, MLP, let observers look. Returns K (RoPE applied) and V, ``[H_kv, N, D]``."""
    if layer >= lay.earliest_stop:  # known on the host: no wait on the device at most layers
        alive = lay.stop_at[run.active] > layer
        if not bool(alive.all()):
            run.keep(alive)
    q, k, v = adapter.qkv(layer, run.hidden)  # q [H, n, D]; k, v [H_kv, n, D]
    keys, values = _cached_kv(adapter, lay, layer)  # [H_kv, N, D], before RoPE
    keep = _select(hooks, LayerView(layer, lay, run.active, keys, values, k=k, v=v)) if hooks else None
    if lay.shift is not None:
        _shift_drift(lay, run.active, keys, values, k, v)
    keys[:, run.active] = k
    values[:, run.active] = v
    for i, (seg_keys, seg_values) in saved.items():
        lo, hi = lay.bounds[i]
        seg_keys.append(keys[:, lo:hi].clone())
        seg_values.append(values[:, lo:hi])
    if keep is not None and not bool(keep.all()):
        # Fresh K/V of every running token were kept; from here on only the selected run.
        q = q[:, keep]
        run.keep(keep)

    cos, sin = rope
    keys = adapter.rotate(keys, cos, sin)
    q = adapter.rotate(q, cos[run.active], sin[run.active])
    run.plan = run.plan or _AttentionPlan(run.active, lay.n_total)
    gqa = adapter.num_heads != adapter.num_kv_heads
    attn = run.plan.attend(q, keys, values, adapter.scaling, gqa)
    run.hidden = adapter.mlp_residual(layer, run.hidden + adapter.attn_output(layer, attn))
    run.context_work = run.context_work + lay.context[run.active].sum()  # read once, at the end
    run.work += int(run.active.numel())
    if hooks:
        _observe(hooks, LayerView(layer, lay, run.active, keys, values, q=q, plan=run.plan,
                                  scaling=adapter.scaling, gqa=gqa))
    return keys, values


# Device types where caches stored in another dtype are joined first and converted after, in
# one more pass over the prompt's K/V: on a GPU that pass is cheap and launching one copy per
# segment is not; on the CPU the pass costs more than the copies, which convert as they go.
JOIN_THEN_CONVERT = ("cuda",)


def _cached_kv(adapter: ArchAdapter, lay: Layout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's pre-RoPE K and V for the whole prompt, cached rows filled in: ``[H_kv, N, D]``."""
    weight = adapter.embed_tokens.weight
    shape = (adapter.num_kv_heads, lay.n_total, adapter.head_dim)
    pairs = [None if seg.cached is None else seg.cached.layer(layer) for seg in lay.segments]
    kinds = [None if p is None else _kind(p, weight.device) for p in pairs]
    joined = _joined_kind(kinds, lay.bounds, weight)
    if joined is not None:
        # One concatenation a tensor for the caches in the dtype most rows are stored in,
        # instead of a copy a segment: on a GPU a 32k prompt of 62 chunks otherwise launches
        # 124 copies a layer, and launching them is what the host spends its time on.
        # Uncached segments' rows are left unset, as below; other caches are copied in after.
        keys, values = (torch.cat([p[side] if kind == joined else
                                   torch.empty(shape[0], hi - lo, shape[2], dtype=joined, device=weight.device)
                                   for p, kind, (lo, hi) in zip(pairs, kinds, lay.bounds)], dim=1).to(weight.dtype)
                        for side in (0, 1))
        pairs = [None if kind == joined else p for p, kind in zip(pairs, kinds)]
    else:
        keys = torch.empty(shape, device=weight.device, dtype=weight.dtype)
        values = torch.empty_like(keys)
    for pair, (lo, hi) in zip(pairs, lay.bounds):
        if pair is not None:
            keys[:, lo:hi] = pair[0]  # converted to the compute dtype and device in the copy
            values[:, lo:hi] = pair[1]
    return keys, values


def _kind(pair: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> torch.dtype | None:
    """The dtype of a cached K/V pair that could be joined on ``device`` (None: it cannot)."""
    keys, values = pair
    return keys.dtype if keys.dtype == values.dtype and keys.device == values.device == device else None


def _joined_kind(kinds: list, bounds: list[tuple[int, int]], weight: torch.Tensor) -> torch.dtype | None:
    """The dtype of the caches :func:`_cached_kv` joins by concatenation (the one most cached
    rows are in), or None to copy every cache into place: when fewer than two would be
    joined, or joining would need a conversion pass where ``JOIN_THEN_CONVERT`` allows none."""
    rows: dict[torch.dtype, int] = {}
    count: dict[torch.dtype, int] = {}
    for kind, (lo, hi) in zip(kinds, bounds):
        if kind is not None:
            rows[kind] = rows.get(kind, 0) + hi - lo
            count[kind] = count.get(kind, 0) + 1
    if not rows:
        return None
    dtype = max(rows, key=lambda d: (rows[d], d == weight.dtype))
    if count[dtype] < 2 or (dtype != weight.dtype and weight.device.type not in JOIN_THEN_CONVERT):
        return None
    return dtype


def _shift_drift(lay: Layout, active: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """Move the cached rows of every segment that shifts by its share of the mean drift
    (fresh minus cached) of its tokens running this layer. A cache made after another
    context is off from full's by a change much of which its tokens share; the tokens
    recomputed measure it for the rest (those from the segment's ``drift_from``). Running
    rows are overwritten with fresh K/V next, so their own shift does not matter; a segment
    with no token measuring it stays as stored."""
    seg = lay.segment_of[active]
    use = (lay.shift[seg] > 0) & lay.samples_drift[active]
    if not bool(use.any()):
        return
    seg, pos = seg[use], active[use]
    if lay.shift_estimator == "median":
        _shift_by_median(lay, seg, pos, keys, values, k[:, use], v[:, use])
        return
    if lay.shift_estimator in ("shrunk", "pooled"):
        _shift_by_agreement(lay, seg, pos, keys, values, k[:, use], v[:, use])
        return
    count = torch.bincount(seg, minlength=lay.shift.numel()).clamp_min(1)
    scale = (lay.shift / count).to(keys.dtype)[None, :, None]  # [1, S, 1]
    owner = lay.segment_of[lay.shifted]
    for cached, fresh in ((keys, k[:, use]), (values, v[:, use])):
        drift = torch.zeros(cached.shape[0], lay.shift.numel(), cached.shape[2], dtype=cached.dtype,
                            device=cached.device).index_add_(1, seg, fresh - cached[:, pos])
        cached[:, lay.shifted] += (drift * scale)[:, owner]


def _shift_by_median(lay: Layout, seg: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """:func:`_shift_drift` with each segment's median change (per KV head and dimension) in
    place of the mean: ``seg`` and ``pos`` are the measuring tokens' segments and positions,
    ``k``/``v`` their fresh K/V. A median of an even count is the lower middle value."""
    for s in torch.unique(seg).tolist():
        mine = seg == s
        lo, hi = lay.bounds[s]
        share = lay.segments[s].drift_shift
        for cached, fresh in ((keys, k[:, mine]), (values, v[:, mine])):
            change = (fresh - cached[:, pos[mine]]).median(dim=1).values  # [H_kv, D]
            cached[:, lo:hi] += (share * change)[:, None]


def _shift_by_agreement(lay: Layout, seg: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """:func:`_shift_drift` with each segment's mean change shrunk by how far its measuring
    tokens agree, per KV head and dimension (arguments as :func:`_shift_by_median`). With
    ``m`` a segment's mean change over its ``n`` tokens and ``s2`` the tokens' variance
    about their own segment's mean, pooled over the prompt's segments (0 where no segment
    has two tokens), the noise in ``m`` is ``s2 / n``. ``shrunk`` moves by
    ``m * m^2 / (m^2 + s2 / n)``; ``pooled`` moves by ``g + f * (m - g)``, ``g`` the mean
    change of every measuring token of the prompt and ``f = t2 / (t2 + s2 / n)``, where
    ``t2`` is how far the measured segments' means spread about ``g`` beyond their noise
    (at least 0). A ratio of 0 to 0 counts as 1: nothing to shrink by."""
    count = torch.bincount(seg, minlength=lay.shift.numel())
    measured = count > 0
    n = count.clamp_min(1).float()[None, :, None]  # [1, S, 1]
    share = lay.shift.float()[None, :, None] * measured.float()[None, :, None]
    owner = lay.segment_of[lay.shifted]
    # read once for keys and values: each is a wait for the device
    dof, samples, segments = (float(x) for x in ((count - 1).clamp_min(0).sum(), count.sum(), measured.sum()))
    for cached, fresh in ((keys, k), (values, v)):
        change = (fresh - cached[:, pos]).float()  # [H_kv, n_samples, D]
        total = change.new_zeros(change.shape[0], count.numel(), change.shape[2]).index_add_(1, seg, change)
        mean = total / n
        spread = (change - mean[:, seg]).square()
        s2 = spread.sum(dim=1, keepdim=True) / dof if dof else torch.zeros_like(mean[:, :1])
        noise = s2 / n  # [H_kv, S, D]
        if lay.shift_estimator == "shrunk":
            move = mean * _ratio(mean.square(), mean.square() + noise)
        else:
            g = total.sum(dim=1, keepdim=True) / samples
            m = measured.float()[None, :, None]
            t2 = ((((mean - g).square() - noise) * m).sum(dim=1, keepdim=True) / segments).clamp_min(0)
            move = g + _ratio(t2, t2 + noise) * (mean - g)
        cached[:, lay.shifted] += (move * share).to(cached.dtype)[:, owner]


def _ratio(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
    """``top / bottom`` with 0 / 0 as 1."""
    return torch.where(bottom > 0, top / bottom.clamp_min(torch.finfo(bottom.dtype).tiny), torch.ones_like(top))


def _select(hooks: Sequence[LayerHook], view: LayerView) -> torch.Tensor | None:
    """The running tokens every selector keeps (None: no selector spoke); they count as recomputed."""
    keep = None
    for hook in hooks:
        mask = hook.select(view)
        if mask is None:
            continue
        assert mask.dtype == torch.bool and mask.shape == view.active.shape, (
            f"a selector returns a bool mask over the {view.active.numel()} running tokens, got "
            f"{mask.dtype} {tuple(mask.shape)}")
        keep = mask if keep is None else keep & mask
    if keep is not None:
        view.layout.recomputed[view.active[keep]] = True
    return keep


def _observe(hooks: Sequence[LayerHook], view: LayerView) -> None:
    """Call the observers; apply the stop layers they return to cached segments."""
    lay = view.layout
    for hook in hooks:
        for i, stop in (hook.observe(view) or {}).items():
            if lay.segments[i].cached is not None:
                lo, hi = lay.bounds[i]
                stop = max(int(stop), view.layer + 1)
                lay.stop_at[lo:hi] = lay.stop_at[lo:hi].clamp(max=stop)
                lay.earliest_stop = min(lay.earliest_stop, stop)


def _last_logits(adapter: ArchAdapter, lay: Layout, run: _Running) -> torch.Tensor:
    last = (run.active == lay.n_total - 1).nonzero()
    assert last.numel() == 1, "the last token must be computed through every layer"
    return adapter.logits(run.hidden[last[0]])[0]


def _saved_kv(lay: Layout, saved: dict[int, tuple[list, list]], fingerprint: str) -> dict[int, ChunkKV]:
    """The ChunkKV of each segment marked ``save`` (statistics are a hook's to attach)."""
    out = {}
    for i, (seg_keys, seg_values) in saved.items():
        before = lay.segments[:i]
        out[i] = ChunkKV(tuple(int(t) for t in lay.segments[i].token_ids), torch.stack(seg_keys),
                         torch.stack(seg_values), fingerprint, tuple(s.key for s in before), None,
                         prefix_tokens=tuple(len(s.token_ids) for s in before))
    return out


def _result(lay: Layout, run: _Running, logits, keys, values, saved) -> BlendResult:
    context_tokens = int(lay.context.sum())
    recomputed = lay.recomputed & (lay.stop_at > 0)
    return BlendResult(lay.token_ids, logits, keys, values, saved,
                       recomputed_tokens=int((recomputed & lay.context).sum()),
                       recomputed=recomputed.cpu(), token_layers=run.work, context_tokens=context_tokens,
                       recompute_work=(int(run.context_work) / (context_tokens * lay.num_layers)
                                       if context_tokens else 0.0))


def _check_statistics(lay: Layout, result: BlendResult) -> None:
    missing = [i for i, s in enumerate(lay.segments)
               if s.collect_stats and i in result.saved and result.saved[i].stats is None]
    if missing:
        raise PromptError(f"segments {missing} ask for attention statistics (collect_stats) but no hook "
                          "gathered them: pass cachecraft.selection.ChunkStatistics in hooks")


def sampled_layers(num_layers: int, step: int) -> tuple[int, ...]:
    """Every ``step``-th layer, ending each run of ``step`` (``step - 1``, ``2 * step - 1``,
    ...; at least one layer): where statistics are gathered when not at every layer.
    Layer 0, whose attention differs most from the rest, is left out unless ``step`` is 1."""
    assert num_layers >= 1 and step >= 1, f"need num_layers >= 1 and step >= 1, got {num_layers}, {step}"
    return tuple(range(min(step, num_layers) - 1, num_layers, step))
