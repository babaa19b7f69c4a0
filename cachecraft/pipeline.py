"""One request end to end: retrieve -> plan -> load -> blend -> generate -> record.

The :class:`Pipeline` owns the model, the store (and its catalog), the policy, the
ingested corpus and a prefix cache for the ``prefix`` baseline. ``answer`` takes
chunk texts in prompt order; ``query`` retrieves them from the corpus first
(``ingest`` fills it, ``warm_corpus`` makes its chunk-caches ahead of time).

Chunk-caches are keyed by (model fingerprint, token ids). A chunk computed in a
request is saved as a variant under that request's prefix (the system prefix and the
chunks before it), so a later request with the same chunks before it reuses it
exactly; the policy picks, per chunk, the variant with the lowest Cache Fix Overhead.
A chunk it would recompute mostly is computed in full and kept the same way.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from cachecraft.catalog import MISS, RequestChunk, RequestRecord, question_hash
from cachecraft.config import Config
from cachecraft.engine import Segment, blended_prefill, generate_from, sampled_layers
from cachecraft.engine.blend import LayerSource
from cachecraft.kv import ChunkKV, chunk_key, variant_key
from cachecraft.methods import (MethodSpec, place_plan_tokens, prefix_segments, remember_prefix,
                                select_question_guided, static_recompute, variant_info)
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.policy.planner import (PolicyParams, RecomputePlan, VariantInfo, early_stop_decision,
                                       expected_reuse, params_from_config, plan_request)
from cachecraft.policy.loading import DEFAULT_BANDWIDTHS, CostModel
from cachecraft.prefix_cache import PrefixCache
from cachecraft.prompt import PromptInputError, PromptPieces, builder_for
from cachecraft.retrieval.chunking import Chunker
from cachecraft.retrieval.corpus import Corpus, IngestReport
from cachecraft.retrieval.documents import DocumentError, read_documents
from cachecraft.retrieval.snapshot import CorpusError
from cachecraft.selection import ChunkStatistics, DeviationCheck, QuestionAttention
from cachecraft.store import CorruptEntryError, LayerReader, LayerStream, TieredStore
from cachecraft import warm_context

log = logging.getLogger(__name__)

MAX_VARIANTS_PER_CHUNK = 4
KEEP_FIXED_FRACTION = 0.5  # a chunk planned to be mostly recomputed is computed in full and kept

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ChunkReport:
    """What happened to one chunk of a request.

    A chunk whose variant was found but that the plan computed in full counts as a hit
    in the tier it was found in; its ``fraction`` is 1.0.
    """

    position: int
    chunk: str
    tokens: int
    tier: str  # gpu / cpu / disk, or "miss"
    variant: str | None  # the variant found; not loaded when the plan computed the chunk in full
    cci: float | None
    beta_prime: float | None
    cfo: float | None
    fraction: float
    stop_layer: int | None


@dataclass(frozen=True)
class Source:
    """A retrieved corpus chunk that went into the prompt (same order as the chunk reports)."""

    id: str
    title: str
    source: str
    score: float
    text: str


@dataclass(frozen=True)
class WarmReport:
    """What one warm pass over (a shard of) the corpus did."""

    made: int
    skipped: int
    total: int


@dataclass
class Answer:
    """The answer and the cache report of one request."""

    text: str
    method: str
    ttft_s: float
    prompt_tokens: int
    new_tokens: int
    recompute_fraction: float
    chunks: list[ChunkReport] = field(default_factory=list)
    request_id: int | None = None
    full_prefill_estimate_s: float | None = None
    logits: torch.Tensor | None = None
    token_layers: int = 0  # prefill work, look-ahead included
    sources: list[Source] = field(default_factory=list)
    retrieval_s: float | None = None

    @property
    def saved_s(self) -> float | None:
        """Estimated prefill time saved against a full prefill."""
        if self.full_prefill_estimate_s is None:
            return None
        return max(0.0, self.full_prefill_estimate_s - self.ttft_s)

    def to_dict(self) -> dict:
        """JSON-friendly report (no logits)."""
        return {"text": self.text, "method": self.method, "ttft_s": self.ttft_s,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "recompute_fraction": self.recompute_fraction, "request_id": self.request_id,
                "full_prefill_estimate_s": self.full_prefill_estimate_s, "saved_s": self.saved_s,
                "retrieval_s": self.retrieval_s, "chunks": [c.__dict__ for c in self.chunks],
                "sources": [s.__dict__ for s in self.sources]}


class Pipeline:
    """Model + store + catalog + policy, answering questions over given chunks."""

    def __init__(self, config: Config, lm: LoadedModel | None = None, store: TieredStore | None = None,
                 policy: PolicyParams | None = None):
        self.config = config
        self.lm = lm or load_model(config.model, config)
        self.store = store or TieredStore(config)
        self.catalog = self.store.catalog
        self.builder = builder_for(self.lm.tokenizer, config)
        self.policy = policy or params_from_config(config)
        self.prefix_cache = PrefixCache(self.lm.fingerprint, budget_bytes=config.cpu_budget_bytes)
        self._seconds_per_token: float | None = None
        self.cost_model: CostModel | None = None  # measured on first use
        self._token_counts: dict[str, int] = {}
        self._sources: dict[str, str] = {}  # chunk key -> the document it came from (catalog rows)
        self._warm: tuple[tuple[int, ...], str] | None = None  # warm context ids and chunk key
        self._corpus: Corpus | None = None
        self.stats_layers = sampled_layers(self.lm.adapter.num_layers, config.stats_layer_step)

    @property
    def corpus(self) -> Corpus:
        """The ingested corpus of the cache directory (opened on first use)."""
        if self._corpus is None:
            self._corpus = Corpus(self.config.corpus_dir, self.config.embedder)
        return self._corpus

    # -- public ------------------------------------------------------------------------
    def answer(self, chunk_texts: Sequence[str], question: str, *, method: str = "cachecraft",
               ratio: float | None = None, max_new_tokens: int | None = None, streamer=None,
               record: bool = True, keep_logits: bool = False, sources: Sequence[str] | None = None) -> Answer:
        """Answer ``question`` over ``chunk_texts`` (formatted chunk texts, in order);
        ``sources`` (one per chunk) names where each chunk came from in the catalog."""
        default = self.policy.alpha if method == "cachecraft" else self.config.cacheblend_ratio
        spec = MethodSpec(method, default if ratio is None else ratio)
        start = time.perf_counter()
        pieces = self.builder.build(chunk_texts, question, max_tokens=self.lm.max_context)
        prefix_key = chunk_key(self.lm.fingerprint, pieces.prefix)
        keys = [chunk_key(self.lm.fingerprint, ids) for ids in pieces.chunks]
        self._note_sources(keys, sources)
        for attempt in range(len(keys) + 1):  # each damaged entry found is removed before the next try
            try:
                with ExitStack() as loading:  # chunk-caches stream in while the layers compute
                    segments, plan, used, tiers, check = self._prepare(spec, pieces, prefix_key, keys, loading,
                                                                        count_hits=attempt == 0)
                    stops: dict[int, int] = {}
                    hooks = [ChunkStatistics(self.stats_layers), *self._early_stop(spec, segments, stops)]
                    hooks += [check] if check is not None else []
                    result = blended_prefill(self.lm.adapter, segments, hooks=hooks,
                                             fingerprint=self.lm.fingerprint)
                break
            except CorruptEntryError as exc:
                if attempt == len(keys):
                    raise
                log.warning("%s; answering again without it", exc)
        int(result.logits.argmax())  # the first token is decided here
        ttft = time.perf_counter() - start
        if spec.name == "full":
            self._learn_cost(result.num_tokens, ttft)
        to_save = [kv for i, kv in result.saved.items() if segments[i].role == "chunk"]  # chunks computed here
        recomputed_mask = result.recomputed
        if spec.name == "prefix":
            remember_prefix(self.prefix_cache, self.lm.adapter, result)
        logits = result.logits.float().cpu() if keep_logits else None
        recompute = result.recompute_fraction
        token_layers = result.token_layers + self._lookahead_work(spec, segments)
        new_ids = generate_from(self.lm.model, self.lm.tokenizer, result,
                                max_new_tokens=max_new_tokens or self.config.max_new_tokens, streamer=streamer)
        self._save(to_save)
        answer = Answer(self.lm.tokenizer.decode(new_ids, skip_special_tokens=True), spec.label, ttft,
                        pieces.num_tokens, len(new_ids), recompute,
                        self._report(pieces, keys, segments, plan, used, tiers, stops, recomputed_mask),
                        full_prefill_estimate_s=self._estimate_request(pieces.num_tokens), logits=logits,
                        token_layers=token_layers)
        if record:
            answer.request_id = self._record(question, answer)
        return answer

    def warm(self, chunk_texts: Sequence[str], sources: Sequence[str] | None = None) -> int:
        """Make chunk-caches ahead of time, after the system prefix and the warm context
        (``config.warm_context``); returns how many were made (already cached chunks are
        skipped). ``sources`` as in :meth:`answer`."""
        pieces = self.builder.build(chunk_texts, "warm")
        prefix_key = chunk_key(self.lm.fingerprint, pieces.prefix)
        prefix_kv = self._prefix_kv(pieces, prefix_key)
        keys = [chunk_key(self.lm.fingerprint, ids) for ids in pieces.chunks]
        self._note_sources(keys, sources)
        prefix = Segment(pieces.prefix, "prefix", cached=prefix_kv, key=prefix_key)
        context = None
        made = 0
        for ids, key in zip(pieces.chunks, keys):
            if self.store.variants_of(key):
                continue
            context = context or self._warm_context_segment(prefix)
            fits = context is not None and (len(pieces.prefix) + len(context.token_ids) + len(ids)
                                            <= self.lm.max_context)
            segments = [prefix, *([context] if fits else []),
                        Segment(ids, "chunk", save=True, collect_stats=True, key=key)]
            kv = blended_prefill(self.lm.adapter, segments, fingerprint=self.lm.fingerprint,
                                 hooks=[ChunkStatistics(self.stats_layers)]).saved[len(segments) - 1]
            self._put(kv)
            made += 1
        return made

    def ingest(self, paths: Iterable[str | Path], progress: Progress | None = None) -> IngestReport:
        """Read ``.txt``/``.md`` files and directories, chunk them in the generator's tokens
        and add them to the corpus (a changed file's chunks are replaced)."""
        paths = list(paths)
        documents = read_documents(paths)
        chunker = Chunker(self.builder.encode, self.config.chunk_tokens, self.config.chunk_overlap)
        steps = 2 * len(documents)  # chunking, then embedding
        files = {}
        for i, doc in enumerate(documents):
            files[str(doc.path)] = chunker.split(doc.text, doc.title)
            if progress:
                progress(i + 1, steps)
        if not any(files.values()):
            raise DocumentError(f"no text found in {', '.join(map(str, paths))}")
        settings = {"model": self.lm.name, "chunk_tokens": self.config.chunk_tokens,
                    "chunk_overlap": self.config.chunk_overlap}
        embed_progress = (lambda done, total: progress(len(documents) + done, steps)) if progress else None
        return self.corpus.ingest(files, scopes=[p for p in paths if Path(p).is_dir()], settings=settings,
                                  progress=embed_progress)

    def warm_corpus(self, progress: Progress | None = None, shard: tuple[int, int] = (0, 1)) -> WarmReport:
        """Make the chunk-cache of every ingested chunk not cached yet (after the system prefix
        alone). ``shard=(i, n)`` takes the i-th of n disjoint parts, for parallel workers."""
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard}")
        self._require_corpus()
        chunks = [c for c in self.corpus.chunks() if int(c.id[:12], 16) % count == index]
        made = 0
        for i, chunk in enumerate(chunks):
            made += self.warm([chunk.prompt_text], sources=[chunk.source])
            if progress:
                progress(i + 1, len(chunks))
        return WarmReport(made, len(chunks) - made, len(chunks))

    def query(self, question: str, top_k: int | None = None, method: str = "cachecraft", streamer=None,
              **options) -> Answer:
        """Retrieve the ``top_k`` chunks most similar to ``question`` (best first) and answer
        over them; ``options`` go to :meth:`answer`. The answer lists its ``sources``."""
        if not question or not question.strip():
            raise PromptInputError("the question is empty")
        self._require_corpus()
        self._ensure_cost_model()  # measured here, outside the TTFT clock; it also estimates savings
        self.corpus.load_embedder()  # retrieval time excludes loading the model
        start = time.perf_counter()
        hits = self.corpus.search(question, self.config.top_k if top_k is None else top_k)
        retrieval_s = time.perf_counter() - start
        answer = self.answer([h.chunk.prompt_text for h in hits], question, method=method, streamer=streamer,
                             sources=[h.chunk.source for h in hits], **options)
        answer.sources = [Source(h.chunk.id, h.chunk.title, h.chunk.source, h.score, h.chunk.text) for h in hits]
        answer.retrieval_s = retrieval_s
        return answer

    def _require_corpus(self) -> None:
        if not len(self.corpus):
            raise CorpusError(f"the corpus in {self.corpus.directory} is empty: run `cachecraft ingest PATH` first")

    def close(self) -> None:
        """Persist memory tiers to disk and release the store."""
        self.store.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- planning and loading ----------------------------------------------------------------
    def _prepare(self, spec: MethodSpec, pieces: PromptPieces, prefix_key: str, keys: list[str],
                 loading: ExitStack, count_hits: bool = True):
        """Segments for ``spec``, the policy plan (cachecraft only) and the tier each chunk came
        from. With ``stream_kv`` the chunk-caches stream in through a :class:`LayerStream`
        that ``loading`` closes; without it they are read whole here. ``count_hits`` is
        false when a request is prepared again after a damaged entry: its hits counted once."""
        tiers: list[str] = [MISS] * len(keys)
        used: list[str | None] = [None] * len(keys)
        if spec.name == "full":  # the baseline: one plain prefill, nothing gathered or kept
            return self._plain_segments(pieces, prefix_key, keys, used, keep=False), None, used, tiers, None
        if spec.name == "prefix":
            match = self.prefix_cache.match(pieces.token_ids, limit=pieces.num_tokens - 1)
            return prefix_segments(pieces, match), None, used, tiers, None
        prefix_kv = self._prefix_kv(pieces, prefix_key, count_hit=count_hits)
        plan = None
        if spec.name == "cachecraft":
            infos = {key: self._variant_infos(key, prefix_key) for key in dict.fromkeys(keys)}
            params = replace(self.policy, alpha=spec.ratio)
            planned = self._hide_loading(plan_request(keys, [len(c) for c in pieces.chunks], infos, params))
            plan = self._compute_mostly_fixed(planned)
            wanted = [p.variant for p in plan.chunks]
        else:  # independent caches: any stored variant, the one made alone first
            wanted = [self._any_variant(key, prefix_key) for key in keys]
        kvs: list[LayerSource | None] = []
        if self.config.stream_kv:
            readers = [self._open(name, count_hits) for name in wanted]
            stream = loading.enter_context(LayerStream([r for r in readers if r is not None]))
            loading.callback(self._learn_from_stream, stream)  # runs first on exit: closes, then reads
            streamed = iter(stream.kvs)
            kvs = [next(streamed) if r is not None else None for r in readers]
            tiers = [kv.tier if kv is not None else MISS for kv in kvs]
        else:  # each variant read whole, in the compute dtype, before the prefill starts
            for i, name in enumerate(wanted):
                start = time.perf_counter()
                kv, tiers[i] = self._load(name, count_hits)
                if kv is not None:
                    self._learn_bandwidth(tiers[i], self._stored_nbytes(kv), time.perf_counter() - start)
                kvs.append(kv)
        used = [name if kv is not None else None for name, kv in zip(wanted, kvs)]
        if plan is not None:  # found but computed in full by choice: still a hit, at fraction 1.0
            for i, (chosen, final) in enumerate(zip(planned.chunks, plan.chunks)):
                tier = self.store.locate(chosen.variant) if final.variant is None and chosen.variant else None
                if tier is not None:
                    tiers[i], used[i] = tier, chosen.variant
        segments = self._plain_segments(pieces, prefix_key, keys, kvs, prefix_kv)
        for seg in segments[1:-1]:
            seg.recompute = static_recompute(spec, len(seg.token_ids), seg.cached)
        check = None
        if spec.name == "cachecraft":
            place_plan_tokens(self.lm.adapter, segments, plan, self.policy.check_layer)
        elif spec.name == "cacheblend":
            check = DeviationCheck(self.config.check_layer, spec.ratio)
        elif spec.name == "qguided":
            select_question_guided(self.lm.adapter, segments, spec.layer, ratio=spec.ratio)
        return segments, plan, used, tiers, check

    def _lookahead_work(self, spec: MethodSpec, segments: Sequence[Segment]) -> int:
        """Token-layers of the question-guided look-ahead (uncached tokens up to the check layer)."""
        if spec.name not in ("cachecraft", "qguided") or not any(s.cached is not None for s in segments):
            return 0
        layer = self.policy.check_layer if spec.name == "cachecraft" else spec.layer
        uncached = sum(len(s.token_ids) for s in segments if s.cached is None)
        return uncached * (min(layer, self.lm.adapter.num_layers - 1) + 1)

    def _plain_segments(self, pieces, prefix_key, keys, kvs, prefix_kv=None, keep: bool = True) -> list[Segment]:
        segments = [Segment(pieces.prefix, "prefix", cached=prefix_kv, key=prefix_key)]
        for ids, key, kv in zip(pieces.chunks, keys, kvs):
            fresh = keep and kv is None  # computed here: keep it as a variant, with its statistics
            segments.append(Segment(ids, "chunk", cached=kv, key=key, save=fresh, collect_stats=fresh))
        segments.append(Segment(pieces.question, "question"))
        return segments

    def starting_bandwidths(self) -> dict[str, float]:
        """Per tier, the bandwidth the loading controller assumes before it has timed a load:
        free (infinite) for a memory tier on the compute device when streaming (its variants
        are used as stored), the default elsewhere."""
        bandwidths = dict(DEFAULT_BANDWIDTHS)
        if self.config.stream_kv:
            bandwidths.update(dict.fromkeys(self.store.tiers_on(self.lm.device), math.inf))
        return bandwidths

    def _ensure_cost_model(self) -> CostModel:
        """The cost model, measured on first use, starting from :meth:`starting_bandwidths`."""
        if self.cost_model is None:
            self.cost_model = CostModel.measure(self.lm, kv_dtype=self.store.stored_dtype,
                                                bandwidths=self.starting_bandwidths())
        return self.cost_model

    def _learn_bandwidth(self, tier: str, nbytes: int, seconds: float) -> None:
        """Fold one timed load from ``tier`` into the cost model's bandwidth for it."""
        if self.cost_model is not None and tier != MISS:
            self.cost_model = self.cost_model.observe_load(tier, nbytes, seconds)

    def _learn_from_stream(self, stream: LayerStream) -> None:
        stream.close()  # the reading thread has finished with its counters
        for tier, nbytes in stream.read_bytes.items():
            self._learn_bandwidth(tier, nbytes, stream.read_seconds[tier])

    def _stored_nbytes(self, kv: ChunkKV) -> int:
        """Bytes of ``kv``'s K and V in the stored dtype (what a tier moves)."""
        return 2 * kv.keys.numel() * self.store.stored_dtype.itemsize

    def _hide_loading(self, plan: RecomputePlan) -> RecomputePlan:
        """Loading controller: raise a chunk's recompute to the fraction whose compute time
        hides loading it from its tier (CacheBlend's r = max(r*, r_load))."""
        self._ensure_cost_model()
        chunks = []
        for chunk_plan in plan.chunks:
            tier = self.store.locate(chunk_plan.variant) if chunk_plan.variant else None
            if tier is not None and chunk_plan.count > 0:
                floor = math.ceil(self.cost_model.r_load(tier) * chunk_plan.tokens)
                chunk_plan = replace(chunk_plan, count=min(chunk_plan.tokens, max(chunk_plan.count, floor)))
            chunks.append(chunk_plan)
        return replace(plan, chunks=tuple(chunks))

    def _compute_mostly_fixed(self, plan: RecomputePlan) -> RecomputePlan:
        """A chunk the plan would recompute at least ``KEEP_FIXED_FRACTION`` of is computed
        in full instead, nothing loaded, while it has room for another variant: its KV and
        statistics, made in this request's context, are then kept as a new variant."""
        chunks = []
        for chunk_plan in plan.chunks:
            if (chunk_plan.variant is not None and chunk_plan.fraction >= KEEP_FIXED_FRACTION
                    and len(self.store.variants_of(chunk_plan.chunk)) < MAX_VARIANTS_PER_CHUNK):
                chunk_plan = replace(chunk_plan, variant=None, count=chunk_plan.tokens)
            chunks.append(chunk_plan)
        return replace(plan, chunks=tuple(chunks))

    def _early_stop(self, spec: MethodSpec, segments: list[Segment], stops: dict[int, int]):
        if spec.name != "cachecraft" or not self.policy.early_stop_layers:
            return []
        chunk_segments = [i for i, s in enumerate(segments) if s.role == "chunk" and s.recompute is not None]

        def decide(layer: int, mass: torch.Tensor) -> dict[int, int]:
            decision = early_stop_decision(layer, mass, [i for i in chunk_segments if i not in stops],
                                           self.policy.early_stop_share)
            stops.update(decision)
            return decision

        return [QuestionAttention(self.policy.early_stop_layers, on_mass=decide)]

    def _warm_context(self) -> tuple[tuple[int, ...], str]:
        """Token ids of the warm context, cut to ``warm_context_tokens`` (and to a quarter
        of the model's window; empty when it is off), and its chunk key; read once."""
        if self._warm is None:
            ids = warm_context.token_ids(warm_context.load_text(self.config.warm_context), self.builder.encode,
                                         self.config.warm_context_tokens, self.lm.max_context)
            self._warm = ids, chunk_key(self.lm.fingerprint, ids)
        return self._warm

    def _warm_key_of(self, prefix_key: str) -> tuple[str, ...] | None:
        """The prefix tuple of variants made by :meth:`warm` (None when the context is off)."""
        ids, key = self._warm_context()
        return (prefix_key, key) if ids else None

    def _warm_context_segment(self, prefix: Segment) -> Segment | None:
        """The warm context as a cached segment after ``prefix``; made once and stored."""
        ids, key = self._warm_context()
        if not ids:
            return None
        kv, _ = self._load(variant_key(key, (prefix.key,)))
        if kv is None:
            made = blended_prefill(self.lm.adapter, [prefix, Segment(ids, "chunk", save=True, key=key)],
                                   fingerprint=self.lm.fingerprint)
            kv = made.saved[1]
            self._sources[key] = warm_context.SOURCE
            self._put(kv)
        return Segment(ids, "chunk", cached=kv, key=key)

    def _prefix_kv(self, pieces: PromptPieces, prefix_key: str, count_hit: bool = True) -> ChunkKV:
        """The system prefix's KV (exact: it always comes first); made once and stored."""
        name = variant_key(prefix_key, ())
        kv, _ = self._load(name, count_hit)
        if kv is None:
            kv = blended_prefill(self.lm.adapter, [Segment(pieces.prefix, "chunk", save=True, key=prefix_key)],
                                 fingerprint=self.lm.fingerprint).saved[0]
            self._put(kv)
        return kv

    def _load(self, name: str | None, count_hit: bool = True) -> tuple[ChunkKV | None, str]:
        if name is None:
            return None, MISS
        tier = self.store.locate(name)
        try:
            kv = self.store.get(name, dtype=self.lm.dtype, device=self.lm.device, fingerprint=self.lm.fingerprint,
                                count_hit=count_hit)
        except CorruptEntryError:
            kv = None
        return (kv, tier or MISS) if kv is not None else (None, MISS)

    def _open(self, name: str | None, count_hit: bool = True) -> LayerReader | None:
        """A layer-by-layer reader of the variant ``name`` in the stored dtype, or None on a miss."""
        if name is None:
            return None
        return self.store.iter_layers(name, device=self.lm.device, fingerprint=self.lm.fingerprint,
                                      count_hit=count_hit)

    def _any_variant(self, key: str, prefix_key: str) -> str | None:
        """An independent variant: the one :meth:`warm` makes, else one made alone, else any."""
        records = self.store.variants_of(key)
        for wanted in (self._warm_key_of(prefix_key), (prefix_key,)):
            match = [r for r in records if tuple(r.prefix) == wanted]
            if match:
                return match[0].key
        return records[0].key if records else None

    def _variant_infos(self, key: str, prefix_key: str) -> list[VariantInfo]:
        infos = []
        for record in self.store.variants_of(key):
            if not record.prefix or record.prefix[0] != prefix_key:
                continue  # made under another system prompt
            stats = self.store.stats_of(record.key)
            if stats is None:
                continue
            chunks = tuple(record.prefix[1:])
            sizes = tuple(self._chunk_tokens(k) for k in chunks)
            tokens = int(stats.outside.shape[1])
            infos.append(VariantInfo(record.key, chunks, stats.inter[:, 1:], stats.intra, tokens, sizes))
        return infos

    def _chunk_tokens(self, key: str) -> int:
        # A chunk's token count never changes: ask the catalog once per key.
        if key not in self._token_counts:
            record = self.catalog.chunk(key)
            if record is None:
                return 1
            self._token_counts[key] = record.num_tokens
        return self._token_counts[key]

    # -- saving and recording ----------------------------------------------------------------
    def _note_sources(self, keys: Sequence[str], sources: Sequence[str] | None) -> None:
        if sources is None:
            return
        if len(sources) != len(keys):
            raise ValueError(f"got {len(sources)} sources for {len(keys)} chunks")
        self._sources.update(zip(keys, sources))

    def _save(self, kvs: Sequence[ChunkKV]) -> None:
        for kv in kvs:
            if not self.store.contains(kv.variant):
                self._put(kv)

    def _put(self, kv: ChunkKV) -> None:
        text = self.lm.tokenizer.decode(list(kv.token_ids[:48]), skip_special_tokens=True)
        cost = self._estimate_full(kv.num_tokens)
        value = quality = None
        if kv.stats is not None:  # a chunk with the statistics the policy reads
            value, quality = expected_reuse(variant_info(kv), self.policy)
        self.store.put(kv, cost_s=cost, quality=quality, cci=value, source=self._sources.get(kv.chunk),
                       preview=text)

    def _report(self, pieces, keys, segments, plan: RecomputePlan | None, used, tiers, stops,
                recomputed: torch.Tensor) -> list[ChunkReport]:
        stop_by_offset = {}
        offset = 0
        for index, seg in enumerate(segments):
            if index in stops:
                stop_by_offset[offset] = stops[index]
            offset += len(seg.token_ids)
        reports, offset = [], len(pieces.prefix)
        for i, (ids, key) in enumerate(zip(pieces.chunks, keys)):
            score = plan.chunks[i].score if plan is not None else None
            fraction = float(recomputed[offset:offset + len(ids)].float().mean())
            reports.append(ChunkReport(i, key, len(ids), tiers[i], used[i], score.cci if score else None,
                                       score.beta_prime if score else None, score.cfo if score else None,
                                       fraction, stop_by_offset.get(offset)))
            offset += len(ids)
        return reports

    def _record(self, question: str, answer: Answer) -> int:
        chunks = tuple(RequestChunk(c.position, c.chunk, c.variant, c.tier if c.variant else MISS, c.cci,
                                    c.beta_prime, c.cfo, c.fraction, c.stop_layer) for c in answer.chunks)
        return self.catalog.record_request(RequestRecord(question_hash(question), answer.method, chunks,
                                                         answer.recompute_fraction, answer.ttft_s,
                                                         answer.full_prefill_estimate_s))

    def _learn_cost(self, tokens: int, seconds: float) -> None:
        per_token = seconds / max(1, tokens)
        self._seconds_per_token = per_token if self._seconds_per_token is None else (
            0.7 * self._seconds_per_token + 0.3 * per_token)

    def _estimate_full(self, tokens: int) -> float | None:
        return None if self._seconds_per_token is None else self._seconds_per_token * tokens

    def _estimate_request(self, tokens: int) -> float | None:
        """A full prefill's time: learned from full prefills, else from the measured cost model."""
        estimate = self._estimate_full(tokens)
        if estimate is None and self.cost_model is not None:
            estimate = self.cost_model.prefill_s_per_token * tokens
        return estimate

