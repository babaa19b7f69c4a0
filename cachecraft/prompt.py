"""Tokenize a RAG prompt as ordered segments: system prefix, chunks, question.

The system prefix and the question's suffix come from the model's chat template
when it has one, so a chunk's tokens do not depend on its neighbours and its cache
key stays the same across requests. What a chat adds (a client's instructions, the
conversation's earlier turns) is written after the chunks, in the question's suffix,
so the chunk-caches made after the system prefix serve chats too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

_MARK = "\x00CTX\x00"

# Retrieved chunks come back request after request, so their token ids are kept: about
# 20 KB each at 600 tokens, 10 MB for the default number.
CHUNK_IDS_KEPT = 512


class PromptInputError(ValueError):
    """The question or chunks cannot make a prompt (empty, too long)."""


class PromptTooLong(PromptInputError):
    """The prompt does not fit in the model's context window."""


@dataclass(frozen=True)
class PromptPieces:
    """Token ids of each part of one prompt, in order."""

    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.prefix) + sum(map(len, self.chunks)) + len(self.question)

    @property
    def token_ids(self) -> list[int]:
        return [*self.prefix, *(t for c in self.chunks for t in c), *self.question]


@dataclass(frozen=True)
class Conversation:
    """What a chat request says besides its question: the client's instructions (its
    system messages) and the earlier turns, oldest first, as (speaker, text) pairs with
    speaker ``user`` or ``assistant``."""

    instructions: tuple[str, ...] = ()
    turns: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        unknown = {speaker for speaker, _ in self.turns} - {"user", "assistant"}
        if unknown:
            raise PromptInputError(f"a turn's speaker must be user or assistant, got {', '.join(sorted(unknown))}")

    def opening(self) -> str:
        """The instructions as written before the first question (empty where there are none)."""
        return "".join(text.strip() + "\n\n" for text in self.instructions if text.strip())

    def exchanges(self, question: str) -> list[tuple[str, str]]:
        """The turns and then ``question``, taking turns: one speaker's turns in a row
        joined, an assistant's turns before the first user's dropped (a greeting says
        nothing the answer needs), so the list goes user, assistant, ..., user."""
        merged: list[tuple[str, str]] = []
        for speaker, text in (*self.turns, ("user", question)):
            text = text.strip()
            if not text or (speaker == "assistant" and not merged):
                continue
            if merged and merged[-1][0] == speaker:
                merged[-1] = (speaker, merged[-1][1] + "\n\n" + text)
            else:
                merged.append((speaker, text))
        return merged


class PromptBuilder:
    """Turns (system prompt, chunk texts, question) into :class:`PromptPieces`."""

    def __init__(self, tokenizer, system_prompt: str, question_template: str = "Question: {question}"):
        assert "{question}" in question_template, "question_template needs a {question} placeholder"
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.question_template = question_template
        self.head, self.tail = self._template_parts()
        self._prefix_ids: tuple[int, ...] | None = None
        self._chunk_ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chunk_ids_lock = threading.Lock()  # the server builds on two threads

    def _template_parts(self) -> tuple[str, str]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "system", "content": self.system_prompt},
                        {"role": "user", "content": _MARK}]
            try:
                rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # some templates reject a system role
                rendered = tok.apply_chat_template(
                    [{"role": "user", "content": self.system_prompt + "\n\n" + _MARK}],
                    tokenize=False, add_generation_prompt=True)
            if isinstance(rendered, str) and rendered.count(_MARK) == 1:
                head, tail = rendered.split(_MARK)
                return head, tail
        return self.system_prompt + "\n\n", "\nAnswer:"

    def with_question_template(self, question_template: str) -> PromptBuilder:
        """A builder like this one but for ``question_template``; the two share the
        remembered chunk ids, since chunks are written alike under any template."""
        other = PromptBuilder(self.tokenizer, self.system_prompt, question_template)
        other._chunk_ids, other._chunk_ids_lock = self._chunk_ids, self._chunk_ids_lock
        return other

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` with no special tokens added."""
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self) -> tuple[int, ...]:
        """The system prefix (with BOS where the tokenizer adds one and the template does not)."""
        if self._prefix_ids is None:
            ids = self.encode(self.head)
            bos = getattr(self.tokenizer, "bos_token_id", None)
            if bos is not None and getattr(self.tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
                ids = (bos, *ids)
            self._prefix_ids = ids
        return self._prefix_ids

    def chunk_ids(self, text: str) -> tuple[int, ...]:
        """Token ids of one formatted chunk; the last :data:`CHUNK_IDS_KEPT` are remembered,
        since the same chunks are retrieved again and again."""
        with self._chunk_ids_lock:
            ids = self._chunk_ids.get(text)
            if ids is not None:
                self._chunk_ids.move_to_end(text)
                return ids
        ids = self.encode(text)
        with self._chunk_ids_lock:
            self._chunk_ids[text] = ids
            while len(self._chunk_ids) > CHUNK_IDS_KEPT:
                self._chunk_ids.popitem(last=False)
        return ids

    @staticmethod
    def chunk_text(text: str, title: str | None = None) -> str:
        """How one retrieved passage is written into the prompt."""
        body = text.strip()
        return f"{title.strip()}\n{body}\n\n" if title else f"{body}\n\n"

    def asked(self, question: str) -> str:
        """``question`` in the question template."""
        return self.question_template.replace("{question}", question.strip())

    def suffix(self, question: str, conversation: Conversation | None = None) -> str:
        """The text after the chunks: the question in its template and the template's tail;
        in a chat, the client's instructions, then each earlier turn as the model's chat
        template writes a turn (the chunks opening the first user turn), then the question."""
        exchanges = conversation.exchanges(question) if conversation is not None else []
        if not exchanges:
            return self.asked(question) + self.tail
        said = [(speaker, self.asked(text) if speaker == "user" else text) for speaker, text in exchanges]
        said[0] = ("user", conversation.opening() + said[0][1])
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self._rendered_after_chunks(said)
            if rendered is not None:
                return rendered
        # no chat template (or one that writes a chat's start unlike a question's): the
        # plain form, each reply after the tail that asks for it
        gap = "" if self.tail[-1:].isspace() else " "
        return "".join(text + self.tail if speaker == "user" else gap + text + "\n\n" for speaker, text in said)

    def _rendered_after_chunks(self, said: list[tuple[str, str]]) -> str | None:
        """The chat template's text after the chunks for turns ``said`` (the first one the
        user's); None where its text before them is not the system prefix chunk-caches are
        made after."""
        turns = [{"role": speaker, "content": text} for speaker, text in said]
        turns[0] = {"role": "user", "content": _MARK + turns[0]["content"]}
        try:
            rendered = self.tokenizer.apply_chat_template([{"role": "system", "content": self.system_prompt}, *turns],
                                                          tokenize=False, add_generation_prompt=True)
        except Exception:  # some templates reject a system role: it opens the first turn, as in the head
            turns[0] = {"role": "user", "content": self.system_prompt + "\n\n" + turns[0]["content"]}
            try:
                rendered = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            except Exception:
                return None
        if not isinstance(rendered, str) or rendered.count(_MARK) != 1:
            return None
        head, after = rendered.split(_MARK)
        return after if head == self.head else None

    def build(self, chunks: Sequence[str], question: str, max_tokens: int | None = None,
              conversation: Conversation | None = None) -> PromptPieces:
        """Tokenize a whole prompt; ``chunks`` are already formatted chunk texts;
        ``conversation``: what a chat said before this question."""
        if not question or not question.strip():
            raise PromptInputError("the question is empty")
        if not chunks:
            raise PromptInputError("no chunks given: a RAG prompt needs at least one chunk")
        pieces = PromptPieces(self.prefix_ids(), tuple(self.chunk_ids(c) for c in chunks),
                              self.encode(self.suffix(question, conversation)))
        if any(len(c) == 0 for c in pieces.chunks):
            raise PromptInputError("a chunk is empty")
        if max_tokens is not None and pieces.num_tokens > max_tokens:
            turns = conversation is not None and conversation.turns
            raise PromptTooLong(f"prompt has {pieces.num_tokens} tokens, more than the model's "
                                f"context window of {max_tokens}"
                                + ("; send fewer of the conversation's earlier turns" if turns else ""))
        return pieces


def builder_for(tokenizer, config) -> PromptBuilder:
    """The prompt builder a config describes."""
    return PromptBuilder(tokenizer, config.system_prompt, config.question_template)
