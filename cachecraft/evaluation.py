"""Answer question/passage items with several methods through the one request path,
and compare every answer with a full prefill's.

``bench quality`` and ``calibrate`` both run here, so what they measure is what
``query`` runs: each item's passages are warmed as ``warm`` makes them (after the
system prefix and the configured warm context), then every method answers through
:meth:`Pipeline.answer` over a scratch store and catalog that nothing outlives. No
variant a request makes is kept (each method meets the same store), and an item's
chunk-caches are removed once the item is done.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Mapping, Sequence

import torch

from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.engine import teacher_forced_logits
from cachecraft.methods import Full, Method
from cachecraft.metrics import (answer_divergence, best_f1, degenerate_repetition, exact_match, first_line,
                                kl_divergence, token_f1)
from cachecraft.pipeline import Answer, Pipeline, PrefillTrace
from cachecraft.policy.calibrate import ANY_DEVICE, POLICY_PROFILE
from cachecraft.policy.planner import params_from_config
from cachecraft.policy.shipped import shipped_fit
from cachecraft.prompt import Conversation, PromptBuilder
from cachecraft.store import TieredStore

Meter = Callable[[], ContextManager]
OnAnswer = Callable[[QAItem, Answer, PrefillTrace], None]


def query_fit(lm, config: Config) -> dict | None:
    """The fitted policy ``query`` would use for ``lm`` under ``config``: the one ``calibrate``
    stored in the catalog for its fingerprint, else the one shipped for a bundled model."""
    from cachecraft.catalog import Catalog, CatalogError, catalog_path

    if config.catalog_url or catalog_path(config.cache_dir).is_file():
        try:
            with Catalog(config.cache_dir, url=config.catalog_url or None) as catalog:
                found = catalog.profile(lm.fingerprint, ANY_DEVICE, POLICY_PROFILE)
        except CatalogError:
            found = None
        if found:
            return found
    return shipped_fit(config.model, lm.model.config)


@contextmanager
def scratch_pipeline(lm, config: Config, tier: str = "cpu", *, fitted: bool = True) -> Iterator[Pipeline]:
    """A pipeline over a throw-away store and catalog (one ``tier``) in a temporary
    directory under the cache directory; it keeps no variant its requests make. Its
    policy is the one ``query`` would use (``fitted``: with the model's fitted parameters
    where the config leaves the defaults), or the config's alone (``fitted=False``, for
    ``calibrate``, which measures its candidates as given)."""
    Path(config.cache_dir).mkdir(parents=True, exist_ok=True)
    policy = params_from_config(config, lm.adapter.num_layers, query_fit(lm, config) if fitted else None)
    scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir=config.cache_dir))
    scratch_config = config.replace(cache_dir=scratch)
    try:
        with TieredStore(scratch_config, tiers=(tier,)) as store:
            yield Pipeline(scratch_config, lm=lm, store=store, keep_new_variants=False, policy=policy)
            store.close(persist=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class InContext:
    """A method run again once the item's in-context variants exist: each passage's cache
    made after each of its ``neighbours`` nearest passages by embedding (what ``warm`` with
    ``warm_neighbours`` makes from the index), labelled ``method+nbN``. Run after the plain
    methods, which therefore never see those variants. The neighbours are found among the
    item's own passages, or, given a ``pool`` (formatted chunk texts: a whole corpus), among
    the pool's, as ``warm`` finds them in a real index. Given ``previous`` (a chunk text ->
    the text of the chunk before it in its file), each passage's one variant is made after
    that chunk instead, as ``warm --previous`` makes it."""

    SUFFIX = "+nb"

    def __init__(self, method: Method, neighbours: int, embed: Callable[[Sequence[str]], "object"],
                 pool: Sequence[str] | None = None, previous: Mapping[str, str] | None = None):
        if neighbours < 1:
            raise ValueError(f"neighbours must be at least 1, got {neighbours}")
        if pool is not None and len(set(pool)) < 2:
            raise ValueError("a neighbour pool needs at least two different passages")
        self.method, self.neighbours, self.embed = method, neighbours, embed
        self.pool = list(dict.fromkeys(pool)) if pool is not None else None
        self._pool_index = None
        self.previous = previous

    @property
    def label(self) -> str:
        """The inner method's label with ``+nbN``."""
        return f"{self.method.label}{self.SUFFIX}{self.neighbours}"

    @staticmethod
    def base_label(label: str) -> str | None:
        """The plain method a ``method+nbN`` label was run against (None for other labels)."""
        head, sep, tail = label.rpartition(InContext.SUFFIX)
        return head if sep and tail.isdigit() else None

    def nearest(self, chunks: Sequence[str]) -> list[list[str]]:
        """For each passage, the texts of its ``neighbours`` nearest other passages, most
        similar first (a copy of its own text is never its neighbour); with ``previous``,
        the chunk before it in its file (none for a file's first chunk)."""
        from cachecraft.retrieval.index import ChunkIndex

        if self.previous is not None:
            return [[self.previous[chunk]] if chunk in self.previous else [] for chunk in chunks]

        vectors = self.embed(list(chunks))
        if self.pool is None:
            index = ChunkIndex(vectors.shape[1])
            index.add(vectors, list(chunks), [str(i) for i in range(len(chunks))])
            return [[chunks[j] for j in near] for near in index.neighbours(self.neighbours)]
        if self._pool_index is None:  # the pool is embedded once, for every item
            pooled = self.embed(self.pool)
            self._pool_index = ChunkIndex(pooled.shape[1])
            self._pool_index.add(pooled, self.pool, [str(i) for i in range(len(self.pool))])
        index = self._pool_index
        want = min(self.neighbours + 1, len(index))
        return [[hit.text for hit in index.search(vector, want) if hit.text != chunk][:self.neighbours]
                for chunk, vector in zip(chunks, vectors)]

    def make_variants(self, pipeline: Pipeline, chunks: Sequence[str]) -> int:
        """Make every passage's variants after its nearest passages; returns how many."""
        return pipeline.warm_after([(other, chunk) for chunk, near in zip(chunks, self.nearest(chunks))
                                    for other in near])


def item_chunks(item: QAItem) -> list[str]:
    """An item's passages as chunk texts, in order."""
    return [PromptBuilder.chunk_text(text, title) for title, text in item.passages]


CHAT_SUFFIX = "+chat"
"""Label suffix of a method's answer to a follow-up question in a chat (``cachecraft+chat``)."""


def follow_up_conversation(item: QAItem, reference: "Reference") -> Conversation:
    """The chat a follow-up question is asked in: the item's question and full's answer to
    it, the same for every method, so only the chunk-caches differ between them."""
    return Conversation(turns=(("user", item.question), ("assistant", reference.answer.text)))


def answer_traced(pipeline: Pipeline, chunks: Sequence[str], question: str, method: Method | str,
                  **options) -> tuple[Answer, PrefillTrace]:
    """:meth:`Pipeline.answer`, with the prefill's trace (logits, work) kept."""
    traces: list[PrefillTrace] = []
    answer = pipeline.answer(chunks, question, method=method, observer=traces.append, **options)
    return answer, traces[0]


@dataclass(frozen=True)
class Reference:
    """The full prefill's answer to one item, which every method is compared with:
    its first-token logits, its greedy answer's ids and the logits along them."""

    answer: Answer
    first_logits: torch.Tensor  # [vocab]
    answer_ids: torch.Tensor  # [n]
    answer_logits: torch.Tensor  # [n, vocab], teacher-forced through full's own prefill


def forced_logits(pipeline: Pipeline, trace: PrefillTrace, answer_ids: torch.Tensor) -> torch.Tensor:
    """Logits along ``answer_ids`` teacher-forced through the prefill of ``trace``."""
    return teacher_forced_logits(pipeline.lm.model, trace.keys, trace.values, trace.token_ids, answer_ids)


def compare(item: QAItem, answer: Answer, trace: PrefillTrace, forced: torch.Tensor, reference: Reference) -> dict:
    """Quality of one answer against the full prefill's (``reference``) and the gold answers;
    ``forced``: the method's logits along full's answer (answer-level divergence)."""
    ref = reference.answer
    answer_kl, token_agreement = answer_divergence(reference.answer_logits, forced)
    return {"item": item.index, "method": answer.method, "tokens": answer.prompt_tokens,
            "chunks": len(answer.chunks), "ttft_s": answer.ttft_s, "speedup_vs_full": ref.ttft_s / answer.ttft_s,
            "recompute_fraction": answer.recompute_fraction,
            "kl": kl_divergence(reference.first_logits, trace.logits),
            "answer_kl": answer_kl, "token_agreement": token_agreement, "answer_tokens": int(forced.shape[0]),
            "agreement_f1": token_f1(first_line(answer.text), first_line(ref.text)),
            "exact_match": float(exact_match(answer.text, ref.text)),
            "gold_f1": best_f1(answer.text, item.answers), "kv_mb": trace.kv_bytes / 2**20,
            "repetition": float(degenerate_repetition(answer.text)),
            # the fallback: a looping first try answered again from a full prefill (its
            # ttft_s is then the kept answer's; answer_kl above is still the first try's)
            "escalated": float(answer.escalated), "first_try_ttft_s": answer.first_try_ttft_s,
            "first_try_repetition": float(degenerate_repetition(answer.abandoned_text or answer.text)),
            "answer": answer.text, "abandoned_text": answer.abandoned_text, "order": answer.order}


def evaluate_items(pipeline: Pipeline, items: Sequence[QAItem], methods: Sequence[Method], *,
                   max_new_tokens: int = 32, on_item: Callable[[int, int], None] | None = None,
                   meter: Meter | None = None, on_answer: OnAnswer | None = None,
                   on_rows: Callable[[QAItem, list[dict]], None] | None = None,
                   follow_up: str | None = None) -> list[dict]:
    """One row per (item, method), ``full`` first on every item (the reference).
    ``meter``: a context manager factory wrapped around each request (its ``peak_mb``
    and ``growth_mb`` go into the row); ``on_answer`` sees every answer with its trace;
    ``on_rows`` gets each item's rows as soon as the item is done; ``follow_up``: a chat's
    second question, as :func:`evaluate_item` asks it."""
    order = method_order(methods)
    pipeline.ensure_cost_model()  # measured once, outside every timed request
    rows: list[dict] = []
    for index, item in enumerate(items):
        item_rows = evaluate_item(pipeline, item, order, max_new_tokens=max_new_tokens, meter=meter,
                                  on_answer=on_answer, follow_up=follow_up)
        rows += item_rows
        if on_rows:
            on_rows(item, item_rows)
        if on_item:
            on_item(index + 1, len(items))
    return rows


def method_order(methods: Sequence[Method | InContext]) -> list[Method | InContext]:
    """``full`` first (the reference), then the plain methods, then the in-context runs."""
    plain = [m for m in methods if not isinstance(m, (Full, InContext))]
    return [Full(), *plain, *(m for m in methods if isinstance(m, InContext))]


def reordered_reference(pipeline: Pipeline, item: QAItem, chunks: Sequence[str], given: Reference,
                        max_new_tokens: int, meter: Meter | None = None,
                        on_answer: OnAnswer | None = None) -> tuple[dict, Reference]:
    """Full's answer over the order the pipeline now gives ``chunks``: its row against
    ``given`` (full's answer in the given order), and the reference it makes."""
    row, made = _answer_row(pipeline, item, chunks, Full(), given, max_new_tokens, meter, on_answer,
                            make_reference=True)
    assert made is not None
    return row, made


def _answer_row(pipeline: Pipeline, item: QAItem, chunks: Sequence[str], method: Method,
                against: Reference | None, max_new_tokens: int, meter: Meter | None, on_answer: OnAnswer | None,
                make_reference: bool = False, question: str | None = None,
                conversation: Conversation | None = None) -> tuple[dict, Reference | None]:
    """One request with ``method``: its row against ``against`` (None: against itself) and,
    with no ``against`` or with ``make_reference``, the reference its answer makes.
    ``question``/``conversation``: a chat's follow-up in place of the item's question."""
    with (meter() if meter else nullcontext()) as mem:
        answer, trace = answer_traced(pipeline, chunks, question or item.question, method,
                                      max_new_tokens=max_new_tokens, conversation=conversation)
    if on_answer:
        on_answer(item, answer, trace)
    made = None
    if against is None or make_reference:
        ids = trace.answer_ids
        made = Reference(answer, trace.logits, ids, forced_logits(pipeline, trace, ids))
    forced = made.answer_logits if against is None else forced_logits(pipeline, trace, against.answer_ids)
    trace.keys = trace.values = []  # the KV is not needed past here
    row = compare(item, answer, trace, forced, against or made)
    if mem is not None:
        row.update(peak_rss_mb=mem.peak_mb, rss_growth_mb=mem.growth_mb)
    return row, made


def row_labels(order: Sequence[Method | InContext], chunk_order: str = "given", follow_up: bool = False) -> list[str]:
    """The methods an item's rows name, in order: ``order``'s, and with ``chunk_order``
    ``cache`` a ``full+nbN`` row (full over the order the in-context variants give the
    prompt) before the first in-context run; with ``follow_up``, each plain method's
    ``method+chat`` row after them."""
    labels = [m.label for m in order]
    first = next((m for m in order if isinstance(m, InContext)), None)
    if chunk_order == "cache" and first is not None:
        labels.insert(labels.index(first.label), f"full{InContext.SUFFIX}{first.neighbours}")
    if follow_up:
        labels += [f"{m.label}{CHAT_SUFFIX}" for m in order if not isinstance(m, InContext)]
    return labels


def evaluate_item(pipeline: Pipeline, item: QAItem, order: Sequence[Method | InContext], *, max_new_tokens: int,
                  meter: Meter | None = None, on_answer: OnAnswer | None = None,
                  follow_up: str | None = None) -> list[dict]:
    """Every method of ``order`` (the reference first) on one item; its caches are made
    by ``warm`` first (the in-context variants just before the first :class:`InContext`
    run) and removed at the end. ``follow_up``: then every plain method (full first, the
    new reference) answers this question after the item's question and full's answer
    (:func:`follow_up_conversation`), as a chat's second turn, in rows labelled
    ``method+chat``; not with in-context runs, whose variants the plain methods would
    then find."""
    if follow_up and any(isinstance(m, InContext) for m in order):
        raise ValueError("a follow-up question is asked with the plain methods only, not with in-context runs")
    chunks = item_chunks(item)
    start = time.perf_counter()
    pipeline.warm(chunks)
    warm_s = time.perf_counter() - start
    reference: Reference | None = None
    rows = []
    in_context = None
    for method in order:
        gc.collect()
        if isinstance(method, InContext) and in_context is None:
            start = time.perf_counter()
            in_context = method.make_variants(pipeline, chunks)
            in_context_s = time.perf_counter() - start
            if pipeline.config.chunk_order == "cache" and reference is not None:
                # The prompt's order now follows the new variants: full's answer over that
                # order is what they are compared with; its own row says what the order alone
                # changed against full's answer in the given order
                row, reference = reordered_reference(pipeline, item, chunks, reference, max_new_tokens, meter,
                                                     on_answer)
                rows.append({**row, "method": f"full{InContext.SUFFIX}{method.neighbours}",
                             "in_context_variants": in_context, "in_context_warm_s": in_context_s, "warm_s": warm_s})
        inner = method.method if isinstance(method, InContext) else method
        row, made = _answer_row(pipeline, item, chunks, inner, reference, max_new_tokens, meter, on_answer)
        reference = reference or made  # the first method's answer is the reference
        if isinstance(method, InContext):
            row.update(method=method.label, in_context_variants=in_context, in_context_warm_s=in_context_s)
        rows.append({**row, "warm_s": warm_s})
    if follow_up and reference is not None:
        chat = follow_up_conversation(item, reference)
        second: Reference | None = None
        for method in order:
            gc.collect()
            row, made = _answer_row(pipeline, item, chunks, method, second, max_new_tokens, meter, on_answer,
                                    question=follow_up, conversation=chat)
            second = second or made  # full's second turn is the reference of the others'
            rows.append({**row, "method": f"{method.label}{CHAT_SUFFIX}", "warm_s": warm_s})
    pipeline.forget(chunks)  # no later item reads them; left there, they would crowd its caches out
    return rows
