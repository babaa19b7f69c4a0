"""Errors raised by the catalog; each message is one line that says what to do."""

from __future__ import annotations


class CatalogError(Exception):
    """The catalog database cannot be used as asked."""


class SchemaVersionError(CatalogError):
    """The catalog was written by an incompatible cachecraft version (or is not ours)."""


class CatalogCorruptError(CatalogError):
    """The catalog database file is damaged."""


class CatalogBusyError(CatalogError):
    """Another process held the catalog's write lock for longer than the timeout."""


class CatalogWriteError(CatalogError):
    """The catalog could not be written (disk full, read-only file or directory)."""


class CatalogUnavailableError(CatalogError):
    """The catalog's server (``catalog_url``) cannot be reached."""
