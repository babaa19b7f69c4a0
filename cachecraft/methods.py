"""The prefill methods compared throughout: what each one reuses and recomputes.

- ``full``: prefill everything.
- ``prefix``: exact prefix reuse of earlier requests' token blocks (vLLM-style).
- ``reuse``: chunk-caches made independently, concatenated; only the question computed.
- ``cacheblend``: like ``reuse`` plus CacheBlend's deviation check at the check layer,
  recomputing a fixed ratio of the chunk tokens.
- ``inter``: like ``reuse`` plus the tokens with the highest stored inter-attention.
- ``firstk``: like ``reuse`` plus the first tokens of every chunk (EPIC-like).
- ``qguided``: like ``reuse`` plus the chunk tokens the question attends to most at the
  check layer, found by running only the question over the cached KV first.
- ``cachecraft``: the policy: per chunk the variant with the lowest CFO and a token
  count from it (an exact prefix match recomputes nothing), the tokens themselves
  chosen where the question looks; ``cachecraft@A`` sets alpha to A.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cachecraft.engine import Segment
from cachecraft.selection import DeviationCheck, count_for, first_tokens, question_guided, top_inter_attention
from cachecraft.kv import ChunkKV, chunk_key
from cachecraft.prefix_cache import PrefixCache, PrefixKV
from cachecraft.policy.planner import PolicyParams, RecomputePlan, VariantInfo, plan_request
from cachecraft.prompt import PromptPieces

METHODS = ("full", "prefix", "reuse", "cacheblend", "inter", "firstk", "qguided", "cachecraft")
RATIO_METHODS = ("cacheblend", "inter", "firstk", "qguided", "cachecraft")


class UnknownMethod(ValueError):
    """A method name that cachecraft does not know."""


@dataclass(frozen=True)
class MethodSpec:
    """A method and its knobs (``ratio``: recompute fraction where it applies)."""

    name: str
    ratio: float = 0.15
    check_layer: int | None = None

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise UnknownMethod(f"unknown method {self.name!r}; choose from {', '.join(METHODS)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be within [0, 1], got {self.ratio}")

    @property
    def label(self) -> str:
        return f"{self.name}@{self.ratio:g}" if self.name in RATIO_METHODS else self.name

    @property
    def layer(self) -> int:
        """The check layer: CacheBlend's default is 1; the question-guided look works best mid-model."""
        if self.check_layer is not None:
            return self.check_layer
        return 8 if self.name in ("qguided", "cachecraft") else 1

    @property
    def uses_cache(self) -> bool:
        """Whether the method reuses chunk-caches."""
        return self.name not in ("full", "prefix")


def parse_methods(text: str, ratio: float, alpha: float | None = None) -> list[MethodSpec]:
    """``"full,reuse,cacheblend@0.3"`` -> specs; a bare name takes ``ratio`` (bare
    ``cachecraft`` takes ``alpha`` when given)."""
    specs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, value = part.partition("@")
        try:
            default = alpha if name == "cachecraft" and alpha is not None else ratio
            specs.append(MethodSpec(name, float(value) if value else default))
        except ValueError as exc:
            raise UnknownMethod(str(exc)) from None
    if not specs:
        raise UnknownMethod(f"no method given; choose from {', '.join(METHODS)}")
    return specs


def segment_keys(fingerprint: str, pieces: PromptPieces) -> tuple[str, list[str]]:
    """Cache keys of the prefix and of each chunk of a prompt."""
    return chunk_key(fingerprint, pieces.prefix), [chunk_key(fingerprint, c) for c in pieces.chunks]


def build_segments(spec: MethodSpec, pieces: PromptPieces, prefix_kv: ChunkKV | None,
                   chunk_kvs: Sequence[ChunkKV | None], adapter=None,
                   policy: PolicyParams | None = None,
                   prefix_cache: PrefixCache | None = None) -> tuple[list[Segment], DeviationCheck | None]:
    """Segments and the optional deviation check that run ``spec`` on ``pieces``
    (``qguided`` and ``cachecraft`` need the ``adapter`` to look ahead; ``policy``
    overrides the policy parameters ``cachecraft`` derives from ``spec``; ``prefix``
    looks its blocks up in ``prefix_cache``)."""
    if spec.name == "prefix":
        match = prefix_cache.match(pieces.token_ids, limit=pieces.num_tokens - 1) if prefix_cache else None
        return prefix_segments(pieces, match), None
    use = spec.uses_cache
    segments = [Segment(pieces.prefix, "prefix", cached=prefix_kv if use else None)]
    for ids, kv in zip(pieces.chunks, chunk_kvs):
        kv = kv if use else None
        segments.append(Segment(ids, "chunk", cached=kv, recompute=static_recompute(spec, len(ids), kv)))
    segments.append(Segment(pieces.question, "question"))
    if spec.name == "cachecraft":
        assert adapter is not None, "cachecraft needs the model adapter"
        plan_with_policy(adapter, segments, chunk_kvs,
                         policy or PolicyParams(alpha=spec.ratio, check_layer=spec.layer))
    if spec.name == "qguided":
        assert adapter is not None, "qguided needs the model adapter"
        select_question_guided(adapter, segments, spec.layer, ratio=spec.ratio)
    check = DeviationCheck(spec.layer, spec.ratio) if spec.name == "cacheblend" else None
    return segments, check


def static_recompute(spec: MethodSpec, num_tokens: int, kv: ChunkKV | None) -> torch.Tensor | None:
    """The tokens of a cached chunk that ``inter`` and ``firstk`` recompute, chosen before
    the prefill; None for the other methods and for a chunk with nothing cached."""
    if kv is None or spec.name not in ("inter", "firstk"):
        return None
    count = count_for(spec.ratio, num_tokens)
    if spec.name == "firstk":
        return first_tokens(num_tokens, count)
    if kv.stats is None:
        raise ValueError(f"method 'inter' needs attention statistics, and the cache {kv.variant} has none")
    return top_inter_attention(kv.stats, count)


def variant_info(kv: ChunkKV) -> VariantInfo:
    """Describe a stored variant for the planner (its system prefix left out)."""
    prefix, sizes = list(kv.prefix), list(kv.prefix_tokens) or [0] * len(kv.prefix)
    inter = kv.stats.inter if kv.stats is not None else torch.zeros(kv.num_layers, len(prefix))
    intra = kv.stats.intra if kv.stats is not None else torch.full((kv.num_layers,), float(kv.num_tokens))
    if prefix:  # the first prefix segment is the system prefix, shared by every request
        prefix, sizes, inter = prefix[1:], sizes[1:], inter[:, 1:]
    return VariantInfo(kv.variant, tuple(prefix), inter, intra, kv.num_tokens, tuple(sizes))


def plan_with_policy(adapter, segments: list[Segment], chunk_kvs: Sequence[ChunkKV | None],
                     params: PolicyParams) -> RecomputePlan:
    """Plan ``segments`` (prefix, chunks, question) with the Cache-Craft policy and write
    the chosen tokens into the chunk segments; returns the plan for reporting."""
    chunk_segments = segments[1:-1]
    keys = [kv.chunk if kv is not None else f"uncached-{i}" for i, kv in enumerate(chunk_kvs)]
    variants = {kv.chunk: [variant_info(kv)] for kv in chunk_kvs if kv is not None}
    plan = plan_request(keys, [len(s.token_ids) for s in chunk_segments], variants, params)
    place_plan_tokens(adapter, segments, plan, params.check_layer)
    return plan


def place_plan_tokens(adapter, segments: list[Segment], plan: RecomputePlan, check_layer: int) -> None:
    """Give the plan's token counts to the chunks where the question looks: chunks the
    plan leaves alone are not candidates; the total is placed over the rest."""
    chunk_segments = segments[1:-1]
    for seg, chunk_plan in zip(chunk_segments, plan.chunks):
        seg.fixable = seg.cached is not None and chunk_plan.count > 0
    total = sum(p.count for p, seg in zip(plan.chunks, chunk_segments) if seg.fixable)
    if total:
        select_question_guided(adapter, segments, check_layer, total=total)


def select_question_guided(adapter, segments: list[Segment], check_layer: int, ratio: float | None = None,
                           total: int | None = None) -> None:
    """Set each fixable cached chunk's recompute tokens from the question's look-ahead."""
    layer = min(check_layer, adapter.num_layers - 1)
    for seg, picked in zip(segments, question_guided(adapter, segments, layer, ratio=ratio, total=total)):
        if picked is not None:
            seg.recompute = picked


def prefix_segments(pieces: PromptPieces, match: PrefixKV | None) -> list[Segment]:
    """Segments for a prompt whose first ``match.num_tokens`` tokens have exact KV:
    each piece is split into its cached head and computed tail, keeping its role."""
    matched = match.num_tokens if match is not None else 0
    parts = [("prefix", pieces.prefix)] + [("chunk", c) for c in pieces.chunks] + [("question", pieces.question)]
    segments, offset = [], 0
    for role, ids in parts:
        cut = min(max(matched - offset, 0), len(ids))
        if cut:
            segments.append(Segment(ids[:cut], role, cached=match.slice(offset, offset + cut)))
        if cut < len(ids):
            segments.append(Segment(ids[cut:], role))
        offset += len(ids)
    return segments


def remember_prefix(cache: PrefixCache, adapter, result) -> int:
    """Add a prefilled prompt's blocks to the prefix cache (keys un-rotated)."""
    n = result.num_tokens
    cos, sin = adapter.rope(torch.arange(n, device=result.keys[0].device), result.keys[0])
    keys = [adapter.unrotate(k, cos, sin) for k in result.keys]
    return cache.insert(result.token_ids.tolist(), keys, result.values)
