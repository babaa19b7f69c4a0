"""A request's chunk-caches read layer by layer on a background thread, so loading overlaps compute.

The engine consumes cached KV in layer order: layer 0 of every cached segment, then
layer 1, and so on. :class:`LayerStream` takes the :class:`LayerReader` of every
variant a request uses and reads them in that same order on one thread, so while the
engine computes layer l, layer l+1 is being read (from disk: read and verified). A disk
variant read to the end is then promoted to a memory tier, as a whole read would. A
variant already in memory on the compute device is not read at all: the engine gets its
stored layers as they are (it only ever copies them into its own buffers). Each
variant reaches the engine as a :class:`StreamedKV`, whose ``layer(i)`` returns as
soon as that layer has arrived.

    stream = LayerStream([store.iter_layers(key) for key in keys])
    try:
        result = blended_prefill(adapter, segments_using(stream.kvs))
    finally:
        stream.close()

``read_bytes`` and ``read_seconds`` (per tier) say how fast the thread read, so the
loading controller can use this machine's bandwidth rather than a guess; read them
after :meth:`close`.

On CUDA the thread copies onto a stream of its own: copies on the compute stream would
wait for every kernel queued before them, so the engine would stall at each layer with
the GPU idle. It issues one layer of every variant (from pinned memory without waiting
for each copy), then waits once for them all. Each layer carries an event; ``layer(i)``
makes the compute stream wait for it (the host does not wait) and marks the tensors as
used there, so the allocator does not hand their memory to the copy stream again while
compute still reads them.

A layer that fails its checksum makes that variant's ``layer(i)`` raise
:class:`CorruptEntryError` (the store has already removed the entry); the other
variants keep streaming. Layers are handed out in the reader's dtype (stored dtype
unless asked otherwise); the engine converts them while copying them into place.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Iterator, Sequence

import torch

from cachecraft.kv import AttentionStats, variant_key
from cachecraft.store.readers import LayerReader


class StreamedKV:
    """One stored variant as the engine sees it: metadata now, layers as they arrive."""

    def __init__(self, reader: LayerReader, stream: "LayerStream") -> None:
        self.tier, self.key = reader.tier, reader.key
        self.token_ids: tuple[int, ...] = tuple(reader.token_ids)
        self.fingerprint: str = reader.fingerprint
        self.prefix: tuple[str, ...] = tuple(reader.prefix)
        self.prefix_tokens: tuple[int, ...] = tuple(reader.prefix_tokens)
        self.stats: AttentionStats | None = reader.stats
        self.chunk: str = reader.chunk
        self.num_layers: int = reader.num_layers
        self._stream = stream
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ready: list[torch.cuda.Event | None] = []  # per layer: copied once this event is reached
        self._error: BaseException | None = None
        self._finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def variant(self) -> str:
        """Key of this variant (chunk + ordered prefix)."""
        return variant_key(self.chunk, self.prefix)

    @property
    def layers_read(self) -> int:
        """How many layers have arrived so far."""
        return len(self._layers)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K (pre-RoPE) and V of one layer, ``[H_kv, T, D]`` each; waits until it is read."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of a variant with {self.num_layers} layers")
        with self._stream.arrived:
            self._stream.arrived.wait_for(lambda: len(self._layers) > index or self._error is not None
                                          or self._finished)
            if len(self._layers) > index:
                pair, ready = self._layers[index], self._ready[index]
                if ready is not None:
                    compute = torch.cuda.current_stream(pair[0].device)
                    compute.wait_event(ready)
                    for tensor in pair:
                        tensor.record_stream(compute)
                return pair
            if self._error is not None:
                raise self._error
        raise RuntimeError(f"the stream of {self.key} ended after {len(self._layers)} of "
                           f"{self.num_layers} layers")


class LayerStream:
    """Reads several variants layer-major on one daemon thread; see the module doc."""

    def __init__(self, readers: Sequence[LayerReader]) -> None:
        self.arrived = threading.Condition()
        self.kvs = [StreamedKV(reader, self) for reader in readers]
        self._readers, self._streamed = [], []
        for reader, kv in zip(readers, self.kvs):
            held = reader.held()
            if held is None:
                self._readers.append(reader)
                self._streamed.append(kv)
            else:  # already in memory where compute runs: hand out its layers as they are, no copy
                kv._layers = [held.layer(i) for i in range(held.num_layers)]
                kv._ready = [None] * held.num_layers
                kv._finished = True
                reader.close()
        self.read_bytes: dict[str, int] = {}  # per tier, bytes read on the thread (held variants: none)
        self.read_seconds: dict[str, float] = {}  # per tier, time spent reading them
        self._stop = threading.Event()
        self._copy_stream = _copy_stream_for(self._readers)
        self._thread = threading.Thread(target=self._read, name="cachecraft-kv-stream", daemon=True)
        if self._readers:
            self._thread.start()

    def _read(self) -> None:
        side = self._copy_stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self._read_layers(side)

    def _read_layers(self, side: "torch.cuda.Stream | None") -> None:
        iterators: list[Iterator[tuple[torch.Tensor, torch.Tensor]] | None] = []
        for reader, kv in zip(self._readers, self._streamed):
            iterators.append(self._guarded(kv, lambda: iter(reader)))
        for layer in range(max((kv.num_layers for kv in self._streamed), default=0)):
            if self._stop.is_set():
                break
            issued = []  # (variant, its K and V of this layer, seconds the thread spent on them)
            for i, (it, kv) in enumerate(zip(iterators, self._streamed)):
                if it is None or layer >= kv.num_layers:
                    continue
                start = time.perf_counter()
                pair = self._guarded(kv, lambda: next(it))
                if pair is None:
                    iterators[i] = None
                    continue
                if side is None:  # hand each variant's layer over as soon as it is read
                    self._hand_over(kv, pair, None, time.perf_counter() - start)
                else:
                    issued.append((kv, pair, time.perf_counter() - start))
            if issued:
                self._hand_over_layer(issued, side)
        else:
            for it, kv in zip(iterators, self._streamed):
                if it is not None:  # run the reader past its last layer (a disk reader then promotes)
                    self._guarded(kv, lambda: next(it, None))
        for kv in self._streamed:
            self._finish(kv)
        for reader in self._readers:
            reader.close()

    def _hand_over(self, kv: StreamedKV, pair: tuple[torch.Tensor, torch.Tensor],
                   ready: "torch.cuda.Event | None", seconds: float) -> None:
        self._count(kv.tier, pair, seconds)
        with self.arrived:
            kv._layers.append(pair)
            kv._ready.append(ready)
            self.arrived.notify_all()

    def _hand_over_layer(self, issued: list, side: "torch.cuda.Stream") -> None:
        """One layer of every variant, its copies issued on ``side`` (from pinned memory
        they run while the thread moves on): one event for them all, waited for here so
        the loading time is the copies' own, shared out by bytes."""
        ready = torch.cuda.Event()
        ready.record(side)
        start = time.perf_counter()
        ready.synchronize()
        waited = time.perf_counter() - start
        sizes = [sum(t.numel() * t.element_size() for t in pair) for _, pair, _ in issued]
        total = sum(sizes) or 1
        for (kv, pair, seconds), size in zip(issued, sizes):
            self._hand_over(kv, pair, ready if pair[0].device.type == "cuda" else None,
                            seconds + waited * size / total)

    def _count(self, tier: str, pair: tuple[torch.Tensor, torch.Tensor], seconds: float) -> None:
        self.read_bytes[tier] = self.read_bytes.get(tier, 0) + sum(t.numel() * t.element_size() for t in pair)
        self.read_seconds[tier] = self.read_seconds.get(tier, 0.0) + seconds

    def _guarded(self, kv: StreamedKV, step):
        """``step()``, or None after recording its exception against ``kv`` (then finished)."""
        try:
            return step()
        except StopIteration:  # fewer layers than announced: layer() reports it
            self._finish(kv)
            return None
        except BaseException as exc:  # handed to the engine's thread by kv.layer()
            with self.arrived:
                kv._error = exc
            self._finish(kv)
            return None

    def _finish(self, kv: StreamedKV) -> None:
        with self.arrived:
            kv._finished = True
            self.arrived.notify_all()

    def close(self) -> None:
        """Stop reading (layers not read yet never arrive) and wait for the thread to release
        the readers. Called after a prefill that used every layer, it only waits for a disk
        variant's promotion to finish."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> "LayerStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _copy_stream_for(readers: Sequence[LayerReader]) -> "torch.cuda.Stream | None":
    """A CUDA stream for the thread's copies when any reader hands layers out on a GPU."""
    devices = {r.device for r in readers if r.device.type == "cuda"}
    if not devices:
        return None
    device = next(iter(devices))
    return torch.cuda.Stream(device=device if device.index is not None else torch.cuda.current_device())


def host_copy_bandwidth(device: torch.device, nbytes: int = 64 * 1024 * 1024, repeats: int = 3) -> float:
    """Bytes per second of one copy of ``nbytes`` from host memory (pinned, for a GPU) to
    ``device``: the fastest of ``repeats``. An upper bound on what streaming from the
    memory tier reaches, whose per-layer copies are smaller."""
    pin = device.type == "cuda"
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if pin else (lambda: None)
    best = math.inf
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        target.copy_(source, non_blocking=pin)
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)
