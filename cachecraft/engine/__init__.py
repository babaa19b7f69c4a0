"""The prefill paths over the architecture adapter, and the hand-off to ``generate``.

The engine is the layer loop; choosing tokens and watching attention are hooks
(:class:`LayerHook`) passed in by callers, implemented in :mod:`cachecraft.selection`.
"""

from cachecraft.engine.blend import BlendResult, blended_prefill, sampled_layers
from cachecraft.engine.handoff import GenerationOptions, generate_from, teacher_forced_logits, to_transformers_cache
from cachecraft.engine.hooks import LayerHook, LayerView
from cachecraft.engine.layout import Layout, LayerSource, PromptError, Segment

__all__ = ["BlendResult", "LayerHook", "LayerSource", "LayerView", "Layout", "PromptError", "Segment",
           "blended_prefill", "GenerationOptions", "generate_from", "sampled_layers", "teacher_forced_logits",
           "to_transformers_cache"]
