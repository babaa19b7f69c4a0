"""What every method shares: the request it plans for, its plan, its prefill hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol, Sequence

from cachecraft.engine import BlendResult, LayerHook, LayerSource, Segment
from cachecraft.policy.planner import PolicyParams, RecomputePlan, VariantInfo
from cachecraft.policy.rules import room_for_variant
from cachecraft.prefix_cache import PrefixCache
from cachecraft.prompt import PromptPieces


class UnknownMethod(ValueError):
    """A method name (or ratio) that cachecraft does not know."""


class VariantLookup(Protocol):
    """What a method may ask about the stored chunk-caches (the pipeline answers)."""

    def independent_variant(self, key: str, prefix_key: str) -> str | None:
        """A variant made without other chunks before it (the one ``warm`` makes first)."""

    def variant_infos(self, key: str, prefix_key: str,
                      keep: Callable[[str], bool] | None = None) -> list[VariantInfo]:
        """Every variant of ``key`` made after ``prefix_key`` (that ``keep`` keeps, asked
        before its statistics are read), as the planner sees it."""

    def variant_count(self, key: str, prefix_key: str | None = None) -> int:
        """How many variants of ``key`` are stored (made after ``prefix_key`` where given)."""

    def load_fraction(self, variant: str) -> float | None:
        """The recompute fraction that takes as long as loading ``variant`` from its tier
        (None: not stored; 1: a full prefill of its chunk is no slower)."""

    def hide_fraction(self, variant: str) -> float | None:
        """The recompute fraction that hides loading ``variant`` beside the blended
        prefill's own cost (None: not stored)."""

    def tier_of(self, variant: str) -> str | None:
        """The tier ``variant`` would load from (None: not stored)."""

    def made_exactly(self, key: str, variant: str) -> bool:
        """Whether ``variant`` of chunk ``key`` was made after a full prefill's KV of its prefix."""

    def has_variant(self, key: str, variant: str) -> bool:
        """Whether ``variant`` of chunk ``key`` is stored."""

    def replaceable_variants(self, key: str, prefix_key: str, asked: int = 0) -> list:
        """The variants of ``key`` an exact one earned by ``asked`` asks may replace at the
        cap (not ``warm``'s; exact ones only where reused fewer times than ``asked``)."""

    def order_history(self, keys: Sequence[str], limit: int) -> list[dict]:
        """The recorded policies of the newest ``limit`` earlier requests of the chunks
        ``keys`` in this order, newest first (none where the pipeline keeps no new variants,
        or cannot tell)."""


@dataclass(frozen=True)
class RequestContext:
    """One request as a method sees it."""

    pieces: PromptPieces
    prefix_key: str
    keys: tuple[str, ...]  # one per chunk, in prompt order
    adapter: object  # the model's ArchAdapter (look-ahead selectors run it)
    policy: PolicyParams
    check_layer: int  # CacheBlend's deviation-check layer
    lookup: VariantLookup
    prefix_cache: PrefixCache
    order: tuple[int, ...] | None = None  # the chunks' given positions, in prompt order (None: as given)


@dataclass(frozen=True)
class LoadPlan:
    """Which stored variant of each chunk to load (None: compute the chunk in full).
    ``found``: the variant the policy found, also where it chose to compute in full.
    ``asked_before``: where the plan keeps its chunk order exact, the asks of the order
    since it was last kept exact, or ever, that earned that (0: not kept exact), and
    ``exact_wait`` the asks it had to wait for (:func:`cachecraft.policy.rules.exact_wait`)."""

    wanted: tuple[str | None, ...]
    plan: RecomputePlan | None = None
    found: tuple[str | None, ...] | None = None
    asked_before: int = 0
    exact_wait: int = 0

    @property
    def keep_exact(self) -> bool:
        """Whether the chunks computed in full are a full prefill's KV, to be kept under
        their exact prefixes even at the cap, in place of inexact variants."""
        return self.asked_before > 0


@dataclass
class PrefillHooks:
    """What a method adds to the prefill: layer hooks that choose tokens or watch
    attention inside it (:mod:`cachecraft.selection`), the early stops they decided, and
    the look-ahead it ran before it (counted as work)."""

    layer_hooks: list[LayerHook] = field(default_factory=list)
    stops: dict[int, int] = field(default_factory=dict)  # segment index -> layer it stopped at
    lookahead_layer: int | None = None


class Method:
    """A prefill method; subclasses set the class fields and override what differs."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    experimental: ClassVar[bool] = False
    takes_ratio: ClassVar[bool] = False
    default_ratio: ClassVar[float | None] = None
    uses_cache: ClassVar[bool] = True

    def __init__(self, ratio: float | None = None):
        if self.takes_ratio:
            ratio = self.default_ratio if ratio is None else float(ratio)
            if not 0.0 <= ratio <= 1.0:
                raise UnknownMethod(f"{self.name}: ratio must be within [0, 1], got {ratio:g}")
        self.ratio = ratio if self.takes_ratio else None

    @property
    def label(self) -> str:
        """``name@ratio`` for methods with a ratio, else the name."""
        return f"{self.name}@{self.ratio:g}" if self.takes_ratio else self.name

    def __repr__(self) -> str:
        return f"<method {self.label}>"

    def load_plan(self, request: RequestContext) -> LoadPlan | None:
        """Variants to load; None when the method uses no chunk-caches (``uses_cache``
        false). Default: each chunk's independent variant."""
        if not self.uses_cache:
            return None
        return LoadPlan(tuple(request.lookup.independent_variant(k, request.prefix_key) for k in request.keys))

    def segments(self, request: RequestContext, prefix_kv: LayerSource | None,
                 kvs: Sequence[LayerSource | None], past_cap: bool = False) -> list[Segment]:
        """The prompt's segments over the loaded caches (chunks computed here are kept; with
        ``past_cap``, also beyond their cap of variants: a plan that keeps them exact)."""
        return plain_segments(request, prefix_kv, kvs, keep=True, past_cap=past_cap)

    def prepare(self, request: RequestContext, segments: list[Segment], load: LoadPlan | None) -> PrefillHooks:
        """Choose tokens to recompute before the prefill (written into ``segments``) and
        return the hooks for the prefill itself. Default: nothing beyond the segments."""
        return PrefillHooks()

    def after_prefill(self, request: RequestContext, result: BlendResult) -> None:
        """Anything the method keeps from a finished prefill (default: nothing)."""


def plain_segments(request: RequestContext, prefix_kv: LayerSource | None, kvs: Sequence[LayerSource | None],
                   keep: bool, past_cap: bool = False) -> list[Segment]:
    """System prefix, chunks (cached where ``kvs`` has one) and question. With ``keep``,
    an uncached chunk is saved with its statistics, to be kept as a variant, while its
    chunk has room for one (:func:`cachecraft.policy.rules.room_for_variant`; with
    ``past_cap`` also beyond, for the caller to make room), and an uncached prefix is saved too."""
    pieces = request.pieces
    segments = [Segment(pieces.prefix, "prefix", cached=prefix_kv, key=request.prefix_key,
                        save=keep and prefix_kv is None)]
    for ids, key, kv in zip(pieces.chunks, request.keys, kvs):
        # a chunk computed here although variants of it are stored (none worth loading
        # from its tier) is not kept past the cap: only eviction would bound them
        fresh = keep and kv is None and (past_cap or room_for_variant(
            request.lookup.variant_count(key, request.prefix_key)))
        segments.append(Segment(ids, "chunk", cached=kv, key=key, save=fresh, collect_stats=fresh))
    segments.append(Segment(pieces.question, "question"))
    return segments
