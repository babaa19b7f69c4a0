"""cachecraft: a chunk-cache manager for retrieval-augmented generation."""

__version__ = "0.1.0"
