"""The request bodies the server accepts: OpenAI's chat and text completions, plus the
fields cachecraft adds (``documents``, ``method``, ``top_k``, ``question_template``,
``retrieval_order``, ``chunk_order``), ingest and warm.

Fields OpenAI defines that change nothing here (``user``, ``n`` of 1, zero penalties,
``stream_options``) are accepted; any other field is refused by name, so a typo is never
silently ignored. Numbers and flags take JSON's own types: ``"stream": "yes"`` or
``"max_tokens": "5"`` are refused, not guessed at.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

from cachecraft.config import CHUNK_ORDERS, RETRIEVAL_ORDERS

_ORDERS = {"retrieval_order": RETRIEVAL_ORDERS, "chunk_order": CHUNK_ORDERS}  # a request's own orders


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(BaseModel):
    """One chat message; content as a string or OpenAI's list of text parts."""

    model_config = ConfigDict(extra="ignore")  # clients add name, tool fields and the like

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    @property
    def text(self) -> str:
        """The message's text (text parts joined; other parts refused earlier)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content)

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            if any(isinstance(part, dict) and "type" not in part for part in value):
                raise ValueError("each content part needs a 'type' ('text')")
            kinds = {part.get("type") for part in value if isinstance(part, dict)}
            if kinds - {"text"} or not all(isinstance(part, dict) for part in value):
                raise ValueError("only text content parts are supported")
            if not all(isinstance(part.get("text"), str) for part in value):
                raise ValueError("a text content part needs its text as a string under 'text'")
        return value


class Generation(_Strict):
    """What OpenAI's completion endpoints share."""

    model: Optional[str] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    stream: StrictBool = False
    seed: Optional[StrictInt] = None
    # accepted because clients send them; they change nothing here
    user: Optional[str] = None
    n: Literal[1] = 1
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0
    stream_options: Optional[dict] = None
    # cachecraft's own
    documents: Optional[list[str]] = Field(None, description="The chunks to answer over, in order (the "
                                                             "client's own retrieval); none: retrieve from "
                                                             "the ingested corpus")
    method: Optional[str] = None
    top_k: Optional[StrictInt] = Field(None, ge=1)
    question_template: Optional[str] = Field(None, description="How the question is put after the chunks, "
                                                               "with a {question} placeholder; "
                                                               "\"{question}\": as sent (a client that "
                                                               "wrote its own prompt)")

    retrieval_order: Optional[str] = Field(None, description="score: the retrieved chunks best first; "
                                                             "document: each file's chunks together, in the "
                                                             "file's order (default: the server's config)")
    chunk_order: Optional[str] = Field(None, description="given: the chunks as retrieved or sent; cache: each "
                                                         "right after a chunk one of its caches was made after "
                                                         "(default: the server's config)")

    fit_max_tokens: StrictBool = Field(False, description="Cap max_tokens at what the context window leaves after "
                                                    "the prompt instead of refusing the request")

    @field_validator("question_template")
    @classmethod
    def _has_placeholder(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and "{question}" not in value:
            raise ValueError("needs a {question} placeholder")
        return value

    @field_validator("retrieval_order", "chunk_order")
    @classmethod
    def _known_order(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        choices = _ORDERS[info.field_name]
        if value is not None and value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        if self.stop is None:
            return ()
        return tuple(s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s)

    @property
    def answer_tokens(self) -> Optional[int]:
        """The answer length asked for (``max_completion_tokens`` is the newer name)."""
        return self.max_completion_tokens or self.max_tokens


class ChatRequest(Generation):
    """``POST /v1/chat/completions``: the question is the last user message; system and
    developer messages are the client's instructions, the messages before the question
    the conversation's earlier turns (both written after the chunks)."""

    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Generation):
    """``POST /v1/completions``: the prompt is the question (or chunks and the question,
    marked by the separator)."""

    prompt: Union[str, list[str]]
    echo: Literal[False] = False

    @property
    def text(self) -> str:
        """The prompt as one string (a list of one string is accepted)."""
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ValueError("prompt: give one string (batches of prompts are not supported)")
            return self.prompt[0]
        return self.prompt


class IngestRequest(_Strict):
    """``POST /v1/ingest``: files or directories on the server's machine."""

    paths: list[str] = Field(min_length=1)


class ForgetRequest(_Strict):
    """``POST /v1/forget``: ingested files or directories to drop from the corpus, and
    (unless ``keep_caches``) their chunk-caches from the store."""

    paths: list[str] = Field(min_length=1)
    keep_caches: StrictBool = False


class WarmRequest(_Strict):
    """``POST /v1/warm``: make the chunk-caches of the ingested corpus."""

    shard: Optional[tuple[StrictInt, StrictInt]] = Field(None, description="[i, n]: the i-th of n parts of the "
                                                                        "corpus (0 <= i < n), for several servers")

    @field_validator("shard")
    @classmethod
    def _a_part_of_the_corpus(cls, value: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
        if value is not None and not 0 <= value[0] < value[1]:
            raise ValueError(f"[i, n] needs 0 <= i < n, got {list(value)}")
        return value
