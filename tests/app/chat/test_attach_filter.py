"""The attach dialog offers every file the document reader reads, and only those."""

from __future__ import annotations

import fnmatch
import re

from app.chat.attachments import attach_filter
from engine.documents.reader import SUPPORTED_SUFFIXES, is_supported


def _documents_patterns(name_filter: str) -> list[str]:
    documents, everything = name_filter.split(";;")
    assert everything == "All files (*)"
    found = re.fullmatch(r"Documents \((.+)\)", documents)
    assert found, documents
    return found.group(1).split(" ")


def test_the_filter_shows_every_suffix_and_name_the_reader_reads() -> None:
    patterns = _documents_patterns(attach_filter())
    offered = [f"notes{suffix}" for suffix in sorted(SUPPORTED_SUFFIXES)]
    offered += ["README", "Makefile", "Dockerfile", "LICENSE", "CHANGELOG", "notice"]
    hidden = [n for n in offered if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    assert not hidden, f"readable files the dialog would hide: {hidden}"


def test_every_file_the_filter_shows_is_one_the_reader_reads() -> None:
    for pattern in _documents_patterns(attach_filter()):
        assert is_supported(pattern.replace("*", "notes")), pattern
