"""CacheBlend's loading controller and the tier a new variant is worth (pure decisions).

Loading a chunk's KV and recomputing some of its tokens run as a pipeline (layer l
recomputes while layer l+1 loads), so loading is free as long as recompute takes at
least as long:

- ``T_recompute(r) = r * T_prefill`` with ``T_prefill = tokens * prefill_s_per_token``;
- ``T_load = tokens * kv_bytes_per_token / bandwidth``.

Both scale with the token count (and with the layer count), so the recompute fraction
that exactly hides loading is ``r_load = kv_bytes_per_token / (bandwidth *
prefill_s_per_token)``, capped at 1. Below it, compute sits idle waiting for bytes, so
CacheBlend recomputes ``max(r, r_load)`` for free, and stores a chunk in the cheapest
(slowest) tier whose load time the planned recompute still hides. The question's own
tokens, always computed, would hide a little more; they are left out (conservative).

A blended prefill costs more than its recompute, though: every layer still runs the
question and the recomputed tokens' attention over the whole context, and the work
around each layer. On a GPU that part alone can take as long as the copies from pinned
memory (an H100 with Llama-3.1-8B's shape at 32k tokens: 0.24 s to reuse caches already
on the GPU, 0.1-0.6 s more to copy them), so recomputing ``r_load`` there was not free: it
made the request slower than loading at the planned fraction. The controller therefore
raises the recompute only to ``r_hide = (kv_bytes_per_token / bandwidth -
blend_s_per_token) / prefill_s_per_token`` (:meth:`CostModel.r_hide`), where
``blend_s_per_token`` is what blended prefills were timed to cost per context token
beyond their recompute (:meth:`CostModel.observe_blend`; 0 until one is timed). The
pipeline times it on a GPU only, whose copies run beside the compute on an engine of
their own; on a CPU the reading thread takes cores from the compute, and ``r_hide``
stays ``r_load``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

# Prefill seconds per token per layer assumed before anything was measured: the
# prototype's ~30 s for a 6.2k-token prefill of SmolLM2-135M's 30 layers on the
# development CPU. The pipeline measures the real rate at start-up (and moves it with
# every full prefill); the store uses this only for entries recorded without a cost.
DEFAULT_PREFILL_S_PER_TOKEN_LAYER = 1.6e-4

# Weight of a new full prefill's timing in the running prefill cost (and of a blended
# prefill's in the running blending cost).
OBSERVED_PREFILL_WEIGHT = 0.3

# A blended prefill that took less than this many times the time its loads were expected
# to take may have waited for them: its time says how fast the bytes came, not what the
# compute costs, so it does not move the blending cost.
LOAD_BOUND_MARGIN = 1.5

# Bytes/s to get a chunk-cache back as compute tensors, from `cachecraft bench store`
# on the development CPU machine (cpu ~3 GB/s, disk ~0.7-1 GB/s); the GPU figure is a
# placeholder for HBM. Starting points only: the pipeline replaces each with what it
# measures while loading (see CostModel.observe_load).
DEFAULT_BANDWIDTHS: dict[str, float] = {"gpu": 100e9, "cpu": 3e9, "disk": 0.7e9}
# Assumed for a tier with no entry above (the shared Redis tier) until a load is timed.
UNKNOWN_TIER_BANDWIDTH = 1e9

# Weight of a new load measurement in a tier's running bandwidth; until a full-size
# load (below) has been timed from a tier, the weight is 1: the measurement replaces
# the assumed value.
OBSERVED_WEIGHT = 0.3

# Loads smaller than this are not timed into the bandwidth (timer noise dominates).
MIN_OBSERVED_BYTES = 256 * 1024

# A load of at least this many bytes counts in full; a smaller one in proportion to its
# size. A short chunk's read is mostly per-layer overhead, so its rate says little about
# the large reads the controller must hide. (In `bench scaling --tier disk`, with the
# warm-up request's two 32-token chunks counted in full, the first question recomputed
# 3.1% of its chunk tokens to hide loading, the later ones 1.5-1.7%.)
FULL_WEIGHT_BYTES = 16 * 1024 * 1024

# Minimum value, in seconds of prefill saved per GB stored over the variant's expected
# reuses, for a new variant to earn each tier. A SmolLM2-135M passage (~600 tokens,
# ~14 MB in float16, ~3 s of CPU prefill) used once is worth ~220 s/GB: disk; about 5
# reuses earn CPU memory, about 50 the GPU.
DEFAULT_VALUE_THRESHOLDS: dict[str, float] = {"gpu": 10_000.0, "cpu": 1_000.0, "disk": 50.0}


def load_hiding_fraction(prefill_s_per_token: float, kv_bytes_per_token: float, bandwidth: float,
                         blend_s_per_token: float = 0.0) -> float:
    """The recompute fraction whose time, with ``blend_s_per_token`` of blending cost
    beside it, equals the load time, within [0, 1]: ``r_load`` with no blending cost."""
    assert prefill_s_per_token > 0, f"prefill_s_per_token must be > 0, got {prefill_s_per_token}"
    assert bandwidth > 0, f"bandwidth must be > 0, got {bandwidth}"
    assert kv_bytes_per_token >= 0, f"kv_bytes_per_token must be >= 0, got {kv_bytes_per_token}"
    assert blend_s_per_token >= 0, f"blend_s_per_token must be >= 0, got {blend_s_per_token}"
    return min(1.0, max(0.0, kv_bytes_per_token / bandwidth - blend_s_per_token) / prefill_s_per_token)


def raise_fractions(plan_fractions: Sequence[float], r_load: float) -> list[float]:
    """Each fraction raised to at least ``r_load`` (recompute that hides loading is free), never above 1."""
    floor = min(max(r_load, 0.0), 1.0)
    return [min(1.0, max(f, floor)) for f in plan_fractions]


def cheapest_tier(recompute_fraction: float, prefill_s_per_token: float, kv_bytes_per_token: float,
                  bandwidths: Mapping[str, float]) -> str | None:
    """The slowest tier whose load time ``recompute_fraction`` of recompute hides; None if none does."""
    for tier, bandwidth in sorted(bandwidths.items(), key=lambda item: item[1]):
        if load_hiding_fraction(prefill_s_per_token, kv_bytes_per_token, bandwidth) <= recompute_fraction:
            return tier
    return None


def tier_for_new_variant(expected_reuse: float, cost_s: float, nbytes: int,
                         thresholds: Mapping[str, float] = DEFAULT_VALUE_THRESHOLDS,
                         bandwidths: Mapping[str, float] | None = None) -> str | None:
    """The tier a new variant is worth, or None (not worth storing).

    Value per byte = ``expected_reuse * cost_s / nbytes`` (prefill seconds saved per byte
    over its reuses, as in PGDSF's frequency x cost / size), in seconds per GB; the most
    demanding tier whose threshold it reaches wins. With ``bandwidths``, a tier that
    loads the variant no faster than ``cost_s`` recomputes it is skipped."""
    assert nbytes > 0, f"nbytes must be > 0, got {nbytes}"
    value_per_gb = expected_reuse * cost_s / (nbytes / 1e9)
    for tier, threshold in sorted(thresholds.items(), key=lambda item: -item[1]):
        if bandwidths is not None and nbytes / bandwidths.get(tier, float("inf")) >= cost_s:
            continue
        if value_per_gb >= threshold:
            return tier
    return None


@dataclass(frozen=True)
class CostModel:
    """What loading decisions need: prefill seconds and KV bytes per token per layer,
    the layer count and each tier's bandwidth (bytes/s)."""

    prefill_s_per_token_layer: float
    kv_bytes_per_token_layer: int
    num_layers: int
    bandwidths: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTHS))
    timed: frozenset[str] = frozenset()  # tiers whose bandwidth a full-size load has set
    # A blended prefill's seconds per context token and layer beyond its recompute (None:
    # none timed yet, counted as 0)
    blend_s_per_token_layer: float | None = None

    def __post_init__(self) -> None:
        assert self.prefill_s_per_token_layer > 0, "prefill_s_per_token_layer must be > 0"
        assert self.num_layers >= 1, "num_layers must be >= 1"
        assert self.blend_s_per_token_layer is None or self.blend_s_per_token_layer >= 0, \
            "blend_s_per_token_layer must be >= 0"

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_s_per_token_layer * self.num_layers

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * self.num_layers

    @property
    def blend_s_per_token(self) -> float | None:
        """The blending cost per context token, all layers (None: none timed yet)."""
        layer = self.blend_s_per_token_layer
        return None if layer is None else layer * self.num_layers

    def r_load(self, tier: str) -> float:
        """The recompute fraction that takes as long as loading from ``tier`` (1: loading
        takes at least as long as a full prefill of the chunk)."""
        return load_hiding_fraction(self.prefill_s_per_token, self.kv_bytes_per_token,
                                    self.bandwidths.get(tier, UNKNOWN_TIER_BANDWIDTH))

    def r_hide(self, tier: str) -> float:
        """The recompute fraction that hides loading from ``tier`` once the blended
        prefill's own cost (the timed blending cost) hides part of it: the controller's
        floor for a variant loaded from there."""
        return load_hiding_fraction(self.prefill_s_per_token, self.kv_bytes_per_token,
                                    self.bandwidths.get(tier, UNKNOWN_TIER_BANDWIDTH),
                                    self.blend_s_per_token or 0.0)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> "CostModel":
        """This model with ``tier``'s bandwidth moved towards ``nbytes / seconds``, one
        measured load; unchanged for loads under :data:`MIN_OBSERVED_BYTES` or without a
        positive time.

        The first full-size load (:data:`FULL_WEIGHT_BYTES`) timed from a tier replaces the
        assumed value, later ones move it by :data:`OBSERVED_WEIGHT`; smaller loads count
        in proportion to their size. Estimates are averaged as seconds per byte, the
        quantity a load time is predicted from."""
        if nbytes < MIN_OBSERVED_BYTES or seconds <= 0:
            return self
        share = min(1.0, nbytes / FULL_WEIGHT_BYTES)
        weight = (OBSERVED_WEIGHT if tier in self.timed else 1.0) * share
        prior = self.bandwidths.get(tier, UNKNOWN_TIER_BANDWIDTH)
        per_byte = (1 - weight) / prior + weight * seconds / nbytes
        timed = self.timed | {tier} if share == 1.0 else self.timed
        return dataclasses.replace(self, bandwidths={**self.bandwidths, tier: 1.0 / per_byte}, timed=timed)

    def load_s(self, tier: str, tokens: int) -> float:
        """Seconds the chunk-caches of ``tokens`` tokens are expected to take from ``tier``."""
        return tokens * self.kv_bytes_per_token / self.bandwidths.get(tier, UNKNOWN_TIER_BANDWIDTH)

    def prefill_s(self, tokens: int) -> float:
        """Seconds a full prefill of ``tokens`` tokens is expected to take."""
        return self.prefill_s_per_token * tokens

    def observe_prefill(self, tokens: int, seconds: float) -> "CostModel":
        """This model with its prefill cost moved towards one timed full prefill of
        ``tokens`` tokens (by :data:`OBSERVED_PREFILL_WEIGHT`); unchanged without a
        positive count and time."""
        if tokens <= 0 or seconds <= 0:
            return self
        measured = seconds / tokens / self.num_layers
        blended = (1 - OBSERVED_PREFILL_WEIGHT) * self.prefill_s_per_token_layer + OBSERVED_PREFILL_WEIGHT * measured
        return dataclasses.replace(self, prefill_s_per_token_layer=blended)

    def observe_blend(self, tokens: int, token_layers: float, seconds: float, load_s: float) -> "CostModel":
        """This model with its blending cost moved towards one timed blended prefill of
        ``tokens`` tokens that ran ``token_layers`` tokens through layers (its recompute and
        the question) in ``seconds``, while loads expected to take ``load_s`` streamed in.

        The measurement is the time beyond that compute at the prefill rate, per token and
        layer. The first replaces the starting 0, later ones move it by
        :data:`OBSERVED_PREFILL_WEIGHT`. Unchanged without a positive count and time, or
        when ``seconds`` is under :data:`LOAD_BOUND_MARGIN` times ``load_s``: such a prefill
        may have waited for its bytes."""
        if tokens <= 0 or seconds <= 0 or seconds < LOAD_BOUND_MARGIN * load_s:
            return self
        measured = max(0.0, seconds - token_layers * self.prefill_s_per_token_layer) / (tokens * self.num_layers)
        if self.blend_s_per_token_layer is not None:
            measured = (1 - OBSERVED_PREFILL_WEIGHT) * self.blend_s_per_token_layer + OBSERVED_PREFILL_WEIGHT * measured
        return dataclasses.replace(self, blend_s_per_token_layer=measured)

    def cheapest_tier(self, recompute_fraction: float) -> str | None:
        """The slowest tier that ``recompute_fraction`` hides (see :func:`cheapest_tier`)."""
        return cheapest_tier(recompute_fraction, self.prefill_s_per_token, self.kv_bytes_per_token, self.bandwidths)

    @classmethod
    def from_history(cls, rows: Iterable[tuple[int, float]], num_layers: int, kv_bytes_per_token_layer: int,
                     bandwidths: Mapping[str, float] | None = None) -> "CostModel | None":
        """From recorded full prefills ``(tokens, seconds)``: total seconds / total tokens
        / layers (rows without a positive count or time are skipped); None without any."""
        usable = [(t, s) for t, s in rows if t and s and t > 0 and s > 0]
        if not usable:
            return None
        per_token = sum(s for _, s in usable) / sum(t for t, _ in usable)
        return cls(per_token / num_layers, kv_bytes_per_token_layer, num_layers,
                   dict(bandwidths if bandwidths is not None else DEFAULT_BANDWIDTHS))
