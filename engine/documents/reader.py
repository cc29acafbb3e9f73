"""Text extraction from files a user drops on Longleaf.

Plain text and source code are streamed (a 1 GB file is never loaded whole),
PDFs are read through their text layer with pypdf and .docx files with
python-docx. Every failure is a ``DocumentError`` whose message names the file
and says what the user can do. No Qt here: the app calls this off its GUI
thread.

The formats live beside this module: ``text`` (streamed plain text and its
encodings), ``pdf`` (with ``typography``, a PDF's typesetting undone), ``docx``
(with ``wordml``, the text of its XML), ``limits`` (the caps that keep a zip
bomb or a huge file from exhausting memory) and ``sniff`` (what a file's first
bytes say it is); this module picks one by the file's first bytes, else by its
suffix.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.documents.docx import docx_text, is_word_zip
from engine.documents.file_access import (
    opened,
    read_all,
    read_head,
    stat_size,
    stop_if_cancelled,
)
from engine.documents.limits import DEFAULT_MAX_CHARS, MAX_CONTAINER_BYTES, check_length
from engine.documents.pdf import pdf_text
from engine.documents.sniff import PDF_MAGIC, ZIP_MAGIC
from engine.documents.text import stream_text
from engine.errors import DocumentError
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
# What each kind of document is called, where its name says another.
KIND_NAMES = {"text": "a text file", "pdf": "a PDF", "docx": "a Word document"}
# Files named by convention rather than suffix.
TEXT_NAMES = frozenset({"readme", "license", "makefile", "dockerfile", "changelog", "notice"})



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


def file_patterns() -> tuple[str, ...]:
    """Glob patterns of every file :func:`read_document` reads, for a file dialog's filter.

    One ``*.suffix`` per supported suffix and the conventional names in the
    spellings they are usually given (``readme``, ``README``, ``Readme``); a
    dialog may match case-sensitively, while the reader ignores case.
    """
    suffixes = sorted(f"*{suffix}" for suffix in SUPPORTED_SUFFIXES)
    names = sorted({spelling for name in TEXT_NAMES
                    for spelling in (name, name.upper(), name.capitalize())})
    return (*suffixes, *names)


def is_supported(path: str | os.PathLike[str]) -> bool:
    """Whether the file's suffix (or conventional name) is one Longleaf reads."""
    p = Path(path)
    return p.suffix.lower() in SUPPORTED_SUFFIXES or p.name.lower() in TEXT_NAMES


def read_document(path: str | os.PathLike[str], *, max_chars: int = DEFAULT_MAX_CHARS,
                  cancel: threading.Event | None = None) -> Document:
    """Extract the text of a file.

    Args:
        path: the file to read.
        max_chars: refuse files whose text is longer than this (the caller
            derives it from the model's context).
        cancel: set from another thread to stop the read: checked before it
            starts, between a PDF's pages and after it ends.

    Returns:
        The extracted ``Document``.

    Raises:
        DocumentError: the file cannot be read as text; the message says why.
        Cancelled: ``cancel`` was set.
    """
    p = Path(path)
    name = p.name
    stop_if_cancelled(name, cancel)  # removed while it waited behind another file
    size = stat_size(p)  # first: a folder is said as one, whatever its name
    if not is_supported(p):
        suffix = p.suffix or "(no suffix)"
        raise DocumentError(
            f"“{name}”: Longleaf can't read {suffix} files. It reads plain text, Markdown, "
            "source code, PDF (with a text layer) and Word .docx files."
        )
    if size == 0:
        raise DocumentError(f"“{name}” is empty — there is no text to add.")
    named = _kind_by_name(p)
    with opened(p) as handle:
        kind = _kind_by_content(handle, name, size) or named
        if kind == "text":
            text, digest, notes = _read_text(handle, name, size, max_chars)
        else:
            text, digest, notes = _read_container(handle, name, size, kind, max_chars, cancel)
    stop_if_cancelled(name, cancel)  # what comes next (counting its tokens) is for no one
    if kind != named:
        notes = (f"“{name}” is {KIND_NAMES[kind]}, not {KIND_NAMES[named]} as its name "
                 "says; it was read as one.", *notes)
    return Document(str(path), name, size, kind, text, digest, notes)


def _read_text(handle: BinaryIO, name: str, size: int,
               max_chars: int) -> tuple[str, str, tuple[str, ...]]:
    """The text, its SHA-256 and notes on how it was decoded."""
    text, digest, notes = stream_text(handle, name, size, max_chars)
    if not text.strip():
        raise DocumentError(f"“{name}” contains only white space — there is no text to add.")
    return text, digest, notes


def _read_container(handle: BinaryIO, name: str, size: int, kind: str, max_chars: int,
                    cancel: threading.Event | None) -> tuple[str, str, tuple[str, ...]]:
    """A PDF's or Word document's text, its SHA-256 and notes, read whole (within
    ``MAX_CONTAINER_BYTES``)."""
    if size > MAX_CONTAINER_BYTES:
        raise DocumentError(
            f"“{name}” is {human_bytes(size)}; Longleaf reads PDF and Word files up to "
            f"{human_bytes(MAX_CONTAINER_BYTES)}. Split it or export its text to a .txt file."
        )
    data = read_all(handle, name, size)
    if kind == "pdf":
        text, notes = pdf_text(name, data, max_chars, cancel)
    else:
        text, notes = docx_text(name, data), ()
    check_length(name, len(text), max_chars, complete=True)
    return text, hashlib.sha256(data).hexdigest(), notes


def _kind_by_name(p: Path) -> str:
    suffix = p.suffix.lower()
    if suffix in PDF_SUFFIXES:
        return "pdf"
    return "docx" if suffix in DOCX_SUFFIXES else "text"


def _kind_by_content(handle: BinaryIO, name: str, size: int) -> str | None:
    """The kind the file's bytes say it is ("pdf" or "docx"), whatever its name: a PDF
    or a Word document saved or renamed as .txt is read as what it is. None when
    they say neither."""
    head = read_head(handle, name, len(PDF_MAGIC))
    if head.startswith(PDF_MAGIC):
        return "pdf"
    if head.startswith(ZIP_MAGIC) and size <= MAX_CONTAINER_BYTES and is_word_zip(handle):
        return "docx"
    return None
