"""Shared helpers for the store/catalog tests: tiny ChunkKVs made with torch.randn."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from cachecraft.config import Config
from cachecraft.kv import AttentionStats, ChunkKV

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_kv(seed: int, fingerprint: str = "tiny-model-a", *, layers: int = 2, heads: int = 1,
            tokens: int = 8, head_dim: int = 8, dtype: torch.dtype = torch.float32,
            prefix: tuple[str, ...] = (), stats: bool = True, token_base: int | None = None) -> ChunkKV:
    """A deterministic random ChunkKV: the same arguments give the same bytes."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, heads, tokens, head_dim, generator=g).to(dtype)
    values = torch.randn(layers, heads, tokens, head_dim, generator=g).to(dtype)
    base = seed * 1000 if token_base is None else token_base
    st = None
    if stats:
        st = AttentionStats(torch.rand(layers, tokens, generator=g), torch.rand(layers, len(prefix), generator=g),
                            torch.rand(layers, generator=g))
    return ChunkKV(tuple(range(base, base + tokens)), keys, values, fingerprint, prefix, st,
                   prefix_tokens=tuple(5 + i for i in range(len(prefix))))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = _INT_VIEW[a.element_size()]
    return torch.equal(a.contiguous().view(view).cpu(), b.contiguous().view(view).cpu())


def same_kv(got: ChunkKV, want: ChunkKV, dtype: torch.dtype) -> bool:
    """``got`` is ``want`` stored in ``dtype``, bit for bit (statistics included)."""
    for f in dataclasses.fields(ChunkKV):  # every field, including ones added later
        if f.name not in ("keys", "values", "stats") and getattr(got, f.name) != getattr(want, f.name):
            return False
    if not (bits_equal(got.keys, want.keys.to(dtype)) and bits_equal(got.values, want.values.to(dtype))):
        return False
    if (got.stats is None) != (want.stats is None):
        return False
    if want.stats is not None:
        return all(bits_equal(x, y) for x, y in zip(got.stats.to_tensors().values(),
                                                     want.stats.to_tensors().values()))
    return True


def config(cache_dir: Path, **overrides) -> Config:
    """A config on a temporary cache directory."""
    return Config(cache_dir=Path(cache_dir), **overrides)


def disk_blob_files(store) -> dict:
    """Blob id -> path of every file in ``store``'s disk tier."""
    disk = store._disk()
    return {b.blob_id: disk.path_of(b.filename) for b in disk.listing().values()}


def flip_byte(path: Path, offset_from_end: int | None = None, offset: int | None = None) -> None:
    """Damage one byte of ``path`` in place (at ``offset``, or ``offset_from_end`` from its end)."""
    data = bytearray(path.read_bytes())
    i = offset if offset is not None else len(data) - offset_from_end
    data[i] ^= 0x40
    path.write_bytes(bytes(data))
