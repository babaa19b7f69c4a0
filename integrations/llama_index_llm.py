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
"""

from __future__ import annotations

import contextvars
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
    (``question_template = "{question}"``) under a plain system prompt."""

    method: str = Field(default="cachecraft", description="cachecraft method, e.g. cachecraft, full, reuse")
    max_new_tokens: int = Field(default=256, description="Answer length limit.")
    _pipeline: Pipeline = PrivateAttr()
    _lock: threading.Lock = PrivateAttr()
    _owns: bool = PrivateAttr()
    last_answer: Answer | None = None

    def __init__(self, pipeline: Pipeline | None = None, *, model: str | None = None,
                 cache_dir: str | Path | None = None, config: Config | Mapping[str, Any] | None = None,
                 method: str = "cachecraft", max_new_tokens: int = 256, **kwargs: Any) -> None:
        from cachecraft.integrations.llama_index import _make_config, pipeline_lock

        parse_method(method)
        super().__init__(method=method, max_new_tokens=max_new_tokens, **kwargs)
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
        watch_retrievals()

    @classmethod
    def class_name(cls) -> str:
        return "CacheCraftLLM"

    def close(self) -> None:
        """Close the pipeline if this LLM made it (persists memory tiers)."""
        if self._owns:
            self._pipeline.close()

    @property
    def pipeline(self) -> Pipeline:
        """The pipeline answering."""
        return self._pipeline

    @property
    def metadata(self) -> LLMMetadata:
        lm = self._pipeline.lm
        return LLMMetadata(context_window=lm.max_context, num_output=self.max_new_tokens, model_name=lm.name,
                           is_chat_model=False)

    def _answer(self, prompt: str, streamer=None) -> Answer:
        chunks, question = split_prompt(prompt, _RETRIEVED.get())
        if not question.strip():  # a template that ends with the context: the last chunk asks
            question, chunks = chunks[-1], chunks[:-1]
        room = self._pipeline.lm.max_context - self._pipeline.builder.build(chunks, question).num_tokens
        with self._lock:
            answer = self._pipeline.answer(chunks, question, method=self.method, streamer=streamer,
                                           max_new_tokens=max(1, min(self.max_new_tokens, room)))
        self.last_answer = answer
        return answer

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        answer = self._answer(prompt)
        return CompletionResponse(text=answer.text, additional_kwargs={"cachecraft": _report(answer)})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
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
            yield CompletionResponse(text=text, delta="",
                                     additional_kwargs={"cachecraft": _report(done["answer"])})

        return gen()


def _report(answer: Answer) -> dict:
    return {"method": answer.method, "ttft_s": answer.ttft_s, "recompute_fraction": answer.recompute_fraction,
            "chunks": len(answer.chunks), "hits_by_tier": answer.hits_by_tier, "request_id": answer.request_id}
