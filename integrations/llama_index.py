"""LlamaIndex integration: a query engine that answers through cachecraft's chunk-caches.

``CacheCraftQueryEngine.from_index(index)`` is the swap for ``index.as_query_engine()``:
retrieval is the index's own retriever; the retrieved nodes' texts become the prompt's
chunks and cachecraft reuses their KV caches. Chunks are keyed by content (the store
keys by token ids), so the same text under another node id, or in another index, hits
the same cache. ``CacheCraftEmbedding`` wraps the bundled MiniLM so an index can be
built with no network.

Needs the ``rag`` extra (``pip install cachecraft[rag]``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any, AsyncGenerator, Generator, Iterator, Mapping, Sequence

try:
    import llama_index.core.instrumentation as instrument
    from llama_index.core.base.base_query_engine import BaseQueryEngine
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
    from llama_index.core.base.response.schema import (RESPONSE_TYPE, AsyncStreamingResponse, Response,
                                                       StreamingResponse)
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
    from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
    from llama_index.core.prompts.mixin import PromptMixinType
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cachecraft.integrations.llama_index needs llama-index-core: "
                      "pip install 'cachecraft[rag]'") from exc

from transformers import TextIteratorStreamer

from cachecraft.catalog import MISS
from cachecraft.config import Config
from cachecraft.methods import parse_method
from cachecraft.pipeline import Answer, Pipeline
from cachecraft.prompt import PromptBuilder
from cachecraft.retrieval.corpus import grouped_by_document

__all__ = ["CacheCraftQueryEngine", "CacheCraftEmbedding", "CacheCraftLLM", "DocumentOrder", "content_hash",
           "in_document_order", "node_chunk_text"]

log = logging.getLogger(__name__)
dispatcher = instrument.get_dispatcher(__name__)

EMPTY_RESPONSE = "Empty Response"  # what LlamaIndex's synthesizers answer when nothing was retrieved
REPORT_KEY = "cachecraft"

# One lock per pipeline, shared by every engine over it: a pipeline runs one prefill at a time.
_LOCKS: "weakref.WeakKeyDictionary[Pipeline, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def pipeline_lock(pipeline: Pipeline) -> threading.Lock:
    """The lock that serialises requests on ``pipeline``."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(pipeline)
        if lock is None:
            lock = _LOCKS[pipeline] = threading.Lock()
        return lock


def content_hash(text: str) -> str:
    """SHA-256 (hex) of a chunk's prompt text: names a chunk independently of node ids."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def node_chunk_text(node) -> str | None:
    """The text a node contributes to the prompt (its content, titled by its ``title``
    metadata when present), or None when it has no text."""
    body = node.get_content(metadata_mode=MetadataMode.NONE)
    if not body or not body.strip():
        return None
    title = (node.metadata or {}).get("title")
    title = str(title) if title is not None and str(title).strip() else None
    return PromptBuilder.chunk_text(body, title)


def in_document_order(nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
    """``nodes`` (best first) with each source document's nodes together, in the
    document's order (their start offsets), where the document's best node ranks:
    ``retrieval_order = "document"`` for a LlamaIndex retriever. A node with no source
    document stays a group of its own; one with no offset goes after its document's others."""
    return grouped_by_document(
        list(nodes), lambda n: n.node.ref_doc_id or ("node", n.node.node_id),
        lambda n: math.inf if getattr(n.node, "start_char_idx", None) is None else n.node.start_char_idx)


class DocumentOrder(BaseNodePostprocessor):
    """A node postprocessor that puts the retrieved nodes in :func:`in_document_order`, for
    any LlamaIndex engine (``CacheCraftQueryEngine`` does it itself when the pipeline's
    config says ``retrieval_order = "document"``). A page cut into several nodes then reads
    top to bottom, and ``warm --previous`` variants find the node before them."""

    @classmethod
    def class_name(cls) -> str:
        return "CacheCraftDocumentOrder"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return in_document_order(nodes)


class CacheCraftQueryEngine(BaseQueryEngine):
    """A LlamaIndex query engine that prefills from cachecraft's chunk-caches.

    Give it a retriever and either a :class:`~cachecraft.pipeline.Pipeline` or the
    settings to make one (``model``, ``cache_dir``, ``config``: a
    :class:`~cachecraft.config.Config` or a mapping of config overrides).
    ``method`` is any cachecraft method (``cachecraft``, ``full``, ``reuse``, ...).

    ``query`` returns a ``Response`` (a ``StreamingResponse`` with ``streaming=True``)
    whose ``source_nodes`` are the retrieved nodes and whose ``metadata`` maps each node
    id to its metadata, as LlamaIndex's engines do, plus ``metadata["cachecraft"]``: the
    cache report (see :func:`cache_report`; when streaming, filled in once the stream
    is consumed).
    """

    def __init__(self, retriever: BaseRetriever, pipeline: Pipeline | None = None, *,
                 model: str | None = None, cache_dir: str | Path | None = None,
                 config: Config | Mapping[str, Any] | None = None, method: str = "cachecraft",
                 ratio: float | None = None, max_new_tokens: int | None = None, streaming: bool = False,
                 node_postprocessors: Sequence[BaseNodePostprocessor] | None = None,
                 callback_manager: CallbackManager | None = None, response_mode: str = "compact",
                 text_qa_template=None, refine_template=None, summary_template=None) -> None:
        if not isinstance(retriever, BaseRetriever):
            raise TypeError(f"retriever must be a LlamaIndex BaseRetriever, got {type(retriever).__name__}")
        if pipeline is not None and (model is not None or cache_dir is not None or config is not None):
            raise ValueError("give either an existing pipeline or model/cache_dir/config to build one, not both")
        parse_method(method, ratio=ratio)  # an unknown name or ratio fails here, with the list of methods
        self.response_mode = _check_response_mode(response_mode)
        for name, template in (("text_qa_template", text_qa_template), ("refine_template", refine_template),
                               ("summary_template", summary_template)):
            if template is not None:
                raise ValueError(_TEMPLATE_HELP.format(name=name))
        self._retriever = retriever
        self._owns_pipeline = pipeline is None
        self.pipeline = pipeline if pipeline is not None else Pipeline(_make_config(model, cache_dir, config))
        self._lock = pipeline_lock(self.pipeline)
        self.method = method
        self.ratio = ratio
        self.max_new_tokens = max_new_tokens
        self.streaming = streaming
        self._node_postprocessors = list(node_postprocessors or [])
        callback_manager = callback_manager or getattr(retriever, "callback_manager", None)
        for postprocessor in self._node_postprocessors:
            postprocessor.callback_manager = callback_manager
        super().__init__(callback_manager=callback_manager)

    _ENGINE_OPTIONS = frozenset({"pipeline", "model", "cache_dir", "config", "method", "ratio", "max_new_tokens",
                                 "streaming", "node_postprocessors", "callback_manager", "response_mode",
                                 "text_qa_template", "refine_template", "summary_template"})

    @classmethod
    def from_index(cls, index, model: str | None = None, similarity_top_k: int = 2,
                   **options: Any) -> "CacheCraftQueryEngine":
        """An engine over ``index.as_retriever(similarity_top_k=...)``; the swap for
        ``index.as_query_engine()``. Options the engine does not know (``filters``, ...)
        go to ``as_retriever``. ``model`` defaults to the config's (``smollm2``)."""
        engine_options = {k: v for k, v in options.items() if k in cls._ENGINE_OPTIONS}
        retriever_options = {k: v for k, v in options.items() if k not in cls._ENGINE_OPTIONS}
        retriever = index.as_retriever(similarity_top_k=similarity_top_k, **retriever_options)
        if engine_options.get("callback_manager") is not None:
            retriever.callback_manager = engine_options["callback_manager"]
        return cls(retriever, model=model, **engine_options)

    @property
    def retriever(self) -> BaseRetriever:
        """The retriever the engine queries."""
        return self._retriever

    def close(self) -> None:
        """Close the pipeline if this engine made it (persists memory tiers)."""
        if self._owns_pipeline:
            self.pipeline.close()

    def __enter__(self) -> "CacheCraftQueryEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _get_prompts(self) -> dict[str, BasePromptTemplate]:
        """The prompt the pipeline builds, as LlamaIndex templates show it: the system
        prompt, then ``{context_str}`` (the chunks, each with its own cache), then the
        question template (``{query_str}``)."""
        config = self.pipeline.config
        question = config.question_template.replace("{question}", "{query_str}")
        return {"text_qa_template": PromptTemplate(f"{config.system_prompt}\n\n{{context_str}}\n\n{question}")}

    def _update_prompts(self, prompts_dict: dict[str, BasePromptTemplate]) -> None:
        for name in prompts_dict:
            raise ValueError(_TEMPLATE_HELP.format(name=name))

    # -- retrieval ---------------------------------------------------------------------
    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """Nodes from the retriever (its own events fire), then the postprocessors, then
        the config's ``retrieval_order`` ("document": :func:`in_document_order`)."""
        nodes = self._retriever.retrieve(query_bundle)
        for postprocessor in self._node_postprocessors:
            nodes = postprocessor.postprocess_nodes(nodes, query_bundle=query_bundle)
        return self._ordered(nodes)

    async def aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """Async :meth:`retrieve`."""
        nodes = await self._retriever.aretrieve(query_bundle)
        for postprocessor in self._node_postprocessors:
            nodes = await postprocessor.apostprocess_nodes(nodes, query_bundle=query_bundle)
        return self._ordered(nodes)

    def _ordered(self, nodes: list[NodeWithScore]) -> list[NodeWithScore]:
        return in_document_order(nodes) if self.pipeline.config.retrieval_order == "document" else nodes

    # -- synthesis -----------------------------------------------------------------------
    @dispatcher.span
    def synthesize(self, query_bundle: QueryBundle, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None) -> RESPONSE_TYPE:
        """Answer over ``nodes`` with the pipeline: a ``Response``, or a
        ``StreamingResponse`` when the engine streams."""
        dispatcher.event(SynthesizeStartEvent(query=query_bundle))
        with self.callback_manager.event(CBEventType.SYNTHESIZE,
                                         payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
            response = self._respond(query_bundle.query_str, list(nodes), list(additional_source_nodes or []))
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query_bundle, response=response))
        return response

    @dispatcher.span
    async def asynthesize(self, query_bundle: QueryBundle, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None) -> RESPONSE_TYPE:
        """Async :meth:`synthesize`: the model runs in a worker thread; streaming gives an
        ``AsyncStreamingResponse``."""
        response = await asyncio.to_thread(self.synthesize, query_bundle, nodes, additional_source_nodes)
        if isinstance(response, StreamingResponse):
            return AsyncStreamingResponse(_to_async(response.response_gen), response.source_nodes, response.metadata)
        return response

    # -- BaseQueryEngine -------------------------------------------------------------------
    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        with self.callback_manager.event(CBEventType.QUERY,
                                         payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
            nodes = self.retrieve(query_bundle)
            response = self.synthesize(query_bundle, nodes)
            event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        with self.callback_manager.event(CBEventType.QUERY,
                                         payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
            nodes = await self.aretrieve(query_bundle)
            response = await self.asynthesize(query_bundle, nodes)
            event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    # -- internals -------------------------------------------------------------------------
    def _respond(self, question: str, nodes: list[NodeWithScore],
                 extra: list[NodeWithScore]) -> Response | StreamingResponse:
        source_nodes = nodes + extra
        # LlamaIndex's synthesizers map node id -> node metadata; the report goes alongside.
        metadata: dict[str, Any] = {n.node.node_id: n.node.metadata for n in source_nodes}
        metadata[REPORT_KEY] = None
        texts, sources = _chunks_of(nodes)
        if self.response_mode == "no_text":  # retrieval only, as LlamaIndex's no_text mode
            return Response(None, source_nodes, metadata)
        if not texts:
            if self.streaming:
                return StreamingResponse(iter([EMPTY_RESPONSE]), source_nodes, metadata)
            return Response(EMPTY_RESPONSE, source_nodes, metadata)
        if not self.streaming:
            with self._lock:
                answer = self._answer(texts, question)
            metadata[REPORT_KEY] = cache_report(answer, texts, sources)
            return Response(answer.text, source_nodes, metadata)
        return StreamingResponse(self._stream(texts, sources, question, metadata), source_nodes, metadata)

    def _answer(self, texts: list[str], question: str, streamer=None) -> Answer:
        return self.pipeline.answer(texts, question, method=self.method, ratio=self.ratio,
                                    max_new_tokens=self.max_new_tokens, streamer=streamer)

    def _stream(self, texts: list[str], sources: list[dict], question: str,
                metadata: dict[str, Any]) -> Generator[str, None, None]:
        """Start the request in a thread now; the generator yields its text pieces and,
        once exhausted, the report is in ``metadata`` (or the thread's error is raised)."""
        streamer = TextIteratorStreamer(self.pipeline.lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with self._lock:
                    answer = self._answer(texts, question, streamer=streamer)
                metadata[REPORT_KEY] = cache_report(answer, texts, sources)
            except BaseException as exc:  # handed to the consumer
                failure.append(exc)
                streamer.end()  # unblock the consumer; a second stop signal after a finished generate is harmless

        thread = threading.Thread(target=run, name="cachecraft-stream")
        thread.start()

        def pieces() -> Generator[str, None, None]:
            for piece in streamer:
                if piece:
                    yield piece
            thread.join()
            if failure:
                raise failure[0]

        return pieces()


ONE_PREFILL_MODES = ("compact", "simple_summarize", "no_text")
"""Response modes the engine serves: the retrieved chunks in one prompt (LlamaIndex's
compact and simple_summarize when the chunks fit, which is what chunk-cache reuse is
for), or retrieval only."""

_TEMPLATE_HELP = ("{name}: this engine builds its prompt from the config (system_prompt, question_template) "
                  "so that every chunk keeps its cache; to use your own LlamaIndex templates, keep LlamaIndex's "
                  "synthesizer with cachecraft as its LLM: RetrieverQueryEngine.from_args(retriever, "
                  "llm=CacheCraftLLM(...), {name}=...)")


def _check_response_mode(mode) -> str:
    name = getattr(mode, "value", mode)
    if name not in ONE_PREFILL_MODES:
        raise ValueError(f"response_mode {name!r} is not served by this engine, which answers in one prefill over "
                         f"the retrieved chunks ({', '.join(ONE_PREFILL_MODES)}); for {name!r} use "
                         "RetrieverQueryEngine.from_args(retriever, llm=CacheCraftLLM(...), "
                         f"response_mode={name!r}): each of its LLM calls still reuses the nodes' chunk-caches")
    return name


def _chunks_of(nodes: Sequence[NodeWithScore]) -> tuple[list[str], list[dict]]:
    """Prompt chunk texts in retrieval order (a text retrieved twice is sent once) and
    one source entry per node."""
    texts: list[str] = []
    seen: set[str] = set()
    sources = []
    for node in nodes:
        text = node_chunk_text(node.node)
        digest = content_hash(text) if text is not None else None
        if text is not None and digest not in seen:
            seen.add(digest)
            texts.append(text)
        elif text is None:
            log.warning("node %s has no text; left out of the prompt", node.node.node_id)
        sources.append({"node_id": node.node.node_id, "score": node.score, "content_hash": digest})
    return texts, sources


def cache_report(answer: Answer, texts: Sequence[str], sources: list[dict]) -> dict[str, Any]:
    """The JSON-friendly cache report of one request: ``Answer.to_dict()`` without the
    text, each chunk named by its content hash, plus the retrieved sources."""
    report = answer.to_dict()
    report.pop("text", None)
    chunks = []
    in_prompt = [texts[i] for i in answer.order] if answer.order is not None else texts  # chunks' prompt order
    for chunk, text in zip(answer.chunks, in_prompt):
        item = asdict(chunk)
        item["cache_key"] = item.pop("chunk")  # the store's key: model fingerprint + token ids
        item["content_hash"] = content_hash(text)
        item["hit"] = chunk.tier != MISS
        chunks.append(item)
    report["chunks"] = chunks
    report["sources"] = sources
    return report


def _make_config(model: str | None, cache_dir: str | Path | None,
                 config: Config | Mapping[str, Any] | None) -> Config:
    if isinstance(config, Config):
        changes = {k: v for k, v in (("model", model), ("cache_dir", cache_dir)) if v is not None}
        return Config.from_mapping({**config.to_dict(), **changes}) if changes else config
    overrides = dict(config or {})
    overrides.update({k: v for k, v in (("model", model), ("cache_dir", cache_dir)) if v is not None})
    return Config.load(overrides=overrides)


async def _to_async(pieces: Iterator[str]) -> AsyncGenerator[str, None]:
    done = object()
    while True:
        piece = await asyncio.to_thread(next, pieces, done)
        if piece is done:
            return
        yield piece


class CacheCraftEmbedding(BaseEmbedding):
    """LlamaIndex embeddings from cachecraft's embedder: the bundled all-MiniLM-L6-v2
    (``"minilm"``, no network) or any sentence-transformers model name or directory."""

    model_name: str = Field(default="minilm", description="A bundled embedder name, a directory or a model id.")
    device: str = Field(default="cpu", description="Torch device the embedder runs on.")
    _embedder: Any = PrivateAttr()

    def __init__(self, model_name: str = "minilm", device: str = "cpu", embedder=None, **kwargs: Any) -> None:
        from cachecraft.retrieval.embed import Embedder

        if embedder is not None:
            model_name = embedder.name
        super().__init__(model_name=model_name, device=device, **kwargs)
        self._embedder = embedder if embedder is not None else Embedder(model_name, device=device)

    @classmethod
    def class_name(cls) -> str:
        return "CacheCraftEmbedding"

    @property
    def embed_dim(self) -> int:
        """Length of each embedding (384 for MiniLM)."""
        return self._embedder.dim

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._get_text_embeddings([query])[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._embedder.embed(texts, batch_size=self.embed_batch_size).tolist()

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return await asyncio.to_thread(self._get_text_embedding, text)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)


from cachecraft.integrations.llama_index_llm import CacheCraftLLM  # noqa: E402  (it uses the helpers above)
