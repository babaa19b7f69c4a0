"""The Pipeline: one request end to end, plan -> load -> blend -> generate -> record.

The :class:`Pipeline` owns the model, the store (and its catalog), the policy, the
ingested corpus and a prefix cache for the ``prefix`` baseline. :meth:`Pipeline.answer`
is the one function every entry point and benchmark answers through: it takes chunk
texts in prompt order and a method (see :mod:`cachecraft.methods`), which plans the
request and selects what to recompute; ``query`` retrieves the chunks from the corpus
first (``ingest`` fills it, ``warm_corpus`` makes its chunk-caches ahead of time).

Chunk-caches are keyed by (model fingerprint, token ids). A chunk computed in a
request is saved as a variant under that request's prefix (the system prefix and the
chunks before it), so a later request with the same chunks before it reuses it
exactly; and each variant a request reused has its measured saving (the share of the
chunk it did not recompute) folded into the quality the eviction policy ranks it by
(``keep_new_variants=False`` turns both off, for benchmarks that must measure each
method on the same store).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

from cachecraft.catalog import MISS, CatalogError, CatalogWriteError, RequestChunk, RequestRecord, question_hash
from cachecraft.catalog.pending import PendingRequests
from cachecraft.config import CHUNK_ORDERS, Config
from cachecraft.engine import (BlendResult, GenerationOptions, LayerHook, LayerSource, Segment, blended_prefill,
                               generate_from, sampled_layers)
from cachecraft.kv import ChunkKV, chunk_key, kv_bytes_per_token, variant_key
from cachecraft.methods import Full, KeptFull, Method, PrefillHooks, RequestContext, parse_method, variant_info
from cachecraft.metrics import RepetitionWatch, degenerate_repetition
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.pipeline.lookup import MADE_EXACTLY, PlannerStatsMemo, RequestLookup
from cachecraft.pipeline.documents import ForgetOutcome, forget_documents
from cachecraft.pipeline.cost import (COST_PROFILE, cost_model_from_profile, cost_profile, device_label,
                                     measure_cost_model, probe_sizes, teaches_rate)
from cachecraft.pipeline.reports import Answer, ChunkReport, PrefillTrace, Source, WarmReport
from cachecraft.policy.loading import DEFAULT_BANDWIDTHS, CostModel
from cachecraft.policy.calibrate import ANY_DEVICE, POLICY_PROFILE
from cachecraft.policy.ordering import cache_order
from cachecraft.policy.rules import room_for_variant, variant_to_replace
from cachecraft.policy.shipped import shipped_fit
from cachecraft.policy.planner import (FITTED_KEYS, PolicyParams, RecomputePlan, expected_reuse,
                                       params_from_config, policy_settings)
from cachecraft.prefix_cache import PrefixCache
from cachecraft.prompt import Conversation, PromptBuilder, PromptInputError, PromptPieces, builder_for
from cachecraft.retrieval.chunking import Chunker
from cachecraft.retrieval.corpus import Corpus, SearchHit
from cachecraft.retrieval.ingest import IngestOutcome, StageProgress, ingest_paths
from cachecraft.retrieval.snapshot import CorpusError
from cachecraft.selection import ChunkStatistics
from cachecraft.store import CorruptEntryError, LayerReader, LayerStream, StoreError, TieredStore
from cachecraft.store.streaming import host_copy_bandwidth
from cachecraft import warm_context

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
Observer = Callable[[PrefillTrace], None]


def in_shard(chunk_id: str, shard: tuple[int, int]) -> bool:
    """Whether the chunk ``chunk_id`` is in the i-th of n disjoint parts of the corpus
    (``shard=(i, n)``) that parallel warm workers take, by its id."""
    index, count = shard
    return int(chunk_id[:12], 16) % count == index


@dataclass(frozen=True)
class Retrieved:
    """What one question retrieved: its chunks (in the retrieval order asked for) and the
    seconds the search took."""

    hits: tuple[SearchHit, ...]
    seconds: float

    @property
    def chunks(self) -> list[str]:
        """The retrieved chunks' texts as the prompt holds them."""
        return [hit.chunk.prompt_text for hit in self.hits]


class _Stopped(Exception):
    """Raised inside a prefill :class:`_StopWhen` was asked to stop."""


class _StopWhen(LayerHook):
    """Stops a prefill before its next layer once ``stop()`` is true (idle work that a
    request arriving must not wait for)."""

    def __init__(self, stop: Callable[[], bool]):
        self.stop = stop

    def select(self, view) -> None:
        if self.stop():
            raise _Stopped
        return None


@dataclass(frozen=True)
class PreparedRequest:
    """A request planned and loaded, ready for the prefill."""

    segments: list[Segment]
    hooks: PrefillHooks
    plan: RecomputePlan | None
    used: tuple[str | None, ...]  # per chunk, the variant used (or found, where computed in full)
    tiers: tuple[str, ...]  # per chunk, the tier it came from, or "miss"
    started: float = 0.0  # time.perf_counter() as the prefill began (loading and planning done)
    asked_before: int = 0  # where kept exact, the asks of its chunk order that earned it (else 0)
    exact_wait: int = 0  # where kept exact, the asks it had to wait for

    @property
    def keep_exact(self) -> bool:
        """Whether its chunks computed here are kept as exact, in place of inexact ones."""
        return self.asked_before > 0


class Pipeline:
    """Model + store + catalog + policy, answering questions over given chunks."""

    def __init__(self, config: Config, lm: LoadedModel | None = None, store: TieredStore | None = None,
                 policy: PolicyParams | None = None, *, keep_new_variants: bool = True):
        self.config = config
        # start-up work, kept apart from every request's TTFT: name -> seconds
        self.startup_s: dict[str, float] = {}
        if lm is None:
            start = time.perf_counter()
            lm = load_model(config.model, config)
            self.startup_s["model"] = time.perf_counter() - start
        self.lm = lm
        self.store = store or TieredStore(config)
        self.catalog = self.store.catalog
        self.builder = builder_for(self.lm.tokenizer, config)
        self.fitted_policy = self._fitted_policy()  # what `calibrate` stored for this model, if anything
        self.policy = policy or params_from_config(config, self.lm.adapter.num_layers, self.fitted_policy)
        # where each fitted setting came from: config, calibrated or default (given params: "given")
        self.policy_sources = (dict.fromkeys(FITTED_KEYS, "given") if policy is not None
                               else policy_settings(config, self.fitted_policy)[1])
        self.keep_new_variants = keep_new_variants
        self.prefix_cache = PrefixCache(self.lm.fingerprint, budget_bytes=config.cpu_budget_bytes)
        self.cost_model: CostModel | None = None  # from the catalog, else measured, on first use
        self._host_bandwidth: float | None = None  # host-to-GPU copy speed, measured on first use
        self._stored_cost_model: CostModel | None = None  # as the catalog holds it
        self._token_counts: dict[str, int] = {}
        self.planner_stats = PlannerStatsMemo(lambda variant: self.store.stats_of(variant))  # read once each
        self.pending = PendingRequests(config.cache_dir)  # request rows waiting for a lost catalog
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
    def method(self, method: str | Method, ratio: float | None = None) -> Method:
        """``method`` as an object: a name (``cacheblend``, ``cacheblend@0.3``) takes
        ``ratio``, else the config's ``cacheblend_ratio`` (the policy's alpha for ``cachecraft``)."""
        if isinstance(method, Method):
            return method
        return parse_method(method, ratio=self.config.cacheblend_ratio if ratio is None else ratio,
                            alpha=self.policy.alpha if ratio is None else ratio)

    def answer(self, chunk_texts: Sequence[str], question: str, *, method: str | Method = "cachecraft",
               ratio: float | None = None, max_new_tokens: int | None = None, streamer=None,
               record: bool = True, sources: Sequence[str] | None = None,
               observer: Observer | None = None, generation: GenerationOptions | None = None,
               question_template: str | None = None, chunk_order: str | None = None,
               conversation: Conversation | None = None) -> Answer:
        """Answer ``question`` over ``chunk_texts`` (formatted chunk texts, in order) with
        ``method``: plan, load, blend, generate, record. ``sources`` (one per chunk) names
        where each chunk came from in the catalog; ``observer`` receives the prefill's
        :class:`PrefillTrace` before generation (benchmarks read logits and work there);
        ``generation``: sampling, stop strings, cancellation (default: greedy);
        ``question_template``: this request's instead of the config's (``"{question}"``: the
        question as given, for a client that wrote its own prompt); ``chunk_order``: this
        request's instead of the config's ``chunk_order``; ``conversation``: a chat's
        instructions and earlier turns, written after the chunks, before the question."""
        if chunk_order is not None and chunk_order not in CHUNK_ORDERS:
            raise PromptInputError(f"the chunk order must be one of {CHUNK_ORDERS}, got {chunk_order!r}")
        chosen = self.method(method, ratio)
        start = time.perf_counter()
        request = self._request(chunk_texts, question, sources, question_template,
                                chunk_order or self.config.chunk_order, conversation)
        prepared, result = self._prefill(chosen, request)
        int(result.logits.argmax())  # the first token is decided here
        decided = time.perf_counter()
        ttft = decided - start
        if all(s.cached is None and not s.collect_stats for s in prepared.segments):
            self._learn_prefill(result.num_tokens, ttft)  # a plain full prefill times the prefill cost
        elif any(s.cached is not None for s in prepared.segments):
            self._learn_blend(prepared, result, decided - prepared.started)
        chosen.after_prefill(request, result)
        trace = self._trace(chosen, prepared, result) if observer is not None else None
        if trace is not None:
            observer(trace)
        recomputed, recompute = result.recomputed, result.recompute_fraction
        fallback = self._falls_back(chosen, streamer)
        limit = max_new_tokens or self.config.max_new_tokens
        new_ids = generate_from(self.lm.model, self.lm.tokenizer, result, max_new_tokens=limit, streamer=streamer,
                                options=generation, until=RepetitionWatch() if fallback else None)
        if trace is not None:
            trace.answer_ids = new_ids
        reports = self._report(request, prepared, recomputed)
        text = self.lm.tokenizer.decode(new_ids, skip_special_tokens=True)
        cancelled = generation is not None and generation.cancel is not None and generation.cancel.is_set()
        exact = self._exact_chunks(request, prepared)
        # every chunk reused from variants stored exactly: what tells a keep that lasted (exact_wait)
        reused_exact = all(exact) and all(s.cached is not None for s in prepared.segments if s.role == "chunk")
        # a prefill whose every chunk is a full prefill's answers as full does: no second try
        loops = fallback and not cancelled and not all(exact) and degenerate_repetition(text)
        gave_way: list[dict] = []  # variants deleted at their chunk's cap for this request's exact ones
        if self.keep_new_variants:
            if not loops:  # a prefill that looped keeps nothing: its second try keeps exact chunks
                result.complete()  # the new chunk-caches' statistics, measured once the answer is out
                # chunks computed here, and the prefix where it was too (a repeated order's
                # exact chunks in place of inexact variants of the same prefix)
                gave_way += self._save(request, result.saved, exact, replace=prepared.keep_exact,
                                       asked=prepared.asked_before,
                                       prior_uses=min(prepared.asked_before, prepared.exact_wait))
            self._learn_use(reports, saved_nothing=loops)
        abandoned = first_try_ttft = None
        if loops:
            # A loop full prefill may not share: answer again from exact KV, and say so
            abandoned, first_try_ttft = text, ttft
            log.info("the %s answer degenerated into repetition; answering again from a full prefill",
                     chosen.label)
            if streamer is not None:
                streamer.restart("the answer repeated itself; answering again from a full prefill")
            # the full prefill keeps its chunks under their exact prefixes: asked again in this
            # order, they are reused exactly, nothing recomputed, and answer as this one does
            _, again = self._prefill(KeptFull() if self.keep_new_variants else Full(), request)
            int(again.logits.argmax())
            ttft, recompute = time.perf_counter() - start, 1.0
            new_ids = generate_from(self.lm.model, self.lm.tokenizer, again, max_new_tokens=limit,
                                    streamer=streamer, options=generation)
            text = self.lm.tokenizer.decode(new_ids, skip_special_tokens=True)
            if self.keep_new_variants:
                again.complete()
                # exact, so they replace a variant of the same prefix made after reused chunks
                gave_way += self._save(request, again.saved, [True] * len(request.keys), replace=True)
        answer = Answer(generation.cut(text) if generation is not None else text, chosen.label, ttft,
                        request.pieces.num_tokens, len(new_ids), recompute, reports,
                        full_prefill_estimate_s=self._estimate_full(request.pieces.num_tokens),
                        abandoned_text=abandoned, first_try_ttft_s=first_try_ttft,
                        order=list(request.order) if request.order is not None else None,
                        kept_exact=prepared.keep_exact, exact_wait=prepared.exact_wait,
                        reused_exact=reused_exact, gave_way=gave_way)
        if record:
            answer.request_id = self._record(question, answer)
            self.store.record_pending()  # hit counts kept while the catalog was away
        return answer

    def _falls_back(self, method: Method, streamer) -> bool:
        """Whether an answer of ``method`` that loops is answered again from a full prefill:
        with ``repetition_fallback`` on, for methods that reuse chunk-caches, unless the
        answer streams to a streamer that cannot start over (one without ``restart``)."""
        return (self.config.repetition_fallback and method.uses_cache
                and (streamer is None or hasattr(streamer, "restart")))

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
            context = context or self._warm_context_segment(prefix)  # loaded once for all chunks
            self._warm_chunk(ids, key, prefix, context)
            made += 1
        return made

    def _warm_chunk(self, ids: Sequence[int], key: str, prefix: Segment, context: Segment | None) -> ChunkKV:
        """Make and store one chunk's cache after ``prefix`` and the warm context ``context``
        (None: none is set; left out where it and the chunk do not fit the model's context);
        returns it."""
        fits = context is not None and (len(prefix.token_ids) + len(context.token_ids) + len(ids)
                                        <= self.lm.max_context)
        segments = [prefix, *([context] if fits else []),
                    Segment(ids, "chunk", save=True, collect_stats=True, key=key)]
        kv = blended_prefill(self.lm.adapter, segments, fingerprint=self.lm.fingerprint,
                             hooks=[ChunkStatistics(self.stats_layers)]).saved[len(segments) - 1]
        self._put(kv, made_exactly=len(segments) == 2, strict=True)  # after the system prefix alone: exact
        return kv

    def make_exact(self, chunk_texts: Sequence[str], sources: Sequence[str] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> int:
        """Store these chunks, in this order, as a full prefill's KV: each after exactly the
        chunks before it, so the next request that holds them in this order (a chat's next
        turn, the same documents asked again, any question) reuses them all with nothing
        recomputed and answers as full prefill does. For idle time, after an answer is out
        (the server's ``exact_when_idle``): one chunk at a time, each computed after the
        exact caches of those before it (those already stored are skipped), so work done
        is kept. ``should_stop()`` is asked before every layer: once it is true the chunk
        being computed is dropped and the call returns, so a request waits for one layer,
        and the next call goes on from there. A chunk at its cap of variants takes one only
        where an inexact one (never ``warm``'s) gives way; else the chunks after it cannot
        be exact and the call ends. Returns how many chunks were stored exactly."""
        if not chunk_texts or not self.keep_new_variants:
            return 0
        stop = should_stop or (lambda: False)
        request = self._request(chunk_texts, "?", sources)
        pieces, keys, prefix_key = request.pieces, request.keys, request.prefix_key
        names = [variant_key(key, (prefix_key, *keys[:index])) for index, key in enumerate(keys)]
        exact = [request.lookup.made_exactly(key, name) for key, name in zip(keys, names)]
        if all(exact):
            return 0
        last = max(index for index, done in enumerate(exact) if not done)  # the rest are stored exactly
        segments = [Segment(pieces.prefix, "prefix", cached=self._prefix_kv(pieces, prefix_key), key=prefix_key)]
        made = 0
        for index, (ids, key, name) in enumerate(zip(pieces.chunks[:last + 1], keys, names)):
            kv = self._load(name, count_hit=False)[0] if exact[index] else None
            if kv is None:
                try:
                    kv = blended_prefill(self.lm.adapter,
                                         [*segments, Segment(ids, "chunk", save=True, collect_stats=True, key=key)],
                                         fingerprint=self.lm.fingerprint,
                                         hooks=[_StopWhen(stop),
                                                ChunkStatistics(self.stats_layers, self.config.miss_stats_stride)]
                                         ).saved[len(segments)]
                except _Stopped:
                    break
                if self.store.contains(name):  # an inexact variant of this very prefix: replaced
                    self.planner_stats.forget(name)
                elif not self._make_room(request, key)[0]:  # room made only for a chunk computed
                    break
                try:
                    self._put(kv, made_exactly=True)
                except (StoreError, CatalogWriteError) as exc:
                    log.warning("a chunk order was not stored exactly: %s", exc)
                    break
                made += 1
            segments.append(Segment(ids, "chunk", cached=kv, key=key))
        return made

    def warm_after(self, pairs: Sequence[tuple[str, str]], sources: Sequence[str] | None = None) -> int:
        """In-context variants: for each ``(before, chunk)`` text pair, make ``chunk``'s cache
        right after the system prefix and ``before``, as a request that puts ``before`` just
        ahead of it would see it; one that holds ``before`` elsewhere finds most of its
        context there. ``before`` comes from its own stored cache (the one :meth:`warm`
        makes, made here first if missing), as such a request reuses it, so only ``chunk``'s
        tokens are computed. Returns how many were made (those already stored are skipped).
        ``sources`` name the chunks' files, one per pair."""
        if not pairs:
            return 0
        pieces = self.builder.build([text for pair in pairs for text in pair], "warm")
        prefix_key = chunk_key(self.lm.fingerprint, pieces.prefix)
        prefix = Segment(pieces.prefix, "prefix", cached=self._prefix_kv(pieces, prefix_key), key=prefix_key)
        keys = [chunk_key(self.lm.fingerprint, ids) for ids in pieces.chunks]
        self._note_sources(keys[1::2], sources)
        made = 0
        for i in range(0, len(keys), 2):
            before_ids, ids = pieces.chunks[i], pieces.chunks[i + 1]
            before_key, key = keys[i], keys[i + 1]
            if before_key == key or self.store.contains(variant_key(key, (prefix_key, before_key))):
                continue
            if len(pieces.prefix) + len(before_ids) + len(ids) > self.lm.max_context:
                continue
            segments = [prefix, Segment(before_ids, "chunk", cached=self._warm_kv(before_ids, before_key, prefix),
                                        key=before_key),
                        Segment(ids, "chunk", save=True, collect_stats=True, key=key)]
            kv = blended_prefill(self.lm.adapter, segments, fingerprint=self.lm.fingerprint,
                                 hooks=[ChunkStatistics(self.stats_layers)]).saved[2]
            self._put(kv, strict=True)
            made += 1
        return made

    def ingest(self, paths: Iterable[str | Path], progress: StageProgress | None = None) -> IngestOutcome:
        """Read text, Markdown, HTML, PDF and docx files and directories, chunk them in the
        generator's tokens (large files streamed) and add them to the corpus (a changed
        file's chunks are replaced). Files that cannot be read are skipped and listed in
        the outcome with their reasons; ``progress(stage, done, total)`` follows reading
        (bytes) and embedding (chunks)."""
        chunker = Chunker(self.builder.encode, self.config.chunk_tokens, self.config.chunk_overlap)
        settings = {"model": self.lm.name, "chunk_tokens": self.config.chunk_tokens,
                    "chunk_overlap": self.config.chunk_overlap}
        return ingest_paths(self.corpus, chunker, paths, settings=settings, progress=progress)

    def forget_documents(self, paths: Iterable[str | Path], keep_caches: bool = False) -> ForgetOutcome:
        """Drop the files ``paths`` name from the corpus and, unless ``keep_caches``, their
        chunk-caches from the store (:func:`~cachecraft.pipeline.documents.forget_documents`)."""
        return forget_documents(self.corpus, None if keep_caches else self.store, paths)

    def warm_corpus(self, progress: Progress | None = None, shard: tuple[int, int] = (0, 1),
                    between: Callable[[], None] | None = None) -> WarmReport:
        """Make the chunk-cache of every ingested chunk not cached yet (after the system prefix
        and the warm context), and with ``config.warm_neighbours`` = N also its in-context
        variants after each of its N nearest chunks in the index (:meth:`warm_after`), with
        ``config.warm_previous`` after the chunk before it in its file.
        ``shard=(i, n)`` takes the i-th of n disjoint parts, for parallel workers;
        ``between`` is called once the shard's own caches are made, before its variants
        (with in-context variants only): a worker waits there for the others, so that every
        neighbour's cache is made, and counted, by the worker whose shard holds it."""
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard}")
        self._require_corpus()
        chunks = [c for c in self.corpus.chunks() if in_shard(c.id, shard)]
        near = self.corpus.neighbours(self.config.warm_neighbours) if self.config.warm_neighbours else {}
        if self.config.warm_previous:  # the file's previous chunk first, then the index's neighbours
            for chunk_id, before in self.corpus.previous_chunks().items():
                near[chunk_id] = [before, *(c for c in near.get(chunk_id, ()) if c.id != before.id)]
        made = in_context = 0
        steps = len(chunks) * (2 if near else 1)
        for i, chunk in enumerate(chunks):
            made += self.warm([chunk.prompt_text], sources=[chunk.source])
            if progress:
                progress(i + 1, steps)
        # the variants after every chunk's own cache is made: each reuses its neighbour's
        if self.config.warms_in_context and between:  # every worker alike, whatever its share holds
            between()
        for i, chunk in enumerate(chunks if near else ()):
            pairs = [(other.prompt_text, chunk.prompt_text) for other in near.get(chunk.id, ())]
            in_context += self.warm_after(pairs, sources=[chunk.source] * len(pairs))
            if progress:
                progress(len(chunks) + i + 1, steps)
        return WarmReport(made, len(chunks) - made, len(chunks), in_context)

    def retrieve(self, question: str, top_k: int | None = None, order: str | None = None) -> Retrieved:
        """The ``top_k`` chunks most similar to ``question``, in ``order`` (default: the
        config's ``retrieval_order``, best first), and the time the search took (loading the
        embedding model left out)."""
        if not question or not question.strip():
            raise PromptInputError("the question is empty")
        self._require_corpus()
        if self.corpus._embed is None:  # retrieval time excludes loading the embedding model
            start = time.perf_counter()
            self.corpus.load_embedder()
            self.startup_s["embedder"] = time.perf_counter() - start
        start = time.perf_counter()
        hits = self.corpus.search(question, self.config.top_k if top_k is None else top_k,
                                  order or self.config.retrieval_order)
        return Retrieved(tuple(hits), time.perf_counter() - start)

    def query(self, question: str, top_k: int | None = None, method: str = "cachecraft", streamer=None, *,
              retrieved: Retrieved | None = None, retrieval_order: str | None = None, **options) -> Answer:
        """Retrieve the ``top_k`` chunks most similar to ``question`` (:meth:`retrieve` in
        ``retrieval_order``, or ``retrieved`` where the caller already did) and answer over
        them; ``options`` go to :meth:`answer`. The answer lists its ``sources``."""
        if retrieved is None:
            retrieved = self.retrieve(question, top_k, retrieval_order)
        self.ensure_cost_model()  # read or measured here, outside the TTFT clock; it also estimates savings
        hits = retrieved.hits
        answer = self.answer(retrieved.chunks, question, method=method, streamer=streamer,
                             sources=[h.chunk.source for h in hits], **options)
        answer.sources = [Source(h.chunk.id, h.chunk.title, h.chunk.source, h.score, h.chunk.text) for h in hits]
        answer.retrieval_s = retrieved.seconds
        return answer

    def _require_corpus(self) -> None:
        if not len(self.corpus):
            raise CorpusError(f"the corpus in {self.corpus.directory} is empty: run `cachecraft ingest PATH` first")

    def close(self) -> None:
        """Keep what the cost model learned, persist memory tiers to disk and release the store;
        request rows the catalog could not take are kept on disk for a later run."""
        try:
            self._save_cost_model()
            if self.pending.rows:
                self.pending.record(self.catalog)
            if self.pending.rows:
                kept = len(self.pending.rows)
                path = self.pending.keep_on_disk()
                log.warning("the catalog at %s %s: %d request row(s) kept in %s, recorded by the next "
                            "request that reaches it", self.catalog.where, self.catalog.why_unwritten, kept, path)
        finally:
            self.store.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def forget(self, chunk_texts: Sequence[str]) -> int:
        """Remove every stored variant of these chunks (as ``answer`` would tokenize them);
        returns how many were removed."""
        pieces = self.builder.build(chunk_texts, "forget")
        removed = 0
        for ids in pieces.chunks:
            for record in self.store.variants_of(chunk_key(self.lm.fingerprint, ids)):
                removed += bool(self.store.delete(record.key))
        return removed

    # -- planning, loading, prefill ------------------------------------------------------------
    def builder_with(self, question_template: str | None) -> PromptBuilder:
        """The prompt builder for ``question_template`` (None: the config's); the system
        prefix and chunks are built alike, so chunk-caches are shared between templates."""
        if question_template is None or question_template == self.builder.question_template:
            return self.builder
        if "{question}" not in question_template:
            raise PromptInputError("question_template needs a {question} placeholder")
        return self.builder.with_question_template(question_template)

    def _request(self, chunk_texts: Sequence[str], question: str, sources: Sequence[str] | None,
                 question_template: str | None = None, chunk_order: str = "given",
                 conversation: Conversation | None = None) -> RequestContext:
        pieces = self.builder_with(question_template).build(chunk_texts, question, max_tokens=self.lm.max_context,
                                                            conversation=conversation)
        keys = tuple(chunk_key(self.lm.fingerprint, ids) for ids in pieces.chunks)
        self._note_sources(keys, sources)
        lookup = RequestLookup(self.store, keys, self.planner_stats, self._warm_key_of, self._chunk_tokens,
                               lambda tier: self.ensure_cost_model().r_load(tier),
                               lambda tier: self.ensure_cost_model().r_hide(tier), self._order_history)
        prefix_key = chunk_key(self.lm.fingerprint, pieces.prefix)
        order = None
        if chunk_order == "cache" and len(keys) > 1:
            order = cache_order(*lookup.links(keys, prefix_key))
            pieces = replace(pieces, chunks=tuple(pieces.chunks[i] for i in order))
            keys = tuple(keys[i] for i in order)
        return RequestContext(pieces, prefix_key, keys, self.lm.adapter, self.policy, self.config.check_layer,
                              lookup, self.prefix_cache, order)

    def _order_history(self, keys: Sequence[str], limit: int) -> list[dict]:
        """The recorded policies of the newest ``limit`` requests of ``keys`` in this order,
        newest first; none where new variants are not kept (nothing would come of knowing)
        or the catalog cannot say."""
        if not self.keep_new_variants:
            return []
        try:
            return self.catalog.order_history(keys, limit)
        except CatalogError as exc:  # advice for the plan: the request goes on without it
            log.warning("cannot count earlier asks of this chunk order (%s)", exc)
            return []

    def _prefill(self, method: Method, request: RequestContext) -> tuple[PreparedRequest, BlendResult]:
        """Plan, load and run the blended prefill; a damaged chunk-cache found on the way
        is removed and the request prepared again without it."""
        for attempt in range(len(request.keys) + 1):
            try:
                with ExitStack() as loading:  # chunk-caches stream in while the layers compute
                    prepared = self._prepare(method, request, loading, count_hits=attempt == 0)
                    # a chunk computed here reads every miss_stats_stride-th token's attention only,
                    # and after the answer (deferred): its first token comes as a plain prefill's does
                    hooks = [ChunkStatistics(self.stats_layers, self.config.miss_stats_stride, deferred=True),
                             *prepared.hooks.layer_hooks]
                    prepared = replace(prepared, started=time.perf_counter())
                    result = blended_prefill(self.lm.adapter, prepared.segments, hooks=hooks,
                                             fingerprint=self.lm.fingerprint)
                return prepared, result
            except CorruptEntryError as exc:
                if attempt == len(request.keys):
                    raise
                log.warning("%s; answering again without it", exc)
        raise AssertionError("unreachable")

    def _prepare(self, method: Method, request: RequestContext, loading: ExitStack,
                 count_hits: bool = True) -> PreparedRequest:
        """The method's plan, its variants loaded (streamed through a :class:`LayerStream`
        that ``loading`` closes, or read whole without ``stream_kv``), its segments and
        hooks. ``count_hits`` is false when a request is prepared again after a damaged
        entry: its hits counted once."""
        n = len(request.keys)
        load = method.load_plan(request)
        if load is None:  # no chunk-caches: full, prefix
            segments = method.segments(request, None, [None] * n)
            return PreparedRequest(segments, method.prepare(request, segments, None), None, (None,) * n, (MISS,) * n)
        # With every chunk computed here, a missing system prefix is computed with them (and
        # saved) rather than in a prefill of its own first
        prefix_kv = self._prefix_kv(request.pieces, request.prefix_key, count_hit=count_hits,
                                    make=any(name is not None for name in load.wanted), best_effort=True)
        kvs, tiers = self._load_variants(load.wanted, loading, count_hits)
        used = [name if kv is not None else None for name, kv in zip(load.wanted, kvs)]
        for i, (found, wanted) in enumerate(zip(load.found or (), load.wanted)):
            tier = request.lookup.tier_of(found) if wanted is None and found else None
            if tier is not None:  # found but computed in full by choice: still a hit, at fraction 1.0
                tiers[i], used[i] = tier, found
        # a plan that keeps its chunks exact keeps them even at the cap (the save makes room)
        segments = method.segments(request, prefix_kv, kvs, past_cap=load.keep_exact)
        hooks = method.prepare(request, segments, load)
        return PreparedRequest(segments, hooks, load.plan, tuple(used), tuple(tiers),
                               asked_before=load.asked_before, exact_wait=load.exact_wait)

    def _load_variants(self, wanted: Sequence[str | None], loading: ExitStack,
                       count_hits: bool) -> tuple[list[LayerSource | None], list[str]]:
        """Each wanted variant as a layer source (None on a miss) and the tier it came from."""
        if self.config.stream_kv:
            readers = [self._open(name, count_hits) for name in wanted]
            stream = loading.enter_context(LayerStream([r for r in readers if r is not None]))
            loading.callback(self._learn_from_stream, stream)  # runs first on exit: closes, then reads
            streamed = iter(stream.kvs)
            kvs = [next(streamed) if r is not None else None for r in readers]
            return kvs, [kv.tier if kv is not None else MISS for kv in kvs]
        kvs, tiers = [], []  # each variant read whole, in the compute dtype, before the prefill starts
        for name in wanted:
            start = time.perf_counter()
            kv, tier = self._load(name, count_hits)
            if kv is not None:
                self._learn_bandwidth(tier, self._stored_nbytes(kv), time.perf_counter() - start)
            kvs.append(kv)
            tiers.append(tier)
        return kvs, tiers

    def _trace(self, method: Method, prepared: PreparedRequest, result: BlendResult) -> PrefillTrace:
        work = result.token_layers
        if prepared.hooks.lookahead_layer is not None:  # the uncached tokens ran up to the check layer first
            uncached = sum(len(s.token_ids) for s in prepared.segments if s.cached is None)
            work += uncached * (prepared.hooks.lookahead_layer + 1)
        kv_bytes = sum(k.numel() * k.element_size() * 2 for k in result.keys)
        return PrefillTrace(method.label, result.logits.float().cpu(), work, kv_bytes, list(result.keys),
                            list(result.values), result.token_ids)

    def starting_bandwidths(self) -> dict[str, float]:
        """Per tier, the bandwidth the loading controller assumes before it has timed a load:
        free (infinite) for a memory tier on the compute device when streaming (its variants
        are used as stored), the default elsewhere."""
        bandwidths = dict(DEFAULT_BANDWIDTHS)
        if self.config.stream_kv:
            bandwidths.update(dict.fromkeys(self.store.tiers_on(self.lm.device), math.inf))
        if self.lm.device.type == "cuda" and "cpu" in self.store.tier_names and bandwidths["cpu"] < math.inf:
            # Measured, not assumed: a starting bandwidth that is too low is a trap. A variant
            # judged slower to load than to recompute is never loaded, so its tier is never
            # timed (on an H100, Llama-3.1-8B's caches in pinned memory at the default 3 GB/s
            # looked several times slower to load than to recompute, and every request
            # recomputed them all). Too high corrects itself: the first load is timed.
            if self._host_bandwidth is None:
                self._host_bandwidth = host_copy_bandwidth(self.lm.device)
            bandwidths["cpu"] = self._host_bandwidth
        return bandwidths

    def ensure_cost_model(self) -> CostModel:
        """The cost model: as the catalog keeps it for this model and device, else measured
        (a few short prefills) and stored there, starting from :meth:`starting_bandwidths`;
        call it before timing requests to keep that out. The time it took is in
        :attr:`startup_s` (``cost model``, or ``cost model (stored)`` when read)."""
        if self.cost_model is None:
            start = time.perf_counter()
            adapter = self.lm.adapter
            per_layer = kv_bytes_per_token(1, adapter.num_kv_heads, adapter.head_dim, self.store.stored_dtype)
            stored = cost_model_from_profile(self._cost_profile(), adapter.num_layers, per_layer,
                                             self.starting_bandwidths(), self._probe_tokens())
            if stored is not None:
                self.cost_model = self._stored_cost_model = stored
                self.startup_s["cost model (stored)"] = time.perf_counter() - start
            else:
                self.cost_model = measure_cost_model(self.lm, kv_dtype=self.store.stored_dtype,
                                                     bandwidths=self.starting_bandwidths())
                self._save_cost_model()
                self.startup_s["cost model"] = time.perf_counter() - start
        return self.cost_model

    def policy_report(self) -> dict:
        """The policy's settings in use (layers resolved for this model) and where each came
        from (config, calibrated, default), for ``explain`` and ``config show``."""
        return {"alpha": self.policy.alpha, "check_layer": self.policy.check_layer, "floor": self.policy.floor,
                "sink_tokens": self.policy.sink_tokens, "drift_shift": self.policy.drift_shift,
                "drift_estimator": self.policy.drift_estimator, "relevance": self.policy.relevance,
                "early_stop_layers": list(self.policy.early_stop_layers),
                "exact_after_asks": self.policy.exact_after_asks, "num_layers": self.lm.adapter.num_layers,
                "sources": dict(self.policy_sources)}

    def _fitted_policy(self) -> dict | None:
        """The policy parameters ``calibrate`` stored for this model, else those shipped for
        it when it is a bundled model (None: neither; an unreadable catalog is only worth
        a warning)."""
        try:
            found = self.catalog.profile(self.lm.fingerprint, ANY_DEVICE, POLICY_PROFILE)
        except CatalogError as exc:
            log.warning("cannot read the calibrated policy (%s); using the config's", exc)
            found = None
        return found or shipped_fit(self.config.model, self.lm.model.config)

    def _probe_tokens(self) -> tuple[int, ...]:
        """The prompt sizes the prefill rate is measured at for this model and device."""
        return probe_sizes(self.lm.device, self.lm.max_context)

    def _cost_profile(self) -> dict | None:
        try:
            return self.catalog.profile(self.lm.fingerprint, device_label(self.lm.device), COST_PROFILE)
        except CatalogError as exc:  # measured again rather than not answering
            log.warning("cannot read the stored cost model (%s); measuring it", exc)
            return None

    def _save_cost_model(self) -> None:
        """Store the cost model in the catalog when it changed since read or stored."""
        model = self.cost_model
        if model is None or model == self._stored_cost_model:
            return
        try:
            self.catalog.save_profile(self.lm.fingerprint, device_label(self.lm.device), COST_PROFILE,
                                      cost_profile(model, self._probe_tokens()))
            self._stored_cost_model = model
        except CatalogError as exc:  # the next process measures again: nothing else is lost
            log.warning("the cost model was not stored (%s)", exc)

    def _learn_prefill(self, tokens: int, seconds: float) -> None:
        """Fold one timed full prefill into the cost model's prefill rate (one long enough
        to tell it: see :func:`teaches_rate`)."""
        if teaches_rate(tokens, self.lm.device, self.lm.max_context):
            self.cost_model = self.ensure_cost_model().observe_prefill(tokens, seconds)

    def _learn_blend(self, prepared: PreparedRequest, result: BlendResult, seconds: float) -> None:
        """Fold one timed blended prefill on a GPU into the cost model's blending cost (one
        long enough to tell it, as for the prefill rate), with the time its streamed loads
        were expected to take, so that one which may have waited for them is left out."""
        # Only a GPU copies on an engine of its own beside the compute; on a CPU the reading
        # thread takes cores from the compute, so the blend's own work hides no load there
        # (and the controller keeps r_load, as measured before on this machine).
        if self.lm.device.type != "cuda" or not teaches_rate(result.num_tokens, self.lm.device,
                                                              self.lm.max_context):
            return
        model = self.ensure_cost_model()
        # only streamed layers carry their tier: ones read whole were in before the prefill began
        load_s = sum(model.load_s(tier, seg.cached.num_tokens) for seg in prepared.segments
                     if seg.cached is not None and (tier := getattr(seg.cached, "tier", None)) is not None)
        self.cost_model = model.observe_blend(result.num_tokens, result.token_layers, seconds, load_s)

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

    def _warm_context(self) -> tuple[tuple[int, ...], str]:
        """Token ids of the warm context, cut to ``warm_context_tokens`` (and to a quarter
        of the model's window; empty when it is off), and its chunk key; read once."""
        if self._warm is None:
            ids = warm_context.token_ids(warm_context.load_text(self.config.warm_context), self.builder.encode,
                                         self.config.warm_context_tokens, self.lm.max_context)
            self._warm = ids, chunk_key(self.lm.fingerprint, ids)
        return self._warm

    def _warm_kv(self, ids: Sequence[int], key: str, prefix: Segment) -> ChunkKV:
        """The cache :meth:`warm` makes of the chunk ``ids`` (keyed ``key``) after ``prefix``,
        loaded, or made and stored when it is not there (a damaged one is made again)."""
        name = variant_key(key, self._warm_key_of(prefix.key) or (prefix.key,))
        kv, _ = self._load(name, count_hit=False)
        if kv is None:
            kv = self._warm_chunk(ids, key, prefix, self._warm_context_segment(prefix))
        return kv

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
            self._put(kv, strict=True)
        return Segment(ids, "chunk", cached=kv, key=key)

    def _prefix_kv(self, pieces: PromptPieces, prefix_key: str, count_hit: bool = True,
                   make: bool = True, best_effort: bool = False) -> ChunkKV | None:
        """The system prefix's KV (exact: it always comes first); made once and stored.
        Without ``make``, None when it is not stored yet. With ``best_effort`` (a request,
        which can answer without it stored), a store that cannot take it is a warning."""
        name = variant_key(prefix_key, ())
        kv, _ = self._load(name, count_hit)
        if kv is None and make:
            kv = blended_prefill(self.lm.adapter, [Segment(pieces.prefix, "chunk", save=True, key=prefix_key)],
                                 fingerprint=self.lm.fingerprint).saved[0]
            if not best_effort:
                self._put(kv, strict=True)
                return kv
            try:
                self._put(kv)
            except (StoreError, CatalogWriteError) as exc:
                log.warning("the system prompt's cache was not kept: %s", exc)
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

    def _chunk_tokens(self, key: str) -> int:
        # A chunk's token count never changes: ask the catalog once per key.
        if key not in self._token_counts:
            try:
                record = self.catalog.chunk(key)
            except CatalogError:  # the catalog is away: the count is only a weight
                return 1
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

    def _save(self, request: RequestContext, saved: dict[int, ChunkKV], exact: Sequence[bool],
              replace: bool = False, asked: int = 0, prior_uses: int = 0) -> list[dict]:
        """Store the chunk-caches (and system prefix) a prefill of ``request`` computed
        (``saved``, by segment: the prefix first, then the chunks) that are not stored yet;
        ``exact``: per chunk, whether its KV in that prefill was a full prefill's (a chunk
        computed there is, when every chunk before it is: recorded with it). With
        ``replace`` (a second try's exact chunks), a chunk's stored variant of the same
        prefix is replaced, and a chunk at the cap makes room (:meth:`_make_room`, for a
        keep of a chunk order ``asked`` that many times since it was last kept exact);
        ``prior_uses``: the earlier asks that earned it, which eviction counts as uses. Best
        effort: the answer is out, so a store that cannot take them (a full disk) costs
        the caches not kept, with a warning, not the answer. Returns the variants that gave
        way at their chunk's cap (see :meth:`_make_room`)."""
        pending, gave_way = sorted(saved.items()), []
        for done, (index, kv) in enumerate(pending):
            if self.store.contains(kv.variant):
                if not (replace and kv.prefix):
                    continue
                self.planner_stats.forget(kv.variant)
            elif replace and kv.prefix:
                room, displaced = self._make_room(request, kv.chunk, asked)
                if displaced is not None:
                    gave_way.append(displaced)
                if not room:
                    continue
            try:
                self._put(kv, made_exactly=all(exact[:index - 1]) if kv.prefix else True,
                          prior_uses=prior_uses if kv.prefix else 0)
            except (StoreError, CatalogWriteError) as exc:  # the next ones would fail the same way
                log.warning("%d new chunk-cache(s) of this request not kept: %s", len(pending) - done, exc)
                break
        return gave_way

    def _make_room(self, request: RequestContext, chunk: str, asked: int = 0) -> tuple[bool, dict | None]:
        """Whether ``chunk`` may keep one more variant under the request's system prompt:
        it has room, or it is at the cap and the variant requests used least of those that
        may give way to one whose order earned it with ``asked`` asks (not ``warm``'s, an
        inexact one before an exact one reused fewer times: :func:`variant_to_replace`) was
        deleted; with the deleted variant's chunk, key, hits and whether it was made
        exactly (None where none was). An exact variant is the only one that makes its chunk
        order's answer full's without recomputing; without it, that order would be answered
        twice on every ask."""
        lookup = request.lookup
        if room_for_variant(lookup.variant_count(chunk, request.prefix_key)):
            return True, None
        candidates = lookup.replaceable_variants(chunk, request.prefix_key, asked)
        exact = {r.key for r in candidates if lookup.made_exactly(chunk, r.key)}
        victim = variant_to_replace(candidates, exact)
        if victim is None:
            return False, None
        try:
            self.store.delete(victim)
        except (StoreError, CatalogError) as exc:  # the cap holds: the exact variant is not kept
            log.warning("could not make room for an exact chunk-cache (%s)", exc)
            return False, None
        self.planner_stats.forget(victim)
        log.info("chunk %s at its cap of variants: %s gave way to one made exactly", chunk, victim)
        hits = next(r.hits for r in candidates if r.key == victim)
        return True, {"chunk": chunk, "variant": victim, "hits": hits, "made_exactly": victim in exact}

    def _exact_chunks(self, request: RequestContext, prepared: PreparedRequest) -> list[bool]:
        """Per chunk, whether its KV in this prefill is a full prefill's: every chunk before
        it is, and it was computed here, or reused from a variant made after exactly the
        chunks before it in a prefill where they were a full prefill's too."""
        chunks = [s for s in prepared.segments if s.role == "chunk"]
        if len(chunks) != len(request.keys):  # a method that cuts chunks up: not known
            return [False] * len(request.keys)
        exact = []
        for index, (key, segment) in enumerate(zip(request.keys, chunks)):
            if segment.cached is not None:
                chained = variant_key(key, (request.prefix_key, *request.keys[:index]))
                if prepared.used[index] != chained or not request.lookup.made_exactly(key, chained):
                    break  # this chunk is not full's KV, so no chunk after it is
            exact.append(True)
        return exact + [False] * (len(request.keys) - len(exact))

    def _learn_use(self, reports: Sequence[ChunkReport], saved_nothing: bool = False) -> None:
        """Tell the store what each reused variant saved this request (``1 -`` the share of
        its chunk recomputed: a variant found but computed in full saved nothing, and so did
        every variant of a request answered again from a full prefill, ``saved_nothing``),
        so that eviction keeps the variants requests reuse nearly exactly."""
        saved = {c.variant: 0.0 if saved_nothing else 1.0 - c.fraction
                 for c in reports if c.variant is not None and c.tier != MISS}
        if not saved:
            return
        try:
            self.store.record_use(saved)
        except CatalogError as exc:  # advice for eviction: the answer stands without it
            log.warning("could not record what the reused variants saved: %s", exc)

    def _put(self, kv: ChunkKV, made_exactly: bool = False, strict: bool = False, prior_uses: int = 0) -> None:
        """Store ``kv``; ``made_exactly``: computed after a full prefill's KV of its prefix
        (recorded in the catalog: see :meth:`RequestLookup.made_exactly`); ``prior_uses``:
        uses the eviction order credits it with from the start. ``strict`` (for
        ``warm``, which makes caches to keep them): a catalog away or locked is an error,
        not a cache left out of the local tiers."""
        text = self.lm.tokenizer.decode(list(kv.token_ids[:48]), skip_special_tokens=True)
        value = quality = None
        if kv.stats is not None:  # a chunk with the statistics the policy reads
            value, quality = expected_reuse(variant_info(kv), self.policy)
        self.store.put(kv, cost_s=self._estimate_full(kv.num_tokens), quality=quality, cci=value,
                       stats={MADE_EXACTLY: 1.0} if made_exactly else None,
                       source=self._sources.get(kv.chunk), preview=text, lost_ok=not strict, prior_uses=prior_uses)

    def _report(self, request: RequestContext, prepared: PreparedRequest, recomputed) -> list[ChunkReport]:
        stops, plan = prepared.hooks.stops, prepared.plan
        stop_by_offset, offset = {}, 0
        for index, seg in enumerate(prepared.segments):
            if index in stops:
                stop_by_offset[offset] = stops[index]
            offset += len(seg.token_ids)
        reports, offset = [], len(request.pieces.prefix)
        for i, (ids, key) in enumerate(zip(request.pieces.chunks, request.keys)):
            score = plan.chunks[i].score if plan is not None else None
            fraction = float(recomputed[offset:offset + len(ids)].float().mean())
            reports.append(ChunkReport(i, key, len(ids), prepared.tiers[i], prepared.used[i],
                                       score.cci if score else None, score.beta_prime if score else None,
                                       score.cfo if score else None, fraction, stop_by_offset.get(offset)))
            offset += len(ids)
        return reports

    def _record(self, question: str, answer: Answer) -> int:
        chunks = tuple(RequestChunk(c.position, c.chunk, c.variant, c.tier if c.variant else MISS, c.cci,
                                    c.beta_prime, c.cfo, c.fraction, c.stop_layer) for c in answer.chunks)
        # while the catalog is away the row waits (None); it is recorded with a later one
        return self.pending.record(self.catalog, RequestRecord(
            question_hash(question), answer.method, chunks, answer.recompute_fraction, answer.ttft_s,
            answer.full_prefill_estimate_s, num_tokens=answer.prompt_tokens,
            policy={**self.policy_report(), "kept_exact": answer.kept_exact,
                    **({"exact_wait": answer.exact_wait} if answer.kept_exact else {}),
                    **({"gave_way": answer.gave_way} if answer.gave_way else {}),
                    **({"first_try_ttft_s": answer.first_try_ttft_s} if answer.escalated else {}),
                    "reused_exact": answer.reused_exact},
            node=self.store.node))

    def _estimate_full(self, tokens: int) -> float:
        """A full prefill's seconds for ``tokens`` tokens, from the cost model."""
        return self.ensure_cost_model().prefill_s(tokens)
