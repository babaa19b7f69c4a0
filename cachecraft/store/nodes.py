"""A cache directory's identity (its node id) in a catalog several nodes share.

With ``catalog_url`` set, several cache directories (nodes: machines, or directories on
one machine) keep one catalog. Each owns the disk rows recorded under its id, and sees
the others' chunks, variants, statistics and requests.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

from cachecraft.catalog import Catalog

NODE_ID_FILE = "node-id"
LEGACY_ID_FILE = "catalog-id"  # what a schema-1 server catalog called the same id


def join_catalog(catalog: Catalog, root: Path) -> tuple[str, bool]:
    """This cache directory's node id in a server catalog (``catalog_url``), and whether it
    joined the catalog just now.

    Several cache directories (nodes: machines, or directories on one machine) share one
    catalog; each owns the disk rows under its id, kept in ``<store root>/node-id`` and
    made on first use. A node that joins finds its own disk tier's blobs recorded anew.
    """
    id_file, legacy = root / NODE_ID_FILE, root / LEGACY_ID_FILE
    if not id_file.is_file() and legacy.is_file():
        legacy.replace(id_file)
    node = id_file.read_text().strip() if id_file.is_file() else ""
    if not node:
        node = uuid.uuid4().hex[:16]
        tmp = id_file.with_suffix(".tmp")
        tmp.write_text(node + "\n")
        tmp.replace(id_file)
    about = {"cache_dir": str(root.parent), "host": socket.gethostname(), "joined_at": time.time()}
    with catalog.write() as tx:
        known = tx.nodes().get(node)
        if known is not None:
            about["joined_at"] = known.get("joined_at", about["joined_at"])
        joined = tx.join_node(node, about)
    return node, joined


def node_id(root: Path) -> str | None:
    """The node id recorded in a store root, or None before the directory joined a catalog."""
    for name in (NODE_ID_FILE, LEGACY_ID_FILE):
        path = root / name
        if path.is_file():
            return path.read_text().strip() or None
    return None
