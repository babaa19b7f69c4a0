"""The persistent corpus: chunk records, their embeddings and a FAISS index.

Chunks are deduplicated by content (id = sha256 of the text). Ingesting a file again
replaces that file's chunks; ingesting a directory again also drops files that are no
longer in it; forgetting a file or a directory drops its files. Every write publishes a
new generation (see :mod:`snapshot`), so readers in other processes always see a whole
corpus.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Iterable, Mapping, Sequence, TypeVar

import numpy as np

from cachecraft.config import RETRIEVAL_ORDERS
from cachecraft.retrieval.chunking import TextChunk
from cachecraft.retrieval.index import ChunkIndex
from cachecraft.retrieval.snapshot import CorpusChunk, CorpusError, Snapshot, SnapshotStore

T = TypeVar("T")

Progress = Callable[[int, int], None]
EMBED_BATCH = 256  # chunks embedded per call (and per progress update)


def chunk_id(text: str) -> str:
    """A chunk's id: the sha256 of its text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def embedding_text(chunk: CorpusChunk | TextChunk) -> str:
    """What gets embedded for a chunk: its title and text."""
    return f"{chunk.title}\n{chunk.text}" if chunk.title else chunk.text


@dataclass(frozen=True)
class SearchHit:
    """One retrieved chunk and its cosine similarity to the question."""

    chunk: CorpusChunk
    score: float


def grouped_by_document(items: Sequence[T], document: Callable[[T], Hashable],
                        position: Callable[[T], float]) -> list[T]:
    """``items`` (best first) with each ``document``'s items together, in ``position``
    order (equal positions keep their order); the documents keep the order of their best
    items."""
    by_document: dict[Hashable, list[T]] = {}
    for item in items:
        by_document.setdefault(document(item), []).append(item)
    return [item for group in by_document.values() for item in sorted(group, key=position)]


def document_order(hits: Sequence[SearchHit]) -> list[SearchHit]:
    """``hits`` (best first) with each source file's chunks together and in their order in
    the file; the files keep the order of their best chunks."""
    return grouped_by_document(hits, lambda h: h.chunk.source, lambda h: h.chunk.position)


@dataclass(frozen=True)
class IngestReport:
    """What one ingest changed."""

    added: int
    unchanged: int
    removed: int
    files: int  # files read in this ingest
    chunks: int  # corpus size after it
    corpus_files: int

    def to_dict(self) -> dict:
        """JSON-friendly counts."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class ForgetReport:
    """What one forget changed."""

    files: tuple[str, ...]  # the files dropped, as ingested
    removed: int  # chunks no longer held by any file
    chunks: int  # corpus size after it
    corpus_files: int

    def to_dict(self) -> dict:
        """JSON-friendly counts and the files dropped."""
        return {**self.__dict__, "files": list(self.files)}


class Corpus:
    """The corpus in ``directory``, embedded with ``embedder`` (a name for :class:`Embedder`).

    ``embed`` replaces the embedding model (texts -> unit vectors), for tests.
    """

    def __init__(self, directory: str | Path, embedder: str = "minilm",
                 embed: Callable[[Sequence[str]], np.ndarray] | None = None, lock_timeout_s: float = 600.0):
        self.directory = Path(directory)
        self.embedder = embedder
        self.snapshots = SnapshotStore(self.directory, lock_timeout_s)
        self._embed = embed
        self._cached: Snapshot | None = None

    # -- reading ---------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The live corpus (re-read only when another process published a new one)."""
        if self._cached is None or self._cached.generation != self.snapshots.current():
            self._cached = self.snapshots.read()
        return self._cached

    def __len__(self) -> int:
        return len(self.snapshot())

    def chunks(self) -> list[CorpusChunk]:
        """Every chunk, by source file and position."""
        return sorted(self.snapshot().chunks.values(), key=lambda c: (c.source, c.position, c.id))

    def documents(self) -> dict[str, int]:
        """Every ingested file (absolute path, sorted) -> its number of distinct chunks."""
        return {src: len(ids) for src, ids in sorted(self.snapshot().files.items())}

    def search(self, question: str, k: int, order: str = "score") -> list[SearchHit]:
        """The ``k`` chunks most similar to ``question`` (``k`` capped at the corpus size),
        best first, or with ``order`` "document" in :func:`document_order`."""
        if not question or not question.strip():
            raise CorpusError("the question is empty")
        if k < 1:
            raise CorpusError(f"top_k must be at least 1, got {k}")
        if order not in RETRIEVAL_ORDERS:
            raise CorpusError(f"the retrieval order must be one of {RETRIEVAL_ORDERS}, got {order!r}")
        snap = self.snapshot()
        if not snap.chunks:
            raise CorpusError(f"the corpus in {self.directory} is empty: run `cachecraft ingest PATH` first")
        self._check_embedder(snap)
        hits = snap.index.search(self.embed([question.strip()])[0], min(k, len(snap)))
        found = [SearchHit(snap.chunks[h.source], h.score) for h in hits]
        return document_order(found) if order == "document" else found

    def previous_chunks(self) -> dict[str, CorpusChunk]:
        """Every chunk's id -> the chunk right before it in its file (a file's first chunk,
        and a chunk whose predecessor was the same text as an earlier chunk, have none)."""
        ordered = self.chunks()
        return {chunk.id: before for before, chunk in zip(ordered, ordered[1:])
                if before.source == chunk.source and before.position + 1 == chunk.position}

    def neighbours(self, k: int) -> dict[str, list[CorpusChunk]]:
        """Every chunk's ``k`` nearest other chunks in the index (by embedding), most similar
        first: the chunks a retrieval is likely to return beside it."""
        snap = self.snapshot()
        if snap.index is None or not snap.chunks:
            return {}
        rows = snap.index.neighbours(k)
        ids = snap.index.sources
        return {ids[row]: [snap.chunks[ids[j]] for j in near] for row, near in enumerate(rows)}

    # -- writing ---------------------------------------------------------------------------
    def ingest(self, files: Mapping[str, Sequence[TextChunk]], *, scopes: Iterable[str | Path] = (),
               settings: Mapping | None = None, progress: Progress | None = None,
               chunk_progress: Progress | None = None) -> IngestReport:
        """Add or replace the chunks of each source file in ``files``.

        ``scopes``: directories that were read whole; corpus files under them that are
        not in ``files`` are dropped. ``settings`` (chunking, model) are recorded.
        ``progress`` counts source files embedded, ``chunk_progress`` chunks embedded
        (every ``EMBED_BATCH``)."""
        with self.snapshots.writing() as old:
            self._check_embedder(old)
            sources = _merge_files(old.files, files, scopes)
            chunks = _records(sources, old.chunks, files)
            index = self._index(old, chunks, progress, len(files), chunk_progress)
            new = Snapshot(self.embedder, dict(settings or old.settings), sources, chunks, index)
            if _same(old, new):
                new = old
            else:
                self.snapshots.publish(new)
            self._cached = new
        given = {chunk_id(c.text) for group in files.values() for c in group}
        return IngestReport(len(chunks.keys() - old.chunks.keys()), len(given & old.chunks.keys()),
                            len(old.chunks.keys() - chunks.keys()), len(files), len(chunks), len(sources))

    def forget(self, paths: Iterable[str | Path]) -> ForgetReport:
        """Drop from the corpus every file ``paths`` name (see :func:`documents_named`):
        its chunks leave the index unless another file holds them too. Nothing changes
        when one path names no ingested file (:class:`CorpusError`)."""
        with self.snapshots.writing() as old:
            dropped = documents_named(old.files, paths)
            files = {src: ids for src, ids in old.files.items() if src not in dropped}
            chunks = _records(files, old.chunks, {})
            new = Snapshot(old.embedder, dict(old.settings), files, chunks, self._index(old, chunks, None, 0))
            self.snapshots.publish(new)
            self._cached = new
        return ForgetReport(tuple(sorted(dropped)), len(old.chunks.keys() - chunks.keys()), len(chunks), len(files))

    def erase(self) -> None:
        """Delete every chunk and the index."""
        with self.snapshots.writing():
            self.snapshots.erase()
        self._cached = None

    # -- helpers ---------------------------------------------------------------------------
    def load_embedder(self) -> None:
        """Load the embedding model now (otherwise it loads on first use)."""
        if self._embed is None:
            from cachecraft.retrieval.embed import Embedder
            self._embed = Embedder(self.embedder).embed

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors for ``texts``."""
        self.load_embedder()
        return self._embed(list(texts))

    def _check_embedder(self, snap: Snapshot) -> None:
        if snap.embedder is not None and snap.chunks and snap.embedder != self.embedder:
            raise CorpusError(f"the corpus in {self.directory} was embedded with {snap.embedder!r}, not "
                              f"{self.embedder!r}; set embedder = {snap.embedder!r} (CACHECRAFT_EMBEDDER), "
                              "or start over with `cachecraft clear --corpus --yes`")

    def _index(self, old: Snapshot, chunks: dict[str, CorpusChunk], progress: Progress | None,
               steps: int, chunk_progress: Progress | None = None) -> ChunkIndex:
        """The index over ``chunks``: old vectors kept, new chunks embedded (progress per
        source, and per batch of chunks)."""
        vectors = _old_vectors(old, chunks)
        fresh = [c for c in chunks.values() if c.id not in vectors]
        by_source: dict[str, list[CorpusChunk]] = {}
        for c in fresh:
            by_source.setdefault(c.source, []).append(c)
        done = steps - len(by_source)
        if progress:
            progress(done, steps)
        embedded = 0
        if chunk_progress:
            chunk_progress(0, len(fresh))
        for group in by_source.values():
            for start in range(0, len(group), EMBED_BATCH):
                batch = group[start:start + EMBED_BATCH]
                vectors.update(zip((c.id for c in batch), self.embed([embedding_text(c) for c in batch])))
                embedded += len(batch)
                if chunk_progress:
                    chunk_progress(embedded, len(fresh))
            done += 1
            if progress:
                progress(done, steps)
        ordered = sorted(chunks.values(), key=lambda c: (c.source, c.position, c.id))
        dim = next(iter(vectors.values())).shape[0] if vectors else (old.index.dim if old.index else 1)
        index = ChunkIndex(dim)
        if ordered:
            index.add(np.stack([vectors[c.id] for c in ordered]), [c.text for c in ordered],
                      [c.id for c in ordered])
        return index


def documents_named(sources: Iterable[str], paths: Iterable[str | Path]) -> set[str]:
    """The ingested files (of ``sources``, absolute paths) that ``paths`` name: a file as
    ingested, a directory (every ingested file under it; neither needs to exist any more),
    or a bare file name naming exactly one ingested file. A path naming none, or a file
    name naming several, is a :class:`CorpusError`."""
    known, paths = list(sources), list(paths)
    if not paths:
        raise CorpusError("no path given")
    named: set[str] = set()
    for given in paths:
        text = str(given).strip()
        if not text:
            raise CorpusError("an empty path names no ingested file")
        target = Path(text).expanduser().resolve()
        found = {s for s in known if Path(s) == target or Path(s).is_relative_to(target)}
        if not found and os.sep not in text:
            found = {s for s in known if Path(s).name == text}
            if len(found) > 1:
                raise CorpusError(f"{text!r} names {len(found)} ingested files; give the path: "
                                  + ", ".join(sorted(found)[:3]))
        if not found:
            raise CorpusError(f"nothing was ingested from {text} (`cachecraft documents` lists what was)")
        named |= found
    return named


def _merge_files(old: Mapping[str, list[str]], files: Mapping[str, Sequence[TextChunk]],
                 scopes: Iterable[str | Path]) -> dict[str, list[str]]:
    roots = [Path(s).resolve() for s in scopes]
    merged = {src: ids for src, ids in old.items()
              if src in files or not any(Path(src).is_relative_to(r) for r in roots)}
    for src, chunks in files.items():
        merged[src] = list(dict.fromkeys(chunk_id(c.text) for c in chunks))
    return dict(sorted(merged.items()))


def _records(sources: Mapping[str, list[str]], old: Mapping[str, CorpusChunk],
             files: Mapping[str, Sequence[TextChunk]]) -> dict[str, CorpusChunk]:
    """One record per referenced chunk id, naming a file that still holds it."""
    new: dict[tuple[str, str], TextChunk] = {}
    for src, chunks in files.items():
        for c in chunks:
            new.setdefault((src, chunk_id(c.text)), c)
    held = {src: set(ids) for src, ids in sources.items()}
    out: dict[str, CorpusChunk] = {}
    for src, ids in sources.items():
        for pos, cid in enumerate(ids):
            kept = old.get(cid)
            if cid in out:
                continue
            if kept is not None and cid in held.get(kept.source, ()):
                out[cid] = kept
                continue
            c = new.get((src, cid))
            text, title = (c.text, c.title) if c is not None else (kept.text, kept.title)
            out[cid] = CorpusChunk(cid, text, title, src, c.position if c is not None else pos)
    return out


def _old_vectors(old: Snapshot, chunks: Mapping[str, CorpusChunk]) -> dict[str, np.ndarray]:
    if old.index is None or not len(old.index):
        return {}
    matrix = old.index.index.reconstruct_n(0, len(old.index))
    return {cid: matrix[i] for i, cid in enumerate(old.index.sources) if cid in chunks}


def _same(old: Snapshot, new: Snapshot) -> bool:
    return (old.generation is not None and old.files == new.files and old.chunks == new.chunks
            and old.settings == new.settings and old.embedder == new.embedder)
