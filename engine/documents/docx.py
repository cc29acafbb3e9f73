"""Word .docx text with python-docx, after the zip is checked against bombs.

A .docx is refused from its zip directory's declared sizes before anything is
unpacked, and each member is then inflated once through a bounded stream, so a
member whose header lies about its size is caught after at most one block past
the lie.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from typing import BinaryIO

from engine.documents.limits import (
    INFLATE_BLOCK,
    MAX_COMPRESSION_RATIO,
    MAX_DOCX_UNPACKED_BYTES,
    RATIO_FROM_BYTES,
)
from engine.errors import DocumentError
from engine.format import human_bytes

# The part every Word document keeps its body in.
WORD_BODY = "word/document.xml"


def docx_text(name: str, data: bytes) -> str:
    """The text of a .docx, after its zip passed the bomb checks.

    The body's paragraphs and table rows come first, in the document's order,
    then its page headers and footers, footnotes and endnotes, each group under
    a label saying what it is.
    """
    import docx

    from engine.documents.word_lists import ListNumbers
    from engine.documents.wordml import block_lines, margin_text

    _check_docx_members(name, data)
    try:
        document = docx.Document(io.BytesIO(data))
        numbers = ListNumbers.of(document)
        body = "\n".join(block_lines(document.element.body, numbers)).strip()
        text = (body + margin_text(document, numbers)).strip()
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise _damaged_docx(name) from exc
    except Exception as exc:  # lxml and python-docx raise their own types on bad XML
        raise DocumentError(
            f"“{name}” could not be read as a Word document ({type(exc).__name__})."
        ) from exc
    if not text:
        raise DocumentError(f"“{name}” has no text in it.")
    return text


def is_word_zip(handle: BinaryIO) -> bool:
    """Whether the file open in ``handle`` is a zip holding a Word document's body
    (only its directory, at the end of the file, is read); the handle is put back
    at its start."""
    try:
        with zipfile.ZipFile(handle) as archive:
            return WORD_BODY in archive.namelist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError):
        return False  # not a readable zip: read by its name, which says what fails
    finally:
        handle.seek(0)


def _damaged_docx(name: str) -> DocumentError:
    return DocumentError(
        f"“{name}” is a damaged Word file that can't be opened. "
        "Open and re-save it in Word or Pages, then try again."
    )


def _check_docx_members(name: str, data: bytes) -> None:
    """Refuse a .docx that unpacks to too much, before python-docx unpacks it.

    After this every member is known to inflate to exactly its declared size,
    so python-docx (which inflates a member in one call, up to 2 GB) cannot be
    led past the declared total.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
        raise _damaged_docx(name) from exc
    declared = sum(member.file_size for member in members)
    if declared > MAX_DOCX_UNPACKED_BYTES:
        raise DocumentError(
            f"“{name}” is {human_bytes(len(data))} but says it unpacks to {human_bytes(declared)}; "
            f"Longleaf unpacks Word files up to {human_bytes(MAX_DOCX_UNPACKED_BYTES)}. It may be "
            "built to exhaust memory; if it is a real document, save its text as .txt and "
            "drop that."
        )
    for member in members:
        _check_ratio(name, member)
    for member in members:
        _inflate_bounded(name, data, member)


def _check_ratio(name: str, member: zipfile.ZipInfo) -> None:
    if member.file_size < RATIO_FROM_BYTES:
        return
    ratio = member.file_size / max(member.compress_size, 1)
    if ratio > MAX_COMPRESSION_RATIO:
        raise DocumentError(
            f"“{name}” looks like a zip bomb: its part {member.filename} unpacks from "
            f"{human_bytes(member.compress_size)} to {human_bytes(member.file_size)} ({ratio:,.0f} "
            f"times; Word files stay under {MAX_COMPRESSION_RATIO}). Longleaf did not open it."
        )


def _inflate_bounded(name: str, data: bytes, member: zipfile.ZipInfo) -> None:
    """Inflate one member block by block, keeping nothing, and check its size and CRC."""
    if member.flag_bits & 0x1:
        raise DocumentError(
            f"“{name}” is an encrypted Word file. Save an unprotected copy and drop that."
        )
    start = _member_start(name, data, member)
    raw = memoryview(data)[start : start + member.compress_size]
    if member.compress_type == zipfile.ZIP_STORED:
        size, crc = len(raw), zlib.crc32(raw)
    elif member.compress_type == zipfile.ZIP_DEFLATED:
        size, crc = _inflate_counting(name, raw, member)
    else:  # Word writes only stored and deflated members
        raise _damaged_docx(name)
    if size != member.file_size or crc != member.CRC:
        raise _damaged_docx(name)


def _inflate_counting(name: str, raw: memoryview, member: zipfile.ZipInfo) -> tuple[int, int]:
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    size = crc = 0
    pending: bytes | memoryview = raw
    try:
        while pending and not inflater.eof:
            block = inflater.decompress(pending, INFLATE_BLOCK)
            pending = inflater.unconsumed_tail
            size += len(block)
            if size > member.file_size:
                raise DocumentError(
                    f"“{name}” is not a genuine Word file: its part {member.filename} says "
                    f"it unpacks to {human_bytes(member.file_size)} but holds more. It may be "
                    "built to exhaust memory, so Longleaf stopped unpacking it."
                )
            crc = zlib.crc32(block, crc)
        # Input used up: at most the rest of one match (258 bytes) is left inside.
        tail = inflater.flush()
    except zlib.error as exc:
        raise _damaged_docx(name) from exc
    return size + len(tail), zlib.crc32(tail, crc)


def _member_start(name: str, data: bytes, member: zipfile.ZipInfo) -> int:
    """Offset of a member's data, found the way ``zipfile`` finds it."""
    offset = member.header_offset
    if data[offset : offset + 4] != b"PK\x03\x04" or offset + 30 > len(data):
        raise _damaged_docx(name)
    name_length, extra_length = struct.unpack_from("<HH", data, offset + 26)
    return offset + 30 + name_length + extra_length
