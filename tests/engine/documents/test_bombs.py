"""Compressed documents that unpack to far more than they weigh are refused cheaply.

The bombs are built in a few milliseconds: deflate output after a full flush
does not depend on what came before, so one compressed 1 MiB block repeated
N times is a valid stream that inflates to N MiB. Refusals are checked with
their numbers and with the peak of traced memory; the time each took is
printed (``pytest -s``), not asserted.
"""

from __future__ import annotations

import io
import struct
import time
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import docx
import pypdf  # noqa: F401  imported here so no import lands in the traced refusals
import pytest

from engine.documents import limits, pdf
from engine.documents.reader import read_document
from engine.errors import DocumentError
from tests.engine.documents.pdf_files import assemble_pdf

MIB = 1024 * 1024
# What a refusal may allocate; reading the bombs before the fix took 1.5 GB.
MEMORY_BOUND = 64 * MIB


def _deflated_spaces(mebibytes: int) -> bytes:
    """A raw deflate stream of ``mebibytes`` MiB of spaces, ~1 KB per MiB."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = compressor.compress(b" " * MIB) + compressor.flush(zlib.Z_FULL_FLUSH)
    return block * mebibytes + compressor.flush()


def _zip(entries: list[tuple[str, bytes, int, int]]) -> bytes:
    """A zip of deflated members given as (name, raw deflate data, declared size, CRC).

    Written by hand so a member can declare any size and CRC, true or not.
    """
    out = bytearray()
    directory = bytearray()
    for name, data, size, crc in entries:
        encoded = name.encode()
        offset = len(out)
        sizes = struct.pack("<IIIHH", crc, len(data), size, len(encoded), 0)
        out += b"PK\x03\x04" + struct.pack("<HHHHH", 20, 0, 8, 0, 0) + sizes + encoded + data
        directory += (
            b"PK\x01\x02"
            + struct.pack("<HHHHHH", 20, 20, 0, 8, 0, 0)
            + sizes
            + struct.pack("<HHHII", 0, 0, 0, 0, offset)
            + encoded
        )
    end = struct.pack("<HHHHIIH", 0, 0, len(entries), len(entries), len(directory), len(out), 0)
    return bytes(out + directory + b"PK\x05\x06" + end)


def _docx_with_document_xml(data: bytes, size: int, crc: int = 0) -> bytes:
    """A real python-docx document whose word/document.xml is replaced."""
    buffer = io.BytesIO()
    docx.Document().save(buffer)
    entries = []
    with zipfile.ZipFile(buffer) as archive:
        for member in archive.infolist():
            if member.filename == "word/document.xml":
                entries.append((member.filename, data, size, crc))
                continue
            body = archive.read(member)
            compressor = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
            raw = compressor.compress(body) + compressor.flush()
            entries.append((member.filename, raw, len(body), zlib.crc32(body)))
    return _zip(entries)


def _pdf(contents: list[bytes]) -> bytes:
    """A PDF with one page per zlib stream in ``contents``."""
    count = len(contents)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(count)).encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>"
               % (kids, count)]
    for index, content in enumerate(contents):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 << /Type /Font /Subtype /Type1 "
                       b"/BaseFont /Helvetica >> >> >> >>" % (4 + 2 * index))
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(content)
                       + content + b"\nendstream")
    return assemble_pdf(objects)


def _zlib_spaces(mebibytes: int) -> bytes:
    """A zlib stream of ``mebibytes`` MiB of spaces (its checksum is never reached)."""
    return b"\x78\xda" + _deflated_spaces(mebibytes) + b"\x00\x00\x00\x00"


def _refusal(read: Callable[[], object]) -> tuple[str, int, float]:
    """Run a read that must be refused; return its message, traced peak and seconds."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(DocumentError) as refusal:
            read()
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return str(refusal.value), peak, seconds


def _report(what: str, size: int, peak: int, seconds: float) -> None:
    print(f"\n{what}: {size / MIB:.2f} MiB file refused in {seconds * 1000:.0f} ms, "
          f"traced peak {peak / MIB:.1f} MiB")


def test_docx_zip_bomb_is_refused_from_its_declared_sizes(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.docx"
    bomb.write_bytes(_docx_with_document_xml(_deflated_spaces(1500), 1500 * MIB))

    message, peak, seconds = _refusal(lambda: read_document(bomb))

    _report("docx, 1.5 GB declared", bomb.stat().st_size, peak, seconds)
    assert message.startswith("“bomb.docx” is 1.5 MB but says it unpacks to 1.5 GB")
    assert "up to 512.0 MB" in message
    assert peak < MEMORY_BOUND


def test_docx_member_that_lies_about_its_size_is_stopped_one_block_past_the_lie(
    tmp_path: Path,
) -> None:
    liar = tmp_path / "liar.docx"
    # Declares 64 KiB; holds 1.5 GB. Before the fix python-docx inflated it all.
    liar.write_bytes(_docx_with_document_xml(_deflated_spaces(1500), 64 * 1024))

    message, peak, seconds = _refusal(lambda: read_document(liar))

    _report("docx, lying header", liar.stat().st_size, peak, seconds)
    assert message == (
        "“liar.docx” is not a genuine Word file: its part word/document.xml says it unpacks "
        "to 64.0 KB but holds more. It may be built to exhaust memory, so Longleaf stopped "
        "unpacking it."
    )
    # The file itself (1.5 MB) and a few inflate blocks, however much the member holds.
    assert peak < 8 * limits.INFLATE_BLOCK


def test_docx_member_compressed_past_the_ratio_limit_is_refused(tmp_path: Path) -> None:
    dense = tmp_path / "dense.docx"
    dense.write_bytes(_docx_with_document_xml(_deflated_spaces(300), 300 * MIB))

    message, peak, _ = _refusal(lambda: read_document(dense))

    assert message.startswith(
        "“dense.docx” looks like a zip bomb: its part word/document.xml unpacks from "
        "304.1 KB to 300.0 MB (1,010 times; Word files stay under 100). Longleaf did not open it."
    )
    assert peak < MEMORY_BOUND


def test_docx_with_a_wrong_checksum_is_damaged_not_read(tmp_path: Path) -> None:
    body = b"<w:document/>" * 10
    compressor = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    raw = compressor.compress(body) + compressor.flush()
    path = tmp_path / "flipped.docx"
    path.write_bytes(_docx_with_document_xml(raw, len(body), zlib.crc32(body) ^ 1))

    with pytest.raises(DocumentError, match="damaged Word file"):
        read_document(path)


def test_pdf_stream_bomb_is_refused_at_the_stream_limit(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.pdf"
    bomb.write_bytes(_pdf([_zlib_spaces(1024)]))

    message, peak, seconds = _refusal(lambda: read_document(bomb))

    _report("pdf, 1 GiB stream", bomb.stat().st_size, peak, seconds)
    assert message.startswith(
        "“bomb.pdf” holds a compressed stream that unpacks to more than 16.0 MB"
    )
    assert peak < MEMORY_BOUND


def test_pdf_streams_past_the_file_budget_are_refused_with_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pdf, "MAX_PDF_UNPACKED_BYTES", 3 * MIB)
    path = tmp_path / "long.pdf"
    # Each page's stream is under the per-stream limit; together they are not.
    path.write_bytes(_pdf([_zlib_spaces(1) for _ in range(10)]))

    message, _, _ = _refusal(lambda: read_document(path))

    assert message == (
        "“long.pdf” unpacks to more than 3.0 MB of page content by page 4 of 10; Longleaf "
        "reads PDFs up to that. Split it, or export its text to a .txt file."
    )


def test_pdf_with_too_many_pages_is_refused_before_reading_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pdf, "MAX_PDF_PAGES", 3)
    path = tmp_path / "book.pdf"
    path.write_bytes(_pdf([zlib.compress(b"BT ET") for _ in range(4)]))

    with pytest.raises(DocumentError) as refusal:
        read_document(path)

    assert str(refusal.value) == (
        "“book.pdf” has 4 pages; Longleaf reads PDFs of up to 3 pages. Split it and attach "
        "a part."
    )


def test_pdf_forms_that_list_each_other_are_looked_through_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A form whose resources list it (some tools give every page and form one shared
    # resource dictionary): four names for itself, walked 16 levels deep, was 4^16
    # walks, and the read never ended.
    content = b"BT /F1 12 Tf 72 712 Td (Hello world) Tj ET /X0 Do"
    form = b"BT /F1 12 Tf (inner) Tj ET"
    names = b" ".join(b"/X%d 5 0 R" % i for i in range(4))
    path = tmp_path / "forms.pdf"
    path.write_bytes(assemble_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 6 0 R >> /XObject << /X0 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
        b"<< /Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font "
        b"<< /F1 6 0 R >> /XObject << " + names + b" >> >> /Length %d >>\nstream\n"
        % len(form) + form + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]))
    walk = pdf._text_streams
    walks = 0

    def counted(*args: object) -> object:
        nonlocal walks
        walks += 1
        assert walks < 100, "the forms are walked again and again"
        return walk(*args)

    monkeypatch.setattr(pdf, "_text_streams", counted)
    document = read_document(path)
    assert "Hello world" in document.text
