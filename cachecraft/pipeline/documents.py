"""Dropping documents: out of the corpus, and their chunk-caches out of the store.

It needs no model, so the CLI runs it without loading one; the server runs it through
:meth:`~cachecraft.pipeline.Pipeline.forget_documents`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cachecraft.catalog import CatalogError
from cachecraft.retrieval.corpus import Corpus, ForgetReport
from cachecraft.store import StoreError, TieredStore


class ForgetIncomplete(StoreError):
    """The files left the corpus, but evicting their chunk-caches failed part way."""


@dataclass(frozen=True)
class ForgetOutcome:
    """What a forget changed: the corpus, and the variants evicted (None: caches kept)."""

    report: ForgetReport
    evicted: int | None

    def to_dict(self) -> dict:
        """The report's fields plus ``evicted``."""
        return {**self.report.to_dict(), "evicted": self.evicted}


def forget_documents(corpus: Corpus, store: TieredStore | None, paths: Iterable[str | Path]) -> ForgetOutcome:
    """Drop the files ``paths`` name from ``corpus`` (:meth:`Corpus.forget`) and the
    chunk-caches of their chunks from every tier ``store`` reaches; with no ``store``
    the caches stay, for eviction to drop in time. The corpus goes first: were the
    eviction interrupted, what is left are caches no retrieval returns."""
    report = corpus.forget(paths)
    if store is None:
        return ForgetOutcome(report, None)
    try:
        evicted = store.evict_documents(report.files)
    except (StoreError, CatalogError) as exc:  # the corpus changed already: say how to finish
        raise ForgetIncomplete(f"forgot {len(report.files)} file(s), but not all of their chunk-caches were "
                               f"evicted ({exc}); once that is mended, `cachecraft evict --source FILE` drops "
                               f"them, for: {', '.join(report.files)}") from exc
    if evicted.unreached:  # this node's copies are gone; the shared tier's wait for it to answer
        raise ForgetIncomplete(f"forgot {len(report.files)} file(s) and evicted {len(evicted.removed)} "
                               f"chunk-cache variant(s), but the shared tier at {evicted.unreached} did not "
                               "answer, so its copies may stay; once it is back, `cachecraft evict --source "
                               f"FILE` drops them, for: {', '.join(report.files)}")
    return ForgetOutcome(report, len(evicted.removed))
