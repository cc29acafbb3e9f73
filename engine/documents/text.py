"""Plain text and source code, streamed block by block (a 1 GB file is never loaded whole).

The encoding is sniffed from a byte-order mark (UTF-8, UTF-16, UTF-32), else
UTF-8, or Windows-1252 (Western, a superset of Latin-1: older Windows and Excel
exports) when the first block is not UTF-8; bytes that do not decode are
replaced and counted, and a file with too many of them, or with NUL bytes, is
refused as not text.
"""

from __future__ import annotations

import codecs
import hashlib
import threading
from typing import BinaryIO

from engine.documents.file_access import os_error, vanished
from engine.documents.limits import MAX_REPLACED_SHARE, READ_BLOCK, check_length
from engine.errors import DocumentError

# What a file without a byte-order mark whose first block is not UTF-8 is read as:
# the Western Windows code page, a superset of Latin-1 (most such files are older
# Windows or Excel exports).
LEGACY = "cp1252"
ENCODING_NAMES = {LEGACY: "Windows-1252 (Western)"}
# The latest a NUL may come in UTF-16 text: within its first few words, a space,
# a newline or a digit (Latin text has one every other byte).
UTF16_FIRST_NUL = 512

# Bytes the decoder replaced on this thread (``_replace_counted``): the decoder
# says exactly which, where a count of U+FFFD in the text would also count those
# the file holds as text.
_replaced = threading.local()


def _replace_counted(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):
        raise error
    _replaced.bytes = getattr(_replaced, "bytes", 0) + error.end - error.start
    return "\ufffd", error.end


codecs.register_error("longleaf.replace-counted", _replace_counted)


def stream_text(handle: BinaryIO, name: str, size: int,
                max_chars: int) -> tuple[str, str, tuple[str, ...]]:
    """The text of the file open in ``handle`` (at its start), its SHA-256 and notes on
    replaced bytes, read block by block."""
    digest = hashlib.sha256()
    parts: list[str] = []
    chars = 0
    total = 0
    _replaced.bytes = 0
    try:
        head = handle.read(READ_BLOCK)
        encoding, skip = _sniff_encoding(name, head)
        decoder = codecs.getincrementaldecoder(encoding)(
            errors="longleaf.replace-counted")
        block = head
        first = True
        while block:
            digest.update(block)
            total += len(block)
            text = decoder.decode(block[skip:] if first else block)
            first = False
            parts.append(text)
            chars += len(text)
            check_length(name, chars, max_chars, complete=False)
            # NULs past the sniffed head: binary data appended to text.
            if encoding == "utf-8" and "\x00" in text:
                raise _binary(name)
            block = handle.read(READ_BLOCK)
        tail = decoder.decode(b"", final=True)
    except OSError as exc:
        raise os_error(name, exc) from exc
    if total != size:  # truncated, grown or deleted while we read it
        raise vanished(name)
    replaced = _replaced.bytes
    parts.append(tail)
    text = "".join(parts)
    notes: tuple[str, ...] = ()
    label = ENCODING_NAMES.get(encoding, encoding.upper().removesuffix("-LE").removesuffix("-BE"))
    if replaced:
        if replaced > max(16, MAX_REPLACED_SHARE * total):
            raise DocumentError(
                f"“{name}” isn't readable text: {replaced:,} of its {total:,} bytes are not "
                f"valid {label}. Save it as UTF-8 text and try again."
            )
        bytes_, were = ("byte", "was") if replaced == 1 else ("bytes", "were")
        notes = (f"{replaced:,} {bytes_} of “{name}” {were} not valid {label} and {were} "
                 "replaced with �.",)
    if encoding == LEGACY:
        notes = (f"“{name}” is not UTF-8: it was read as {label} text.", *notes)
    elif skip == 0 and encoding.startswith("utf-16"):
        # No byte-order mark said so: the bytes' pattern did, so the user can check.
        order = "little" if encoding.endswith("le") else "big"
        notes = (f"“{name}” has no byte-order mark: it was read as UTF-16 ({order}-endian) "
                 "text.", *notes)
    return text, digest.hexdigest(), notes


def _sniff_encoding(name: str, head: bytes) -> tuple[str, int]:
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8", len(codecs.BOM_UTF8)
    # UTF-32's little-endian mark begins with UTF-16's, so it is looked for first.
    if head.startswith(codecs.BOM_UTF32_LE):
        return "utf-32-le", len(codecs.BOM_UTF32_LE)
    if head.startswith(codecs.BOM_UTF32_BE):
        return "utf-32-be", len(codecs.BOM_UTF32_BE)
    if head.startswith(codecs.BOM_UTF16_LE):
        return "utf-16-le", len(codecs.BOM_UTF16_LE)
    if head.startswith(codecs.BOM_UTF16_BE):
        return "utf-16-be", len(codecs.BOM_UTF16_BE)
    if b"\x00" in head:
        encoding = _unmarked_utf16(head)
        if encoding is None:
            raise _binary(name)
        return encoding, 0
    return ("utf-8" if _utf8(head) else LEGACY), 0


def _utf8(head: bytes) -> bool:
    """Whether ``head`` (a file's first block) is UTF-8 up to a character the block
    may cut at its end."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start >= len(head) - 3 and error.reason == "unexpected end of data"
    return True


def _unmarked_utf16(head: bytes) -> str | None:
    """The UTF-16 codec ``head`` reads as, when it is UTF-16 text rather than binary
    data; None otherwise. Its NULs (the high bytes of Latin letters, spaces and
    newlines) come from its start and on one side of every pair only (which side
    says the byte order), and the characters it then decodes to are almost all
    printable (CJK or Cyrillic text has few NULs; binary data has them on both
    sides, decodes to control codes, or follows text that has none)."""
    even, odd = head[0::2].count(0), head[1::2].count(0)
    if min(even, odd) > max(even, odd) // 50 or head.find(0) > UTF16_FIRST_NUL:
        return None
    encoding = "utf-16-be" if even > odd else "utf-16-le"
    text = head[:len(head) // 2 * 2].decode(encoding, "replace")
    shown = sum(char.isprintable() or char in "\t\n\r" for char in text)
    return encoding if shown >= 0.95 * len(text) > 0 else None


def _binary(name: str) -> DocumentError:
    return DocumentError(
        f"“{name}” looks like a binary file, not text (it contains NUL bytes). "
        "Drop a text, Markdown, source, PDF or .docx file instead."
    )


