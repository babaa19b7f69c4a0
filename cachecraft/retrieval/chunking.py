"""Split a document into chunks that fit a token budget of the generator's tokenizer.

A chunk is measured as it will be tokenized in the prompt: its title and body
formatted by :meth:`PromptBuilder.chunk_text`. Text is cut at paragraph boundaries
when it can be, else at line, sentence and word boundaries, and a single word longer
than the budget is cut by characters. Pieces are then packed greedily, so chunk
boundaries fall between whole paragraphs unless a paragraph alone is too long.

A long text can come as a stream of blocks (:meth:`Chunker.split_stream`): it is cut at
complete paragraph breaks as the blocks arrive and chunks come out as they are made, so
no more than a paragraph (at most ``max_buffer`` characters) is tokenized at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Iterable, Iterator, Sequence

from cachecraft.prompt import PromptBuilder

# (pattern that splits a piece, separator that joins the parts back), coarsest first
_LEVELS = ((re.compile(r"\n[ \t]*\n\s*"), "\n\n"), (re.compile(r"\n\s*"), "\n"),
           (re.compile(r"(?<=[.!?;:])\s+"), " "), (re.compile(r"\s+"), " "))
# A stream shorter than this (characters) is chunked as one text. A stream gives the
# chunks of the whole text except where the whole text fits in one chunk (none is near
# this long) or a paragraph is longer than MAX_BUFFER.
WHOLE_BELOW = 1 << 16
MAX_BUFFER = 1 << 20  # characters of a stream held when no paragraph break comes


@dataclass(frozen=True)
class TextChunk:
    """One chunk of a document: body text, the document's title, its position."""

    text: str
    title: str
    position: int

    @property
    def prompt_text(self) -> str:
        """The chunk as written into the prompt (and cached)."""
        return PromptBuilder.chunk_text(self.text, self.title)


@dataclass(frozen=True)
class _Piece:
    text: str
    sep: str  # joins it to the piece before


class Chunker:
    """Splits texts into chunks of at most ``chunk_tokens`` tokens, title included.

    ``encode`` maps text to token ids (the generator's tokenizer, no special tokens);
    ``overlap`` carries up to that many tokens of whole trailing pieces of a chunk into
    the next one.
    """

    def __init__(self, encode: Callable[[str], Sequence[int]], chunk_tokens: int, overlap: int = 0):
        assert chunk_tokens >= 16, f"chunk_tokens must be >= 16, got {chunk_tokens}"
        assert 0 <= overlap <= chunk_tokens // 2, f"overlap must be within [0, chunk_tokens / 2], got {overlap}"
        self.encode = encode
        self.limit = chunk_tokens
        self.overlap = overlap

    def split(self, text: str, title: str) -> list[TextChunk]:
        """The chunks of ``text``, in order; every non-whitespace character lands in one."""
        title = self.fit_title(title)
        pieces = self._pieces(text.strip(), "", 0, title)
        bodies = self._pack(pieces, title)
        return [TextChunk(body, title, i) for i, body in enumerate(bodies)]

    def split_stream(self, blocks: Iterable[str], title: str, *, whole_below: int | None = None,
                     max_buffer: int | None = None) -> Iterator[TextChunk]:
        """The chunks of the text ``"".join(blocks)``, yielded as they are made.

        A text shorter than ``whole_below`` characters is chunked as :meth:`split` does.
        A longer one is cut at complete paragraph breaks as blocks arrive, which gives the
        same chunks as :meth:`split` on the whole text; a paragraph longer than
        ``max_buffer`` characters is cut at the last line break, else sentence or word
        break, else character, within it."""
        whole_below = WHOLE_BELOW if whole_below is None else whole_below
        blocks = iter(blocks)
        head: list[str] = []
        length = 0
        for block in blocks:
            head.append(block)
            length += len(block)
            if length >= whole_below:
                break
        else:
            if length < whole_below:
                yield from self.split("".join(head), title)
                return
        title = self.fit_title(title)
        pieces = self._stream_pieces(chain(head, blocks), title, max_buffer or MAX_BUFFER)
        for position, body in enumerate(self._pack_stream(pieces, title)):
            yield TextChunk(body, title, position)

    def size(self, body: str, title: str) -> int:
        """Tokens of a chunk as it goes into the prompt."""
        return len(self.encode(PromptBuilder.chunk_text(body, title)))

    def fit_title(self, title: str) -> str:
        """``title`` cut to at most a quarter of the budget, so bodies keep room."""
        title = " ".join(title.split())
        while title and len(self.encode(title)) > self.limit // 4:
            words = title.split(" ")
            title = " ".join(words[:-1]) if len(words) > 1 else title[:len(title) // 2]
        return title

    def _fits(self, body: str, title: str) -> bool:
        return self.size(body, title) <= self.limit

    def _pieces(self, text: str, sep: str, level: int, title: str) -> list[_Piece]:
        """``text`` as pieces that each fit alone, cut at the coarsest boundary that works."""
        if not text:
            return []
        if self._fits(text, title):
            return [_Piece(text, sep)]
        if level == len(_LEVELS):
            return self._cut_characters(text, sep, title)
        pattern, joiner = _LEVELS[level]
        parts = [p.strip() for p in pattern.split(text) if p.strip()]
        out: list[_Piece] = []
        for i, part in enumerate(parts):
            out.extend(self._pieces(part, sep if i == 0 else joiner, level + 1, title))
        return out

    def _cut_characters(self, text: str, sep: str, title: str) -> list[_Piece]:
        """A word longer than the budget, cut into the longest prefixes that fit."""
        out = []
        while text:
            lo, hi = 1, len(text)  # the longest fitting prefix, found by bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self._fits(text[:mid], title) else (lo, mid - 1)
            out.append(_Piece(text[:lo], sep if not out else ""))
            text = text[lo:]
        return out

    def _stream_pieces(self, blocks: Iterable[str], title: str, max_buffer: int) -> Iterator[_Piece]:
        """The pieces :meth:`_pieces` makes of the whole text, from its blocks: a paragraph
        break followed by text is final, so the paragraphs before it are the whole text's."""
        paragraph, joiner = _LEVELS[0]
        buffer, sep, emitted = "", "", False  # sep joins the next part to the one before

        def parts(text: str) -> Iterator[_Piece]:
            nonlocal sep, emitted
            for part in (p.strip() for p in paragraph.split(text)):
                if part:
                    yield from self._pieces(part, sep, 1, title)
                    sep, emitted = joiner, True

        for block in blocks:
            buffer += block
            cut = _last_break(buffer, paragraph)
            if cut is not None:
                yield from parts(buffer[:cut[0]])
                buffer = buffer[cut[1]:]
                sep = joiner if emitted else ""
            elif len(buffer) > max_buffer:  # no paragraph break in sight: cut inside the paragraph
                start, end, continued = _forced_cut(buffer, max_buffer)
                yield from parts(buffer[:start])
                buffer = buffer[end:]
                sep = continued if emitted else ""
        yield from parts(buffer)

    def _pack(self, pieces: list[_Piece], title: str) -> list[str]:
        """Greedily join pieces into chunk bodies that fit."""
        return list(self._pack_stream(pieces, title))

    def _pack_stream(self, pieces: Iterable[_Piece], title: str) -> Iterator[str]:
        """Greedily join pieces into chunk bodies that fit, each yielded when complete."""
        current: list[_Piece] = []
        for piece in pieces:
            if current and self._fits(_join(current + [piece]), title):
                current.append(piece)
                continue
            if current:
                yield _join(current)
                current = self._carry(current, piece, title)
            current.append(piece)
        if current:
            yield _join(current)

    def _carry(self, previous: list[_Piece], piece: _Piece, title: str) -> list[_Piece]:
        """Trailing pieces of ``previous`` within ``overlap`` tokens that leave room for ``piece``."""
        tail: list[_Piece] = []
        for candidate in reversed(previous):
            trial = [candidate] + tail
            if len(self.encode(_join(trial))) > self.overlap or not self._fits(_join(trial + [piece]), title):
                break
            tail = trial
        return tail


def _last_break(text: str, pattern: re.Pattern) -> tuple[int, int] | None:
    """(start, end) of the last match of ``pattern`` in ``text`` that text follows (so more
    text cannot extend it), or None."""
    last = None
    for match in pattern.finditer(text):
        if match.end() < len(text) and match.end() > match.start():
            last = match.span()
    return last


def _forced_cut(text: str, limit: int) -> tuple[int, int, str]:
    """Where to cut a paragraph longer than ``limit``: the last line, else sentence, else
    word break, else at ``limit`` characters; (start, end, joiner of the two sides)."""
    for pattern, joiner in _LEVELS[1:]:
        cut = _last_break(text, pattern)
        if cut is not None:
            return cut[0], cut[1], joiner
    return limit, limit, ""


def _join(pieces: list[_Piece]) -> str:
    return "".join((p.sep if i else "") + p.text for i, p in enumerate(pieces))


def split_text(text: str, title: str, encode: Callable[[str], Sequence[int]], chunk_tokens: int,
               overlap: int = 0) -> list[TextChunk]:
    """Chunks of ``text`` (see :class:`Chunker`)."""
    return Chunker(encode, chunk_tokens, overlap).split(text, title)
