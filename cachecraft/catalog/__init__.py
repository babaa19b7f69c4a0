"""cachecraft catalog: what is cached, where, and what each request did (SQLite or PostgreSQL)."""

from cachecraft.catalog.db import (CATALOG_FILE, Catalog, CatalogTx, catalog_path, display_url,
                                   remove_catalog)
from cachecraft.catalog.errors import (CatalogBusyError, CatalogCollisionError, CatalogCorruptError,
                                       CatalogError, CatalogUnavailableError, CatalogWriteError,
                                       SchemaVersionError)
from cachecraft.catalog.models import SCHEMA_VERSION
from cachecraft.catalog.records import (EVENT_KINDS, MISS, TIERS, ChunkRecord, EntryRecord,
                                        RequestChunk, RequestRecord, TierEventRecord,
                                        VariantRecord, question_hash)

__all__ = [
    "CATALOG_FILE", "Catalog", "CatalogTx", "catalog_path", "display_url", "remove_catalog",
    "CatalogError", "CatalogUnavailableError", "CatalogCollisionError", "CatalogBusyError", "CatalogCorruptError",
    "CatalogWriteError", "SchemaVersionError",
    "SCHEMA_VERSION", "EVENT_KINDS", "MISS", "TIERS", "ChunkRecord", "EntryRecord",
    "RequestChunk", "RequestRecord", "TierEventRecord", "VariantRecord", "question_hash",
]
