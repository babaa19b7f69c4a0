"""Adapters for other frameworks (LlamaIndex first)."""
