"""`evict` and `clear`: drop chunk-caches through the store, or the whole cache state."""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from cachecraft.catalog import CATALOG_FILE
from cachecraft.config import Config
from cachecraft.store import TieredStore, store_paths
from cachecraft.store.locks import FileLock, owner_alive
from cachecraft.store.store import MAINTENANCE_LOCK

from .common import UserError

MEMORY_TIERS = ("gpu", "cpu")
MIN_PREFIX = 6


@dataclass
class EvictReport:
    """Variant keys removed, and a note when nothing could be."""

    removed: list[str] = field(default_factory=list)
    note: str | None = None

    def to_dict(self) -> dict:
        """JSON-friendly report."""
        return {"removed": len(self.removed), "variants": self.removed, "note": self.note}


def evict(config: Config, chunk: str | None, tier: str | None, everything: bool,
          source: str | None = None) -> EvictReport:
    """Remove the variants of one chunk, of every chunk of one document, of one tier, or all
    of them (catalog rows stay, as evicted)."""
    if (chunk is not None) + (source is not None) + (tier is not None) + bool(everything) != 1:
        raise UserError("give exactly one of --chunk ID, --source FILE, --tier TIER or --all")
    if tier is not None and tier not in (*MEMORY_TIERS, "disk"):
        raise UserError(f"unknown tier {tier!r}; choose from gpu, cpu, disk")
    if tier in MEMORY_TIERS:
        return _memory_tier_note(config, tier)
    with TieredStore(config) as store:
        if chunk is not None:
            keys = _variants_of_chunk(store, chunk)
        elif source is not None:
            keys = _variants_of_source(store, source)
        else:
            keys = store.keys("disk")
        return EvictReport([key for key in keys if store.delete(key)])


def _memory_tier_note(config: Config, tier: str) -> EvictReport:
    from cachecraft.catalog import Catalog

    with Catalog(config.cache_dir) as catalog, catalog.read() as tx:
        rows = tx.entries(tier=tier)
    owners = len({r.owner for r in rows})
    return EvictReport(note=f"the {tier} tier lives inside each running cachecraft process ({len(rows)} "
                            f"entries in {owners} process(es)); it moves to disk when they exit: evict "
                            "with --tier disk then")


def _stored_variants(tx) -> list:
    """Catalog records of the variants that have bytes in some tier, by key."""
    stored = {row.variant_key for row in tx.entries()}
    return [r for r in (tx.variant(key) for key in sorted(stored)) if r is not None]


def _variants_of_chunk(store: TieredStore, prefix: str) -> list[str]:
    """Stored variant keys of the chunk whose key (or a variant's key) starts with ``prefix``."""
    prefix = prefix.strip().lower()
    if len(prefix) < MIN_PREFIX:
        raise UserError(f"give at least {MIN_PREFIX} characters of the chunk key (see `cachecraft query` "
                        "or `cachecraft explain`)")
    with store.catalog.read() as tx:
        records = _stored_variants(tx)
    chunks = {r.chunk_key for r in records if r.chunk_key.startswith(prefix) or r.key.startswith(prefix)}
    if not chunks:
        raise UserError(f"no cached chunk matches {prefix!r}")
    if len(chunks) > 1:
        raise UserError(f"{prefix!r} matches {len(chunks)} chunks; give more characters")
    return [r.key for r in records if r.chunk_key in chunks]


def _variants_of_source(store: TieredStore, source: str) -> list[str]:
    """Stored variant keys of every chunk the catalog says came from ``source``: the path
    as ingested (relative paths are resolved), or a file name that names one document."""
    wanted = source.strip()
    if not wanted:
        raise UserError("--source needs a document path or file name")
    with store.catalog.read() as tx:
        records = _stored_variants(tx)
        origin = {}
        for key in {r.chunk_key for r in records}:
            chunk = tx.chunk(key)
            origin[key] = chunk.source if chunk is not None else None
    documents = {s for s in origin.values() if s}
    exact = {s for s in documents if s in (wanted, str(Path(wanted).expanduser().resolve()))}
    named = exact or {s for s in documents if Path(s).name == wanted}
    if not named:
        raise UserError(f"no cached chunk comes from {wanted!r} (see the source column of `cachecraft stats`)")
    if len(named) > 1:
        raise UserError(f"{wanted!r} names {len(named)} documents; give the path: "
                        + ", ".join(sorted(named)[:3]))
    return [r.key for r in records if origin.get(r.chunk_key) in named]


def clear(config: Config, corpus: bool) -> list[str]:
    """Delete every chunk-cache and the catalog (and the corpus with ``corpus``); converted
    models and the config file stay. Refuses while another process has the store open."""
    root, _, locks = store_paths(config.cache_dir)
    busy = [p for p in locks.glob("owner-*.lock") if owner_alive(locks, p.stem.removeprefix("owner-"))]
    if busy:
        raise UserError(f"{len(busy)} other cachecraft process(es) are using {config.cache_dir}; "
                        "stop them, then run clear again")
    removed = []
    lock = FileLock(locks / MAINTENANCE_LOCK).exclusive(10.0) if locks.is_dir() else nullcontext(True)
    with lock as got:
        if not got:
            raise UserError(f"another process is writing to {root}; stop it, then run clear again")
        if root.exists():
            shutil.rmtree(root)
            removed.append(str(root))
        for suffix in ("", "-wal", "-shm"):
            path = Path(config.cache_dir) / (CATALOG_FILE + suffix)
            if path.exists():
                path.unlink()
                removed.append(str(path))
    if corpus:
        from cachecraft.retrieval.corpus import Corpus

        if config.corpus_dir.exists():
            Corpus(config.corpus_dir, config.embedder).erase()
            removed.append(str(config.corpus_dir))
    return removed

