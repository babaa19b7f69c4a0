"""How numbers and tables read when printed."""

from __future__ import annotations


def seconds(value: float | None, digits: int = 2) -> str:
    """``value`` as ``"1.23 s"`` (``"-"`` for None); a value that rounds to zero never
    reads ``-0.00``."""
    if value is None:
        return "-"
    rounded = round(value, digits)
    return f"{(rounded if rounded != 0 else 0.0):.{digits}f} s"


def saved(value: float | None, digits: int = 2) -> str:
    """Prefill time saved as ``"saved 1.23 s"``, or ``"0.40 s slower than a full prefill"``
    when negative (``"-"`` for None)."""
    if value is None:
        return "-"
    if round(value, digits) >= 0:
        return f"saved {seconds(value, digits)}"
    return f"{seconds(-value, digits)} slower than a full prefill"


def startup(parts: dict[str, float]) -> str:
    """Start-up work as ``"model 3.10 s, embedder 0.80 s"`` (``"none"`` when empty)."""
    return ", ".join(f"{name} {seconds(s)}" for name, s in parts.items()) or "none"


WIDEST_LOG_TABLE = 250  # columns; a table in a log is printed no wider than this


def print_table(console, table) -> None:
    """``table`` on ``console``; where that is not a terminal (a log, a pipe: 80 columns), as
    wide as its columns need (up to :data:`WIDEST_LOG_TABLE`) instead of squeezed with its
    values cut to ``1.0…``."""
    if console.is_terminal:
        console.print(table)
        return
    import io

    from rich.console import Console
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(WIDEST_LOG_TABLE), table).maximum
    wide = Console(file=io.StringIO(), width=max(console.width, min(needed, WIDEST_LOG_TABLE)), color_system=None,
                   soft_wrap=True)
    wide.print(table)
    console.print(wide.file.getvalue(), end="", markup=False, highlight=False, emoji=False, soft_wrap=True)
