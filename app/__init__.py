"""Longleaf's Qt front end."""

from __future__ import annotations

import ctypes
import sys

_SINGLETONS = (None, True, False, Ellipsis, NotImplemented, *range(-5, 257))


def _make_singletons_immortal() -> None:
    # PySide6 6.12.0 is built assuming Python 3.12's immortal singletons: on 3.11
    # it drops a reference to None (every void call), True/False and cached small
    # ints, draining their refcounts until CPython aborts ("Fatal Python error:
    # none_dealloc" / "bool_dealloc"). These objects are never freed anyway, so
    # give them the effectively infinite refcount 3.12+ gives them.
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return
    for obj in _SINGLETONS:
        ctypes.c_ssize_t.from_address(id(obj)).value = 1 << 60


_make_singletons_immortal()
