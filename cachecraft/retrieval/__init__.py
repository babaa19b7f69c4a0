"""cachecraft retrieval."""
