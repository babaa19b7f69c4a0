"""The shared tier: chunk-caches in Redis (or Valkey), read by every node.

It holds the same bytes as the disk tier (safetensors with per-tensor digests and the
header checksum, see :mod:`cachecraft.store.codec`; nothing pickled) and is indexed in
Redis itself, so a node finds what another node stored without a shared catalog:

- ``cachecraft:blob:<variant>``: the blob, one string (read whole with ``GET``, or
  layer by layer with ``GETRANGE``);
- ``cachecraft:meta`` (hash): variant -> JSON (checksum, size, chunk, the catalog's
  chunk and variant fields);
- ``cachecraft:size`` (hash): variant -> bytes; ``cachecraft:bytes``: their sum;
- ``cachecraft:used`` (sorted set): variant -> last use (the tier evicts least
  recently used first);
- ``cachecraft:chunk:<chunk>`` (set): the chunk's variants.

Puts and deletes are Lua scripts, atomic on the server, so concurrent nodes keep the
byte count exact; cachecraft keeps ``cachecraft:bytes`` under ``redis_budget_bytes``.

Faults: any Redis error (unreachable, restarted, timed out) makes the operation a miss
(reads) or a no-op (writes); the first one logs one warning and the tier then waits
before trying again (backoff doubling from :data:`BACKOFF_START_S` to
:data:`BACKOFF_MAX_S`); the next success logs one line. A value that fails its checksum
or names another variant is deleted and counted (``corrupt``), never served. A flushed
server is an empty tier.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from cachecraft.kv import ChunkKV
from cachecraft.store.codec import (_LAYER, Blob, BlobError, LayeredBlob, _header_length,
                                    _parse_header, checksum, decode)

log = logging.getLogger(__name__)

PREFIX = "cachecraft:"
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
SOCKET_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0
HEADER_GUESS = 64 * 1024  # first read of a blob's head: its header fits in it almost always

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}

# KEYS: blob, meta, size, used, chunk set, bytes; ARGV: variant, data, meta json, nbytes, now
_PUT = """
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then redis.call('DECRBY', KEYS[6], old) end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
return redis.call('INCRBY', KEYS[6], ARGV[4])
"""
# KEYS: blob, meta, size, used, chunk set, bytes; ARGV: variant. Returns the bytes freed.
_DELETE = """
local old = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
if old then redis.call('DECRBY', KEYS[6], old); return tonumber(old) end
return 0
"""


@dataclass
class SharedCounters:
    """What the shared tier did since this store opened."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0  # operations that failed on a Redis error (answered as a miss / skipped)
    skipped: int = 0  # operations not tried while waiting to reconnect

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SharedMeta:
    """What the shared tier records beside a blob (enough to fill a node's catalog)."""

    variant: str
    chunk: str
    checksum: str
    nbytes: int
    fingerprint: str
    num_tokens: int
    prefix: tuple[str, ...]
    dtype: str
    cci: float | None = None
    stats: dict | None = None
    cost_s: float | None = None
    quality: float | None = None
    source: str | None = None

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "prefix": list(self.prefix)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: bytes | str) -> "SharedMeta":
        data = json.loads(text)
        data["prefix"] = tuple(data["prefix"])
        return cls(**data)


def _parse_meta(raw: bytes | str | None) -> SharedMeta | None:
    """A meta record, or None when absent or unreadable (a damaged index entry)."""
    if raw is None:
        return None
    try:
        return SharedMeta.from_json(raw)
    except (ValueError, TypeError, KeyError):
        return None


def _keys(variant: str, chunk: str) -> list[str]:
    return [f"{PREFIX}blob:{variant}", f"{PREFIX}meta", f"{PREFIX}size", f"{PREFIX}used",
            f"{PREFIX}chunk:{chunk}", f"{PREFIX}bytes"]


class RedisTier:
    """The shared tier on one Redis server (see the module docstring).

    ``url``: ``redis://[[user]:password@]host:port/db``, ``rediss://`` for TLS, or
    ``unix://path?db=N``. One connection pool per tier; every command has a timeout.
    """

    name = "redis"
    is_disk = False

    def __init__(self, url: str, budget: int, *, socket_timeout_s: float = SOCKET_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, max_connections: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis_errors = (redis.RedisError, OSError)
        self.budget = budget
        self.counters = SharedCounters()
        # one retry, on a broken connection only: a pooled connection broken by a server
        # restart reconnects at once, while a server that stopped answering costs one
        # socket timeout per attempt, not two
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self.pool = redis.ConnectionPool.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
            max_connections=max_connections, retry=retry, health_check_interval=30)
        self.client = redis.Redis(connection_pool=self.pool)
        self._put_script = self.client.register_script(_PUT)
        self._delete_script = self.client.register_script(_DELETE)
        self._clock = clock
        self._state = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = BACKOFF_START_S
        self.where = _display(url)

    # -- fault handling --------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while waiting to reconnect after an error."""
        return self._down_since is None

    def _call(self, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        """``fn()``, or ``default`` on a Redis error (or while backing off after one)."""
        with self._state:
            if self._down_since is not None and self._clock() < self._retry_at:
                self.counters.skipped += 1
                return default
        try:
            out = fn()
        except self._redis_errors as exc:
            self._failed(what, exc)
            return default
        with self._state:
            if self._down_since is not None:
                log.warning("shared tier %s is reachable again after %.1fs", self.where,
                            self._clock() - self._down_since)
                self._down_since, self._backoff = None, BACKOFF_START_S
        return out

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._state:
            self.counters.errors += 1
            now = self._clock()
            if self._down_since is None:
                self._down_since = now
                log.warning("shared tier %s failed on %s (%s); counting it as a miss and "
                            "retrying with backoff", self.where, what, str(exc).splitlines()[0] if str(exc) else
                            type(exc).__name__)
            else:
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            self._retry_at = now + self._backoff

    # -- writes ----------------------------------------------------------------------

    def put(self, meta: SharedMeta, blob: Blob) -> bool:
        """Store a blob (replacing one of the same variant), then evict least recently used
        entries until the tier is within its budget; False if not stored."""
        size = len(blob.data)
        if size > self.budget:
            return False
        meta = SharedMeta(**{**asdict(meta), "checksum": blob.checksum, "nbytes": size})

        def run() -> int:
            return int(self._put_script(keys=_keys(meta.variant, meta.chunk),
                                        args=[meta.variant, blob.data, meta.to_json(), size, time.time()]))

        used = self._call("put", run)
        if used is None:
            return False
        self.counters.puts += 1
        if used > self.budget:
            self._evict(used, keep=meta.variant)
        return True

    def _evict(self, used: int, keep: str) -> None:
        """Delete least recently used entries (never ``keep``) until within the budget."""
        while used > self.budget:
            oldest = self._call("evict", lambda: self.client.zrange(f"{PREFIX}used", 0, 15), default=[])
            victims = [k.decode() for k in oldest if k.decode() != keep]
            if not victims:
                return
            for key in victims:
                if used <= self.budget:
                    return
                freed = self.delete(key)
                if freed is None:
                    return
                self.counters.evictions += 1
                used -= freed

    def delete(self, variant: str) -> int | None:
        """Remove a variant; the bytes freed (0 if absent), None on a Redis error."""
        def run() -> int:
            meta = _parse_meta(self.client.hget(f"{PREFIX}meta", variant))
            chunk = meta.chunk if meta is not None else "?"
            return int(self._delete_script(keys=_keys(variant, chunk), args=[variant]))

        return self._call("delete", run)

    def clear(self) -> int:
        """Delete the whole tier, every node's entries (each ``cachecraft:*`` key); returns
        how many entries it held. Unlike the request path, a Redis error is raised."""
        entries = int(self.client.hlen(f"{PREFIX}meta"))
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=f"{PREFIX}*", count=500):
            batch.append(key)
            if len(batch) == 500:
                self.client.unlink(*batch)
                batch = []
        if batch:
            self.client.unlink(*batch)
        return entries

    def _drop_corrupt(self, variant: str, why: str) -> None:
        self.counters.corrupt += 1
        log.warning("dropped damaged shared entry %s from %s: %s", variant, self.where, why)
        self.delete(variant)

    # -- reads -----------------------------------------------------------------------

    def used(self) -> int:
        """Bytes this tier holds (all nodes), 0 when unreachable."""
        return int(self._call("used", lambda: self.client.get(f"{PREFIX}bytes"), default=0) or 0)

    def variants_of(self, chunk: str) -> list[SharedMeta]:
        """What the tier holds of a chunk (empty when unreachable)."""
        return self.variants_of_chunks([chunk])[chunk]

    def variants_of_chunks(self, chunks: Sequence[str]) -> dict[str, list[SharedMeta]]:
        """:meth:`variants_of` for each of ``chunks`` in two round trips, however many
        chunks a request has (each chunk's members, then every variant's facts)."""
        wanted = list(dict.fromkeys(chunks))

        def run() -> dict[str, list[SharedMeta]]:
            pipe = self.client.pipeline(transaction=False)
            for chunk in wanted:
                pipe.smembers(f"{PREFIX}chunk:{chunk}")
            members = {chunk: sorted(k.decode() for k in found) for chunk, found in zip(wanted, pipe.execute())}
            keys = [k for chunk in wanted for k in members[chunk]]
            raws = dict(zip(keys, self.client.hmget(f"{PREFIX}meta", keys))) if keys else {}
            out = {}
            for chunk in wanted:
                metas = [_parse_meta(raws[k]) for k in members[chunk]]
                out[chunk] = [m for m in metas if m is not None and m.chunk == chunk]
            return out

        return self._call("lookup", run, default=None) or {chunk: [] for chunk in wanted}

    def meta(self, variant: str) -> SharedMeta | None:
        """The recorded facts about a variant, or None."""
        raw = self._call("lookup", lambda: self.client.hget(f"{PREFIX}meta", variant))
        meta = _parse_meta(raw)
        if raw is not None and meta is None:
            self._drop_corrupt(variant, "unreadable index entry")
        return meta

    def contains(self, variant: str) -> bool:
        return bool(self._call("lookup", lambda: self.client.hexists(f"{PREFIX}meta", variant), default=False))

    def get(self, variant: str) -> tuple[SharedMeta, ChunkKV] | None:
        """The variant's facts and verified ChunkKV (stored dtype, CPU), or None on a miss."""
        return self.get_many([variant]).get(variant)

    def get_many(self, variants: Sequence[str]) -> dict[str, tuple[SharedMeta, ChunkKV]]:
        """Several variants in one pipelined round trip; those missing or damaged are left out."""
        if not variants:
            return {}

        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            for v in variants:
                pipe.hget(f"{PREFIX}meta", v)
                pipe.get(f"{PREFIX}blob:{v}")
            return pipe.execute()

        replies = self._call("get", run)
        if replies is None:
            self.counters.misses += len(variants)
            return {}
        out: dict[str, tuple[SharedMeta, ChunkKV]] = {}
        for i, variant in enumerate(variants):
            raw, data = replies[2 * i], replies[2 * i + 1]
            if raw is None or data is None:
                if raw is not None or data is not None:  # half an entry (flushed or evicted by Redis)
                    self.delete(variant)
                self.counters.misses += 1
                continue
            meta = _parse_meta(raw)
            if meta is None or meta.variant != variant:
                self._drop_corrupt(variant, "unreadable index entry")
                self.counters.misses += 1
                continue
            try:
                out[variant] = meta, decode(data, meta.checksum, variant)
            except BlobError as exc:
                self._drop_corrupt(variant, str(exc))
                self.counters.misses += 1
                continue
            self.counters.hits += 1
        if out:
            self.touch(list(out))
        return out

    def open(self, variant: str, count: bool = True) -> "RedisBlob | None":
        """A verified lazy view of a variant's blob (header and small tensors read now,
        layers when asked), or None on a miss or a damaged entry (dropped). Without
        ``count`` the read is not counted as a hit or miss, nor as a use."""
        meta = self.meta(variant)
        if meta is None:
            self.counters.misses += count
            return None
        try:
            blob = RedisBlob(self, variant, meta)
        except _Unavailable:
            self.counters.misses += count
            return None
        except BlobError as exc:
            self._drop_corrupt(variant, str(exc))
            self.counters.misses += count
            return None
        if count:
            self.counters.hits += 1
            self.touch([variant])
        return blob

    def drop(self, variant: str, exc: BaseException) -> None:
        """A layer read failed: drop the entry if it was damaged (not if Redis failed)."""
        if not isinstance(exc, _Unavailable):
            self._drop_corrupt(variant, str(exc))

    def count(self) -> int:
        """Entries this tier holds (all nodes), 0 when unreachable."""
        return int(self._call("count", lambda: self.client.hlen(f"{PREFIX}meta"), default=0) or 0)

    def ranges(self, variant: str, spans: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """Byte ranges ``[start, end)`` of a blob in one pipelined round trip; None on an error."""
        def run() -> list[bytes]:
            pipe = self.client.pipeline(transaction=False)
            for start, end in spans:
                pipe.getrange(f"{PREFIX}blob:{variant}", start, end - 1)
            return pipe.execute()

        return self._call("read", run)

    def touch(self, variants: Sequence[str]) -> None:
        """Mark variants used now (least recently used ones are evicted first)."""
        now = time.time()
        self._call("touch", lambda: self.client.zadd(f"{PREFIX}used", {v: now for v in variants}, xx=True))

    def audit(self, repair: bool = False) -> list[tuple[str, str, str]]:
        """Check every entry of the tier (``verify``): index entries that cannot be read,
        values missing or failing their checksums, values no index entry names, a byte
        count that is not the sum of the sizes, and bytes over the budget. Returns
        ``(kind, target, detail)`` problems; with ``repair`` each is fixed (damaged entries
        dropped, the count rewritten, least recently used entries evicted). Raises the
        Redis error when the server cannot be reached (verify says so in one line)."""
        client, problems = self.client, []
        metas = {k.decode(): v for k, v in client.hgetall(f"{PREFIX}meta").items()}
        for variant, raw in sorted(metas.items()):
            meta, data = _parse_meta(raw), client.get(f"{PREFIX}blob:{variant}")
            if meta is None or meta.variant != variant:
                problem = ("shared-damaged", "unreadable index entry")
            elif data is None:
                problem = ("shared-missing", "index entry without its value (evicted by the server?)")
            else:
                try:
                    decode(data, meta.checksum, variant)
                    continue
                except BlobError as exc:
                    problem = ("shared-damaged", str(exc))
            if repair and meta is not None:
                self.delete(variant)
            elif repair:  # the index entry names no chunk: remove what can be found by the variant
                client.hdel(f"{PREFIX}meta", variant)
                client.hdel(f"{PREFIX}size", variant)
                client.zrem(f"{PREFIX}used", variant)
                client.delete(f"{PREFIX}blob:{variant}")
            problems.append((problem[0], variant, problem[1]))
        for key in client.scan_iter(match=f"{PREFIX}blob:*", count=500):
            variant = key.decode().removeprefix(f"{PREFIX}blob:")
            if variant not in metas:
                if repair:
                    client.delete(key)
                problems.append(("shared-orphan", variant, "value with no index entry"))
        sizes = sum(int(v) for v in client.hvals(f"{PREFIX}size"))
        counted = int(client.get(f"{PREFIX}bytes") or 0)
        if counted != sizes:
            if repair:
                client.set(f"{PREFIX}bytes", sizes)
            problems.append(("shared-count", f"{PREFIX}bytes", f"says {counted} bytes, entries hold {sizes}"))
        if sizes > self.budget:
            if repair:
                self._evict(sizes, keep="")
            problems.append(("shared-over-budget", self.where,
                             f"{sizes} bytes held, redis_budget_bytes is {self.budget}"))
        return problems

    def close(self) -> None:
        """Close the pool's connections."""
        self.pool.disconnect()


class _Unavailable(BlobError):
    """Redis failed while a blob was being read (the tier already logged it): the read
    fails like a damaged one, but nothing is dropped or counted as damaged."""


class RedisBlob(LayeredBlob):
    """A verified view of a blob in Redis that reads layers on demand (``GETRANGE``).

    The same interface as :class:`cachecraft.store.codec.LazyBlob`: opening verifies the
    header checksum, the small tensors and the entry's identity; each layer is verified
    when read. K and V of one layer come in one round trip.
    """

    def __init__(self, tier: RedisTier, variant: str, meta: SharedMeta) -> None:
        self.tier, self.variant, self.meta = tier, variant, meta
        got = tier.ranges(variant, [(0, HEADER_GUESS)])
        if got is None:
            raise _Unavailable
        head = got[0]
        if not head:
            raise BlobError("value is missing")
        n = _header_length(head[:8])
        if len(head) < 8 + n:
            more = tier.ranges(variant, [(len(head), 8 + n)])
            if more is None:
                raise _Unavailable
            head += more[0]
        header, metadata = _parse_header(memoryview(head)[: 8 + n], meta.checksum)
        self.digests: dict[str, str] = metadata.pop("digests")
        self.metadata: dict[str, str] = {k: v for k, v in metadata.items() if isinstance(v, str)}
        header = {k: v for k, v in header.items() if k != "__metadata__"}
        if set(header) != set(self.digests):
            raise BlobError("tensor list does not match the digests")
        self._table, self._base = header, 8 + n
        self._pending: dict[str, torch.Tensor] = {}
        small = [name for name in self.digests if not _LAYER.match(name)]
        self.small = dict(zip(small, self._fetch(small)))
        self._opened(variant)

    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        spans = []
        for name in names:
            start, end = self._table[name]["data_offsets"]
            spans.append((self._base + start, self._base + end))
        got = self.tier.ranges(self.variant, spans) if spans else []
        if got is None:
            raise _Unavailable("the shared tier failed mid-read")
        out = []
        for name, data, (start, end) in zip(names, got, spans):
            if len(data) != end - start or checksum(data) != self.digests[name]:
                raise BlobError(f"tensor {name} checksum mismatch")
            info = self._table[name]
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise BlobError(f"tensor {name} has unknown dtype {info['dtype']}")
            t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
            out.append(t.reshape(info["shape"]))
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """One verified tensor (a layer's K also fetches its V, in the same round trip)."""
        if name in self._pending:
            return self._pending.pop(name)
        if name in self.small:
            return self.small[name]
        if name.startswith("k."):
            pair = ["k." + name[2:], "v." + name[2:]]
            k, v = self._fetch(pair)
            self._pending[pair[1]] = v
            return k
        return self._fetch([name])[0]

    def close(self) -> None:
        self._pending.clear()


def _display(url: str) -> str:
    from cachecraft.config import hide_password
    return hide_password(url)
