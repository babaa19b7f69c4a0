"""Answer text on its way to a client while ``generate`` makes it: a streamer that hands
decoded pieces to the event loop, and the cutter that holds back what may turn out to be
the start of a stop string."""

from __future__ import annotations

from typing import Callable

from transformers import TextStreamer


class PieceStreamer(TextStreamer):
    """Decodes new tokens (the prompt skipped) and passes each finished piece of text to
    ``push``, which must be safe to call from the worker thread."""

    def __init__(self, tokenizer, push: Callable[[str], None]) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._push = push

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self._push(text)


class StopCutter:
    """Feeds answer text through; what it returns is safe to send. Text that could be the
    beginning of a stop string is held back until it is known not to be; once a stop
    string appears, nothing from it on is ever returned (``stopped`` tells)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The part of the answer so far that may be sent now."""
        if self.stopped:
            return ""
        self.text += piece
        ends = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if ends:
            self.stopped = True
            return self._send(min(ends))
        return self._send(max(self.sent, len(self.text) - self._hold))

    def finish(self) -> str:
        """What is left to send once generation ended."""
        return "" if self.stopped else self._send(len(self.text))

    def _send(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out
