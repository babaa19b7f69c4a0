"""A FAISS inner-product index over chunk texts, persisted in a directory."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

INDEX_FILE, META_FILE = "index.faiss", "chunks.json"


@dataclass(frozen=True)
class Hit:
    """One retrieved chunk."""

    index: int
    score: float
    text: str
    source: str


class ChunkIndex:
    """Exact cosine-similarity search (``IndexFlatIP`` over unit vectors)."""

    def __init__(self, dim: int):
        import faiss

        self.dim = dim
        self.index = faiss.IndexFlatIP(dim)
        self.texts: list[str] = []
        self.sources: list[str] = []

    def __len__(self) -> int:
        return len(self.texts)

    def add(self, vectors: np.ndarray, texts: Sequence[str], sources: Sequence[str]) -> None:
        """Add chunks with their embeddings (rows of unit length)."""
        assert vectors.shape == (len(texts), self.dim), f"{vectors.shape} vectors for {len(texts)} texts"
        assert len(texts) == len(sources)
        self.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        self.texts.extend(texts)
        self.sources.extend(sources)

    def search(self, query: np.ndarray, k: int) -> list[Hit]:
        """The ``k`` most similar chunks, best first."""
        if k < 1:
            raise ValueError(f"top_k must be at least 1, got {k}")
        if k > len(self):
            raise ValueError(f"top_k is {k} but the index holds only {len(self)} chunks")
        scores, ids = self.index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), k)
        return [Hit(int(i), float(s), self.texts[i], self.sources[i]) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def neighbours(self, k: int) -> list[list[int]]:
        """For every row, the rows of its ``k`` most similar other chunks, most similar first
        (fewer when the index holds fewer); identical texts are not each other's neighbours."""
        if k < 1 or len(self) < 2:
            return [[] for _ in range(len(self))]
        vectors = np.ascontiguousarray(self.index.reconstruct_n(0, len(self)), dtype=np.float32)

        def others(row: int, found) -> list[int]:
            return [int(i) for i in found if i >= 0 and i != row and self.texts[i] != self.texts[row]][:k]

        want = min(k + 1, len(self))
        _, ids = self.index.search(vectors, want)
        out = [others(row, found) for row, found in enumerate(ids)]
        for row, near in enumerate(out):
            if len(near) < k and want < len(self):  # copies of its text took places: look further
                _, wider = self.index.search(vectors[row:row + 1], len(self))
                out[row] = others(row, wider[0])
        return out

    def save(self, directory: Path) -> None:
        """Write index and chunk list (each to a temporary file, then renamed)."""
        import faiss

        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (INDEX_FILE + ".tmp")
        faiss.write_index(self.index, str(tmp))
        os.replace(tmp, directory / INDEX_FILE)
        meta = directory / (META_FILE + ".tmp")
        meta.write_text(json.dumps({"dim": self.dim, "texts": self.texts, "sources": self.sources}), encoding="utf-8")
        os.replace(meta, directory / META_FILE)

    @classmethod
    def load(cls, directory: Path) -> "ChunkIndex":
        """Read an index written by :meth:`save`."""
        import faiss

        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
        index = cls(meta["dim"])
        index.index = faiss.read_index(str(directory / INDEX_FILE))
        index.texts, index.sources = meta["texts"], meta["sources"]
        if index.index.ntotal != len(index.texts):
            raise ValueError(f"index in {directory} is inconsistent: {index.index.ntotal} vectors, "
                             f"{len(index.texts)} chunks")
        return index
