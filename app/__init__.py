"""Longleaf's Qt front end."""

from __future__ import annotations

import ctypes
import sys


def _make_none_immortal() -> None:
    # PySide6 6.12.0 built for the stable ABI drops a reference to None on every
    # void call (it assumes Python 3.12's immortal None). On 3.11 that drives
    # None's refcount to zero after a few thousand calls and aborts the process
    # ("Fatal Python error: none_dealloc"). None is never freed anyway, so give
    # it the effectively infinite refcount 3.12+ gives it.
    if sys.version_info < (3, 12) and sys.implementation.name == "cpython":
        ctypes.c_ssize_t.from_address(id(None)).value = 1 << 60


_make_none_immortal()
