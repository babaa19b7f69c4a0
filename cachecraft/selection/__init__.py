"""Choosing tokens to recompute and watching attention: the engine's layer hooks,
the selectors that run before a prefill, and chunk-cache creation with statistics."""

from cachecraft.selection.deviation import DeviationCheck
from cachecraft.selection.early_stop import QuestionAttention
from cachecraft.selection.lookahead import TokenAttention, chunk_attention, question_guided
from cachecraft.selection.static import count_for, first_tokens, spread_tokens, top_inter_attention
from cachecraft.selection.statistics import ChunkStatistics, create_chunk_cache

__all__ = ["ChunkStatistics", "DeviationCheck", "QuestionAttention", "TokenAttention", "chunk_attention", "count_for",
           "create_chunk_cache", "first_tokens", "question_guided", "spread_tokens",
           "top_inter_attention"]
