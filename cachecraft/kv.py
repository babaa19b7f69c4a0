"""ChunkKV: the cached keys/values of one run of tokens, and how it is keyed.

Keys are stored *before* RoPE so a chunk can be placed at any position; values carry
no position. Shapes: ``keys``/``values`` are ``[L, H_kv, T, D]``.

A chunk's identity is a hash of (model fingerprint, token ids), so a cache made for one
model, tokenizer or dtype is never served to another. A *variant* of a chunk is its KV
computed after a particular ordered prefix of segments; its key also hashes that prefix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Sequence

import torch

FORMAT_VERSION = "1"


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> int:
    """Bytes a chunk-cache holds per token: K and V of ``num_layers`` layers in ``dtype``."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:32]


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Canonical bytes of a token-id sequence (int64 little-endian)."""
    return b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids)


def chunk_key(fingerprint: str, token_ids: Sequence[int]) -> str:
    """Identity of a chunk's tokens under one model fingerprint."""
    return _digest(b"chunk", fingerprint.encode(), token_bytes(token_ids))


def variant_key(chunk: str, prefix: Sequence[str]) -> str:
    """Identity of one variant: the chunk computed after the ordered ``prefix`` keys."""
    return _digest(b"variant", chunk.encode(), "\x1f".join(prefix).encode())


@dataclass(frozen=True)
class AttentionStats:
    """Attention statistics gathered when a chunk's KV was computed.

    Masses are attention probabilities averaged over query heads and summed over the
    chunk's query tokens, so per layer ``intra + inter.sum() == T`` (each token's row
    sums to 1). ``L`` counts the layers they were gathered at: every layer, or the
    sample the caller chose (readers average over layers).

    - ``outside``: ``[L, T]`` per token, the mass it puts on tokens before the chunk;
    - ``inter``: ``[L, P]`` per earlier segment (in ``ChunkKV.prefix`` order), the mass
      the chunk's tokens put on it;
    - ``intra``: ``[L]`` the mass the chunk's tokens put inside the chunk.
    """

    outside: torch.Tensor
    inter: torch.Tensor
    intra: torch.Tensor

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"stats.outside": self.outside.contiguous(), "stats.inter": self.inter.contiguous(),
                "stats.intra": self.intra.contiguous()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "AttentionStats | None":
        if "stats.outside" not in tensors:
            return None
        return cls(tensors["stats.outside"], tensors["stats.inter"], tensors["stats.intra"])


@dataclass(frozen=True)
class ChunkKV:
    """Per-layer pre-RoPE K and V of a run of tokens, computed after ``prefix``.

    ``prefix`` holds the keys of the segments that preceded the chunk when it was
    computed (the system prefix first); their rows are not part of this object.
    """

    token_ids: tuple[int, ...]
    keys: torch.Tensor  # [L, H_kv, T, D], before RoPE
    values: torch.Tensor  # [L, H_kv, T, D]
    fingerprint: str
    prefix: tuple[str, ...] = ()
    stats: AttentionStats | None = None
    chunk: str = field(default="", compare=False)
    prefix_tokens: tuple[int, ...] = ()  # token count of each prefix segment

    def __post_init__(self) -> None:
        assert self.keys.shape == self.values.shape, (
            f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} differ")
        assert self.keys.dim() == 4, f"keys must be [L, H_kv, T, D], got {tuple(self.keys.shape)}"
        assert self.keys.shape[2] == len(self.token_ids), (
            f"{self.keys.shape[2]} KV rows for {len(self.token_ids)} tokens")
        if not self.chunk:
            object.__setattr__(self, "chunk", chunk_key(self.fingerprint, self.token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def variant(self) -> str:
        """Key of this variant (chunk + ordered prefix)."""
        return variant_key(self.chunk, self.prefix)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K (pre-RoPE) and V of one layer, ``[H_kv, T, D]`` each."""
        return self.keys[index], self.values[index]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (statistics excluded)."""
        return self.keys.numel() * self.keys.element_size() * 2

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "ChunkKV":
        """The same KV in another dtype and/or device (statistics stay float32 on CPU)."""
        return ChunkKV(self.token_ids, self.keys.to(device=device, dtype=dtype),
                       self.values.to(device=device, dtype=dtype), self.fingerprint,
                       self.prefix, self.stats, self.chunk, self.prefix_tokens)

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Flatten to named tensors (one K and one V per layer) and string metadata,
        ready for safetensors; :meth:`from_tensors` inverts it."""
        tensors = {"token_ids": torch.tensor(self.token_ids, dtype=torch.int64)}
        for layer in range(self.num_layers):
            tensors[f"k.{layer}"] = self.keys[layer].contiguous()
            tensors[f"v.{layer}"] = self.values[layer].contiguous()
        if self.stats is not None:
            tensors.update(self.stats.to_tensors())
        metadata = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint,
                    "prefix": json.dumps(list(self.prefix)), "chunk": self.chunk,
                    "prefix_tokens": json.dumps(list(self.prefix_tokens)),
                    "num_layers": str(self.num_layers)}
        return tensors, metadata

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> "ChunkKV":
        """Rebuild from :meth:`to_tensors` output."""
        if metadata.get("format") != FORMAT_VERSION:
            raise ValueError(f"unsupported ChunkKV format {metadata.get('format')!r}")
        num_layers = int(metadata["num_layers"])
        keys = torch.stack([tensors[f"k.{i}"] for i in range(num_layers)])
        values = torch.stack([tensors[f"v.{i}"] for i in range(num_layers)])
        return cls(tuple(tensors["token_ids"].tolist()), keys, values, metadata["fingerprint"],
                   tuple(json.loads(metadata["prefix"])), AttentionStats.from_tensors(tensors),
                   metadata["chunk"], tuple(json.loads(metadata.get("prefix_tokens", "[]"))))
