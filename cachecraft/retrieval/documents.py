"""Read plain-text and Markdown documents from files and directories."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

SUFFIXES = (".txt", ".md", ".markdown")
_HEADING = re.compile(r"^#[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


class DocumentError(ValueError):
    """A path cannot be read as documents; the message says which and why."""


@dataclass(frozen=True)
class Document:
    """One file's text and title."""

    path: Path  # absolute
    title: str
    text: str


def title_of(text: str, path: Path) -> str:
    """The first Markdown ``# heading`` of a Markdown file, else the file stem."""
    if path.suffix.lower() != ".txt":
        match = _HEADING.search(text)
        if match:
            return match.group(1).strip()
    return path.stem


def find_files(paths: Iterable[str | Path]) -> list[Path]:
    """Supported files named by ``paths`` (directories walked recursively, sorted,
    hidden files and folders skipped), absolute and without duplicates."""
    paths = list(paths)
    found: dict[Path, None] = {}
    for given in paths:
        path = Path(given).expanduser()
        if not path.exists():
            raise DocumentError(f"no such file or directory: {given}")
        if path.is_dir():
            found.update(dict.fromkeys(_walk(path.resolve())))
        elif path.suffix.lower() in SUFFIXES:
            found[path.resolve()] = None
        else:
            raise DocumentError(f"{given}: unsupported file type {path.suffix or '(none)'!r}; "
                                f"supported: {', '.join(SUFFIXES)}")
    if not found:
        names = ", ".join(str(p) for p in paths) or "(no paths given)"
        raise DocumentError(f"no {'/'.join(SUFFIXES)} files found in {names}")
    return list(found)


def _walk(directory: Path) -> list[Path]:
    files = []
    for path in sorted(directory.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(directory).parts)
        if not hidden and path.is_file() and path.suffix.lower() in SUFFIXES:
            files.append(path)
    return files


def read_document(path: Path) -> Document:
    """One file as a :class:`Document` (UTF-8, a BOM allowed)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{path} is not UTF-8 text (bad byte at offset {exc.start}); "
                            "convert it to UTF-8 first") from None
    except OSError as exc:
        raise DocumentError(f"cannot read {path}: {exc.strerror or exc}") from None
    return Document(path, title_of(text, path), text)


def read_documents(paths: Iterable[str | Path]) -> list[Document]:
    """Every supported document under ``paths``, in a stable order."""
    return [read_document(p) for p in find_files(paths)]
