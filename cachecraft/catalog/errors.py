"""Errors raised by the catalog; each message is one line that says what to do."""

from __future__ import annotations


class CatalogError(Exception):
    """The catalog database cannot be used as asked."""


class SchemaVersionError(CatalogError):
    """The catalog was written by an incompatible cachecraft version (or is not ours)."""


class CatalogCorruptError(CatalogError):
    """The catalog database file is damaged."""


class CatalogWriteError(CatalogError):
    """The catalog could not be written (disk full, read-only file or directory)."""


class CatalogUnavailableError(CatalogError):
    """The catalog's server (``catalog_url``) cannot be reached."""


class CatalogBusyError(CatalogUnavailableError):
    """Another process held the catalog's write lock for longer than the timeout.

    The write is lost as in an outage, so every caller that goes on without the catalog
    (a request's hit counts, new chunk-caches, its row) goes on without it here too; reads
    go on, and writes fail at once until a retry is due (see :class:`Catalog`)."""


class CatalogCollisionError(CatalogUnavailableError):
    """The catalog's server rolled this transaction back in a collision with another writer
    (a deadlock, a serialization failure). Its write is lost as in an outage, so every
    caller that goes on without the catalog goes on without it here too; but the server
    answered, so no outage starts and the next transaction goes ahead."""
