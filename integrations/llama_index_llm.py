"""A LlamaIndex ``LLM`` that answers through cachecraft, for the places LlamaIndex wants an
LLM rather than a query engine: ``Settings.llm``, ``RetrieverQueryEngine.from_args``,
``index.as_query_engine(llm=...)``, ``index.as_chat_engine()``, ``CondenseQuestionChatEngine``.

LlamaIndex hands an LLM one finished prompt, the retrieved nodes' texts pasted into its
template. Chunk boundaries come from the nodes themselves: every retrieval LlamaIndex
runs is observed (its instrumentation's ``RetrievalEndEvent``), and the nodes of the
latest one in this context are looked up in the prompt. Each node found becomes a chunk
whose chunk-cache is reused; the template's text before the first node becomes a chunk
too (it is the same on every request, so it is cached like the others), and the text
after the last node is the question. In a prompt with no retrieved node in it (a condense
step, a plain completion) everything before the last line is one chunk, the last line
the question.

With ``server=URL`` the LLM loads nothing itself: it sends those chunks (as
``documents``) and the question (as written, ``question_template = "{question}"``) to a
running ``cachecraft serve``, whose memory tiers keep the chunk-caches between requests
and between applications. The app keeps its own index and retriever.
"""

from __future__ import annotations

import contextvars
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from llama_index.core import instrumentation as instrument
from llama_index.core.base.llms.types import (CompletionResponse, CompletionResponseGen, LLMMetadata)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import MetadataMode

from cachecraft.config import Config
from cachecraft.methods import parse_method
from cachecraft.pipeline import Answer, Pipeline
from cachecraft.server.client import ServerClient, chat_body, message_text

# The nodes of the latest retrieval in this context (thread or task): what the prompt's
# chunks are looked up by.
_RETRIEVED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("cachecraft_retrieved", default=())
_HANDLER_LOCK = threading.Lock()
_HANDLER_ADDED = False

LLM_SYSTEM_PROMPT = "You are a helpful assistant."


class _RetrievalWatcher(BaseEventHandler):
    """Keeps the texts of the latest retrieval's nodes (every form they may be pasted in)."""

    @classmethod
    def class_name(cls) -> str:
        return "CacheCraftRetrievalWatcher"

    def handle(self, event, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            texts = []
            for scored in event.nodes or ():
                for mode in (MetadataMode.LLM, MetadataMode.NONE):
                    text = scored.node.get_content(metadata_mode=mode).strip()
                    if text and text not in texts:
                        texts.append(text)
            _RETRIEVED.set(tuple(texts))


def watch_retrievals() -> None:
    """Observe every LlamaIndex retrieval (once per process)."""
    global _HANDLER_ADDED
    with _HANDLER_LOCK:
        if not _HANDLER_ADDED:
            instrument.get_dispatcher().add_event_handler(_RetrievalWatcher())
            _HANDLER_ADDED = True


def split_prompt(prompt: str, node_texts: Sequence[str]) -> tuple[list[str], str]:
    """``(chunks, question)`` of a prompt: the node texts found in it (each once, in prompt
    order, the longest form of a node first), the template text before the first as a
    chunk of its own, text between nodes as chunks where it is more than whitespace, and
    the text after the last node as the question. No node found: everything before the
    prompt's last line is one chunk, that line the question."""
    found: list[tuple[int, int]] = []
    for text in sorted(node_texts, key=len, reverse=True):
        start = prompt.find(text)
        while start >= 0 and any(s < start + len(text) and start < e for s, e in found):
            start = prompt.find(text, start + 1)
        if start >= 0:
            found.append((start, start + len(text)))
    if not found:
        return _whole(prompt)
    found.sort()
    chunks, cursor = [], 0
    for start, end in found:
        between = prompt[cursor:start]
        if between.strip():
            chunks.append(between)
        chunks.append(prompt[start:end])
        cursor = end
    return chunks, prompt[cursor:]


def _whole(prompt: str) -> tuple[list[str], str]:
    """A prompt with no retrieved node: everything before its last line is one chunk (the
    template around, the history of a chat), the last line the question. A one-line
    prompt splits at its last space."""
    body = prompt.rstrip()
    cut = body.rfind("\n") + 1 or body.rfind(" ") + 1
    if cut <= 0 or not body[:cut].strip():
        raise ValueError("the prompt is a single word; cachecraft needs some context before the question")
    return [prompt[:cut]], prompt[cut:]


class CacheCraftLLM(CustomLLM):
    """cachecraft as a LlamaIndex LLM (see the module docstring for how a prompt becomes
    chunks). Give it a :class:`~cachecraft.pipeline.Pipeline`, or the settings to make
    one (``model``, ``cache_dir``, ``config``: a Config or a mapping of overrides); a
    pipeline made here passes the prompt's text through as the question
    (``question_template = "{question}"``) under a plain system prompt. Or give it
    ``server``, the URL of a running ``cachecraft serve`` (``api_key``, default
    ``CACHECRAFT_API_KEY``, when the server asks for one), and it answers there.

    ``last_report`` is the cache report of the latest answer (hits per tier, recompute,
    TTFT), also in each response's ``additional_kwargs["cachecraft"]``."""

    method: str = Field(default="cachecraft", description="cachecraft method, e.g. cachecraft, full, reuse")
    max_new_tokens: int = Field(default=256, description="Answer length limit.")
    server: str | None = Field(default=None, description="URL of a cachecraft server to answer on.")
    _pipeline: Pipeline | None = PrivateAttr()
    _client: ServerClient | None = PrivateAttr()
    _server_info: dict | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr()
    _owns: bool = PrivateAttr()
    last_answer: Answer | None = None
    last_report: dict | None = None

    def __init__(self, pipeline: Pipeline | None = None, *, model: str | None = None,
                 cache_dir: str | Path | None = None, config: Config | Mapping[str, Any] | None = None,
                 method: str = "cachecraft", max_new_tokens: int = 256, server: str | None = None,
                 api_key: str | None = None, **kwargs: Any) -> None:
        from cachecraft.integrations.llama_index import _make_config, pipeline_lock

        parse_method(method)
        if server is not None and (pipeline is not None or model or cache_dir or config):
            raise ValueError("give either server (answer on a running cachecraft serve) or a local pipeline "
                             "and its settings, not both")
        super().__init__(method=method, max_new_tokens=max_new_tokens, server=server, **kwargs)
        watch_retrievals()
        if server is not None:
            self._owns, self._pipeline = False, None
            self._client = ServerClient(server, api_key or os.environ.get("CACHECRAFT_API_KEY") or None)
            return
        self._client = None
        owns = pipeline is None
        if pipeline is None:
            overrides = {"question_template": "{question}", "system_prompt": LLM_SYSTEM_PROMPT}
            if isinstance(config, Config):
                base = config.replace(**overrides)
            else:
                base = {**overrides, **dict(config or {})}
            pipeline = Pipeline(_make_config(model, cache_dir, base))
        self._owns = owns
        self._pipeline = pipeline
        self._lock = pipeline_lock(pipeline)

    @classmethod
    def class_name(cls) -> str:
        return "CacheCraftLLM"

    def close(self) -> None:
        """Close the pipeline if this LLM made it (persists memory tiers)."""
        if self._owns:
            self._pipeline.close()

    @property
    def pipeline(self) -> Pipeline | None:
        """The pipeline answering (None when a server answers)."""
        return self._pipeline

    @property
    def metadata(self) -> LLMMetadata:
        if self._client is not None:
            if self._server_info is None:  # asked once: the server's model and context window
                self._server_info = self._client.get("/healthz")
            info = self._server_info
            return LLMMetadata(context_window=info["context_window"], num_output=self.max_new_tokens,
                               model_name=info["model"], is_chat_model=False)
        lm = self._pipeline.lm
        return LLMMetadata(context_window=lm.max_context, num_output=self.max_new_tokens, model_name=lm.name,
                           is_chat_model=False)

    def _split(self, prompt: str) -> tuple[list[str], str]:
        chunks, question = split_prompt(prompt, _RETRIEVED.get())
        if not question.strip():  # a template that ends with the context: the last chunk asks
            question, chunks = chunks[-1], chunks[:-1]
        return chunks, question

    def _answer(self, prompt: str, streamer=None) -> Answer:
        chunks, question = self._split(prompt)
        room = self._pipeline.lm.max_context - self._pipeline.builder.build(chunks, question).num_tokens
        with self._lock:
            answer = self._pipeline.answer(chunks, question, method=self.method, streamer=streamer,
                                           max_new_tokens=max(1, min(self.max_new_tokens, room)))
        self.last_answer = answer
        self.last_report = _report(answer)
        return answer

    def _server_body(self, prompt: str) -> dict:
        """The chat request for ``prompt``: its chunks as documents, its question as written."""
        chunks, question = self._split(prompt)
        return chat_body(question, documents=chunks, method=self.method, max_tokens=self.max_new_tokens,
                         fit_max_tokens=True, question_template="{question}")

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        if self._client is not None:
            data = self._client.post("/v1/chat/completions", self._server_body(prompt))
            self.last_report = data["cachecraft"]
            return CompletionResponse(text=message_text(data), additional_kwargs={"cachecraft": self.last_report})
        answer = self._answer(prompt)
        return CompletionResponse(text=answer.text, additional_kwargs={"cachecraft": self.last_report})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        if self._client is not None:
            return self._stream_from_server(prompt)
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self._pipeline.lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[BaseException] = []
        done: dict[str, Answer] = {}
        context = contextvars.copy_context()  # the retrieval seen by this caller, in the worker too

        def run() -> None:
            try:
                done["answer"] = context.run(self._answer, prompt, streamer)
            except BaseException as exc:  # handed to the consumer
                failure.append(exc)
                streamer.end()

        thread = threading.Thread(target=run, name="cachecraft-llm-stream")
        thread.start()

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in streamer:
                if piece:
                    text += piece
                    yield CompletionResponse(text=text, delta=piece)
            thread.join()
            if failure:
                raise failure[0]
            yield CompletionResponse(text=text, delta="", additional_kwargs={"cachecraft": self.last_report})

        return gen()

    def _stream_from_server(self, prompt: str) -> CompletionResponseGen:
        body = self._server_body(prompt)  # split now: the retrieval seen by this caller

        def gen() -> CompletionResponseGen:
            text = ""
            for payload in self._client.stream("/v1/chat/completions", body):
                piece = message_text(payload)
                if piece:
                    text += piece
                    yield CompletionResponse(text=text, delta=piece)
                if "cachecraft" in payload:
                    self.last_report = payload["cachecraft"]
            yield CompletionResponse(text=text, delta="", additional_kwargs={"cachecraft": self.last_report})

        return gen()


def _report(answer: Answer) -> dict:
    return {"method": answer.method, "ttft_s": answer.ttft_s, "recompute_fraction": answer.recompute_fraction,
            "chunks": len(answer.chunks), "hits_by_tier": answer.hits_by_tier, "request_id": answer.request_id}
