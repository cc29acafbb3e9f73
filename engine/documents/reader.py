"""Text extraction from files a user drops on Longleaf.

Plain text and source code are streamed (a 1 GB file is never loaded whole),
PDFs are read through their text layer with pypdf and .docx files with
python-docx. Every failure is a ``DocumentError`` whose message names the file
and says what the user can do. No Qt here: the app calls this off its GUI
thread.

Both containers are compressed, so a small file can unpack to gigabytes (a zip
bomb). A .docx is refused from its zip directory's declared sizes before
anything is unpacked, and each member is then inflated once through a bounded
stream, so a member whose header lies about its size is caught after at most
one block past the lie. A PDF is refused past a page count, and every stream
that text extraction unpacks is charged against a per-stream and a per-file
limit as it is unpacked.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import errno
import hashlib
import io
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import DocumentError, DocumentTooLong
from engine.format import human_bytes


def _suffixes(words: str) -> frozenset[str]:
    return frozenset(words.split())


TEXT_SUFFIXES = _suffixes(
    ".txt .text .md .markdown .rst .org .adoc .tex .csv .tsv .log .json .jsonl .yaml .yml"
    " .toml .ini .cfg .conf .xml .html .htm .css .scss .svg .srt .vtt"
)
SOURCE_SUFFIXES = _suffixes(
    ".py .pyi .ipynb .js .mjs .cjs .ts .tsx .jsx .vue .svelte .c .h .cc .cpp .cxx .hpp .hh"
    " .m .mm .swift .kt .kts .java .scala .go .rs .rb .php .pl .pm .lua .r .jl .dart .cs"
    " .fs .hs .ml .mli .ex .exs .erl .clj .el .lisp .scm .zig .nim .sql .sh .bash .zsh"
    " .fish .ps1 .bat .cmake .mk .gradle .proto .graphql .tf .dockerfile .patch .diff"
)
PDF_SUFFIXES = frozenset({".pdf"})
DOCX_SUFFIXES = frozenset({".docx"})
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | SOURCE_SUFFIXES | PDF_SUFFIXES | DOCX_SUFFIXES
# Files named by convention rather than suffix.
TEXT_NAMES = frozenset({"readme", "license", "makefile", "dockerfile", "changelog", "notice"})

# PDF and .docx parsers hold the whole file in memory; cap what they are given.
MAX_CONTAINER_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_CHARS = 8 * 1024 * 1024
READ_BLOCK = 1 << 20
# Above this share of replaced bytes a file is not text in any useful sense.
MAX_REPLACED_SHARE = 0.02
# python-docx unpacks every member of a .docx into memory (images too).
MAX_DOCX_UNPACKED_BYTES = 512 * 1024 * 1024
# Word's XML compresses 5-30 times; repeated bytes compress ~1000 times. Tiny
# members may legitimately beat the ratio, so it applies from this size on.
MAX_COMPRESSION_RATIO = 100
RATIO_FROM_BYTES = 1024 * 1024
INFLATE_BLOCK = 1 << 20
# pypdf caches every stream it unpacks for as long as the reader lives.
MAX_PDF_PAGES = 5_000
MAX_PDF_STREAM_BYTES = 16 * 1024 * 1024
MAX_PDF_UNPACKED_BYTES = 256 * 1024 * 1024
# Nested form XObjects deeper than this are not followed by the budget.
MAX_FORM_DEPTH = 16


@dataclass(frozen=True)
class Document:
    """Text extracted from one file.

    Attributes:
        path: the file as given.
        name: its file name.
        size_bytes: its size on disk.
        kind: "text", "pdf" or "docx".
        text: the extracted text.
        sha256: hex digest of the file's bytes.
        notes: things the user should know (e.g. replaced bytes), possibly empty.
    """

    path: str
    name: str
    size_bytes: int
    kind: str
    text: str
    sha256: str
    notes: tuple[str, ...] = ()


def is_supported(path: str | os.PathLike[str]) -> bool:
    """Whether the file's suffix (or conventional name) is one Longleaf reads."""
    p = Path(path)
    return p.suffix.lower() in SUPPORTED_SUFFIXES or p.name.lower() in TEXT_NAMES


def read_document(path: str | os.PathLike[str], *, max_chars: int = DEFAULT_MAX_CHARS) -> Document:
    """Extract the text of a file.

    Args:
        path: the file to read.
        max_chars: refuse files whose text is longer than this (the caller
            derives it from the model's context).

    Returns:
        The extracted ``Document``.

    Raises:
        DocumentError: the file cannot be read as text; the message says why.
    """
    p = Path(path)
    name = p.name
    if not is_supported(p):
        suffix = p.suffix or "(no suffix)"
        raise DocumentError(
            f"“{name}”: Longleaf can't read {suffix} files. It reads plain text, Markdown, "
            "source code, PDF (with a text layer) and Word .docx files."
        )
    size = _stat_size(p)
    if size == 0:
        raise DocumentError(f"“{name}” is empty — there is no text to add.")
    suffix = p.suffix.lower()
    if suffix in PDF_SUFFIXES or suffix in DOCX_SUFFIXES:
        if size > MAX_CONTAINER_BYTES:
            raise DocumentError(
                f"“{name}” is {human_bytes(size)}; Longleaf reads PDF and Word files up to "
                f"{human_bytes(MAX_CONTAINER_BYTES)}. Split it or export its text to a .txt file."
            )
        data = _read_all(p, size)
        digest = hashlib.sha256(data).hexdigest()
        if suffix in PDF_SUFFIXES:
            text = _pdf_text(name, data)
            kind = "pdf"
        else:
            text = _docx_text(name, data)
            kind = "docx"
        _check_length(name, len(text), max_chars, complete=True)
        return Document(str(path), name, size, kind, text, digest)
    text, digest, notes = _stream_text(p, size, max_chars)
    if not text.strip():
        raise DocumentError(f"“{name}” contains only white space — there is no text to add.")
    return Document(str(path), name, size, "text", text, digest, notes)


def _stat_size(p: Path) -> int:
    try:
        st = p.stat()
    except OSError as exc:
        raise _os_error(p.name, exc) from exc
    if p.is_dir():
        raise DocumentError(f"“{p.name}” is a folder; drop the files inside it instead.")
    return st.st_size


def _os_error(name: str, exc: OSError) -> DocumentError:
    if exc.errno == errno.ELOOP:
        return DocumentError(
            f"“{name}” is a symbolic link that points back to itself (a link loop); "
            "drop the real file instead."
        )
    if isinstance(exc, FileNotFoundError):
        return DocumentError(
            f"“{name}” is gone — it was moved or deleted before it could be read."
        )
    if isinstance(exc, PermissionError):
        return DocumentError(f"Longleaf isn't allowed to read “{name}”; check its permissions.")
    return DocumentError(f"“{name}” could not be read: {exc.strerror or exc}.")


def _read_all(p: Path, size: int) -> bytes:
    try:
        with p.open("rb") as handle:
            # Sized from stat: read(n) allocates n bytes up front.
            data = handle.read(min(size, MAX_CONTAINER_BYTES) + 1)
    except OSError as exc:
        raise _os_error(p.name, exc) from exc
    if len(data) != size and not p.exists():
        raise _vanished(p.name)
    return data


def _vanished(name: str) -> DocumentError:
    return DocumentError(
        f"“{name}” changed or disappeared while it was being read; "
        "wait until it is written completely and drop it again."
    )


def _check_length(name: str, chars: int, max_chars: int, *, complete: bool) -> None:
    if chars <= max_chars:
        return
    amount = f"{chars:,}" if complete else f"more than {max_chars:,}"
    raise DocumentTooLong(
        f"“{name}” has {amount} characters of text, more than the {max_chars:,} "
        "that fit in this model's context. Attach a part of it, or use a model with a "
        "longer context.",
        chars if complete else None, max_chars,
    )


def _stream_text(p: Path, size: int, max_chars: int) -> tuple[str, str, tuple[str, ...]]:
    name = p.name
    digest = hashlib.sha256()
    parts: list[str] = []
    chars = 0
    replaced = 0
    total = 0
    try:
        with p.open("rb") as handle:
            head = handle.read(READ_BLOCK)
            encoding, skip = _sniff_encoding(name, head)
            decoder = codecs.getincrementaldecoder(encoding)(errors="replace")
            block = head
            first = True
            while block:
                digest.update(block)
                total += len(block)
                text = decoder.decode(block[skip:] if first else block)
                first = False
                replaced += _count_replaced(text, block, encoding)
                parts.append(text)
                chars += len(text)
                _check_length(name, chars, max_chars, complete=False)
                # NULs past the sniffed head: binary data appended to text.
                if encoding == "utf-8" and "\x00" in text:
                    raise _binary(name)
                block = handle.read(READ_BLOCK)
            tail = decoder.decode(b"", final=True)
    except OSError as exc:
        raise _os_error(name, exc) from exc
    if total != size:  # truncated, grown or deleted while we read it
        raise _vanished(name)
    replaced += tail.count("\ufffd")
    parts.append(tail)
    text = "".join(parts)
    notes: tuple[str, ...] = ()
    if replaced:
        label = encoding.upper().removesuffix("-LE").removesuffix("-BE")
        if replaced > max(16, MAX_REPLACED_SHARE * total):
            raise DocumentError(
                f"“{name}” isn't readable text: {replaced:,} of its {total:,} bytes are not "
                f"valid {label}. Save it as UTF-8 text and try again."
            )
        notes = (
            f"{replaced:,} byte{'s' if replaced != 1 else ''} of “{name}” were not valid "
            f"{label} and were replaced with �.",
        )
    return text, digest.hexdigest(), notes


def _sniff_encoding(name: str, head: bytes) -> tuple[str, int]:
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8", len(codecs.BOM_UTF8)
    # UTF-32's little-endian mark begins with UTF-16's, so it is looked for first.
    if head.startswith(codecs.BOM_UTF32_LE):
        return "utf-32-le", len(codecs.BOM_UTF32_LE)
    if head.startswith(codecs.BOM_UTF32_BE):
        return "utf-32-be", len(codecs.BOM_UTF32_BE)
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16", 0
    if b"\x00" in head:
        raise _binary(name)
    return "utf-8", 0


def _binary(name: str) -> DocumentError:
    return DocumentError(
        f"“{name}” looks like a binary file, not text (it contains NUL bytes). "
        "Drop a text, Markdown, source, PDF or .docx file instead."
    )


def _count_replaced(text: str, block: bytes, encoding: str) -> int:
    found = text.count("\ufffd")
    if not found:
        return 0
    # A genuine U+FFFD in the file is not a decoding error.
    genuine = block.count("\ufffd".encode("utf-16-le" if encoding == "utf-16" else encoding))
    return max(0, found - genuine)


def _pdf_text(name: str, data: bytes) -> str:
    import pypdf
    from pypdf.errors import LimitReachedError, PdfReadError

    try:
        with _pdf_limits():
            reader = pypdf.PdfReader(io.BytesIO(data))
            if reader.is_encrypted and not _pdf_unlock(reader):
                raise DocumentError(
                    f"“{name}” is an encrypted PDF that needs a password. Save an unprotected "
                    "copy (e.g. Print → Save as PDF) and drop that."
                )
            count = len(reader.pages)
            if count > MAX_PDF_PAGES:
                raise DocumentError(
                    f"“{name}” has {count:,} pages; Longleaf reads PDFs of up to "
                    f"{MAX_PDF_PAGES:,} pages. Split it and attach a part."
                )
            budget = _UnpackBudget(name, count)
            pages = []
            for number, page in enumerate(reader.pages, start=1):
                budget.charge(page, number)
                pages.append(page.extract_text() or "")
    except DocumentError:
        raise
    except LimitReachedError as exc:
        raise _pdf_limit_error(name, exc) from exc
    except (PdfReadError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise DocumentError(
            f"“{name}” is a damaged PDF that can't be read ({type(exc).__name__}). "
            "Re-export it and try again."
        ) from exc
    except Exception as exc:  # pypdf raises many internal types on broken input
        raise DocumentError(
            f"“{name}” could not be read as a PDF ({type(exc).__name__}: {exc})."
        ) from exc
    text = "\n\n".join(t.strip() for t in pages if t.strip())
    if not text:
        raise DocumentError(
            f"“{name}” has no text layer (it is probably scanned images, {len(pages)} "
            f"page{'s' if len(pages) != 1 else ''}). Run OCR on it first, e.g. Preview "
            "or ocrmypdf, then drop the result."
        )
    return text


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

    def charge(self, page: Any, number: int) -> None:
        for stream in _text_streams(page, MAX_FORM_DEPTH):
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


def _text_streams(holder: Any, depth: int) -> Iterator[Any]:
    """The streams ``extract_text`` unpacks for a page or form XObject."""
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
        if isinstance(form, StreamObject) and form.get("/Subtype") == "/Form":
            yield form
            yield from _text_streams(form, depth - 1)


def _resolved(holder: Any, key: str) -> Any:
    value = holder.get(key) if isinstance(holder, dict) else None
    return value.get_object() if value is not None else None


def _pdf_unlock(reader: object) -> bool:
    try:
        return bool(reader.decrypt(""))  # type: ignore[attr-defined]
    except Exception:  # missing AES provider or a real password: both mean locked
        return False


def _docx_text(name: str, data: bytes) -> str:
    import docx

    _check_docx_members(name, data)
    try:
        document = docx.Document(io.BytesIO(data))
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise _damaged_docx(name) from exc
    except Exception as exc:  # lxml and python-docx raise their own types on bad XML
        raise DocumentError(
            f"“{name}” could not be read as a Word document ({type(exc).__name__})."
        ) from exc
    lines = [para.text for para in document.paragraphs]
    for table in document.tables:
        for row in table.rows:
            lines.append("\t".join(cell.text for cell in row.cells))
    text = "\n".join(lines).strip()
    if not text:
        raise DocumentError(f"“{name}” has no text in it.")
    return text


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


