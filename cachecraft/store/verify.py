"""``cachecraft verify [--repair]``: walk catalog and disk tier, report every inconsistency.

Checks, in order:

1. the catalog database opens and passes SQLite's integrity check (a damaged catalog
   is moved aside and, with ``repair``, rebuilt from the blobs on disk);
2. the disk tier's diskcache database opens and passes its integrity check (a damaged
   one is moved aside and, with ``repair``, every blob file that still verifies is
   salvaged into a fresh one);
3. every disk row of the catalog has its blob, the blob's tag equals the row's
   checksum, and the blob decodes with every checksum right and its key recomputed
   from its tokens, fingerprint and prefix;
4. no blob or file lies in the disk tier without a catalog row;
5. memory-tier rows belong to processes still alive;
6. every variant's ``tier`` column names the fastest tier that holds it;
7. with ``redis_url``, every entry of the shared tier: readable index entry, value present
   and passing its checksums, no value without an index entry, the byte count right and
   within ``redis_budget_bytes``.

With ``catalog_url`` the catalog is a PostgreSQL database several cache directories
(nodes) may share: step 1 is the server's own business, and steps 3-5 cover this node's
rows; a node whose disk tier the catalog does not know is joined (with ``repair``).

Verify holds the store's maintenance lock exclusively, so disk writers wait for it.
Repairing a damaged catalog replaces the file: stop other processes using the cache
directory first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachecraft.catalog import Catalog, CatalogCorruptError, EntryRecord, catalog_path
from cachecraft.catalog.records import fastest_tier
from cachecraft.store.codec import Blob, BlobError, decode, header_checksum
from cachecraft.store.errors import SharedTierError, StoreBusyError, StoreError
from cachecraft.store.locks import FileLock, owner_alive
from cachecraft.store.nodes import join_catalog, node_id
from cachecraft.store.paths import MAINTENANCE_LOCK, store_paths
from cachecraft.store.recover import rebuild_from_disk, record_blob
from cachecraft.store.tiers import DISKCACHE_DB, DiskTier

log = logging.getLogger(__name__)

_ANY_BUDGET = 2**62  # verify never evicts; the budget is irrelevant here


@dataclass(frozen=True)
class Problem:
    """One inconsistency: what kind, on what, details, and whether it was repaired."""

    kind: str
    target: str
    detail: str
    repaired: bool = False


@dataclass
class VerifyReport:
    """What :func:`verify` found (and fixed); ``to_dict`` is JSON-serialisable."""

    cache_dir: str
    repair: bool
    problems: list[Problem] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    @property
    def consistent(self) -> bool:
        """The cache is consistent now: no problem, or every problem repaired."""
        return all(p.repaired for p in self.problems)

    def add(self, kind: str, target: str, detail: str, repaired: bool) -> None:
        """Record one problem."""
        self.problems.append(Problem(kind, target, detail, repaired))
        (log.warning if not repaired else log.info)("verify: %s %s: %s%s", kind, target, detail,
                                                    " (repaired)" if repaired else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        by_kind: dict[str, int] = {}
        for p in self.problems:
            by_kind[p.kind] = by_kind.get(p.kind, 0) + 1
        return {"cache_dir": self.cache_dir, "repair": self.repair, "ok": self.ok,
                "consistent": self.consistent, "counts": dict(self.counts),
                "problems_by_kind": by_kind, "problems": [dataclasses.asdict(p) for p in self.problems]}

    def to_json(self, **kwargs) -> str:
        """One JSON document."""
        return json.dumps(self.to_dict(), **kwargs)


def verify(cache_dir: str | Path, repair: bool = False, *, catalog_url: str | None = None,
           redis_url: str | None = None, redis_budget_bytes: int = _ANY_BUDGET,
           lock_timeout_s: float = 60.0) -> VerifyReport:
    """Check (and with ``repair`` fix) the catalog and disk tier of ``cache_dir``, and the
    shared tier when ``redis_url`` is given.

    With ``catalog_url`` (a PostgreSQL catalog several nodes share) the checks cover this
    cache directory's rows (its node's disk tier and processes) and the variants' tier
    column; the server keeps its own integrity. Raises :class:`StoreBusyError` if disk
    writers keep the maintenance lock busy longer than ``lock_timeout_s``,
    :class:`SchemaVersionError` for a catalog of an incompatible version (never
    modified), :class:`CatalogUnavailableError` for an unreachable catalog server and
    :class:`SharedTierError` for an unreachable Redis.
    """
    cache_dir = Path(cache_dir)
    report = VerifyReport(str(cache_dir), repair)
    if redis_url:
        _check_shared(redis_url, redis_budget_bytes, report)
    root, disk_dir, locks_dir = store_paths(cache_dir)
    if not catalog_url and not catalog_path(cache_dir).exists() and not disk_dir.exists():
        report.counts.update({"chunks": 0, "variants": 0, "disk_entries": 0, "disk_bytes": 0})
        log.info("verify: no cache at %s", cache_dir)
        return report
    locks_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(locks_dir / MAINTENANCE_LOCK).exclusive(lock_timeout_s) as got:
        if not got:
            raise StoreBusyError(f"processes writing to {cache_dir} kept it busy for {lock_timeout_s:.0f} s; "
                                 "retry verify later")
        if catalog_url:
            catalog, rebuild, node = _open_server_catalog(cache_dir, catalog_url, root, disk_dir, report)
        else:
            (catalog, rebuild), node = _open_catalog(cache_dir, report), ""
        try:
            disk = (_open_disk(disk_dir, catalog, report, node)
                    if catalog is not None and node is not None else None)
            if catalog is not None and disk is not None:
                try:
                    if rebuild:
                        _rebuild_catalog(catalog, disk, report, node)
                    _check_disk(catalog, disk, report, node)
                    _check_owners(catalog, locks_dir, report, node)
                finally:
                    disk.close()
            if catalog is not None:
                _check_tiers(catalog, report)
                report.counts.update(_counts(catalog))
        finally:
            if catalog is not None:
                catalog.close()
    return report


def _check_shared(url: str, budget: int, report: VerifyReport) -> None:
    """Every entry of the shared tier read and checked (see :meth:`RedisTier.audit`)."""
    from cachecraft.store.shared import RedisTier
    tier = RedisTier(url, budget)
    try:
        problems = tier.audit(report.repair)
        report.counts.update(shared_entries=tier.count(), shared_bytes=tier.used())
    except tier._redis_errors as exc:
        raise SharedTierError(f"redis_url {tier.where} cannot be reached ({str(exc).splitlines()[0]}); "
                              "start the server or fix redis_url, then verify again") from None
    finally:
        tier.close()
    for kind, target, detail in problems:
        report.add(kind, target, detail, report.repair)


def _open_server_catalog(cache_dir: Path, url: str, root: Path, disk_dir: Path,
                         report: VerifyReport) -> tuple[Catalog, bool, str | None]:
    """The shared catalog, whether this node's rows must be rebuilt, and its node id (None
    when it never joined and is not being repaired: its disk tier is then not checked)."""
    catalog = Catalog(cache_dir, url=url)
    node = node_id(root)
    if node is not None:
        with catalog.read() as tx:
            known = node in tx.nodes()
        if known:
            return catalog, False, node
    blobs = disk_dir.is_dir() and any(disk_dir.rglob("*.val"))
    if not blobs:
        return catalog, False, node
    if not report.repair:
        report.add("node-not-joined", str(cache_dir), f"the disk tier holds blobs the catalog at {catalog.where} "
                   "has no rows for", False)
        return catalog, False, None
    node, _ = join_catalog(catalog, root)
    report.add("node-not-joined", str(cache_dir), "joined the catalog; its disk tier's blobs recorded", True)
    return catalog, True, node


def _move_aside(path: Path) -> Path:
    target = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    os.replace(path, target)
    return target


def _open_catalog(cache_dir: Path, report: VerifyReport) -> tuple[Catalog | None, bool]:
    """Open the catalog; a damaged one is reported and, when repairing, moved aside."""
    path = catalog_path(cache_dir)
    damage = None
    if not path.exists():
        damage = "catalog file is missing"
    else:
        try:
            catalog = Catalog(cache_dir)
        except CatalogCorruptError as exc:
            damage = str(exc)
        else:
            try:
                findings = catalog.integrity_problems()
            except CatalogCorruptError as exc:
                findings = [str(exc)]
            if not findings:
                return catalog, False
            catalog.close()
            damage = "; ".join(findings[:5])
    if not report.repair:
        report.add("catalog-damaged", str(path), damage, False)
        return None, False
    if path.exists():
        moved = _move_aside(path)
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                os.replace(side, moved.with_name(moved.name + suffix))
        damage += f"; old file kept as {moved.name}"
    report.add("catalog-damaged", str(path), damage + "; rebuilt from the disk tier", True)
    return Catalog(cache_dir), True


def _open_disk(disk_dir: Path, catalog: Catalog, report: VerifyReport, node: str) -> DiskTier | None:
    """Open the disk tier; a damaged database is moved aside and its sound blobs salvaged.

    A salvaged blob takes the place of the catalog row that names its checksum, or gets
    new rows when the catalog has none for its variant.
    """
    db = disk_dir / DISKCACHE_DB
    damage = None
    if db.exists():
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=60)
            try:
                rows = [r[0] for r in con.execute("PRAGMA integrity_check")]
            finally:
                con.close()
            if rows != ["ok"]:
                damage = "; ".join(rows[:5])
        except sqlite3.DatabaseError as exc:
            damage = str(exc)
    if damage is None:
        try:
            return DiskTier(disk_dir, _ANY_BUDGET)
        except StoreError as exc:
            damage = str(exc)
    if not report.repair:
        report.add("disk-db-damaged", str(db), damage, False)
        return None
    moved = _move_aside(disk_dir)
    disk = DiskTier(disk_dir, _ANY_BUDGET)
    salvaged = 0
    for path in moved.rglob("*.val"):
        try:
            data = path.read_bytes()
            checksum = header_checksum(data)
            kv = decode(data, checksum)
        except (OSError, BlobError):
            continue
        blob_id = f"{kv.variant}.{uuid.uuid4().hex[:12]}"
        with catalog.write() as tx:
            row = tx.entry(kv.variant, "disk", node)
            if row is not None and row.checksum != checksum:
                continue  # an older copy the current row replaced
            disk.write(blob_id, Blob(data, checksum))
            if row is None:
                record_blob(tx, kv, blob_id, checksum, len(data), node)
            else:
                tx.add_entry(EntryRecord(kv.variant, "disk", node, len(data), blob_id, checksum, node=node))
        salvaged += 1
    shutil.rmtree(moved, ignore_errors=True)
    report.add("disk-db-damaged", str(db), f"{damage}; {salvaged} sound blobs salvaged", True)
    return disk


def _rebuild_catalog(catalog: Catalog, disk: DiskTier, report: VerifyReport, node: str) -> None:
    """Fill a fresh catalog with a row for every sound blob (one per variant)."""
    report.counts["rebuilt_entries"] = rebuild_from_disk(catalog, disk, node)


def _check_disk(catalog: Catalog, disk: DiskTier, report: VerifyReport, node: str) -> None:
    listing = disk.listing()
    with catalog.read() as tx:
        rows = tx.entries(tier="disk", owner=node)
    referenced: set[str] = set()
    checked = 0
    for row in rows:
        found = listing.get(row.blob)
        problem = None
        if found is None:
            problem = ("missing-bytes", "no blob for this row")
        elif found.tag != row.checksum:
            problem = ("checksum-mismatch", "blob tag differs from the catalog checksum")
        else:
            data = disk.read(row.blob)
            checked += 1
            if data is None:
                problem = ("missing-bytes", "blob file is missing")
            else:
                try:
                    decode(data, row.checksum, row.variant_key)
                except BlobError as exc:
                    problem = ("damaged-blob", str(exc))
                else:
                    if len(data) != row.nbytes:
                        problem = ("wrong-size", f"catalog says {row.nbytes} bytes, blob has {len(data)}")
        if found is not None:
            referenced.add(row.blob)  # reported (and removed) with its row, not as an orphan
        if problem is None:
            continue
        if report.repair:
            with catalog.write() as tx:
                if tx.remove_entry(row.variant_key, "disk", node, blob=row.blob) is not None:
                    kind = "lost" if problem[0] == "missing-bytes" else "corrupt"
                    tx.event(kind, row.variant_key, "disk", None, row.nbytes, "verify")
            disk.delete(row.blob)
        report.add(problem[0], row.variant_key, problem[1], report.repair)
    for blob_id in sorted(set(listing) - referenced):
        if report.repair:
            disk.delete(blob_id)
        report.add("orphan-blob", blob_id, "blob with no catalog row", report.repair)
    for path in disk.unknown_files(disk.listing()):
        if report.repair:
            path.unlink(missing_ok=True)
        report.add("orphan-file", str(path), "file with no diskcache row", report.repair)
    if report.repair:
        disk.remove_empty_dirs()
    report.counts["blobs_checked"] = checked


def _check_owners(catalog: Catalog, locks_dir: Path, report: VerifyReport, node: str) -> None:
    with catalog.read() as tx:
        owners = tx.memory_owners(node)
    for owner in sorted(owners):
        if owner_alive(locks_dir, owner):
            continue
        if report.repair:
            with catalog.write() as tx:
                n = len(tx.remove_owner(owner, "lost"))
        else:
            with catalog.read() as tx:
                n = len([e for e in tx.entries(owner=owner) if e.tier != "disk"])
        report.add("dead-owner", owner, f"{n} memory-tier rows of a process that is gone", report.repair)


def _check_tiers(catalog: Catalog, report: VerifyReport) -> None:
    with catalog.read() as tx:
        entries = tx.entries()
        recorded = tx.variant_tiers()
    tiers: dict[str, set[str]] = {}
    for e in entries:
        tiers.setdefault(e.variant_key, set()).add(e.tier)
    for key, tier in sorted(recorded.items()):
        expected = fastest_tier(tiers.get(key, ()))
        if tier == expected:
            continue
        if report.repair:
            with catalog.write() as tx:
                tx.refresh_tier(key)
        report.add("tier-mismatch", key, f"variant says {tier}, entries say {expected}", report.repair)


def _counts(catalog: Catalog) -> dict[str, int]:
    with catalog.read() as tx:
        return tx.counts()
