"""Progress on a console: a live bar or spinner in a terminal, plain lines elsewhere.

Where the console is not a terminal (a log file, a pipe, ``nohup``, CI) rich draws
nothing until the work ends, so long work would look stuck; there, each step that
matters is one plain line after the time the work has run (``[12m40s] ...``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from rich.console import Console


QUIET_S = 5.0  # a task passing another tenth says so at most this often (its end always)


class ProgressLines:
    """Progress as lines: one each time a task changes its description, reaches its end,
    or passes another tenth of its total at least :data:`QUIET_S` seconds after its last
    line (so quick work says little). Nothing before the work moves, so an error at the
    start stays the only line. Answers the part of rich's ``Progress`` the commands use
    (``add_task``, ``update``, a ``with`` block)."""

    def __init__(self, out: Console, clock: Callable[[], float] = time.monotonic):
        self.out, self.clock, self.began = out, clock, clock()
        self.tasks: list[dict[str, Any]] = []

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        """Start a task (no line yet); its id for :meth:`update`."""
        self.tasks.append({"description": description, "total": total, "completed": 0, "tenth": 0,
                           "said": self.clock()})
        return len(self.tasks) - 1

    def update(self, task: int, *, completed: float | None = None, total: float | None = None,
               description: str | None = None, advance: float | None = None, **_: Any) -> None:
        """Move ``task`` on; a line only where its description changed or it passed another tenth."""
        state = self.tasks[task]
        if total is not None:
            state["total"] = total
        if completed is not None:
            state["completed"] = completed
        if advance:
            state["completed"] += advance
        tenth = int(10 * state["completed"] / state["total"]) if state["total"] else 0
        now = self.clock()
        if description is not None and description != state["description"]:
            state["description"] = description  # a new step: its tenths count from here
        elif tenth <= state["tenth"] or (tenth < 10 and now - state["said"] < QUIET_S):
            return
        state["tenth"], state["said"] = tenth, now
        count = f" {_number(state['completed'])}/{_number(state['total'])}" if state["total"] else ""
        _line(self.out, now - self.began, f"{state['description']}{count}")


class StatusLines:
    """A spinner's text as lines: each new text, after the time the work has run."""

    def __init__(self, out: Console, clock: Callable[[], float] = time.monotonic):
        self.out, self.clock, self.began, self.text = out, clock, clock(), None

    def update(self, text: str) -> None:
        """Say ``text``, unless it is what was said last."""
        if text != self.text:
            self.text = text
            _line(self.out, self.clock() - self.began, text)


def bar(console: Console, time_left: bool = True):
    """A transient progress bar (description, bar, done/total and, with ``time_left``, the
    time remaining) on ``console``; :class:`ProgressLines` where it is not a terminal."""
    if not console.is_terminal:
        return ProgressLines(console)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    return Progress(*columns, *([TimeRemainingColumn()] if time_left else []), console=console, transient=True)


@contextlib.contextmanager
def spinner(console: Console, text: str) -> Iterator[Any]:
    """A spinner saying ``text`` while a long step runs (its ``update`` changes the text);
    :class:`StatusLines` where ``console`` is not a terminal."""
    if console.is_terminal:
        with console.status(text) as status:
            yield status
    else:
        lines = StatusLines(console)
        lines.update(text)
        yield lines


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _line(out: Console, elapsed: float, text: str) -> None:
    """``text`` as one plain line, after the minutes and seconds the work has run."""
    minutes, secs = divmod(int(elapsed), 60)
    out.print(f"[{minutes:d}m{secs:02d}s] {text}", highlight=False, markup=False)
