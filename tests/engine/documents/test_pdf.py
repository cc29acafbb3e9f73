"""What engine.documents.pdf says of PDFs that are empty, not PDFs, cut short, partly
scanned or typeset (ligatures, hyphens), each built by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.documents.reader import read_document
from engine.errors import DocumentError
from tests.engine.documents.pdf_files import assemble_pdf


def _refused(path: Path) -> str:
    with pytest.raises(DocumentError) as error:
        read_document(path)
    return str(error.value)


def test_a_pdf_with_no_pages_is_said_to_have_none(tmp_path: Path) -> None:
    path = tmp_path / "zero.pdf"
    path.write_bytes(assemble_pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                                   b"<< /Type /Pages /Kids [] /Count 0 >>"]))
    assert _refused(path) == (
        "“zero.pdf” is a PDF with no pages — there is no text to add. If it should have "
        "pages, export it again from the program that made it.")
