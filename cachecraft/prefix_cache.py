"""The ``prefix`` baseline: exact prefix reuse over earlier requests' token blocks.

Like vLLM's automatic prefix caching: the prompt is cut into fixed-size blocks, each
block keyed by a chained hash of (parent key, its token ids), so a block is found
only if every token before it matched too. Blocks are kept LRU within a byte budget.
Keys are kept before RoPE, like every other cache here.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from cachecraft.kv import token_bytes


@dataclass(frozen=True)
class PrefixKV:
    """KV of the first ``num_tokens`` tokens of a prompt (a ``LayerSource``)."""

    keys: torch.Tensor  # [L, H_kv, n, D], before RoPE
    values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    def slice(self, start: int, end: int) -> "PrefixKV":
        return PrefixKV(self.keys[:, :, start:end], self.values[:, :, start:end])


def block_keys(fingerprint: str, token_ids: Sequence[int], block_size: int) -> list[str]:
    """Chained keys of every full block of ``token_ids``."""
    keys, parent = [], fingerprint
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.sha256(parent.encode() + token_bytes(token_ids[start:start + block_size]))
        parent = digest.hexdigest()[:32]
        keys.append(parent)
    return keys


class PrefixCache:
    """Block-hash prefix cache with LRU eviction under ``budget_bytes``."""

    def __init__(self, fingerprint: str, block_size: int = 16, budget_bytes: int = 1 << 30):
        assert block_size >= 1 and budget_bytes > 0
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = self.lookups = 0

    def match(self, token_ids: Sequence[int], limit: int | None = None) -> PrefixKV | None:
        """KV of the longest cached block-aligned prefix (at most ``limit`` tokens)."""
        self.lookups += 1
        matched = []
        for key in block_keys(self.fingerprint, token_ids, self.block_size):
            if key not in self._blocks or (limit is not None and (len(matched) + 1) * self.block_size > limit):
                break
            matched.append(key)
        if not matched:
            return None
        self._touch(matched)
        found = [self._blocks[key] for key in matched]
        self.hits += 1
        return PrefixKV(torch.cat([k for k, _ in found], dim=2), torch.cat([v for _, v in found], dim=2))

    def insert(self, token_ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> int:
        """Store every full block of a prefilled prompt; ``keys``/``values`` are per layer
        ``[H_kv, N, D]`` (keys before RoPE). Returns the number of new blocks."""
        added = 0
        chain = block_keys(self.fingerprint, token_ids, self.block_size)
        for index, key in enumerate(chain):
            if key in self._blocks:
                continue
            lo, hi = index * self.block_size, (index + 1) * self.block_size
            k = torch.stack([layer[:, lo:hi] for layer in keys]).clone()
            v = torch.stack([layer[:, lo:hi] for layer in values]).clone()
            self._blocks[key] = (k, v)
            self.bytes += k.numel() * k.element_size() * 2
            added += 1
        self._touch(chain)
        while self.bytes > self.budget_bytes and self._blocks:
            _, (k, _) = self._blocks.popitem(last=False)
            self.bytes -= k.numel() * k.element_size() * 2
        return added

    def _touch(self, chain: list[str]) -> None:
        # Deepest block first, so a chain's root is the most recent and leaves go first:
        # evicting a root would strand every block after it.
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def __len__(self) -> int:
        return len(self._blocks)
