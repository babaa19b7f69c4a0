"""Chunking in generator tokens, and reading documents."""

from __future__ import annotations

import random

import pytest

from cachecraft.prompt import PromptBuilder
from cachecraft.retrieval.chunking import Chunker, split_text
from cachecraft.retrieval.documents import DocumentError, find_files, read_documents, title_of
from tests.conftest import tiny_tokenizer


def _encoders():
    from transformers import AutoTokenizer

    from cachecraft.retrieval.embed import resolve_embedder

    word = tiny_tokenizer()
    wordpiece = AutoTokenizer.from_pretrained(resolve_embedder("minilm"))  # a real subword tokenizer
    return {name: (lambda tok: lambda text: tok(text, add_special_tokens=False)["input_ids"])(tok)
            for name, tok in (("word", word), ("wordpiece", wordpiece))}


ENCODERS = _encoders()


def _document(seed: int) -> str:
    rng = random.Random(seed)
    words = ["w1", "w22.", "w3", "w45!", "w5,", "w6?", "w7", "w8;"]
    paragraphs = []
    for _ in range(25):
        n = rng.choice([3, 15, 60, 200])
        lines = [" ".join(rng.choice(words) for _ in range(n)) for _ in range(rng.choice([1, 1, 3]))]
        paragraphs.append("\n".join(lines))
    paragraphs.insert(7, "w" + "9" * 400)  # one "word" longer than any chunk
    return "\n\n  \n".join(paragraphs)


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("limit", [16, 40, 128])
def test_chunks_never_exceed_the_limit_and_cover_the_text(encoder, limit):
    encode = ENCODERS[encoder]
    text = _document(limit)
    chunks = split_text(text, "w10 w11", encode, limit)
    assert [c.position for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        assert len(encode(PromptBuilder.chunk_text(c.text, c.title))) <= limit
        assert len(encode(c.prompt_text)) <= limit and c.title == "w10 w11"
    assert "".join("".join(c.text.split()) for c in chunks) == "".join(text.split())


def test_paragraphs_stay_whole_when_they_fit():
    encode = ENCODERS["word"]
    paragraphs = [" ".join(f"w{i}" for i in range(start, start + n)) for start, n in
                  [(10, 5), (20, 12), (40, 3), (50, 20), (80, 7), (100, 9)]]
    chunks = split_text("\n\n".join(paragraphs), "w1", encode, 32)
    assert len(chunks) > 1
    for c in chunks:
        parts = c.text.split("\n\n")
        assert all(part in paragraphs for part in parts)  # cut only between paragraphs
    assert [p for c in chunks for p in c.text.split("\n\n")] == paragraphs


def test_a_long_paragraph_is_cut_at_sentences_before_words():
    encode = ENCODERS["word"]
    sentences = [" ".join(f"w{i}" for i in range(start, start + 9)) + "." for start in range(10, 200, 10)]
    chunks = split_text(" ".join(sentences), "w1", encode, 24)
    for c in chunks:
        assert c.text.endswith(".")  # every cut falls after a sentence


def test_overlap_repeats_the_tail_of_the_previous_chunk():
    encode = ENCODERS["word"]
    sentences = [f"w{i} w{i + 1} w{i + 2}." for i in range(10, 130, 3)]
    plain = split_text(" ".join(sentences), "w1", encode, 24)
    overlapping = split_text(" ".join(sentences), "w1", encode, 24, overlap=6)
    assert len(overlapping) > len(plain)
    for before, after in zip(overlapping, overlapping[1:]):
        assert after.text.split(". ")[0] + "." in before.text  # the next chunk starts with repeated text
        assert len(encode(after.prompt_text)) <= 24


def test_a_long_title_is_shortened_to_leave_room():
    chunker = Chunker(ENCODERS["word"], 16)
    chunks = chunker.split("w1 w2 w3 w4 w5 w6 w7 w8", " ".join(f"w{i}" for i in range(50)))
    assert chunks and all(len(c.title.split()) <= 4 for c in chunks)
    assert len(split_text("   \n\n  ", "w1", ENCODERS["word"], 16)) == 0


def test_documents_from_files_and_directories(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.md").write_text("intro\n\n# The Title #\n\nbody", encoding="utf-8")
    (root / "sub" / "a.txt").write_text("\ufeffplain text", encoding="utf-8")
    (root / "sub" / "c.markdown").write_text("no heading", encoding="utf-8")
    (root / "skip.png").write_bytes(b"\x89PNG")
    (root / ".hidden.md").write_text("secret")
    (root / ".git" / "x.md").write_text("secret")
    docs = read_documents([root, root / "b.md"])
    assert [d.path.relative_to(root).as_posix() for d in docs] == ["b.md", "sub/a.txt", "sub/c.markdown"]
    assert [d.title for d in docs] == ["The Title", "a", "c"]
    assert docs[1].text == "plain text"
    assert title_of("# Heading\n", root / "x.txt") == "x"  # plain text has no Markdown headings


@pytest.mark.parametrize("case,needle", [("missing", "no such file or directory"),
                                         ("png", "unsupported file type '.png'"),
                                         ("latin1", "is not UTF-8 text"),
                                         ("empty_dir", "no .txt/.md/.markdown/.html/.htm/.pdf/.docx files found")])
def test_document_errors_are_clear(tmp_path, case, needle):
    paths = {"missing": tmp_path / "nope.md", "png": tmp_path / "a.png", "latin1": tmp_path / "l.txt",
             "empty_dir": tmp_path / "empty"}
    (tmp_path / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "l.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.png").write_bytes(b"x")
    with pytest.raises(DocumentError, match=needle):
        read_documents([paths[case]])
    with pytest.raises(DocumentError, match="no .txt"):
        find_files([])


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("block", [7, 100, 5000])
def test_chunking_a_stream_of_blocks_matches_chunking_the_whole_text(encoder, block):
    text = _document(3)
    chunker = Chunker(ENCODERS[encoder], 40, overlap=8)
    blocks = [text[i:i + block] for i in range(0, len(text), block)]
    assert list(chunker.split_stream(blocks, "a title", whole_below=0)) == chunker.split(text, "a title")


def test_a_stream_without_paragraph_breaks_is_still_cut_and_covered():
    chunker = Chunker(ENCODERS["word"], 24)
    text = " ".join(f"w{i % 300}" for i in range(5000))  # one long paragraph
    blocks = [text[i:i + 500] for i in range(0, len(text), 500)]
    chunks = list(chunker.split_stream(blocks, "t", whole_below=0, max_buffer=2000))
    assert all(chunker.size(c.text, c.title) <= 24 for c in chunks)
    assert " ".join(c.text for c in chunks).split() == text.split()
    assert [c.position for c in chunks] == list(range(len(chunks)))


def test_a_small_stream_is_chunked_as_a_whole():
    chunker = Chunker(ENCODERS["word"], 24)
    assert list(chunker.split_stream(["w1 w2\n\n", "w3"], "t")) == chunker.split("w1 w2\n\nw3", "t")
