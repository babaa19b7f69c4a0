"""Ingest paths into a corpus: every readable file goes in, every other one is reported.

Files are read as streams of blocks and chunked as the blocks arrive (see
:meth:`Chunker.split_stream`), so a large file is never one string nor tokenized at
once, and progress moves with every chunk made. A file that cannot be read (type,
encoding, damage, permissions) is skipped with its reason; the others are ingested.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from cachecraft.retrieval.chunking import Chunker, TextChunk
from cachecraft.retrieval.corpus import Corpus, IngestReport
from cachecraft.retrieval.documents import DocumentError, Skipped, open_document, scan_files

log = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20  # read from a text file at a time
# stage ("reading": bytes of all files; "embedding": chunks), done, total
StageProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class IngestOutcome:
    """What an ingest changed, and the files it left out with their reasons."""

    report: IngestReport
    skipped: tuple[Skipped, ...]

    @property
    def failed(self) -> list[Skipped]:
        """The skipped files that are a problem: named ones, and files of a type that is
        read but could not be (encoding, damage, permissions, no text, broken links); not
        the files of other types met in a directory."""
        return [s for s in self.skipped if not s.ignored]

    def to_dict(self) -> dict:
        """The report's counts plus ``skipped``: ``[{path, reason, ignored}]``."""
        return {**self.report.to_dict(),
                "skipped": [{"path": str(s.path), "reason": s.reason, "ignored": s.ignored} for s in self.skipped]}


def ingest_paths(corpus: Corpus, chunker: Chunker, paths: Iterable[str | Path], *,
                 settings: Mapping | None = None, progress: StageProgress | None = None) -> IngestOutcome:
    """Read, chunk and add every supported file under ``paths`` to ``corpus``.

    Raises :class:`DocumentError` when a path does not exist or no file yields text
    (the message lists what was skipped and why); otherwise the good files are ingested
    and the bad ones are listed in the outcome."""
    paths = list(paths)
    files, skipped = scan_files(paths)
    total = sum(_size(p) for p in files)
    chunked: dict[str, list[TextChunk]] = {}
    before = 0
    for path in files:
        try:
            chunks, size = _chunk_file(path, chunker, lambda read: progress and progress("reading", before + read,
                                                                                          total))
        except DocumentError as exc:
            skipped.append(Skipped(path, _reason(str(exc), path)))
            log.info("skipped %s: %s", path, exc)
            continue
        finally:
            before += _size(path)
        if chunks:
            chunked[str(path)] = chunks
        else:
            skipped.append(Skipped(path, "no text found" + (" (a scanned PDF needs OCR first)"
                                                            if path.suffix.lower() == ".pdf" else "")))
    if progress:
        progress("reading", total, total)
    if not chunked:
        named = ", ".join(str(p) for p in paths) or "(no paths given)"
        reasons = "; ".join(f"{s.path.name}: {s.reason}" for s in skipped)
        raise DocumentError(f"no text found in {named}" + (f" ({len(skipped)} file(s) skipped: {reasons})"
                                                           if skipped else ""))
    embed_progress = (lambda done, count: progress("embedding", done, count)) if progress else None
    report = corpus.ingest(chunked, scopes=[p for p in paths if Path(p).is_dir()], settings=settings,
                           chunk_progress=embed_progress)
    return IngestOutcome(report, tuple(sorted(skipped, key=lambda s: str(s.path))))


def _chunk_file(path: Path, chunker: Chunker, on_chunk: Callable[[int], object]) -> tuple[list[TextChunk], int]:
    stream = open_document(path, block_bytes=BLOCK_BYTES)
    chunks = []
    for chunk in chunker.split_stream(stream.blocks, stream.title):
        chunks.append(chunk)
        on_chunk(stream.read)
    return chunks, stream.size


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _reason(message: str, path: Path) -> str:
    """A document error's message without the path it starts with (the report names it)."""
    for prefix in (f"{path}: ", f"{path} "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message.replace(f" {path}", "", 1)
