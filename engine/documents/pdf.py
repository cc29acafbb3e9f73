"""PDF text through its text layer with pypdf, refused past a page count and an unpack budget.

Each page's text has its typesetting undone (``typography``: ligatures, soft
hyphens, words broken across lines); the values filled into its form fields and
its comments follow, labelled (``pdf_fields``).

Every stream that text extraction unpacks is charged against a per-stream and
a per-file limit as it is unpacked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import threading
import unicodedata
from collections.abc import Iterator
from typing import Any

from engine.documents.file_access import stop_if_cancelled
from engine.documents.limits import (
    MAX_FORM_DEPTH,
    MAX_PDF_PAGES,
    MAX_PDF_STREAM_BYTES,
    MAX_PDF_UNPACKED_BYTES,
    check_length,
)
from engine.documents.pdf_fields import marked_text
from engine.documents.sniff import has_pdf_header, looks_like
from engine.documents.typography import untypeset
from engine.errors import DocumentError, EngineError
from engine.format import human_bytes

# A complete PDF ends with this marker (after it, at most a line end or a few bytes
# some tools add); a copy cut short has none in its last kilobyte.
EOF_MARKER = b"%%EOF"
EOF_WITHIN = 1024
# Past this share of a page's visible characters being control or private-use
# characters, its text is a font's raw codes, not letters (``_undecodable``).
MAX_CODES_SHARE = 0.2


def pdf_text(name: str, data: bytes, max_chars: int | None = None,
             cancel: threading.Event | None = None) -> tuple[str, tuple[str, ...]]:
    """The text layer of a PDF, page by page, within the unpack limits, then its form
    fields' values and comments, and notes for the user (pages without text).

    Raises:
        DocumentTooLong: past ``max_chars`` characters, at the page that passes them
            (the rest of a 2,000-page PDF is not read only to be refused).
        Cancelled: ``cancel`` was set; checked before each page.
    """
    import pypdf
    from pypdf.errors import LimitReachedError

    if not has_pdf_header(data):
        raise _not_a_pdf(name, data)
    try:
        with _pdf_limits():
            reader = pypdf.PdfReader(io.BytesIO(data))
            _check_opened(name, reader)
            pages = _page_texts(name, reader, max_chars, cancel)
            marked, marked_notes = marked_text(name, reader)
    except EngineError:  # a refusal or a cancel, already said
        raise
    except LimitReachedError as exc:
        raise _pdf_limit_error(name, exc) from exc
    except Exception as exc:  # pypdf raises many internal types on broken input
        raise _unreadable(name, data, exc) from exc
    text, notes = _joined(name, pages, marked)
    return text, notes + marked_notes


def _check_opened(name: str, reader: Any) -> None:
    """Refuse a PDF that is locked, empty or too long before any page is read."""
    if reader.is_encrypted and not _pdf_unlock(reader):
        raise DocumentError(
            f"“{name}” is an encrypted PDF that needs a password. Save an unprotected "
            "copy (e.g. Print → Save as PDF) and drop that."
        )
    count = len(reader.pages)
    if count == 0:
        raise DocumentError(
            f"“{name}” is a PDF with no pages — there is no text to add. If it "
            "should have pages, export it again from the program that made it."
        )
    if count > MAX_PDF_PAGES:
        raise DocumentError(
            f"“{name}” has {count:,} pages; Longleaf reads PDFs of up to "
            f"{MAX_PDF_PAGES:,} pages. Split it and attach a part."
        )


def _page_texts(name: str, reader: Any, max_chars: int | None,
                cancel: threading.Event | None) -> list[str | None]:
    """Each page's text: "" for a page without any, None for one whose text can't be
    decoded; charged to the unpack budget."""
    count = len(reader.pages)
    budget = _UnpackBudget(name, count)
    pages: list[str | None] = []
    read = 0
    for number, page in enumerate(reader.pages, start=1):
        stop_if_cancelled(name, cancel)
        budget.charge(page, number)
        text = untypeset(page.extract_text() or "").strip()
        pages.append(None if _undecodable(text) else text)
        if pages[-1]:  # the joined text's length so far, separators included
            read += len(text) + (2 if read else 0)
        if max_chars is not None and number < count:
            check_length(name, read, max_chars, complete=False)
    return pages


def _undecodable(text: str) -> bool:
    """Whether a page's text is a font's raw codes rather than letters.

    A font without a character map (a subset CID font without ToUnicode) gives its
    glyph numbers as characters, and a subset numbers its glyphs from 1, so many
    come out as control characters; a font mapped into the private-use area gives
    characters no one can read. Real text has almost none of either.
    """
    shown = [char for char in text if not char.isspace()]
    codes = sum(unicodedata.category(char) in ("Cc", "Co") for char in shown)
    return codes > MAX_CODES_SHARE * len(shown)


def _joined(name: str, pages: list[str | None],
            marked: str) -> tuple[str, tuple[str, ...]]:
    """The pages' text followed by ``marked`` (form fields and comments), and notes on
    pages without text (scanned, most likely) and those whose text can't be decoded
    (left out)."""
    drawn = "\n\n".join(t for t in pages if t)
    text = (drawn + marked).strip()
    undecodable = pages.count(None)
    if not text and undecodable:
        raise DocumentError(
            f"“{name}” has text that can't be decoded: its fonts give no character map, "
            "so what they draw can't be read as letters. Run OCR on it first, e.g. "
            "ocrmypdf --force-ocr, then drop the result."
        )
    if not text:
        raise DocumentError(
            f"“{name}” has no text layer (it is probably scanned images, {len(pages)} "
            f"page{'s' if len(pages) != 1 else ''}). Run OCR on it first, e.g. Preview "
            "or ocrmypdf, then drop the result."
        )
    notes = []
    blank = pages.count("")
    if blank and not drawn:  # a form's pages may draw nothing but its fields
        notes.append(f"“{name}”: its pages have no text of their own, so only what was "
                     "filled into its form fields or written in comments was read. If its "
                     "pages are scanned images, run OCR on it first, e.g. Preview or "
                     "ocrmypdf, to read them too.")
    elif blank:
        notes.append(f"“{name}”: no text on {blank:,} of its {len(pages):,} pages (scanned "
                     "images?), so only the rest was read. Run OCR on it first, e.g. Preview "
                     "or ocrmypdf, to read those too.")
    if undecodable:
        notes.append(f"“{name}”: the text on {undecodable:,} of its {len(pages):,} pages "
                     "can't be decoded (its fonts give no character map) and was left out. "
                     "Run OCR on it first, e.g. ocrmypdf --force-ocr, to read those too.")
    return text, tuple(notes)


def _not_a_pdf(name: str, data: bytes) -> DocumentError:
    kind = looks_like(data)
    if kind is None:
        return DocumentError(
            f"“{name}” isn't a PDF: it does not start as one. Download it again, or "
            "export it to PDF again from the program that made it."
        )
    return DocumentError(
        f"“{name}” isn't a PDF: it looks like {kind}. If it came from a download, the site "
        "may have sent an error or sign-in page instead; download it again."
    )


def _unreadable(name: str, data: bytes, exc: Exception) -> DocumentError:
    """The refusal for a PDF pypdf failed on: cut short, damaged, or beyond it."""
    from pypdf.errors import PdfReadError

    if EOF_MARKER not in data[-EOF_WITHIN:]:
        return DocumentError(
            f"“{name}” ends early: it is cut off, as by an interrupted download or copy. "
            "Download or copy it again, then drop the whole file."
        )
    if isinstance(exc, (PdfReadError, ValueError, KeyError, TypeError, AttributeError,
                        IndexError)):
        return DocumentError(
            f"“{name}” is a damaged PDF that can't be read ({type(exc).__name__}). "
            "Re-export it and try again."
        )
    return DocumentError(f"“{name}” could not be read as a PDF ({type(exc).__name__}: {exc}).")


def _pdf_limit_error(name: str, exc: Exception) -> DocumentError:
    """The refusal for one of pypdf's safety limits, naming the limit that was hit.

    pypdf has one exception type for all its limits; only its message tells an
    unpacked stream that grew too large from a structure nested or looped past
    its bounds (a page tree, outlines, form fields).
    """
    detail = str(exc).strip()
    if "decompress" in detail.lower():
        return DocumentError(
            f"“{name}” holds a compressed stream that unpacks to more than "
            f"{human_bytes(MAX_PDF_STREAM_BYTES)}, more than any page's text needs; it may be "
            "built to exhaust memory, so Longleaf did not read it. Export the text you "
            "need to a .txt file and drop that."
        )
    if "page tree" in detail.lower():
        return DocumentError(
            f"“{name}” has its pages nested inside each other deeper than any ordinary PDF "
            f"({detail.rstrip('.')}); it may be built to exhaust the reader, so Longleaf "
            "did not read it. Print it to a new PDF (Print → Save as PDF) and drop that."
        )
    return DocumentError(
        f"“{name}” goes past a safety limit of the PDF reader ({detail.rstrip('.')}), so "
        "Longleaf did not read it. Print it to a new PDF (Print → Save as PDF) and drop that."
    )


def _pdf_limits() -> contextlib.AbstractContextManager[Any]:
    """pypdf's per-stream output limits, lowered to ``MAX_PDF_STREAM_BYTES``.

    The configuration is a context variable, so other threads keep theirs. pypdf
    before 7 has no configuration object and keeps its own 75 MB limits; the
    per-file budget still applies there.
    """
    import pypdf

    apply = getattr(pypdf, "apply_configuration", None)
    if apply is None:
        return contextlib.nullcontext()
    known = {field.name for field in dataclasses.fields(pypdf.Configuration)}
    wanted = (
        "zlib_maximum_output_length",
        "lzw_maximum_output_length",
        "run_length_maximum_output_length",
        "brotli_maximum_output_length",
        "jbig2_maximum_output_length",
        "array_based_stream_maximum_output_length",
    )
    return apply(**{key: MAX_PDF_STREAM_BYTES for key in wanted if key in known})


class _UnpackBudget:
    """Counts the bytes of every stream text extraction unpacks, once each.

    A page's content streams, its form XObjects (nested) and its fonts' ToUnicode
    maps are unpacked here, before ``extract_text`` reads them from pypdf's
    cache, so the file is refused at most one stream past the limit.
    """

    def __init__(self, name: str, pages: int) -> None:
        self.name = name
        self.pages = pages
        self.unpacked = 0
        self._seen: set[int] = set()
        self._walked: set[int] = set()  # forms whose resources were looked through

    def charge(self, page: Any, number: int) -> None:
        for stream in _text_streams(page, MAX_FORM_DEPTH, self._walked):
            if id(stream) in self._seen:
                continue
            self._seen.add(id(stream))
            self.unpacked += len(stream.get_data())
            if self.unpacked > MAX_PDF_UNPACKED_BYTES:
                raise DocumentError(
                    f"“{self.name}” unpacks to more than {human_bytes(MAX_PDF_UNPACKED_BYTES)} of "
                    f"page content by page {number:,} of {self.pages:,}; Longleaf reads PDFs "
                    f"up to that. Split it, or export its text to a .txt file."
                )


def _text_streams(holder: Any, depth: int, walked: set[int]) -> Iterator[Any]:
    """The streams ``extract_text`` unpacks for a page or form XObject, each form
    looked through once (``walked``): forms that list each other, or themselves, in
    their resources would otherwise be walked again at every level."""
    from pypdf.generic import StreamObject

    contents = _resolved(holder, "/Contents")
    if isinstance(contents, StreamObject):
        yield contents
    elif isinstance(contents, list):
        yield from (s for part in contents if isinstance(s := part.get_object(), StreamObject))
    resources = _resolved(holder, "/Resources")
    if not isinstance(resources, dict):
        return
    fonts = _resolved(resources, "/Font")
    for font in fonts.values() if isinstance(fonts, dict) else ():
        cmap = _resolved(font.get_object(), "/ToUnicode")
        if isinstance(cmap, StreamObject):
            yield cmap
    forms = _resolved(resources, "/XObject")
    for entry in forms.values() if isinstance(forms, dict) and depth > 0 else ():
        form = entry.get_object()
        if (isinstance(form, StreamObject) and form.get("/Subtype") == "/Form"
                and id(form) not in walked):
            walked.add(id(form))
            yield form
            yield from _text_streams(form, depth - 1, walked)


def _resolved(holder: Any, key: str) -> Any:
    value = holder.get(key) if isinstance(holder, dict) else None
    return value.get_object() if value is not None else None


def _pdf_unlock(reader: object) -> bool:
    try:
        return bool(reader.decrypt(""))  # type: ignore[attr-defined]
    except Exception:  # missing AES provider or a real password: both mean locked
        return False

