"""The prefill paths over the architecture adapter, and the hand-off to ``generate``."""

from cachecraft.engine.blend import (BlendResult, DeviationCheck, PromptError, Segment,
                                     blended_prefill, create_chunk_cache, sampled_layers)
from cachecraft.engine.handoff import generate_from, to_transformers_cache

__all__ = ["BlendResult", "DeviationCheck", "PromptError", "Segment", "blended_prefill",
           "create_chunk_cache", "generate_from", "sampled_layers", "to_transformers_cache"]
