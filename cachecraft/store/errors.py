"""Errors raised by the store; each message is one line that says what to do."""

from __future__ import annotations


class StoreError(Exception):
    """The chunk-cache store cannot do what was asked."""


class StoreConfigError(StoreError):
    """A store setting is invalid (a budget, a tier name, a dtype)."""


class CacheDirError(StoreError):
    """The cache directory cannot be created or written."""


class DiskFullError(StoreError):
    """The device holding the cache directory ran out of space."""


class CorruptEntryError(StoreError):
    """Stored bytes failed their checksum; the entry was removed (treat it as a miss)."""


class StoreBusyError(StoreError):
    """Another process held the store's maintenance lock for longer than the timeout."""


class SelectorError(StoreError):
    """What names the variants to evict (a chunk key prefix, a document) matches no stored
    chunk, or more than one where one is needed."""


class SharedTierError(StoreError):
    """The shared tier (``redis_url``) cannot be reached where it must be (``verify``);
    requests never raise it: there the shared tier failing is a miss."""
