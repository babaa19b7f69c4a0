"""What the server does behind its routes: one :class:`Pipeline` loaded once, one worker
thread in front of the model, and the translation of OpenAI requests into
:meth:`Pipeline.answer` / :meth:`Pipeline.query` calls (the one request path).

Concurrency: the model computes one request at a time (on the CPU two would only slow
each other). Requests wait in a first-in, first-out queue of at most
``config.server_queue``; one more is refused at once (:class:`Busy`, HTTP 429). A request
not finished within ``config.server_timeout_s`` is cancelled (:class:`TimedOut`, HTTP
503): dropped from the queue if it had not started, stopped at its next token if it had.

Idle time (``config.exact_when_idle``): once no request waits, the worker stores each chunk
order the policy answered from inexact chunk-caches as a full prefill's KV
(:meth:`Pipeline.make_exact`), newest first, so the next ask in that order (a chat's next
turn) reuses it exactly instead of paying the keep's full prefill at its first token. A
request that comes meanwhile stops that work before its next layer (what was stored
stays; the rest goes on at the next idle time), so it waits for one layer of one chunk.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cachecraft.config import Config
from cachecraft.engine import GenerationOptions
from cachecraft.pipeline import Answer, Pipeline, Retrieved
from cachecraft.methods.policy import CacheCraft
from cachecraft.prompt import Conversation, PromptInputError

log = logging.getLogger(__name__)

IDLE_ORDERS_KEPT = 8
"""Chunk orders remembered for idle time; older ones are dropped (their next ask keeps
them exact as any order's second ask does)."""


class Busy(Exception):
    """The queue in front of the model is full."""


class TimedOut(Exception):
    """A request was not answered within the server's timeout."""


class BadRequest(ValueError):
    """A request the server cannot answer as asked; the message says why (one line)."""


@dataclass
class Job:
    """One request in the pipeline's terms."""

    question: str
    chunks: list[str] | None  # None: retrieve from the corpus
    method: str
    top_k: int | None
    max_new_tokens: int
    generation: GenerationOptions
    question_template: str | None = None  # None: the server's
    retrieved: Retrieved | None = None  # what retrieval found, where chunks is None
    chunk_order: str | None = None  # None: the server's
    conversation: Conversation | None = None  # a chat's instructions and earlier turns


@dataclass
class Counters:
    """What the server did since it started (for ``/metrics`` and ``/healthz``)."""

    started_at: float = field(default_factory=time.time)
    requests: int = 0
    refused_busy: int = 0
    timed_out: int = 0
    failed: int = 0
    made_exact: int = 0  # chunk orders stored exactly while no request waited (exact_when_idle)


def search_text(question: str, conversation: Conversation | None) -> str:
    """What a chat's retrieval searches for: the question, after the user's turn before it
    where there is one, so a follow-up ("and the K9?") finds the passages its subject is in."""
    said_before = [text.strip() for speaker, text in (conversation.turns if conversation else ())
                   if speaker == "user" and text.strip()]
    return f"{said_before[-1]}\n{question}" if said_before else question


class Service:
    """The loaded pipeline and the queue in front of it."""

    def __init__(self, config: Config, pipeline: Pipeline) -> None:
        self.config = config
        self.pipeline = pipeline
        self.counters = Counters()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachecraft-model")
        self.on_answer: Callable[[Answer], None] | None = None
        # chunk orders answered inexactly, newest last, to store exactly while no request waits
        self._to_make_exact: collections.deque[tuple[tuple[str, ...], tuple[str, ...] | None]] = \
            collections.deque(maxlen=IDLE_ORDERS_KEPT)
        self._closing = threading.Event()

    @property
    def model_name(self) -> str:
        """The served model's name, as clients give it in ``model``."""
        return self.pipeline.lm.name

    @property
    def queued(self) -> int:
        """Requests waiting for the model or being computed."""
        return self._pending

    # ------------------------------------------------------------------ requests

    def job(self, question: str, *, documents: Sequence[str] | None, method: str | None, top_k: int | None,
            max_tokens: int | None, generation: GenerationOptions, question_template: str | None = None,
            fit_max_tokens: bool = False, retrieval_order: str | None = None,
            chunk_order: str | None = None, conversation: Conversation | None = None) -> Job:
        """A :class:`Job` for one question, chunk boundaries taken from ``documents`` or, when
        the question holds the chunk separator, from the question itself (the last part is
        the question); otherwise the corpus is searched (in ``retrieval_order``; None: the
        config's) for the question and the user's turn before it (:func:`search_text`).
        ``conversation``: a chat's instructions and earlier turns, put in the prompt before
        the question. Raises :class:`BadRequest`."""
        separator = self.config.chunk_separator
        chunks = list(documents) if documents is not None else None
        marked = chunks is None and separator in question
        if marked:
            *chunks, question = question.split(separator)
        if chunks is not None:
            chunks = [c.strip() for c in chunks if c.strip()]
        question = question.strip()
        if not question:
            raise BadRequest("the question is empty" + (" (with the chunk separator, the question comes after "
                                                        "the last separator)" if marked else ""))
        if chunks is not None and not chunks:
            raise BadRequest("documents is empty: give at least one, or leave it out to search the corpus")
        if chunks is None and not len(self.pipeline.corpus):
            raise BadRequest("the server's corpus is empty: POST /v1/ingest first, or send documents")
        name = "cachecraft" if method is None else method  # "" is no method, not the default
        try:
            self.pipeline.method(name)
        except ValueError as exc:
            raise BadRequest(f"method: {exc}") from None
        # retrieved once: the answer is made over the chunks its room was measured on
        retrieved = (self.pipeline.retrieve(search_text(question, conversation), top_k, retrieval_order)
                     if chunks is None else None)
        room = self._answer_room(chunks if retrieved is None else retrieved.chunks, question, max_tokens,
                                 question_template, fit_max_tokens, conversation)
        return Job(question, chunks, name, top_k, room, generation, question_template=question_template,
                   retrieved=retrieved, chunk_order=chunk_order, conversation=conversation)

    def _answer_room(self, chunks: list[str], question: str, max_tokens: int | None,
                     question_template: str | None = None, fit: bool = False,
                     conversation: Conversation | None = None) -> int:
        """The answer length: ``max_tokens`` (default: the config's), within what the
        context window leaves after the prompt; a prompt that does not fit is refused, and
        so is a ``max_tokens`` past what is left unless ``fit``."""
        pipe = self.pipeline
        try:
            pieces = pipe.builder_with(question_template).build(chunks, question, max_tokens=pipe.lm.max_context,
                                                                conversation=conversation)
        except PromptInputError as exc:
            raise BadRequest(str(exc)) from None
        room = pipe.lm.max_context - pieces.num_tokens
        if room < 1:
            raise BadRequest(f"the prompt takes {pieces.num_tokens} tokens, the whole {pipe.lm.max_context}-token "
                             "context window: no room for an answer")
        if max_tokens is not None and max_tokens > room and not fit:
            raise BadRequest(f"max_tokens {max_tokens} does not fit: the model's context window is "
                             f"{pipe.lm.max_context} tokens and the prompt takes {pieces.num_tokens}; "
                             f"ask for at most {room}")
        return min(max_tokens or self.config.max_new_tokens, room)

    def answer(self, job: Job, streamer=None) -> Answer:
        """Answer one job on the calling thread (the worker): the one request path."""
        pipe = self.pipeline
        options: dict[str, Any] = {"max_new_tokens": job.max_new_tokens, "generation": job.generation,
                                   "streamer": streamer, "question_template": job.question_template,
                                   "chunk_order": job.chunk_order, "conversation": job.conversation}
        if job.chunks is None:
            answer = pipe.query(job.question, top_k=job.top_k, method=job.method, retrieved=job.retrieved,
                                **options)
        else:
            answer = pipe.answer(job.chunks, job.question, method=job.method, **options)
        if self.on_answer is not None:
            self.on_answer(answer)
        self._note_inexact_order(job, answer)
        return answer

    # ------------------------------------------------------------------ idle time

    def _note_inexact_order(self, job: Job, answer: Answer) -> None:
        """Remember the chunk order of an answer the policy made from reused, inexact
        chunk-caches, and have the worker store it exactly once no request waits
        (``exact_when_idle``)."""
        pipe = self.pipeline
        if (not self.config.exact_when_idle or not isinstance(pipe.method(job.method), CacheCraft)
                or answer.reused_exact or answer.kept_exact or answer.escalated or not answer.chunks):
            return
        if job.chunks is not None:
            texts, sources = tuple(job.chunks), None
        elif job.retrieved is not None:
            texts = tuple(job.retrieved.chunks)
            sources = tuple(hit.chunk.source for hit in job.retrieved.hits)
        else:  # pragma: no cover - the server retrieves as it takes the job
            return
        if answer.order is not None:  # stored in the order the prompt held them
            texts = tuple(texts[i] for i in answer.order)
            sources = None if sources is None else tuple(sources[i] for i in answer.order)
        with self._pending_lock:
            if (texts, sources) in self._to_make_exact:
                self._to_make_exact.remove((texts, sources))
            self._to_make_exact.append((texts, sources))
        self._worker.submit(self._make_exact_while_idle)

    def _make_exact_while_idle(self) -> None:
        """On the worker: store the remembered chunk orders exactly, the newest first (the
        conversation most likely to go on), a chunk at a time, for as long as no request
        waits; one that comes waits for one layer of one chunk, and the order cut short
        goes on at the next idle time."""
        while not self._closing.is_set():
            with self._pending_lock:
                if self._pending or not self._to_make_exact:
                    return
                texts, sources = self._to_make_exact.pop()
            start = time.perf_counter()
            try:
                made = self.pipeline.make_exact(texts, sources, should_stop=self._idle_is_over)
            except Exception as exc:  # idle work: a failure costs the next ask its exactness, nothing else
                log.warning("could not store a chunk order exactly while idle: %s", exc)
                continue
            if made:
                log.info("stored %d chunk(s) exactly while idle (%.2f s)", made, time.perf_counter() - start)
            if self._idle_is_over():  # cut short: go on with it at the next idle time
                with self._pending_lock:
                    if (texts, sources) not in self._to_make_exact:
                        self._to_make_exact.append((texts, sources))
                return
            if made:
                self.counters.made_exact += 1

    def _idle_is_over(self) -> bool:
        """Whether idle work must give way: a request waits, or the server is closing."""
        return self._pending > 0 or self._closing.is_set()

    def forget(self, paths: Sequence[str], keep_caches: bool = False):
        """Drop files from the corpus (:meth:`Pipeline.forget_documents`, on the worker), and
        the chunk orders remembered for idle time with them: storing those afterwards would
        bring back chunk-caches of text the corpus no longer holds."""
        with self._pending_lock:
            self._to_make_exact.clear()
        return self.pipeline.forget_documents(paths, keep_caches=keep_caches)

    def settle(self) -> None:
        """Wait until the worker has done everything handed to it so far, requests and idle
        work alike (for tests and benchmarks that ask the next turn once idle time passed)."""
        self._worker.submit(lambda: None).result()

    # ------------------------------------------------------------------ the queue

    async def run(self, fn: Callable[[], Any], cancel: threading.Event | None = None,
                  timeout_s: float | None = None) -> Any:
        """Run ``fn`` on the model's worker thread once the requests before it are done.
        Raises :class:`Busy` when the queue is full and :class:`TimedOut` past the timeout
        (``cancel`` is then set, so a running generation stops at its next token)."""
        with self._pending_lock:
            if self._pending > self.config.server_queue:  # one computing, server_queue waiting
                self.counters.refused_busy += 1
                raise Busy(f"{self._pending} requests are queued for the model (server_queue = "
                           f"{self.config.server_queue}); retry later")
            self._pending += 1
        self.counters.requests += 1
        future = self._worker.submit(fn)
        future.add_done_callback(lambda _: self._done())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s or self.config.server_timeout_s)
        except asyncio.TimeoutError:
            future.cancel()  # still queued: it never runs
            if cancel is not None:
                cancel.set()
            self.counters.timed_out += 1
            raise TimedOut(f"not answered within server_timeout_s = {timeout_s or self.config.server_timeout_s:g} s "
                           f"({self._pending} requests were queued); retry later") from None
        except asyncio.CancelledError:  # the client went away
            future.cancel()
            if cancel is not None:
                cancel.set()
            raise

    def _done(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def close(self) -> None:
        """Finish the request being computed, drop the queued ones and the idle work not
        begun, release the pipeline."""
        self._closing.set()
        self._worker.shutdown(wait=True, cancel_futures=True)
        self.pipeline.close()
