"""The limits a dropped document is held to, so a small file cannot exhaust memory.

PDF and .docx files are compressed containers: a few kilobytes can unpack to
gigabytes (a zip bomb). The PDF and Word readers charge what they unpack
against these limits as they unpack it.
"""

from __future__ import annotations

from engine.errors import DocumentTooLong

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


def check_length(name: str, chars: int, max_chars: int, *, complete: bool) -> None:
    """Refuse a text longer than ``max_chars``; ``complete`` says ``chars`` is its full length."""
    if chars <= max_chars:
        return
    amount = f"{chars:,}" if complete else f"more than {max_chars:,}"
    raise DocumentTooLong(
        f"“{name}” has {amount} characters of text, more than the {max_chars:,} "
        "that fit in this model's context. Attach a part of it, or use a model with a "
        "longer context.",
        chars if complete else None, max_chars,
    )
