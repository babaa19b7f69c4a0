"""Tokenize a RAG prompt as ordered segments: system prefix, chunks, question.

The system prefix and the question's suffix come from the model's chat template
when it has one, so a chunk's tokens do not depend on its neighbours and its cache
key stays the same across requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

_MARK = "\x00CTX\x00"


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


class PromptBuilder:
    """Turns (system prompt, chunk texts, question) into :class:`PromptPieces`."""

    def __init__(self, tokenizer, system_prompt: str, question_template: str = "Question: {question}"):
        assert "{question}" in question_template, "question_template needs a {question} placeholder"
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.question_template = question_template
        self.head, self.tail = self._template_parts()

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

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` with no special tokens added."""
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self) -> tuple[int, ...]:
        """The system prefix (with BOS where the tokenizer adds one and the template does not)."""
        ids = self.encode(self.head)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and getattr(self.tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
            ids = (bos, *ids)
        return ids

    @staticmethod
    def chunk_text(text: str, title: str | None = None) -> str:
        """How one retrieved passage is written into the prompt."""
        body = text.strip()
        return f"{title.strip()}\n{body}\n\n" if title else f"{body}\n\n"

    def build(self, chunks: Sequence[str], question: str, max_tokens: int | None = None) -> PromptPieces:
        """Tokenize a whole prompt; ``chunks`` are already formatted chunk texts."""
        if not question or not question.strip():
            raise PromptInputError("the question is empty")
        if not chunks:
            raise PromptInputError("no chunks given: a RAG prompt needs at least one chunk")
        pieces = PromptPieces(self.prefix_ids(), tuple(self.encode(c) for c in chunks),
                              self.encode(self.question_template.replace("{question}", question.strip())
                                          + self.tail))
        if any(len(c) == 0 for c in pieces.chunks):
            raise PromptInputError("a chunk is empty")
        if max_tokens is not None and pieces.num_tokens > max_tokens:
            raise PromptTooLong(f"prompt has {pieces.num_tokens} tokens, more than the model's "
                                f"context window of {max_tokens}")
        return pieces


def builder_for(tokenizer, config) -> PromptBuilder:
    """The prompt builder a config describes."""
    return PromptBuilder(tokenizer, config.system_prompt, config.question_template)
