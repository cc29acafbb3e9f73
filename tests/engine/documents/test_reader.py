"""Text extraction and the messages a user sees for files Longleaf can't read."""

from __future__ import annotations

import hashlib
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest

from engine.documents.reader import (
    SUPPORTED_SUFFIXES,
    TEXT_NAMES,
    file_patterns,
    is_supported,
    read_document,
)
from engine.errors import DocumentError, DocumentTooLong
from tests.engine.documents.pdf_files import assemble_pdf


def _pdf_with_text(lines: list[str]) -> bytes:
    """A minimal one-page PDF whose content stream draws ``lines`` in Helvetica."""
    ops = ["BT", "/F1 12 Tf", "72 720 Td", "14 TL"]
    for line in lines:
        ops.append(f"({line}) Tj T*")
    ops.append("ET")
    content = zlib.compress("\n".join(ops).encode("latin-1"))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(content)
        + content
        + b"\nendstream",
    ]
    return assemble_pdf(objects)


def test_plain_text_and_source_are_read_with_their_hash(tmp_path: Path) -> None:
    text = "# Notes\n\nLongleaf keeps a paged KV cache — ünïcödé and emoji 🌲.\n"
    md = tmp_path / "notes.md"
    md.write_text(text, encoding="utf-8")
    doc = read_document(md)
    assert doc.text == text
    assert doc.kind == "text"
    assert doc.size_bytes == len(text.encode())
    assert doc.sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert doc.notes == ()

    src = tmp_path / "main.rs"
    src.write_text("fn main() { println!(\"hi\"); }\n")
    assert "println" in read_document(src).text
    assert is_supported(tmp_path / "Makefile")


def test_file_patterns_name_exactly_what_the_reader_reads() -> None:
    patterns = file_patterns()
    suffixes = {p.removeprefix("*") for p in patterns if p.startswith("*.")}
    names = {p for p in patterns if not p.startswith("*")}
    assert suffixes == SUPPORTED_SUFFIXES
    assert {name.lower() for name in names} == TEXT_NAMES
    assert {"README", "Makefile", "LICENSE"} <= names
    assert all(is_supported(p.replace("*", "notes")) for p in patterns)
    assert len(patterns) == len(set(patterns))


def test_utf8_bom_and_utf16_are_decoded(tmp_path: Path) -> None:
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello")
    assert read_document(bom).text == "hello"
    wide = tmp_path / "wide.txt"
    wide.write_bytes("héllo wörld".encode("utf-16"))
    assert read_document(wide).text == "héllo wörld"


def test_text_that_is_not_utf8_is_read_as_windows_1252(tmp_path: Path) -> None:
    path = tmp_path / "latin.txt"
    path.write_bytes(b"caf\xe9 au lait, " * 3 + b"plain ascii " * 200)
    doc = read_document(path)
    assert doc.text.startswith("café au lait, café") and "\ufffd" not in doc.text
    assert doc.notes == ("“latin.txt” is not UTF-8: it was read as Windows-1252 (Western) "
                         "text.",)


def test_mostly_undecodable_text_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "random.txt"
    path.write_bytes(bytes(range(128, 256)) * 40)
    with pytest.raises(DocumentError, match=r"isn't readable text: .* not valid Windows-1252"):
        read_document(path)


def test_binary_empty_and_blank_files_are_refused(tmp_path: Path) -> None:
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"\x7fELF\x00\x00\x01" + os.urandom(64))
    with pytest.raises(DocumentError, match="looks like a binary file"):
        read_document(binary)
    empty = tmp_path / "empty.md"
    empty.write_bytes(b"")
    with pytest.raises(DocumentError, match=r"“empty.md” is empty"):
        read_document(empty)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\t")
    with pytest.raises(DocumentError, match="only white space"):
        read_document(blank)


def test_unknown_suffix_names_what_is_supported(tmp_path: Path) -> None:
    path = tmp_path / "photo.heic"
    path.write_bytes(b"whatever")
    with pytest.raises(DocumentError, match=r"can't read \.heic files.*PDF"):
        read_document(path)


def test_symlink_loop_and_missing_file(tmp_path: Path) -> None:
    loop = tmp_path / "loop.txt"
    loop.symlink_to(tmp_path / "loop.txt")
    with pytest.raises(DocumentError, match="link loop"):
        read_document(loop)
    with pytest.raises(DocumentError, match="is gone"):
        read_document(tmp_path / "missing.txt")


def test_file_that_vanishes_while_being_read(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "vanishing.txt"
    path.write_text("x" * 5000)
    real_open = Path.open

    def open_then_shrink(self: Path, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        if self == path and "r" in args[0]:
            os.truncate(self, 10)  # shortened by another program...
            os.unlink(self)  # ...and then deleted
        return handle

    monkeypatch.setattr(Path, "open", open_then_shrink)
    with pytest.raises(DocumentError, match="disappeared while it was being read"):
        read_document(path)


def test_huge_text_file_is_refused_after_streaming_only_the_start(tmp_path: Path) -> None:
    path = tmp_path / "huge.txt"
    with path.open("wb") as handle:
        handle.write(b"word " * 800_000)  # 4 MB of text, then NULs to 1 GB
        handle.truncate(1 << 30)  # a 1 GB file, sparse on disk
    with pytest.raises(DocumentError, match=r"more than 3,000,000 characters") as info:
        read_document(path, max_chars=3_000_000)
    assert "fit in this model's context" in str(info.value)
    # The caller can tell a file too long from one that can't be read, and by how much.
    assert isinstance(info.value, DocumentTooLong)
    assert (info.value.chars, info.value.max_chars) == (None, 3_000_000)


def test_pdf_text_layer_is_extracted(tmp_path: Path) -> None:
    path = tmp_path / "paper.pdf"
    path.write_bytes(_pdf_with_text(["Paged attention", "keeps memory flat"]))
    doc = read_document(path)
    assert doc.kind == "pdf"
    assert "Paged attention" in doc.text and "keeps memory flat" in doc.text


def test_scanned_pdf_without_text_layer(tmp_path: Path) -> None:
    import pypdf

    writer = pypdf.PdfWriter()
    writer.add_blank_page(612, 792)
    writer.add_blank_page(612, 792)
    path = tmp_path / "scan.pdf"
    with path.open("wb") as handle:
        writer.write(handle)
    with pytest.raises(DocumentError, match=r"no text layer .*2 pages.*OCR"):
        read_document(path)


def test_encrypted_pdf_asks_for_an_unprotected_copy(tmp_path: Path) -> None:
    import pypdf

    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(_write(tmp_path / "a.pdf",
                                                                _pdf_with_text(["secret"]))))
    writer.encrypt(user_password="hunter2", algorithm="RC4-128")
    path = tmp_path / "locked.pdf"
    with path.open("wb") as handle:
        writer.write(handle)
    with pytest.raises(DocumentError, match="encrypted PDF that needs a password"):
        read_document(path)


def test_corrupt_pdf(tmp_path: Path) -> None:
    path = tmp_path / "broken.pdf"
    path.write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 9 0 R >> garbage")
    with pytest.raises(DocumentError, match=r"“broken.pdf”"):
        read_document(path)


def _paragraph_and_table(paragraph: str, cells: tuple[str, str]) -> Any:
    """A Word document: ``paragraph``, then a table of one row of ``cells``."""
    import docx

    document = docx.Document()
    document.add_paragraph(paragraph)
    table = document.add_table(rows=1, cols=2)
    for cell, text in zip(table.rows[0].cells, cells, strict=True):
        cell.text = text
    return document


def test_docx_paragraphs_and_tables(tmp_path: Path) -> None:
    document = _paragraph_and_table("Quarterly plan", ("q6", "388 bytes"))
    path = tmp_path / "plan.docx"
    document.save(str(path))
    doc = read_document(path)
    assert doc.kind == "docx"
    assert doc.text == "Quarterly plan\nq6\t388 bytes"


def test_docx_reads_in_order_with_content_controls(tmp_path: Path) -> None:
    from docx.oxml import parse_xml
    from docx.oxml.ns import nsdecls

    document = _paragraph_and_table("Intro.", ("A1", "B1"))
    document.add_paragraph("After the table.")
    # A form's field: its text lives in a content control (w:sdt) in the body.
    document.element.body.insert(0, parse_xml(
        f"<w:sdt {nsdecls('w')}><w:sdtContent><w:p><w:r><w:t>The contract terms."
        "</w:t></w:r></w:p></w:sdtContent></w:sdt>"))
    path = tmp_path / "form.docx"
    document.save(str(path))
    assert read_document(path).text == (
        "The contract terms.\nIntro.\nA1\tB1\nAfter the table.")


def test_corrupt_docx(tmp_path: Path) -> None:
    path = tmp_path / "broken.docx"
    path.write_bytes(b"PK\x03\x04 this is not really a zip archive")
    with pytest.raises(DocumentError, match="damaged Word file"):
        read_document(path)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_binary_data_after_a_text_start_is_refused(tmp_path: Path) -> None:
    past_head = tmp_path / "mixed.log"
    past_head.write_bytes(b"started\n" * 200_000 + b"\x00\x01\x02\x03" * 256)  # NULs after 1.6 MB
    with pytest.raises(DocumentError, match="looks like a binary file"):
        read_document(past_head)


def test_file_truncated_but_not_deleted_while_being_read(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "rewritten.txt"
    path.write_text("row\n" * 500_000)
    real_open = Path.open

    def open_then_truncate(self: Path, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        if self == path:
            os.truncate(self, 1000)
        return handle

    monkeypatch.setattr(Path, "open", open_then_truncate)
    with pytest.raises(DocumentError, match="changed or disappeared while it was being read"):
        read_document(path)


@pytest.mark.parametrize("grows", [False, True])
def test_a_pdf_rewritten_while_being_read_is_said_to_have_changed_not_to_be_damaged(
        tmp_path: Path, monkeypatch, grows: bool) -> None:
    path = _write(tmp_path / "report.pdf", _pdf_with_text(["Quarterly figures"] * 50))
    real_open = Path.open

    def open_then_rewrite(self: Path, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        if self == path:  # another program saves it again, in place
            if grows:
                with real_open(self, "ab") as appended:
                    appended.write(b"% more\n" * 100)
            else:
                os.truncate(self, 200)
        return handle

    monkeypatch.setattr(Path, "open", open_then_rewrite)
    with pytest.raises(DocumentError, match="changed or disappeared while it was being read"):
        read_document(path)


def test_a_pdf_too_long_is_refused_at_the_page_that_passes_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    import pypdf

    page = pypdf.PdfReader(io.BytesIO(_pdf_with_text(["Quarterly figures " * 4] * 20))).pages[0]
    writer = pypdf.PdfWriter()
    for _ in range(40):
        writer.add_page(page)
    path = tmp_path / "long.pdf"
    with path.open("wb") as handle:
        writer.write(handle)
    whole = read_document(path).text
    read: list[int] = []
    extract = pypdf.PageObject.extract_text

    def counted(self: pypdf.PageObject, *args: object, **kwargs: object) -> str:
        read.append(1)
        return extract(self, *args, **kwargs)

    monkeypatch.setattr(pypdf.PageObject, "extract_text", counted)
    with pytest.raises(DocumentTooLong, match="more than 5,000 characters") as refused:
        read_document(path, max_chars=5_000)
    assert refused.value.chars is None and len(read) < 40 // 2
    # One character short of the whole text is refused only once every page is in,
    # with the exact count; the whole text fits exactly.
    read.clear()
    with pytest.raises(DocumentTooLong) as exact:
        read_document(path, max_chars=len(whole) - 1)
    assert exact.value.chars == len(whole) and len(read) == 40
    assert read_document(path, max_chars=len(whole)).text == whole


@pytest.mark.parametrize("name", ["report.txt", "report.md", "README"])
def test_a_pdf_under_a_text_name_is_read_as_a_pdf_and_said(tmp_path: Path, name: str) -> None:
    path = _write(tmp_path / name, _pdf_with_text(["Quarterly figures"]))
    doc = read_document(path)
    assert (doc.kind, doc.text) == ("pdf", "Quarterly figures")
    assert doc.notes == (
        f"“{name}” is a PDF, not a text file as its name says; it was read as one.",)


def test_a_word_document_under_another_name_is_read_as_one_and_said(tmp_path: Path) -> None:
    document = _paragraph_and_table("Quarterly plan", ("q6", "388 bytes"))
    for name, named in (("plan.txt", "a text file"), ("plan.pdf", "a PDF")):
        path = tmp_path / name
        document.save(str(path))
        doc = read_document(path)
        assert (doc.kind, doc.text) == ("docx", "Quarterly plan\nq6\t388 bytes")
        assert doc.notes == (
            f"“{name}” is a Word document, not {named} as its name says; it was read as one.",)
    # A zip that holds no Word document is what its name says: a .txt one binary data.
    with zipfile.ZipFile(tmp_path / "photos.txt", "w") as archive:
        archive.writestr("photo.jpg", b"\xff\xd8\xff" + bytes(100))
    with pytest.raises(DocumentError, match="looks like a binary file"):
        read_document(tmp_path / "photos.txt")
