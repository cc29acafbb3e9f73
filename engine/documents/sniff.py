"""What a file's first bytes say it is, whatever its name says.

A download interrupted, or answered with a sign-in or error page, is often saved
under the name the user expected; the bytes tell what arrived.
"""

from __future__ import annotations

PDF_MAGIC = b"%PDF-"
ZIP_MAGIC = b"PK\x03\x04"
# Readers (Acrobat, pypdf) find a PDF's header anywhere in its first kilobyte:
# some tools write a few bytes before it.
PDF_HEADER_WITHIN = 1024
# What a file is said to look like, by how it starts (after white space and a
# UTF-8 byte-order mark, compared in lower case); the first match counts, so RTF
# comes before JSON, which also starts with "{".
_STARTS = (
    (b"<!doctype html", "a web page (HTML)"),
    (b"<html", "a web page (HTML)"),
    (b"<?xml", "an XML file"),
    (b"{\\rtf", "an RTF document"),
    (b"{", "JSON data"),
    (ZIP_MAGIC.lower(), "a zip archive"),
    (b"\x89png", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"gif8", "a GIF image"),
)


def has_pdf_header(data: bytes) -> bool:
    """Whether ``data`` holds a PDF header where PDF readers look for one."""
    return PDF_MAGIC in data[:PDF_HEADER_WITHIN]


def looks_like(head: bytes) -> str | None:
    """What ``head``, a file's first bytes, looks like ("a web page (HTML)"), or None."""
    start = head[:64].removeprefix(b"\xef\xbb\xbf").lstrip().lower()
    return next((kind for magic, kind in _STARTS if start.startswith(magic)), None)
