"""Per-architecture access to a decoder's pieces, so the engine can run it layer by layer.

The adapter calls the model's own modules (norms, projections, q/k norms, rotary
embedding with its scaling, MLP), so numerics match the model's forward. Shapes are
for one sequence, no batch dimension: hidden ``[n, hidden]``, q ``[H, n, D]``,
k/v ``[H_kv, n, D]``.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")

# What a known-but-unsupported architecture lacks, for the error message.
_MISSING = {
    "gpt2": "it uses learned absolute position embeddings, so cached keys cannot be moved (needs RoPE)",
    "gpt_neox": "its partial rotary embedding and parallel attention/MLP block are not implemented",
    "opt": "it uses learned absolute position embeddings, so cached keys cannot be moved (needs RoPE)",
    "bloom": "it uses ALiBi instead of RoPE",
    "deepseek_v2": "multi-head latent attention (MLA) is not implemented",
    "deepseek_v3": "multi-head latent attention (MLA) is not implemented",
    "gemma2": "alternating sliding-window layers and logit soft-capping are not implemented",
    "gemma3": "alternating sliding-window layers are not implemented",
    "mixtral": "mixture-of-experts MLP routing is not validated",
    "phi3": "its fused qkv projection is not implemented",
}


class UnsupportedArchitecture(ValueError):
    """The model's architecture cannot be run exactly by the engine."""


def _check_supported(config) -> None:
    model_type = getattr(config, "model_type", "unknown")
    if model_type not in SUPPORTED:
        reason = _MISSING.get(model_type, "it has not been adapted and checked")
        raise UnsupportedArchitecture(
            f"architecture {model_type!r} is not supported: {reason}. "
            f"Supported: {', '.join(SUPPORTED)}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("longrope",) :
        raise UnsupportedArchitecture(
            f"{model_type}: rope_type {rope['rope_type']!r} depends on the sequence length in a way "
            "the engine does not reproduce")


class ArchAdapter:
    """The layer-level operations the engine needs, for one supported model."""

    def __init__(self, model: nn.Module):
        config = model.config
        _check_supported(config)
        self.config = config
        self.model_type = config.model_type
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.final_norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.num_layers = len(self.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.layers[0].self_attn.scaling
        self.has_qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.max_context = int(config.max_position_embeddings)
        # Sliding-window attention equals full causal attention while the prompt fits
        # in the window, so the window becomes the context limit instead of a silent error.
        layer_types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        if window and (self.model_type == "mistral" or "sliding_attention" in layer_types):
            self.max_context = min(self.max_context, int(window))

    # -- per-layer pieces -------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[n, hidden]``."""
        return self.embed_tokens(token_ids)

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm and projections: q ``[H, n, D]``, k ``[H_kv, n, D]`` (pre-RoPE), v."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        n = x.shape[0]
        q = attn.q_proj(x).view(n, -1, self.head_dim)
        k = attn.k_proj(x).view(n, -1, self.head_dim)
        v = attn.v_proj(x).view(n, -1, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, D]`` for absolute ``positions`` (rope scaling included)."""
        cos, sin = self.rotary(like, positions[None])
        return cos[0], sin[0]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to ``x [heads, n, D]`` with ``cos/sin [n, D]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @classmethod
    def unrotate(cls, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`rotate` (RoPE's attention scaling included: cos^2 + sin^2 = s^2)."""
        return cls.rotate(x, cos, -sin) / (cos * cos + sin * sin)

    def attn_output(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of attention ``[H, n, D]`` to ``[n, hidden]``."""
        n = attn.shape[1]
        return self.layers[layer].self_attn.o_proj(attn.transpose(0, 1).reshape(n, -1))

    def mlp_residual(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + MLP(post_attention_norm(hidden))``."""
        block = self.layers[layer]
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[n, hidden]`` to ``[n, vocab]``."""
        return self.lm_head(self.final_norm(hidden))
