"""How numbers read when printed."""

from __future__ import annotations


def seconds(value: float | None, digits: int = 2) -> str:
    """``value`` as ``"1.23 s"`` (``"-"`` for None); a value that rounds to zero never
    reads ``-0.00``."""
    if value is None:
        return "-"
    rounded = round(value, digits)
    return f"{(rounded if rounded != 0 else 0.0):.{digits}f} s"
