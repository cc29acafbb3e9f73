"""Files that used to come out wrong or be refused for the wrong reason."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

from engine.documents.limits import READ_BLOCK
from engine.documents.reader import read_document
from engine.errors import DocumentError
from tests.engine.documents.pdf_files import assemble_pdf


@pytest.mark.parametrize("bom, codec", [(codecs.BOM_UTF32_LE, "utf-32-le"),
                                        (codecs.BOM_UTF32_BE, "utf-32-be")])
def test_utf32_with_a_bom_is_decoded_in_both_byte_orders(tmp_path: Path, bom: bytes,
                                                         codec: str) -> None:
    # Long enough to cross a read block, so a code unit split between blocks is covered.
    text = "héllo wörld 🌲 " * (READ_BLOCK // 40 + 3) + "end"
    path = tmp_path / "wide.txt"
    path.write_bytes(bom + text.encode(codec))
    doc = read_document(path)
    assert doc.text == text
    assert "\x00" not in doc.text


def test_utf32_with_bad_code_units_names_utf32(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(codecs.BOM_UTF32_LE + b"\xff\xff\xff\xff" * 100)
    with pytest.raises(DocumentError, match="UTF-32"):
        read_document(path)


def _nested_pages_pdf(depth: int) -> bytes:
    """One page at the bottom of ``depth`` /Pages nodes, each the only kid of the last."""
    content = b"BT /F1 12 Tf 72 720 Td (Hello deep) Tj ET"
    page = depth + 2
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    for level in range(depth):
        number = 2 + level
        parent = f"/Parent {number - 1} 0 R " if level else ""
        objects.append(f"<< /Type /Pages {parent}/Kids [{number + 1} 0 R] /Count 1 >>".encode())
    objects.append(
        f"<< /Type /Page /Parent {page - 1} 0 R /MediaBox [0 0 612 792] /Contents {page + 1} "
        "0 R /Resources << /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica "
        ">> >> >> >>".encode())
    objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    return assemble_pdf(objects)


def test_a_shallow_page_tree_is_read(tmp_path: Path) -> None:
    path = tmp_path / "shallow.pdf"
    path.write_bytes(_nested_pages_pdf(3))
    assert read_document(path).text == "Hello deep"


def test_a_deeply_nested_page_tree_is_refused_for_its_nesting(tmp_path: Path) -> None:
    path = tmp_path / "deep.pdf"
    path.write_bytes(_nested_pages_pdf(2000))
    with pytest.raises(DocumentError) as refused:
        read_document(path)
    message = str(refused.value)
    assert "nested" in message and "page tree depth" in message
    assert "compressed stream" not in message
