"""One validated configuration object.

Values come, later ones overriding earlier ones, from: the defaults below, a TOML
file (``--config`` or ``CACHECRAFT_CONFIG``, else ``<cache_dir>/config.toml`` if it
exists), ``CACHECRAFT_<FIELD>`` environment variables, and explicit overrides (CLI
flags). Unknown keys are an error that lists the known ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import platformdirs

ENV_PREFIX = "CACHECRAFT_"
CONFIG_ENV = "CACHECRAFT_CONFIG"

log = logging.getLogger(__name__)
_warned_env: set[str] = set()  # unknown variables already named in this process
_warned_tables: set[str] = set()  # config files whose other tables were already named

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the passages below. "
    "Answer briefly, in a few words."
)
# Placed after the passages; asking for a short answer keeps answers comparable.
DEFAULT_QUESTION_TEMPLATE = (
    "Answer the question based on the passages above, in at most five words.\nQuestion: {question}"
)

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_DTYPES = ("float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_EVICTION = ("cachecraft", "lru", "lfu", "pgdsf", "decay")
CHUNK_ORDERS = ("given", "cache")
# score: retrieved chunks best first; document: one file's chunks together, in the file's
# order, where its best chunk ranks (a page cut in two then reads top to bottom)
RETRIEVAL_ORDERS = ("score", "document")
# how a drift shift turns its measuring tokens' changes into a chunk's move (the engine's
# Segment.drift_estimator; policy_drift_estimator)
DRIFT_ESTIMATORS = ("mean", "median", "shrunk", "pooled")


def named_drift_estimator(data: Mapping[str, Any], prefix: str = "") -> str:
    """The drift estimator ``data`` (a stored fit, a request's record, a result file) names
    under ``<prefix>drift_estimator``. Data written while the estimator was a yes/no for the
    median (``<prefix>drift_median``) reads as the median or the mean; older data as the mean."""
    if f"{prefix}drift_estimator" in data:
        return data[f"{prefix}drift_estimator"]
    return "median" if data.get(f"{prefix}drift_median") else "mean"
_CATALOG_SCHEMES = ("postgresql://", "postgresql+psycopg://")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_URL_KEYS = ("catalog_url", "redis_url")
_SECRET_KEYS = ("api_key",)
TIER_ORDERS = ("gpu,cpu,disk,redis", "gpu,cpu,redis,disk")
"""The lookup orders ``tier_order`` may name: the memory tiers always come first."""
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """A configuration value or file is invalid; the message says which and why."""


def parse_bytes(value: int | str) -> int:
    """Parse a byte size such as ``1048576``, ``"512MiB"`` or ``"2GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"not a byte size: {value!r} (use e.g. 1048576, 512MiB, 2GB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def hide_password(url: str) -> str:
    """``url`` with the password (``scheme://user:PASSWORD@host``) replaced by ``***``."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def _parse_bool(value: Any) -> bool:
    """``true``/``false`` as a TOML boolean or a word (1/0, yes/no, on/off), any case."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The cache directory: ``$CACHECRAFT_CACHE_DIR`` or the user cache directory."""
    env = (os.environ if environ is None else environ).get(ENV_PREFIX + "CACHE_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("cachecraft"))


def default_config_file(overrides: Mapping[str, Any] | None = None,
                        environ: Mapping[str, str] | None = None) -> Path:
    """``<cache_dir>/config.toml``, the cache directory taken from ``overrides`` or the environment."""
    cache_dir = (overrides or {}).get("cache_dir")
    base = Path(str(cache_dir)).expanduser() if cache_dir is not None else default_cache_dir(environ)
    return base / "config.toml"


@dataclass(frozen=True)
class Config:
    """Every setting cachecraft reads; build with :meth:`load`, never mutate."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    model: str = "smollm2"
    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "float16"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    question_template: str = DEFAULT_QUESTION_TEMPLATE
    max_new_tokens: int = 32
    cacheblend_ratio: float = 0.15
    check_layer: int = 1
    policy_alpha: float = 0.08
    # Layers: a whole number names a layer, a fraction below 1 a depth (0.27: layer 8 of 30)
    policy_check_layer: float = 8
    # Every cached chunk without an exact prefix match recomputes at least this share of its
    # tokens, and its first policy_sink_tokens tokens come first among them (0, 0: CFO alone)
    policy_floor: float = 0.0
    policy_sink_tokens: int = 0
    # > 0: the rest of each fixed chunk's recomputed tokens are spread evenly over it, and its
    # other tokens move by this share of the mean change those show, layer by layer (0: off)
    policy_drift_shift: float = 0.0
    # how the drift shift turns the spread tokens' changes into a chunk's move: mean, median
    # (resists a few far-drifting tokens), shrunk (the mean shrunk toward no move where they
    # disagree) or pooled (each chunk's mean shrunk toward the prompt's)
    policy_drift_estimator: str = "mean"
    # with a drift shift: this share of the chunks' spread tokens is given out anew, in
    # proportion to the attention the question pays each chunk at the check layer (0: each
    # chunk keeps the count its plan gives it; 1: the question's attention alone decides)
    policy_relevance: float = 0.0
    # an answer from reused chunk-caches that degenerates into repetition is answered again
    # from a full prefill (not for a streamed answer whose streamer cannot start over)
    repetition_fallback: bool = True
    # a chunk order asked this many times before whose chunk-caches are not all a full
    # prefill's KV is computed in full once (from its first such chunk on) and kept exact,
    # so that later asks reuse it exactly and answer as full prefill does (0: never). Asks
    # count since the order was last kept exact: where its variants were evicted before any
    # ask reused them, the next keep waits twice as long as that one did (up to 8 times this)
    exact_after_asks: int = 1
    early_stop_layers: str = ""  # comma-separated layers or depths, e.g. "12,20" or "0.4,0.67"; empty: off
    early_stop_share: float = 0.25
    stats_layer_step: int = 4  # attention statistics at every 4th layer (1: every layer)
    miss_stats_stride: int = 8  # on a request, a missed chunk's statistics from every 8th token (1: all; warm reads all)
    stream_kv: bool = True  # read chunk-caches layer by layer while the prefill runs (false: whole, first)
    gpu_budget_bytes: int = 2 * 2**30
    cpu_budget_bytes: int = 4 * 2**30
    disk_budget_bytes: int = 50 * 2**30
    eviction: str = "cachecraft"
    embedder: str = "minilm"  # bundled all-MiniLM-L6-v2, or a sentence-transformers dir or id
    chunk_tokens: int = 256  # generator tokens per ingested chunk, title included
    chunk_overlap: int = 0
    top_k: int = 3
    retrieval_order: str = "score"  # RETRIEVAL_ORDERS: best first, or each file's chunks in its order
    warm_context: str = "builtin"  # text chunk-caches are warmed after: builtin, none, or a text file
    warm_context_tokens: int = 1024
    warm_neighbours: int = 0  # also make each chunk's cache after each of its N nearest chunks in the index
    warm_previous: bool = False  # also make each chunk's cache after the chunk before it in its file
    # given: a request's chunks stay in the order given (retrieval's, best first); cache: they
    # are chained so that chunks come right after a chunk one of their variants was made after
    chunk_order: str = "given"
    # beyond one machine (both optional; empty: SQLite in cache_dir and local tiers only)
    catalog_url: str = ""  # postgresql+psycopg://user:password@host:port/database
    redis_url: str = ""  # redis://[:password@]host:port/db (rediss:// for TLS): a shared tier after disk
    redis_budget_bytes: int = 4 * 2**30  # what cachecraft keeps in Redis, enforced by cachecraft
    tier_order: str = "gpu,cpu,disk,redis"  # lookup order; redis may come before disk
    # `cachecraft serve`, and the commands that talk to a running one
    server: str = ""  # http://host:port of a running server: `query` and `stats` ask it
    server_queue: int = 8  # requests that may wait for the model; one more is refused (429)
    server_timeout_s: float = 300.0  # a request not answered within this is refused (503)
    # with no request waiting, the server stores each answered chunk order as a full
    # prefill's KV, so the next ask in that order (a chat's next turn) reuses it exactly
    exact_when_idle: bool = True
    chunk_separator: str = "<|chunk|>"  # marks chunk boundaries in a prompt sent to the server
    api_key: str = ""  # when set, the server requires it (Authorization: Bearer <key>)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        check(self.device in _DEVICES, f"device must be one of {_DEVICES}, got {self.device!r}")
        check(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check(self.kv_dtype in _KV_DTYPES, f"kv_dtype must be one of {_KV_DTYPES}, got {self.kv_dtype!r}")
        check(self.eviction in _EVICTION, f"eviction must be one of {_EVICTION}, got {self.eviction!r}")
        check(bool(str(self.model).strip()), "model must not be empty")
        check("{question}" in self.question_template,
              "question_template must contain the placeholder {question}")
        check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check(0.0 <= self.cacheblend_ratio <= 1.0,
              f"cacheblend_ratio must be within [0, 1], got {self.cacheblend_ratio}")
        check(self.check_layer >= 1, f"check_layer must be >= 1, got {self.check_layer}")
        check(0.0 <= self.policy_alpha <= 10.0, f"policy_alpha must be within [0, 10], got {self.policy_alpha}")
        check(_is_layer(self.policy_check_layer), "policy_check_layer must be a layer number or a depth below 1 "
              f"(e.g. 8 or 0.27), got {self.policy_check_layer}")
        check(0.0 <= self.policy_floor <= 1.0, f"policy_floor must be within [0, 1], got {self.policy_floor}")
        check(self.policy_sink_tokens >= 0, f"policy_sink_tokens must be >= 0, got {self.policy_sink_tokens}")
        check(0.0 <= self.policy_drift_shift <= 2.0,
              f"policy_drift_shift must be within [0, 2], got {self.policy_drift_shift}")
        check(self.policy_drift_estimator in DRIFT_ESTIMATORS,
              f"policy_drift_estimator must be one of {DRIFT_ESTIMATORS}, got {self.policy_drift_estimator!r}")
        check(0.0 <= self.policy_relevance <= 1.0,
              f"policy_relevance must be within [0, 1], got {self.policy_relevance}")
        check(0.0 <= self.early_stop_share <= 1.0, f"early_stop_share must be within [0, 1], got {self.early_stop_share}")
        try:
            ok = all(_is_layer(x) for x in self.early_stop_layer_list)
        except ValueError:
            ok = False
        check(ok, "early_stop_layers must be comma-separated layer numbers or depths below 1 (e.g. 12,20 or "
                  f"0.4,0.67), got {self.early_stop_layers!r}")
        check(self.exact_after_asks >= 0, f"exact_after_asks must be >= 0, got {self.exact_after_asks}")
        check(self.stats_layer_step >= 1, f"stats_layer_step must be >= 1, got {self.stats_layer_step}")
        check(self.miss_stats_stride >= 1, f"miss_stats_stride must be >= 1, got {self.miss_stats_stride}")
        check(bool(str(self.embedder).strip()), "embedder must not be empty")
        check(self.chunk_tokens >= 16, f"chunk_tokens must be >= 16, got {self.chunk_tokens}")
        check(0 <= self.chunk_overlap <= self.chunk_tokens // 2,
              f"chunk_overlap must be within [0, chunk_tokens / 2], got {self.chunk_overlap}")
        check(self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}")
        check(self.retrieval_order in RETRIEVAL_ORDERS,
              f"retrieval_order must be one of {RETRIEVAL_ORDERS}, got {self.retrieval_order!r}")
        check(self.warm_context in ("builtin", "none") or Path(self.warm_context).expanduser().is_file(),
              f"warm_context must be 'builtin', 'none' or an existing text file, got {self.warm_context!r}")
        check(self.warm_context_tokens >= 0, f"warm_context_tokens must be >= 0, got {self.warm_context_tokens}")
        check(0 <= self.warm_neighbours <= 8, f"warm_neighbours must be 0 to 8, got {self.warm_neighbours}")
        check(self.chunk_order in CHUNK_ORDERS,
              f"chunk_order must be one of {CHUNK_ORDERS}, got {self.chunk_order!r}")
        check(not self.catalog_url or self.catalog_url.startswith(_CATALOG_SCHEMES),
              f"catalog_url must be empty (SQLite in cache_dir) or start with one of {_CATALOG_SCHEMES}, "
              f"got {hide_password(self.catalog_url)!r}")
        check(not self.redis_url or self.redis_url.startswith(_REDIS_SCHEMES),
              f"redis_url must be empty (no shared tier) or start with one of {_REDIS_SCHEMES}, "
              f"got {hide_password(self.redis_url)!r}")
        check(self.tier_order.replace(" ", "") in TIER_ORDERS,
              f"tier_order must be one of {', '.join(TIER_ORDERS)} (memory tiers first; redis before or "
              f"after disk), got {self.tier_order!r}")
        for name in ("gpu_budget_bytes", "cpu_budget_bytes", "disk_budget_bytes", "redis_budget_bytes"):
            check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        check(not self.server or self.server.startswith(("http://", "https://")),
              f"server must be empty or an http(s):// URL of a running `cachecraft serve`, got {self.server!r}")
        check(self.server_queue >= 0, f"server_queue must be >= 0, got {self.server_queue}")
        check(self.server_timeout_s > 0, f"server_timeout_s must be positive, got {self.server_timeout_s}")
        check(bool(self.chunk_separator.strip()), "chunk_separator must not be empty or blank")

    @property
    def early_stop_layer_list(self) -> tuple[float, ...]:
        """``early_stop_layers`` as numbers: whole ones are layers, fractions below 1 depths."""
        return tuple(float(x) for x in str(self.early_stop_layers).replace(" ", "").split(",") if x)

    @property
    def warms_in_context(self) -> bool:
        """Whether ``warm`` also makes in-context variants (``warm_neighbours`` or ``warm_previous``)."""
        return bool(self.warm_neighbours or self.warm_previous)

    @property
    def models_dir(self) -> Path:
        """Where converted models live (a subfolder of the cache directory)."""
        return self.cache_dir / "models"

    @property
    def corpus_dir(self) -> Path:
        """Where the ingested corpus lives (a subfolder of the cache directory)."""
        return self.cache_dir / "corpus"

    def to_dict(self) -> dict[str, Any]:
        """The effective values, JSON-friendly (passwords in URLs hidden)."""
        def shown(name: str, value: Any) -> Any:
            if isinstance(value, Path):
                return str(value)
            if name in _URL_KEYS:
                return hide_password(value)
            return "***" if name in _SECRET_KEYS and value else value

        return {f.name: shown(f.name, getattr(self, f.name)) for f in fields(self)}

    @property
    def given(self) -> frozenset[str]:
        """The settings a config file, the environment or an override gave, even where the
        value given is the default's (a calibrated fit yields to those)."""
        return getattr(self, "_given", frozenset())

    def settings_changed(self) -> dict[str, Any]:
        """Settings that differ from the defaults or were given; ``cache_dir`` and the server
        URLs are left out (they move bytes, they do not change results; URLs may hold
        passwords)."""
        defaults = Config(cache_dir=self.cache_dir)
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("cache_dir", "server") + _URL_KEYS + _SECRET_KEYS
                and (getattr(self, f.name) != getattr(defaults, f.name) or f.name in self.given)}

    @classmethod
    def known_keys(cls) -> list[str]:
        """Names accepted in a config file, as env suffixes and as overrides."""
        return [f.name for f in fields(cls)]

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> "Config":
        """Build the effective config: defaults < TOML file < environment < overrides.

        The TOML file is ``path``, else ``$CACHECRAFT_CONFIG``, else
        ``<cache_dir>/config.toml`` when that file exists (``cache_dir`` from the
        overrides, ``$CACHECRAFT_CACHE_DIR`` or the user cache directory)."""
        values: dict[str, Any] = {}
        for _, layer in cls.layers(path, overrides, environ):
            values.update(layer)
        return cls.from_mapping(values)

    @classmethod
    def layers(cls, path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
               environ: Mapping[str, str] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """The values :meth:`load` merges, as (source, values) from the lowest precedence
        up: ``file <path>``, ``environment`` and ``flag``. An unknown ``CACHECRAFT_*``
        variable is named in a warning with the nearest known one."""
        environ = os.environ if environ is None else environ
        out: list[tuple[str, dict[str, Any]]] = []
        path = path or environ.get(CONFIG_ENV)
        if path:
            out.append((f"file {path}", _read_toml(Path(path))))
        else:
            implicit = default_config_file(overrides, environ)
            if implicit.is_file():
                out.append((f"file {implicit}", _read_toml(implicit)))
        known = cls.known_keys()
        from_env = {}
        for name, value in environ.items():
            if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
                continue
            key = name[len(ENV_PREFIX):].lower()
            if key in known:
                from_env[key] = value
            else:
                _warn_unknown_env(name, known)
        out.append(("environment", from_env))
        out.append(("flag", {k: v for k, v in (overrides or {}).items() if v is not None}))
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Config":
        """Validate and coerce a flat mapping of settings."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        coerced = {name: _coerce(known[name], value) for name, value in values.items()}
        return cls(**coerced)._with_given(frozenset(coerced))

    def replace(self, **changes: Any) -> "Config":
        """A copy with some values changed (validated again); those count as given."""
        return dataclasses.replace(self, **changes)._with_given(self.given | frozenset(changes))

    def _with_given(self, names: frozenset[str]) -> "Config":
        object.__setattr__(self, "_given", names)  # not a setting: kept beside the frozen fields
        return self


def _is_layer(value: float) -> bool:
    """A layer setting: a whole number >= 0, or a depth within [0, 1)."""
    return math.isfinite(value) and value >= 0 and (value < 1 or value == int(value))


def _warn_unknown_env(name: str, known: list[str]) -> None:
    """One warning per process naming an unknown ``CACHECRAFT_*`` variable and the nearest known one."""
    if name in _warned_env:
        return
    _warned_env.add(name)
    names = [ENV_PREFIX + k.upper() for k in known] + [CONFIG_ENV]
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else "see `cachecraft config show` for the known settings"
    log.warning("unknown environment variable %s is ignored; %s", name, hint)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    # Accept either a flat file or one with a [cachecraft] table, not both: a key outside
    # the table would be ignored without a word.
    if "cachecraft" not in data:
        return dict(data)
    if not isinstance(data["cachecraft"], dict):
        raise ConfigError(f"config file {path}: cachecraft must be a table ([cachecraft]), not a value")
    outside = sorted(k for k, v in data.items() if k != "cachecraft" and not isinstance(v, dict))
    if outside:
        raise ConfigError(f"config file {path} has settings outside its [cachecraft] table ({', '.join(outside)}); "
                          "put them all in the table, or drop the table header")
    others = sorted(k for k in data if k != "cachecraft")  # only tables are left: another tool's
    if others and str(path) not in _warned_tables:  # said once per file
        _warned_tables.add(str(path))
        log.warning("config file %s: only the [cachecraft] table is read; ignoring [%s]", path, "], [".join(others))
    return dict(data["cachecraft"])


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if f.name.endswith("_bytes"):
            return parse_bytes(value)
        if kind == "Path":
            if not str(value).strip():  # Path("") is the current directory: never what was meant
                raise ConfigError(f"{f.name}: an empty path names nothing; give a directory or leave it unset")
            return Path(str(value)).expanduser()
        if kind == "int":
            if isinstance(value, float) or isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind == "float":
            number = float(value)
            if not math.isfinite(number):  # inf or nan pass every bound check, and JSON has no word for them
                raise ConfigError(f"{f.name}: {value!r} is not a finite number")
            return number
        if kind == "bool":
            return _parse_bool(value)
        return str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{f.name}: cannot read {value!r} as {kind}") from None
