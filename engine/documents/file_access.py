"""Reading a dropped file's bytes, and the messages for what the file system refuses."""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from engine.documents.limits import MAX_CONTAINER_BYTES
from engine.errors import Cancelled, DocumentError


def stat_size(p: Path) -> int:
    """The file's size, refusing folders and unreadable paths."""
    try:
        st = p.stat()
    except OSError as exc:
        raise os_error(p.name, exc) from exc
    if p.is_dir():
        raise DocumentError(f"“{p.name}” is a folder; drop the files inside it instead.")
    return st.st_size


def os_error(name: str, exc: OSError) -> DocumentError:
    """A message the user can act on for a failed open or read."""
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


@contextlib.contextmanager
def opened(p: Path) -> Iterator[BinaryIO]:
    """The file open for reading: sniffed and read through one handle, so it cannot be
    swapped or deleted between the two."""
    try:
        handle = p.open("rb")
    except OSError as exc:
        raise os_error(p.name, exc) from exc
    with handle:
        yield handle


def read_head(handle: BinaryIO, name: str, size: int) -> bytes:
    """The file's first ``size`` bytes (fewer if it is shorter), the handle put back
    at its start."""
    try:
        head = handle.read(size)
        handle.seek(0)
    except OSError as exc:
        raise os_error(name, exc) from exc
    return head


def read_all(handle: BinaryIO, name: str, size: int) -> bytes:
    """The whole file (a PDF or .docx, already capped in size) from ``handle``, at its start."""
    try:
        # Sized from stat: read(n) allocates n bytes up front.
        data = handle.read(min(size, MAX_CONTAINER_BYTES) + 1)
    except OSError as exc:
        raise os_error(name, exc) from exc
    if len(data) != size:
        # Rewritten since its size was read (or deleted): what came is part of one
        # version and part of another, which a parser would call damaged.
        raise vanished(name)
    return data


def stop_if_cancelled(name: str, cancel: threading.Event | None) -> None:
    """End the read of ``name`` once ``cancel`` is set (its chip was removed): a read
    no one waits for would hold up every file dropped after it.

    Raises:
        Cancelled: ``cancel`` is set.
    """
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"Reading “{name}” was stopped.")


def vanished(name: str) -> DocumentError:
    """The refusal for a file that changed while it was read."""
    return DocumentError(
        f"“{name}” changed or disappeared while it was being read; "
        "wait until it is written completely and drop it again."
    )
