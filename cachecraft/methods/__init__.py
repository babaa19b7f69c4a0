"""The prefill methods, as small objects registered by name.

Each method owns how it plans a request (which stored variant of each chunk to load,
if any) and how it selects the cached tokens to recompute; the pipeline runs every
method through the same steps (plan -> load -> blend -> generate -> record).

- ``full``: prefill everything.
- ``prefix``: exact prefix reuse of earlier requests' token blocks (vLLM-style).
- ``reuse``: chunk-caches made independently, concatenated; only the question computed.
- ``cacheblend``: ``reuse`` plus CacheBlend's deviation check at the check layer,
  recomputing a fixed ratio of the chunk tokens.
- ``cachecraft``: the policy (per chunk the variant with the lowest Cache Fix Overhead
  and a token count from it; the tokens where the question looks).
- experimental selectors, for comparisons: ``qguided`` (the tokens the question looks at
  most, at a fixed ratio), ``inter`` (the highest stored inter-attention), ``firstk``
  (the first tokens of every chunk, EPIC-like), ``spread`` (tokens spread evenly over
  every chunk, the rest moved by the drift those show).

A name takes a ratio after ``@`` where the method has one (``cacheblend@0.3``; for
``cachecraft`` it is alpha): :func:`parse_method` is the one parser of method names.
"""

from __future__ import annotations

from cachecraft.methods.base import (LoadPlan, Method, PrefillHooks, RequestContext, UnknownMethod,
                                     VariantLookup, plain_segments)
from cachecraft.methods.baselines import CacheBlend, Full, KeptFull, Prefix, Reuse, prefix_segments, remember_prefix
from cachecraft.methods.experimental import FirstK, Inter, QuestionGuided, Spread
from cachecraft.methods.policy import CacheCraft, variant_info

REGISTRY: dict[str, type[Method]] = {cls.name: cls for cls in (
    Full, Prefix, Reuse, CacheBlend, CacheCraft, QuestionGuided, Inter, FirstK, Spread)}
METHODS = tuple(REGISTRY)


def method_class(name: str) -> type[Method]:
    """The method registered as ``name``; :class:`UnknownMethod` names the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownMethod(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def parse_method(text: str, *, ratio: float | None = None, alpha: float | None = None) -> Method:
    """``"cacheblend@0.3"`` -> a method object. A bare name takes ``ratio`` (``alpha`` for
    ``cachecraft``), else the method's own default; ``@`` on a method without a ratio is an error."""
    name, at, value = text.strip().partition("@")
    cls = method_class(name)
    if at:
        if not cls.takes_ratio:
            raise UnknownMethod(f"method {name!r} takes no ratio (got {text!r})")
        try:
            given = float(value)
        except ValueError:
            raise UnknownMethod(f"method {text!r}: {value!r} is not a number") from None
    else:
        given = alpha if cls is CacheCraft else ratio
    return cls(given if cls.takes_ratio else None)


def parse_methods(text: str, ratio: float | None = None, alpha: float | None = None) -> list[Method]:
    """``"full,reuse,cacheblend@0.3"`` -> method objects (see :func:`parse_method`)."""
    methods = [parse_method(part, ratio=ratio, alpha=alpha) for part in text.split(",") if part.strip()]
    if not methods:
        raise UnknownMethod(f"no method given; choose from {', '.join(METHODS)}")
    return methods


def methods_help() -> str:
    """One phrase per method for ``--help``, experimental ones marked."""
    return "; ".join(f"{cls.name}{' (experimental)' if cls.experimental else ''}: {cls.summary}"
                     for cls in REGISTRY.values())


__all__ = ["CacheBlend", "CacheCraft", "FirstK", "Full", "Inter", "LoadPlan", "METHODS", "Method",
           "PrefillHooks", "Prefix", "QuestionGuided", "REGISTRY", "RequestContext", "Reuse", "UnknownMethod",
           "VariantLookup", "method_class", "methods_help", "parse_method", "parse_methods", "plain_segments",
           "prefix_segments", "remember_prefix", "variant_info"]
