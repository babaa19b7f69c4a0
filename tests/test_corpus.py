"""The persistent corpus: dedupe, persistence, replacement, locking, search."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from cachecraft.retrieval.chunking import TextChunk
from cachecraft.retrieval.corpus import Corpus, SearchHit, chunk_id, document_order
from cachecraft.retrieval.snapshot import CorpusBusyError, CorpusChunk, CorpusError


def bag_of_words(texts):
    """A deterministic stand-in embedder: hashed word counts, unit length."""
    out = np.zeros((len(texts), 64), dtype=np.float32)
    for row, text in enumerate(texts):
        for word in text.replace(".", " ").split():
            out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def chunks(*texts, title="t"):
    return [TextChunk(text, title, i) for i, text in enumerate(texts)]


@pytest.fixture
def corpus(tmp_path):
    return Corpus(tmp_path / "corpus", "fake", embed=bag_of_words)


def test_ingest_dedupes_and_persists(corpus, tmp_path):
    report = corpus.ingest({"/d/a.md": chunks("alpha beta", "gamma delta", "alpha beta"),
                            "/d/b.md": chunks("gamma delta", "epsilon")})
    assert (report.added, report.unchanged, report.removed, report.chunks) == (3, 0, 0, 3)
    again = Corpus(tmp_path / "corpus", "fake", embed=bag_of_words)
    assert len(again) == 3 and again.snapshot().files["/d/a.md"] == [chunk_id("alpha beta"), chunk_id("gamma delta")]
    record = again.snapshot().chunks[chunk_id("epsilon")]
    assert (record.text, record.title, record.source, record.position) == ("epsilon", "t", "/d/b.md", 1)
    hits = again.search("epsilon", 10)
    assert len(hits) == 3 and hits[0].chunk.text == "epsilon"  # k capped at the corpus size
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_reingesting_the_same_files_changes_nothing(corpus):
    corpus.ingest({"/d/a.md": chunks("alpha", "beta")})
    generation = corpus.snapshots.current()
    report = corpus.ingest({"/d/a.md": chunks("alpha", "beta")})
    assert (report.added, report.unchanged, report.removed) == (0, 2, 0)
    assert corpus.snapshots.current() == generation


def test_a_changed_file_replaces_its_chunks(corpus, tmp_path):
    corpus.ingest({"/d/a.md": chunks("alpha", "shared"), "/d/b.md": chunks("shared", "beta")})
    report = corpus.ingest({"/d/a.md": chunks("alpha two")})
    assert (report.added, report.unchanged, report.removed) == (1, 0, 1)
    texts = {c.text: c for c in Corpus(tmp_path / "corpus", "fake", embed=bag_of_words).chunks()}
    assert set(texts) == {"alpha two", "shared", "beta"}
    assert texts["shared"].source == "/d/b.md"  # still held by the other file
    assert corpus.search("alpha two", 1)[0].chunk.text == "alpha two"
    assert len(corpus.snapshot().index) == 3


def test_a_directory_ingested_again_drops_its_deleted_files(corpus, tmp_path):
    docs = tmp_path / "docs"
    a, b, outside = str(docs / "a.md"), str(docs / "b.md"), str(tmp_path / "other.md")
    corpus.ingest({a: chunks("alpha"), b: chunks("beta"), outside: chunks("gamma")})
    report = corpus.ingest({a: chunks("alpha")}, scopes=[docs])
    assert report.removed == 1 and set(corpus.snapshot().files) == {a, outside}


def test_forgetting_a_file_drops_its_chunks_but_not_the_ones_another_file_holds(corpus, tmp_path):
    corpus.ingest({"/d/a.md": chunks("alpha", "shared"), "/d/b.md": chunks("shared", "beta"),
                   "/e/c.md": chunks("gamma")})
    assert corpus.documents() == {"/d/a.md": 2, "/d/b.md": 2, "/e/c.md": 1}
    report = corpus.forget(["/d/a.md"])
    assert (report.files, report.removed, report.chunks, report.corpus_files) == (("/d/a.md",), 1, 3, 2)
    again = Corpus(tmp_path / "corpus", "fake", embed=bag_of_words)  # persisted
    kept = {c.text: c for c in again.chunks()}
    assert set(kept) == {"shared", "beta", "gamma"}
    assert (kept["shared"].source, kept["shared"].position) == ("/d/b.md", 0)  # now held by b
    assert len(again.snapshot().index) == 3
    assert {h.chunk.text for h in again.search("alpha", 3)} == {"shared", "beta", "gamma"}


def test_forgetting_a_directory_or_a_file_name(corpus, tmp_path):
    docs = tmp_path / "docs"
    a, b, outside = str(docs / "a.md"), str(docs / "sub" / "b.md"), str(tmp_path / "other.md")
    corpus.ingest({a: chunks("alpha"), b: chunks("beta"), outside: chunks("gamma")})
    assert corpus.forget([docs]).files == (a, b)  # the directory need not exist any more
    assert corpus.forget(["other.md"]).files == (outside,)
    assert len(corpus) == 0 and corpus.documents() == {}
    with pytest.raises(CorpusError, match="run `cachecraft ingest PATH` first"):
        corpus.search("alpha", 1)


def test_forgetting_what_was_not_ingested_changes_nothing(corpus):
    corpus.ingest({"/d/a.md": chunks("alpha"), "/e/a.md": chunks("beta")})
    generation = corpus.snapshots.current()
    with pytest.raises(CorpusError, match="nothing was ingested from /d/missing.md"):
        corpus.forget(["/d/a.md", "/d/missing.md"])
    with pytest.raises(CorpusError, match="'a.md' names 2 ingested files; give the path"):
        corpus.forget(["a.md"])
    with pytest.raises(CorpusError, match="no path given"):
        corpus.forget([])
    assert corpus.snapshots.current() == generation and len(corpus) == 2


def test_embedder_mismatch_is_refused(corpus, tmp_path):
    corpus.ingest({"/d/a.md": chunks("alpha")})
    other = Corpus(tmp_path / "corpus", "another-model", embed=bag_of_words)
    with pytest.raises(CorpusError, match="embedded with 'fake', not 'another-model'"):
        other.search("alpha", 1)
    with pytest.raises(CorpusError, match="CACHECRAFT_EMBEDDER"):
        other.ingest({"/d/b.md": chunks("beta")})


def test_empty_corpus_and_bad_questions(corpus):
    with pytest.raises(CorpusError, match="run `cachecraft ingest PATH` first"):
        corpus.search("anything", 3)
    corpus.ingest({"/d/a.md": chunks("alpha")})
    with pytest.raises(CorpusError, match="question is empty"):
        corpus.search("  ", 3)
    with pytest.raises(CorpusError, match="top_k must be at least 1"):
        corpus.search("alpha", 0)
    corpus.erase()
    assert len(corpus) == 0 and not list(corpus.directory.glob("gen-*"))


def test_document_order_keeps_each_files_chunks_together_in_file_order():
    def hit(source, position, score):
        return SearchHit(CorpusChunk(f"{source}{position}", "text", "", source, position), score)

    best_first = [hit("a", 7, 0.9), hit("b", 0, 0.8), hit("a", 2, 0.7), hit("c", 5, 0.6), hit("b", 3, 0.5),
                  hit("a", 6, 0.4)]
    ordered = document_order(best_first)
    # a's three chunks where a7 ranked, by position; then b's two; then c
    assert [h.chunk.id for h in ordered] == ["a2", "a6", "a7", "b0", "b3", "c5"]
    assert [h.score for h in ordered] == [0.7, 0.4, 0.9, 0.8, 0.5, 0.6]
    assert document_order([]) == []


def test_search_in_document_order(corpus):
    corpus.ingest({"/d/a.md": chunks("alpha", "zeta", "alpha beta gamma"), "/d/b.md": chunks("alpha beta")})
    by_score = corpus.search("alpha beta gamma", 3)
    assert [(h.chunk.source, h.chunk.position) for h in by_score] == [("/d/a.md", 2), ("/d/b.md", 0),
                                                                       ("/d/a.md", 0)]
    by_file = corpus.search("alpha beta gamma", 3, order="document")
    assert [(h.chunk.source, h.chunk.position) for h in by_file] == [("/d/a.md", 0), ("/d/a.md", 2),
                                                                      ("/d/b.md", 0)]
    with pytest.raises(CorpusError, match="retrieval order must be one of"):
        corpus.search("alpha", 1, order="random")


def test_previous_chunks_are_the_chunks_right_before_in_the_same_file(corpus):
    corpus.ingest({"/d/a.md": chunks("alpha", "beta", "gamma"), "/d/b.md": chunks("delta", "alpha", "epsilon")})
    text = {c.id: c.text for c in corpus.chunks()}
    previous = {text[chunk_id]: before.text for chunk_id, before in corpus.previous_chunks().items()}
    # a's second and third; b's "alpha" is a's first chunk, so epsilon's predecessor in b has
    # no record at b's position 1 and epsilon gets none; delta starts its file
    assert previous == {"beta": "alpha", "gamma": "beta"}


def test_a_second_writer_waits_then_gives_up(tmp_path):
    first = Corpus(tmp_path / "corpus", "fake", embed=bag_of_words)
    second = Corpus(tmp_path / "corpus", "fake", embed=bag_of_words, lock_timeout_s=0.2)
    with first.snapshots.writing():
        with pytest.raises(CorpusBusyError, match="another process is writing the corpus"):
            second.ingest({"/d/a.md": chunks("alpha")})
    assert second.ingest({"/d/a.md": chunks("alpha")}).added == 1


def test_readers_always_see_a_whole_corpus(corpus, tmp_path):
    corpus.ingest({"/d/a.md": chunks("w0")})
    errors, stop = [], threading.Event()

    def read():
        reader = Corpus(tmp_path / "corpus", "fake", embed=bag_of_words)
        while not stop.is_set():
            snap = reader.snapshots.read()
            if len(snap.index) != len(snap.chunks) or set(snap.chunks) != set(snap.files["/d/a.md"]):
                errors.append(snap.generation)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for n in range(2, 12):
            corpus.ingest({"/d/a.md": chunks(*(f"w{i}" for i in range(n)))})
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert len(list(corpus.directory.glob("gen-*"))) == 1  # old generations are deleted


def test_real_embedder_ranks_the_matching_chunk_first(tmp_path):
    corpus = Corpus(tmp_path / "corpus")  # the bundled MiniLM
    corpus.ingest({"/d/a.md": chunks("The Eiffel Tower is in Paris.", "Bananas are yellow fruit.",
                                     "Mount Everest is the highest mountain.")})
    assert corpus.search("Which is the tallest mountain on Earth?", 2)[0].chunk.text.startswith("Mount Everest")
