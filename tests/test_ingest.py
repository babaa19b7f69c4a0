"""Ingesting paths: every readable file in, every skipped one reported, big files streamed."""

from __future__ import annotations

import os

import pytest

from cachecraft.retrieval import chunking, ingest as ingest_module
from cachecraft.retrieval.chunking import Chunker
from cachecraft.retrieval.corpus import Corpus
from cachecraft.retrieval.documents import DocumentError
from cachecraft.retrieval.ingest import ingest_paths
from tests.conftest import tiny_tokenizer
from tests.test_corpus import bag_of_words

TOKENIZER = tiny_tokenizer()


def words(start: int, n: int) -> str:
    return " ".join(f"w{i % 300}" for i in range(start, start + n))


@pytest.fixture
def corpus(tmp_path):
    return Corpus(tmp_path / "corpus", "fake", embed=bag_of_words)


def encode(text):
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def test_good_files_go_in_and_bad_ones_are_reported(corpus, tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.md").write_text(f"# w5\n\n{words(10, 12)}\n", encoding="utf-8")
    (root / "b.html").write_text(f"<title>w7</title><p>{words(40, 9)}</p>", encoding="utf-8")
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "gone.md").symlink_to(root / "nowhere.md")
    os.mkfifo(root / "pipe.md")
    outcome = ingest_paths(corpus, Chunker(encode, 24), [root])
    assert outcome.report.files == 2 and outcome.report.corpus_files == 2
    assert {c.title for c in corpus.chunks()} == {"w5", "w7"}
    reasons = {s.path.name: s.reason for s in outcome.skipped}
    assert set(reasons) == {"latin.txt", "gone.md", "pipe.md"}
    assert "not UTF-8" in reasons["latin.txt"]
    as_json = outcome.to_dict()
    assert as_json["files"] == 2 and {s["path"] for s in as_json["skipped"]} == {
        str(root / n) for n in ("latin.txt", "gone.md", "pipe.md")}


def test_nothing_readable_is_an_error_naming_the_reasons(corpus, tmp_path):
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.md").write_text("  \n", encoding="utf-8")
    with pytest.raises(DocumentError, match="not UTF-8.*no text|no text.*not UTF-8"):
        ingest_paths(corpus, Chunker(encode, 24), [tmp_path])
    assert not len(corpus)


def test_a_big_file_is_streamed_with_progress_per_chunk(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_module, "BLOCK_BYTES", 2048)
    monkeypatch.setattr(chunking, "WHOLE_BELOW", 4096)
    path = tmp_path / "big.txt"
    path.write_text("\n\n".join(words(i * 7, 30) for i in range(600)), encoding="utf-8")
    seen = []

    def measured(text):
        seen.append(len(text))
        return encode(text)

    calls = []
    outcome = ingest_paths(corpus, Chunker(measured, 48), [path],
                           progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert max(seen) < 8192  # never the whole file (about 100 kB) at once
    reading = [c for c in calls if c[0] == "reading"]
    assert len(reading) >= outcome.report.chunks  # one update per chunk made
    assert reading[-1][1] == reading[-1][2] == path.stat().st_size
    embedding = [c for c in calls if c[0] == "embedding"]
    assert embedding[-1][1] == embedding[-1][2] == outcome.report.added
    expected = Chunker(encode, 48).split(path.read_text(encoding="utf-8"), "big")
    assert [c.text for c in corpus.chunks()] == list(dict.fromkeys(c.text for c in expected))
