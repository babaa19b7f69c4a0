"""cachecraft store: chunk-cache variants in GPU / CPU / disk tiers under byte budgets.

Bytes only, no policy decisions: the policy package decides which variant to use and
how much to recompute; the store keeps, moves, verifies and hands out the bytes.
"""

from cachecraft.store.errors import (CacheDirError, CorruptEntryError, DiskFullError, SelectorError,
                                     StoreBusyError, StoreConfigError, StoreError)
from cachecraft.store.eviction import (POLICIES, CacheCraftPolicy, DecayPolicy, EntryInfo, EvictionPolicy,
                                       LFUPolicy, LRUPolicy, PGDSFPolicy, make_policy)
from cachecraft.store.maintenance import DestroyReport, EvictReport, destroy
from cachecraft.store.readers import LayerReader
from cachecraft.store.streaming import LayerStream, StreamedKV
from cachecraft.store.store import StoreCounters, TieredStore, TierState, store_paths
from cachecraft.store.verify import Problem, VerifyReport, verify

__all__ = [
    "CacheDirError", "CorruptEntryError", "DiskFullError", "StoreBusyError", "StoreConfigError",
    "SelectorError", "DestroyReport", "EvictReport", "destroy",
    "StoreError", "POLICIES", "CacheCraftPolicy", "DecayPolicy", "EntryInfo", "EvictionPolicy", "LFUPolicy",
    "LRUPolicy", "PGDSFPolicy", "make_policy", "LayerReader", "LayerStream", "StreamedKV",
    "StoreCounters", "TieredStore", "TierState", "store_paths", "Problem", "VerifyReport", "verify",
]
