"""The baselines: ``full``, ``prefix``, ``reuse`` and ``cacheblend``."""

from __future__ import annotations


import torch

from cachecraft.engine import BlendResult, Segment
from cachecraft.methods.base import LoadPlan, Method, PrefillHooks, RequestContext, plain_segments
from cachecraft.prefix_cache import PrefixCache, PrefixKV
from cachecraft.prompt import PromptPieces
from cachecraft.selection import DeviationCheck


class Full(Method):
    """Prefill everything; nothing gathered or kept."""

    name = "full"
    summary = "prefill everything"
    uses_cache = False

    def segments(self, request, prefix_kv, kvs, past_cap=False) -> list[Segment]:
        return plain_segments(request, None, [None] * len(request.keys), keep=False)


class KeptFull(Full):
    """A full prefill that keeps each chunk it computes as a variant made after the exact
    chunks before it (at the cap, in place of one used least: see the pipeline's
    ``_save``): what a looping answer is made again with, so that the same chunks asked in
    the same order later are reused exactly, nothing recomputed, and answer as this
    prefill did. Not a method to name: it is ``full`` in every report."""

    def segments(self, request, prefix_kv, kvs, past_cap=False) -> list[Segment]:
        return plain_segments(request, None, [None] * len(request.keys), keep=True, past_cap=True)


class Prefix(Method):
    """Exact prefix reuse of earlier requests' token blocks, as vLLM's prefix caching."""

    name = "prefix"
    summary = "exact prefix reuse of earlier requests (vLLM-style)"
    uses_cache = False

    def segments(self, request, prefix_kv, kvs, past_cap=False) -> list[Segment]:
        pieces = request.pieces
        return prefix_segments(pieces, request.prefix_cache.match(pieces.token_ids, limit=pieces.num_tokens - 1))

    def after_prefill(self, request: RequestContext, result: BlendResult) -> None:
        remember_prefix(request.prefix_cache, request.adapter, result)


class Reuse(Method):
    """Independent chunk-caches concatenated; only the question computed."""

    name = "reuse"
    summary = "chunk-caches concatenated, only the question computed"


class CacheBlend(Method):
    """``reuse`` plus CacheBlend's deviation check: at the check layer, the ``ratio`` of
    cached chunk tokens whose V deviates most from the cache is recomputed."""

    name = "cacheblend"
    summary = "reuse plus CacheBlend's deviation check at a fixed ratio"
    takes_ratio = True
    default_ratio = 0.15

    def prepare(self, request: RequestContext, segments: list[Segment], load: LoadPlan | None) -> PrefillHooks:
        return PrefillHooks([DeviationCheck(request.check_layer, self.ratio)])


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


def remember_prefix(cache: PrefixCache, adapter, result: BlendResult) -> int:
    """Add a prefilled prompt's blocks to the prefix cache (keys un-rotated)."""
    n = result.num_tokens
    cos, sin = adapter.rope(torch.arange(n, device=result.keys[0].device), result.keys[0])
    keys = [adapter.unrotate(k, cos, sin) for k in result.keys]
    return cache.insert(result.token_ids.tolist(), keys, result.values)
