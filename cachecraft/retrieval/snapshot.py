"""The corpus on disk: immutable generations behind an atomically replaced pointer.

``<corpus dir>/CURRENT`` names the live generation folder ``gen-<id>/``, which holds
``corpus.json`` (embedder, settings, files, chunk records) and the FAISS index
(:class:`ChunkIndex`: chunk texts, with chunk ids as sources). A writer builds a new
generation in full, then swaps ``CURRENT`` with ``os.replace``, so a crash at any
point leaves the previous corpus intact. Two file locks: ``ingest.lock`` (exclusive)
serialises writers; ``read.lock`` is held shared while a generation is read and
exclusively while the pointer moves and old generations are deleted, so a reader
never sees a generation disappear under it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from cachecraft.prompt import PromptBuilder
from cachecraft.retrieval.index import ChunkIndex
from cachecraft.store.locks import FileLock

FORMAT_VERSION = 1
POINTER, META = "CURRENT", "corpus.json"
INGEST_LOCK, READ_LOCK = "ingest.lock", "read.lock"
SWAP_TIMEOUT_S = 30.0


class CorpusError(ValueError):
    """The corpus cannot do what was asked; the message says what to do."""


class CorpusBusyError(CorpusError):
    """Another process held the corpus lock for longer than the timeout."""


@dataclass(frozen=True)
class CorpusChunk:
    """One ingested chunk; ``id`` is the sha256 of its text."""

    id: str
    text: str
    title: str
    source: str
    position: int

    @property
    def prompt_text(self) -> str:
        """The chunk as written into the prompt (and cached)."""
        return PromptBuilder.chunk_text(self.text, self.title)


@dataclass
class Snapshot:
    """One generation of the corpus, in memory."""

    embedder: str | None = None
    settings: dict = field(default_factory=dict)
    files: dict[str, list[str]] = field(default_factory=dict)  # source path -> chunk ids in order
    chunks: dict[str, CorpusChunk] = field(default_factory=dict)
    index: ChunkIndex | None = None  # rows in the order of ``index.sources`` (chunk ids)
    generation: str | None = None

    def __len__(self) -> int:
        return len(self.chunks)


class SnapshotStore:
    """Reads and writes :class:`Snapshot` generations in one directory."""

    def __init__(self, directory: Path, lock_timeout_s: float = 600.0):
        self.directory = Path(directory)
        self.lock_timeout_s = lock_timeout_s
        self._read_lock = FileLock(self.directory / READ_LOCK)
        self._ingest_lock = FileLock(self.directory / INGEST_LOCK)

    def current(self) -> str | None:
        """The live generation's folder name, or None for an empty corpus."""
        try:
            name = (self.directory / POINTER).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        return name or None

    def read(self) -> Snapshot:
        """The live generation (an empty snapshot when nothing was ingested)."""
        if self.current() is None:
            return Snapshot()
        self._ensure_dir()
        with self._read_lock.shared():
            name = self.current()
            return Snapshot() if name is None else _read_generation(self.directory / name, name)

    @contextlib.contextmanager
    def writing(self) -> Iterator[Snapshot]:
        """Hold the writer lock; yields the live snapshot to build the next one from."""
        self._ensure_dir()
        with self._ingest_lock.exclusive(self.lock_timeout_s) as got:
            if not got:
                raise CorpusBusyError(f"another process is writing the corpus in {self.directory}; "
                                      "wait for it to finish and retry")
            yield self.read()

    def publish(self, snapshot: Snapshot) -> str:
        """Write ``snapshot`` as a new generation and make it live (call inside :meth:`writing`)."""
        name = f"gen-{uuid.uuid4().hex[:16]}"
        _write_generation(self.directory / name, snapshot)
        self._swap(name)
        snapshot.generation = name
        return name

    def erase(self) -> None:
        """Delete the whole corpus (call inside :meth:`writing`)."""
        self._swap(None)

    def _swap(self, name: str | None) -> None:
        pointer = self.directory / POINTER
        with self._read_lock.exclusive(SWAP_TIMEOUT_S) as got:
            if name is None:
                pointer.unlink(missing_ok=True)
            else:
                _atomic_write(pointer, name)
            if got:  # with readers still busy, old generations go on the next write
                self._drop_generations(keep=name)

    def _drop_generations(self, keep: str | None) -> None:
        for path in self.directory.glob("gen-*"):
            if path.name != keep:
                shutil.rmtree(path, ignore_errors=True)

    def _ensure_dir(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CorpusError(f"cannot create the corpus directory {self.directory}: {exc.strerror}") from None


def _read_generation(folder: Path, name: str) -> Snapshot:
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
        index = ChunkIndex.load(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise CorpusError(f"the corpus in {folder.parent} is damaged ({exc}); start over with "
                          "`cachecraft clear --corpus --yes` and ingest again") from None
    if meta.get("version") != FORMAT_VERSION:
        raise CorpusError(f"the corpus in {folder.parent} has format {meta.get('version')}, this cachecraft "
                          f"reads {FORMAT_VERSION}; start over with `cachecraft clear --corpus --yes`")
    records = meta["chunks"]
    chunks = {cid: CorpusChunk(cid, text, *records[cid]) for text, cid in zip(index.texts, index.sources)}
    return Snapshot(meta["embedder"], meta["settings"], meta["files"], chunks, index, name)


def _write_generation(folder: Path, snapshot: Snapshot) -> None:
    assert snapshot.index is not None and len(snapshot.index) == len(snapshot.chunks)
    folder.mkdir(parents=True)
    snapshot.index.save(folder)
    records = {c.id: [c.title, c.source, c.position] for c in snapshot.chunks.values()}
    meta = {"version": FORMAT_VERSION, "embedder": snapshot.embedder, "settings": snapshot.settings,
            "files": snapshot.files, "chunks": records}
    _atomic_write(folder / META, json.dumps(meta))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
