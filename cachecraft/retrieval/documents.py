"""Read documents from files and directories: plain text, Markdown, HTML, PDF and docx.

Text and Markdown are read in blocks of ``BLOCK_BYTES`` (a 50 MB file never sits in
memory as one string); a PDF is read page by page. HTML goes through BeautifulSoup,
PDF through pypdf and docx through python-docx (the libraries LlamaIndex's file
readers use; the ``rag`` extra installs them). A file that cannot be read is a
:class:`DocumentError` naming it and why, so a caller can skip it and go on.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
SUFFIXES = TEXT_SUFFIXES + (".html", ".htm", ".pdf", ".docx")
BLOCK_BYTES = 1 << 20
_HEADING = re.compile(r"^#[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


class DocumentError(ValueError):
    """A path cannot be read as documents; the message says which and why."""


@dataclass(frozen=True)
class Document:
    """One file's text and title."""

    path: Path  # absolute
    title: str
    text: str


@dataclass(frozen=True)
class Skipped:
    """A file left out of an ingest, and why. ``ignored``: a file of a type that is not read,
    found by walking a directory (not named, and nothing in it was lost)."""

    path: Path
    reason: str
    ignored: bool = False


@dataclass
class DocumentStream:
    """One file's title and its text as consecutive blocks (joined, the whole text).

    ``read`` counts the file's bytes consumed so far (for progress); ``size`` is the
    file's size in bytes."""

    path: Path
    title: str
    blocks: Iterator[str]
    size: int
    read: int = 0


def title_of(text: str, path: Path) -> str:
    """The first Markdown ``# heading`` of a Markdown file, else the file stem."""
    if path.suffix.lower() != ".txt":
        match = _HEADING.search(text)
        if match:
            return match.group(1).strip()
    return path.stem


def scan_files(paths: Iterable[str | Path]) -> tuple[list[Path], list[Skipped]]:
    """Supported files named by ``paths`` (directories walked recursively, sorted, hidden
    files and folders left out), absolute and without duplicates; and every other entry,
    with the reason it is left out (unsupported type, broken link, not a regular file;
    one of another type met in a directory is marked ``ignored``).
    A path that does not exist is a :class:`DocumentError`."""
    found: dict[Path, None] = {}
    skipped: dict[Path, Skipped] = {}
    for given in paths:
        path = Path(given).expanduser()
        if not path.exists() and not path.is_symlink():
            raise DocumentError(f"no such file or directory: {given}")
        walked = path.is_dir()
        entries = _walk(path) if walked else [path]
        for entry in entries:
            reason = _unreadable_entry(entry)
            absolute = entry.absolute() if reason else entry.resolve()
            if reason:
                other_type = walked and entry.is_file() and entry.suffix.lower() not in SUFFIXES
                skipped[absolute] = Skipped(absolute, reason, ignored=other_type)
            else:
                found[absolute] = None
    return list(found), list(skipped.values())


def find_files(paths: Iterable[str | Path]) -> list[Path]:
    """Supported files named by ``paths`` (see :func:`scan_files`); a named file of an
    unsupported type, or finding nothing, is a :class:`DocumentError`."""
    paths = list(paths)
    found, skipped = scan_files(paths)
    for s in skipped:
        if any(Path(p).expanduser().absolute() == s.path for p in paths):
            raise DocumentError(f"{s.path}: {s.reason}")
    if not found:
        names = ", ".join(str(p) for p in paths) or "(no paths given)"
        raise DocumentError(f"no {'/'.join(SUFFIXES)} files found in {names}")
    return found


def _walk(directory: Path) -> list[Path]:
    """Every non-directory entry under ``directory`` that is not hidden, sorted."""
    root = directory.resolve()
    out = []
    for path in sorted(root.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
        if not hidden and (path.is_symlink() or not path.is_dir()):
            if not (path.is_symlink() and path.is_dir()):
                out.append(path)
    return out


def _unreadable_entry(path: Path) -> str | None:
    """Why ``path`` cannot be read as a document, judged from its name and kind; None if it may."""
    if path.is_symlink() and not path.exists():
        return "broken symbolic link"
    if not path.is_file():
        return "not a regular file"
    if path.suffix.lower() not in SUFFIXES:
        return f"unsupported file type {path.suffix or '(none)'!r}; supported: {', '.join(SUFFIXES)}"
    return None


def open_document(path: Path, block_bytes: int | None = None) -> DocumentStream:
    """``path`` as a :class:`DocumentStream`; reading errors raise :class:`DocumentError`,
    here or while the blocks are consumed."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        size = path.stat().st_size
        if suffix in TEXT_SUFFIXES:
            return _text_stream(path, size, block_bytes or BLOCK_BYTES)
        if suffix in (".html", ".htm"):
            return _html_stream(path, size)
        if suffix == ".pdf":
            return _pdf_stream(path, size)
        if suffix == ".docx":
            return _docx_stream(path, size)
    except DocumentError:
        raise
    except OSError as exc:
        raise DocumentError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ImportError as exc:
        raise DocumentError(f"reading {suffix} files needs the {exc.name} package: "
                            "pip install 'cachecraft[rag]'") from None
    except Exception as exc:  # the parsers raise many kinds of error on a damaged file
        raise DocumentError(f"cannot read {path} as {suffix[1:]}: {type(exc).__name__}: {exc}") from None
    raise DocumentError(f"{path}: unsupported file type {suffix or '(none)'!r}; supported: {', '.join(SUFFIXES)}")


def read_document(path: Path) -> Document:
    """One file as a :class:`Document` (text files: UTF-8, a BOM allowed)."""
    stream = open_document(path)
    return Document(stream.path, stream.title, "".join(stream.blocks))


def read_documents(paths: Iterable[str | Path]) -> list[Document]:
    """Every supported document under ``paths``, in a stable order."""
    return [read_document(p) for p in find_files(paths)]


# -- formats ---------------------------------------------------------------------------------

def _text_stream(path: Path, size: int, block_bytes: int) -> DocumentStream:
    handle = path.open("rb")
    stream = DocumentStream(path, path.stem, iter(()), size)
    decoder = codecs.getincrementaldecoder("utf-8-sig")()

    def blocks() -> Iterator[str]:
        with handle:
            while True:
                data = handle.read(block_bytes)
                try:
                    text = decoder.decode(data, final=not data)
                except UnicodeDecodeError as exc:
                    raise DocumentError(f"{path} is not UTF-8 text (bad byte near offset "
                                        f"{stream.read + max(exc.start - len(exc.object) + len(data), 0)}); "
                                        "convert it to UTF-8 first") from None
                stream.read += len(data)
                if text:
                    yield text
                if not data:
                    return

    stream.blocks = blocks()
    first = next(stream.blocks, "")
    stream.title = title_of(first, path)
    stream.blocks = chain([first], stream.blocks)
    return stream


_BLOCK_TAGS = ("p", "div", "section", "article", "header", "footer", "main", "aside", "nav", "blockquote",
               "pre", "li", "dt", "dd", "tr", "table", "ul", "ol", "dl", "figure", "figcaption", "hr",
               "h1", "h2", "h3", "h4", "h5", "h6")


def _html_stream(path: Path, size: int) -> DocumentStream:
    from bs4 import BeautifulSoup, NavigableString

    soup = BeautifulSoup(path.read_bytes(), "html.parser")  # the encoding from the bytes or <meta>
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    if not title and soup.find("h1"):
        title = soup.find("h1").get_text(" ", strip=True)
    for tag in soup(["script", "style", "noscript", "template", "head"]):
        tag.decompose()
    for text in soup.find_all(string=True):
        if not text.find_parent("pre"):
            text.replace_with(NavigableString(re.sub(r"\s+", " ", str(text))))
    for tag in soup.find_all("br"):
        tag.replace_with("\n")
    for tag in soup.find_all(_BLOCK_TAGS):
        tag.insert_before("\n\n")
        tag.insert_after("\n\n")
    lines = (line.strip() for line in soup.get_text().split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return DocumentStream(path, title or path.stem, iter([text]), size, size)


def _pdf_stream(path: Path, size: int) -> DocumentStream:
    from pypdf import PdfReader

    reader = PdfReader(path)
    if reader.is_encrypted and not reader.decrypt(""):
        raise DocumentError(f"cannot read {path}: the PDF is encrypted")
    title = (reader.metadata.title if reader.metadata else None) or path.stem
    pages = len(reader.pages)
    stream = DocumentStream(path, str(title).strip() or path.stem, iter(()), size)

    def blocks() -> Iterator[str]:
        for i, page in enumerate(reader.pages):
            try:
                text = page.extract_text() or ""
            except Exception as exc:  # pypdf raises many kinds of error on a damaged page
                raise DocumentError(f"cannot read page {i + 1} of {path}: {type(exc).__name__}: {exc}") from None
            stream.read = size * (i + 1) // pages
            yield ("\n\n" if i else "") + text.strip()

    stream.blocks = blocks()
    return stream


def _docx_stream(path: Path, size: int) -> DocumentStream:
    import docx

    doc = docx.Document(str(path))
    paragraphs = [p for p in doc.paragraphs if p.text.strip()]
    title = doc.core_properties.title or next(
        (p.text.strip() for p in paragraphs if p.style is not None and
         p.style.name.lower() in ("title", "heading 1")), "")
    texts = [p.text.strip() for p in paragraphs]
    for table in doc.tables:
        for row in table.rows:
            cells = list(dict.fromkeys(c.text.strip() for c in row.cells if c.text.strip()))
            if cells:
                texts.append(" | ".join(cells))
    return DocumentStream(path, title.strip() or path.stem, iter(["\n\n".join(texts)]), size, size)
