"""ChunkKV <-> safetensors bytes, with checksums; no pickle.

A blob is a plain safetensors file: one tensor per layer for K and for V (``k.{l}``,
``v.{l}``), the token ids, the attention statistics when present. Its header metadata
holds the ChunkKV metadata plus ``digests``: a checksum of every tensor's bytes. The
*entry checksum* is the checksum of the header bytes, so it covers the metadata and,
through the per-tensor digests, every data byte: a whole blob can be verified in one
pass, and a lazy reader can verify each layer as it reads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cachecraft.kv import FORMAT_VERSION, AttentionStats, ChunkKV, chunk_key, variant_key

MAX_HEADER_BYTES = 100_000_000


class BlobError(ValueError):
    """A blob is damaged or is not what its key says (internal; the store maps it)."""


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def stack_layers(layers: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` for CPU tensors, as one plain memory copy per layer.

    (On a busy machine many small parallel torch copies are far slower than this.)
    """
    first = layers[0]
    out = torch.empty((len(layers), *first.shape), dtype=first.dtype)
    as_int = _SAME_SIZE_INT[first.element_size()]
    dst = out.view(as_int).numpy()
    for i, t in enumerate(layers):
        assert t.shape == first.shape and t.dtype == first.dtype, "layers differ in shape or dtype"
        dst[i] = t.detach().contiguous().view(as_int).numpy()
    return out


_LAYER = re.compile(r"[kv]\.\d+$")


def assemble(small: dict[str, torch.Tensor], metadata: dict[str, str], keys: list[torch.Tensor],
             values: list[torch.Tensor]) -> ChunkKV:
    """A ChunkKV from its per-layer CPU tensors, other tensors and string metadata.

    :meth:`ChunkKV.from_tensors` reads every field (one layer, to stay cheap); the
    layers are then stacked with :func:`stack_layers`.
    """
    if metadata.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported ChunkKV format {metadata.get('format')!r}")
    base = ChunkKV.from_tensors({**small, "k.0": keys[0], "v.0": values[0]}, {**metadata, "num_layers": "1"})
    return dataclasses.replace(base, keys=stack_layers(keys), values=stack_layers(values))


def copy_to(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str,
            non_blocking: bool = False) -> torch.Tensor:
    """A fresh copy of ``t`` in ``dtype`` (None: its own) on ``device``.

    A same-dtype CPU copy is one plain memory copy; anything else goes through torch
    (``non_blocking``: from pinned memory to a GPU, returns before the copy is done; the
    caller waits on the current stream before using the result).
    """
    target = t.dtype if dtype is None else dtype
    if target == t.dtype and torch.device(device).type == "cpu" and t.device.type == "cpu" and t.dim() > 0:
        as_int = _SAME_SIZE_INT[t.element_size()]
        out = torch.empty(t.shape, dtype=t.dtype)
        out.view(as_int).numpy()[...] = t.detach().contiguous().view(as_int).numpy()
        return out
    return t.to(device=device, dtype=target, copy=True, non_blocking=non_blocking)


def checksum(data) -> str:
    """Checksum of a bytes-like object (SHA-256, 128 bits, hex)."""
    return hashlib.sha256(data).hexdigest()[:32]


def tensor_checksum(t: torch.Tensor) -> str:
    """Checksum of a contiguous CPU tensor's raw bytes."""
    return checksum(t.detach().contiguous().view(torch.uint8).numpy())


@dataclass(frozen=True)
class Blob:
    """Encoded bytes of one ChunkKV and the checksum of its header."""

    data: bytes
    checksum: str


def encode(kv: ChunkKV) -> Blob:
    """Serialise a ChunkKV (already in its stored dtype) to safetensors bytes."""
    kv = kv.to(device="cpu")
    tensors, metadata = kv.to_tensors()
    metadata["digests"] = json.dumps({name: tensor_checksum(t) for name, t in tensors.items()},
                                     sort_keys=True)
    metadata["variant"] = kv.variant
    metadata["dtype"] = str(kv.keys.dtype).removeprefix("torch.")
    data = st_save(tensors, metadata)
    header_len = struct.unpack("<Q", data[:8])[0]
    return Blob(data, checksum(memoryview(data)[: 8 + header_len]))


def header_checksum(data: bytes) -> str:
    """The entry checksum computed from a blob itself (used to salvage blobs)."""
    n = _header_length(data[:8])
    if len(data) < 8 + n:
        raise BlobError("truncated blob")
    return checksum(memoryview(data)[: 8 + n])


def _parse_header(head: bytes | memoryview, expected: str) -> tuple[dict, dict[str, str]]:
    if checksum(head) != expected:
        raise BlobError("header checksum mismatch")
    try:
        header = json.loads(bytes(head[8:]))
        metadata = header.pop("__metadata__")
        digests = json.loads(metadata["digests"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BlobError(f"unreadable header: {exc}") from None
    return header, {**metadata, "digests": digests}


def _header_length(prefix: bytes) -> int:
    if len(prefix) < 8:
        raise BlobError("truncated blob")
    n = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER_BYTES:
        raise BlobError("implausible header length")
    return n


def _check_identity(key: str | None, metadata: dict, token_ids: tuple[int, ...]) -> None:
    chunk = chunk_key(metadata["fingerprint"], token_ids)
    if chunk != metadata.get("chunk"):
        raise BlobError("chunk key does not match the stored tokens and fingerprint")
    variant = variant_key(chunk, json.loads(metadata["prefix"]))
    if variant != metadata.get("variant") or (key is not None and variant != key):
        raise BlobError(f"blob holds variant {variant}, expected {key}")


def decode(data: bytes, expected_checksum: str, key: str | None = None) -> ChunkKV:
    """Verify and rebuild a ChunkKV; raises :class:`BlobError` on any damage or mismatch."""
    view = memoryview(data)
    n = _header_length(data[:8])
    if len(data) < 8 + n:
        raise BlobError("truncated blob")
    header, metadata = _parse_header(view[: 8 + n], expected_checksum)
    digests = metadata.pop("digests")
    base = 8 + n
    if set(header) != set(digests):
        raise BlobError("tensor list does not match the digests")
    for name, info in header.items():
        start, end = info["data_offsets"]
        if base + end > len(data) or checksum(view[base + start: base + end]) != digests[name]:
            raise BlobError(f"tensor {name} checksum mismatch")
    try:
        tensors = st_load(data)
        strings = {k: v for k, v in metadata.items() if isinstance(v, str)}
        num_layers = int(strings["num_layers"])
        kv = assemble({n: t for n, t in tensors.items() if not _LAYER.match(n)}, strings,
                      [tensors[f"k.{i}"] for i in range(num_layers)],
                      [tensors[f"v.{i}"] for i in range(num_layers)])
    except Exception as exc:  # safetensors raises its own error types
        raise BlobError(f"cannot decode: {exc}") from None
    _check_identity(key, metadata, kv.token_ids)
    return kv


def read_header(fh: BinaryIO, expected_checksum: str) -> tuple[dict, dict]:
    """Read and verify the header of an open blob file: (tensor table, metadata)."""
    prefix = fh.read(8)
    n = _header_length(prefix)
    head = prefix + fh.read(n)
    if len(head) != 8 + n:
        raise BlobError("truncated blob")
    return _parse_header(head, expected_checksum)


class LayeredBlob:
    """What a verified, layer-by-layer view of a blob shares, wherever its bytes live:
    the small tensors (token ids, statistics) read and checked on opening, then each
    layer read and verified on demand through :meth:`tensor`."""

    digests: dict[str, str]
    metadata: dict[str, str]
    small: dict[str, torch.Tensor]

    def _opened(self, key: str | None) -> None:
        """Read the entry's identity from the small tensors and check it against ``key``."""
        self.token_ids = tuple(self.small["token_ids"].tolist())
        try:
            self.num_layers = int(self.metadata["num_layers"])
            self.stats = AttentionStats.from_tensors(self.small)
        except (KeyError, ValueError) as exc:
            raise BlobError(f"unreadable metadata: {exc}") from None
        _check_identity(key, self.metadata, self.token_ids)

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def layers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) per layer, each ``[H_kv, T, D]``, verified as read."""
        for layer in range(self.num_layers):
            yield self.tensor(f"k.{layer}"), self.tensor(f"v.{layer}")

    def assemble(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> ChunkKV:
        """The whole ChunkKV from layers read (in the stored dtype, on the CPU)."""
        return assemble(self.small, self.metadata, keys, values)


class LazyBlob(LayeredBlob):
    """A verified view of a blob file that reads layers on demand (safetensors mmap).

    Construction verifies the header checksum, every tensor that is not a layer (token
    ids, statistics) and the entry's identity; each layer is verified when read.
    """

    def __init__(self, path: str | Path, fh: BinaryIO, expected_checksum: str, key: str | None) -> None:
        header, metadata = read_header(fh, expected_checksum)
        self.digests: dict[str, str] = metadata.pop("digests")
        self.metadata: dict[str, str] = {k: v for k, v in metadata.items() if isinstance(v, str)}
        try:
            self._file = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:
            if not Path(path).exists():
                raise FileNotFoundError(str(path)) from None
            raise BlobError(f"cannot open: {exc}") from None
        if set(self._file.keys()) != set(self.digests):
            raise BlobError("tensor list does not match the digests")
        self.small = {name: self.tensor(name) for name in self.digests if not _LAYER.match(name)}
        self._opened(key)

    def tensor(self, name: str) -> torch.Tensor:
        """One verified tensor."""
        try:
            t = self._file.get_tensor(name)
        except Exception as exc:
            raise BlobError(f"cannot read tensor {name}: {exc}") from None
        if tensor_checksum(t) != self.digests.get(name):
            raise BlobError(f"tensor {name} checksum mismatch")
        return t

    def close(self) -> None:
        """Release the mapping."""
        self._file = None
