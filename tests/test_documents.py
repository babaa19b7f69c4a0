"""Reading the formats users have: text, Markdown, HTML, PDF and docx; bad files skipped."""

from __future__ import annotations

import os

import pytest

from cachecraft.retrieval.documents import DocumentError, open_document, read_document, scan_files


def write_pdf(path, title, pages):
    canvas = pytest.importorskip("reportlab.pdfgen.canvas")
    pdf = canvas.Canvas(str(path))
    pdf.setTitle(title)
    for lines in pages:
        y = 760
        for line in lines:
            pdf.drawString(72, y, line)
            y -= 16
        pdf.showPage()
    pdf.save()


def write_docx(path, title, paragraphs):
    docx = pytest.importorskip("docx")
    doc = docx.Document()
    doc.add_heading(title, level=1)
    for text in paragraphs:
        doc.add_paragraph(text)
    doc.save(str(path))


def test_html_text_and_title(tmp_path):
    path = tmp_path / "page.html"
    path.write_text("<html><head><title>Kestrel manual</title><style>p {color: red}</style>"
                    "<script>var x = 1;</script></head><body><h1>Setup</h1><p>Turn the\n   dial.</p>"
                    "<ul><li>one</li><li>two</li></ul></body></html>", encoding="utf-8")
    doc = read_document(path)
    assert doc.title == "Kestrel manual"
    assert "Turn the dial." in doc.text and "one" in doc.text and "two" in doc.text
    assert "color" not in doc.text and "var x" not in doc.text
    assert "Setup\n\nTurn the dial." in doc.text  # block elements are paragraphs


def test_pdf_pages_and_title(tmp_path):
    path = tmp_path / "manual.pdf"
    write_pdf(path, "The PDF manual", [["First page line."], ["Second page line."]])
    doc = read_document(path)
    assert doc.title == "The PDF manual"
    assert "First page line." in doc.text and "Second page line." in doc.text


def test_docx_paragraphs_and_heading_title(tmp_path):
    path = tmp_path / "notes.docx"
    write_docx(path, "Release notes", ["Version two adds streaming.", "Version three adds PDF."])
    doc = read_document(path)
    assert doc.title == "Release notes"
    assert "Version two adds streaming.\n\nVersion three adds PDF." in doc.text


def test_text_is_read_in_blocks(tmp_path):
    path = tmp_path / "big.md"
    path.write_text("# Big\n\n" + "word " * 50_000, encoding="utf-8")
    stream = open_document(path, block_bytes=4096)
    assert stream.title == "Big"
    blocks = list(stream.blocks)
    assert len(blocks) > 10 and max(len(b) for b in blocks) <= 4096
    assert "".join(blocks) == path.read_text(encoding="utf-8")


def test_a_bad_byte_late_in_a_big_file_is_a_document_error(tmp_path):
    path = tmp_path / "late.txt"
    path.write_bytes(b"ok " * 10_000 + "caf\xe9".encode("latin-1"))
    with pytest.raises(DocumentError, match="not UTF-8 text"):
        list(open_document(path, block_bytes=1024).blocks)


def test_scan_reports_every_skipped_entry_with_its_reason(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "good.md").write_text("good", encoding="utf-8")
    (root / "page.html").write_text("<p>html</p>", encoding="utf-8")
    (root / "photo.png").write_bytes(b"\x89PNG")
    (root / "gone.md").symlink_to(root / "missing.md")
    os.mkfifo(root / "pipe.txt")
    (root / ".hidden.md").write_text("secret")
    files, skipped = scan_files([root])
    assert [p.name for p in files] == ["good.md", "page.html"]
    reasons = {s.path.name: s.reason for s in skipped}
    assert set(reasons) == {"photo.png", "gone.md", "pipe.txt"}
    assert "unsupported file type '.png'" in reasons["photo.png"]
    assert "broken symbolic link" in reasons["gone.md"]
    assert "not a regular file" in reasons["pipe.txt"]


@pytest.mark.parametrize("name,content,needle", [
    ("broken.pdf", b"%PDF-1.4 not really", "cannot read"),
    ("broken.docx", b"PK not a zip", "cannot read"),
])
def test_damaged_files_are_document_errors(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DocumentError, match=needle):
        read_document(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file anyway")
def test_an_unreadable_file_is_a_document_error(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("x")
    path.chmod(0)
    with pytest.raises(DocumentError, match="cannot read"):
        read_document(path)
