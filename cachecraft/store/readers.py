"""Layer-by-layer access to one stored variant (so loading can overlap compute).

    reader = store.iter_layers(key, dtype=torch.float32, device="cuda")
    if reader is not None:
        with reader:
            for layer, (k, v) in enumerate(reader):   # k, v: [H_kv, T, D], K before RoPE
                ...

A disk-backed reader reads and verifies each layer only when the loop reaches it. If a
layer fails its checksum the entry is removed and :class:`CorruptEntryError` is raised
from the loop: the caller must recompute that chunk (layers already handed out were
verified and are sound).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Iterator

import torch

from cachecraft.kv import AttentionStats, ChunkKV
from cachecraft.store.codec import BlobError, LazyBlob, copy_to
from cachecraft.store.errors import CorruptEntryError


class LayerReader:
    """One stored variant: its metadata, and (K, V) per layer when iterated.

    ``metadata`` holds the ChunkKV's string metadata (as in :meth:`ChunkKV.to_tensors`),
    so fields beyond the ones copied to attributes are available too.
    """

    tier: str
    key: str
    chunk: str
    fingerprint: str
    token_ids: tuple[int, ...]
    prefix: tuple[str, ...]
    prefix_tokens: tuple[int, ...]
    stats: AttentionStats | None
    num_layers: int
    metadata: dict[str, str]
    device: torch.device  # where the layers are handed out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def read_all(self) -> ChunkKV:
        """Every layer, stacked into a ChunkKV (in the requested dtype and device)."""
        raise NotImplementedError

    def held(self) -> ChunkKV | None:
        """The stored variant itself, with no copy, when it already sits in memory on the
        device asked for (in its stored dtype; shared with the store, so never to be
        written to); None when its layers have to be read."""
        return None

    def close(self) -> None:
        """Release what the reader holds."""

    def __enter__(self) -> "LayerReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryLayerReader(LayerReader):
    """Layers of a variant held in a memory tier; each layer is a fresh copy."""

    def __init__(self, tier: str, key: str, kv: ChunkKV, dtype: torch.dtype | None,
                 device: torch.device | str) -> None:
        self.tier, self.key, self._kv, self._dtype, self._device = tier, key, kv, dtype, device
        self.device = torch.device(device)
        self.chunk, self.fingerprint, self.token_ids = kv.chunk, kv.fingerprint, kv.token_ids
        self.prefix, self.stats, self.num_layers = kv.prefix, kv.stats, kv.num_layers
        self.prefix_tokens = kv.prefix_tokens
        self.metadata = kv.to_tensors()[1]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # From pinned host memory to a GPU the copies need not be waited for one by one:
        # whoever iterates (a LayerStream) waits for the layer on the stream they ran on.
        early = self.device.type == "cuda" and self._kv.keys.is_pinned()
        for layer in range(self.num_layers):
            yield (copy_to(self._kv.keys[layer], self._dtype, self._device, non_blocking=early),
                   copy_to(self._kv.values[layer], self._dtype, self._device, non_blocking=early))

    def read_all(self) -> ChunkKV:
        return dataclasses.replace(self._kv, keys=copy_to(self._kv.keys, self._dtype, self._device),
                                   values=copy_to(self._kv.values, self._dtype, self._device))

    def held(self) -> ChunkKV | None:
        wanted, there = torch.device(self._device), self._kv.keys.device
        same = wanted.type == there.type and (wanted.index is None or wanted.index == there.index)
        return self._kv if same else None


class DiskLayerReader(LayerReader):
    """Layers of a variant on disk, read lazily and verified one by one."""

    def __init__(self, key: str, blob: LazyBlob, dtype: torch.dtype | None, device: torch.device | str,
                 on_corrupt: Callable[[Exception], None],
                 on_complete: Callable[[ChunkKV], None] | None = None) -> None:
        self.tier, self.key, self._blob = "disk", key, blob
        self._dtype, self._device = dtype, device
        self.device = torch.device(device)
        self._on_corrupt, self._on_complete = on_corrupt, on_complete
        self.metadata = dict(blob.metadata)
        self.chunk, self.fingerprint = self.metadata["chunk"], self.metadata["fingerprint"]
        self.token_ids, self.prefix = blob.token_ids, tuple(json.loads(self.metadata["prefix"]))
        self.prefix_tokens = tuple(json.loads(self.metadata.get("prefix_tokens", "[]")))
        self.num_layers, self.stats = blob.num_layers, blob.stats

    def _fail(self, exc: Exception) -> None:
        self._on_corrupt(exc)
        self.close()
        raise CorruptEntryError(f"variant {self.key} is damaged on disk ({exc}); it was removed, "
                                "recompute the chunk") from None

    def _read(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Verified stored-dtype layers; after the last one, hands the whole entry to on_complete."""
        assert self._blob is not None, "reader is closed"
        kept: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if self._on_complete else None
        blob = self._blob
        for layer in range(self.num_layers):
            try:
                k, v = blob.tensor(f"k.{layer}"), blob.tensor(f"v.{layer}")
            except BlobError as exc:
                self._fail(exc)
            if kept is not None:
                kept.append((k, v))
            yield k, v
        if kept is not None and self._on_complete is not None:
            on_complete, self._on_complete = self._on_complete, None
            on_complete(blob.assemble([k for k, _ in kept], [v for _, v in kept]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        promoting = self._on_complete is not None
        for k, v in self._read():
            if promoting:  # never hand out the tensors kept for promotion
                yield copy_to(k, self._dtype, self._device), copy_to(v, self._dtype, self._device)
            else:  # fresh tensors from the file: convert only if asked
                yield k.to(device=self._device, dtype=self._dtype), v.to(device=self._device, dtype=self._dtype)

    def read_all(self) -> ChunkKV:
        assert self._blob is not None, "reader is closed"
        blob = self._blob
        layers = list(self._read())
        kv = blob.assemble([k for k, _ in layers], [v for _, v in layers])
        return _convert_whole(kv, self._dtype, self._device)

    def close(self) -> None:
        """Release the file mapping."""
        if self._blob is not None:
            self._blob.close()
            self._blob = None


class SharedLayerReader(DiskLayerReader):
    """Layers of a variant in the shared tier (Redis), fetched and verified one by one."""

    def __init__(self, tier: str, key: str, blob, dtype: torch.dtype | None, device: torch.device | str,
                 on_corrupt: Callable[[Exception], None],
                 on_complete: Callable[[ChunkKV], None] | None = None) -> None:
        super().__init__(key, blob, dtype, device, on_corrupt, on_complete)
        self.tier = tier

    def _fail(self, exc: Exception) -> None:
        self._on_corrupt(exc)
        self.close()
        raise CorruptEntryError(f"variant {self.key} could not be read from the shared tier ({exc}); "
                                "recompute the chunk") from None


def _convert_whole(kv: ChunkKV, dtype: torch.dtype | None, device: torch.device | str) -> ChunkKV:
    return dataclasses.replace(kv, keys=kv.keys.to(device=device, dtype=dtype),
                               values=kv.values.to(device=device, dtype=dtype))
