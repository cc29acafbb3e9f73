"""Disks that fill up or turn read-only while Longleaf runs, said in words.

A failed write surfaces in many shapes: an ``OSError`` with ``ENOSPC`` or
``EROFS``, or, on MLX's CPU backend, a kernel compile into ``$TMPDIR`` whose
compiler could not write its output (MLX raises a ``RuntimeError`` quoting the
whole ``g++`` command line). This module turns each into a :class:`DiskFault`
whose message names the folder and what to do, and never shows a command line.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from engine.errors import DiskFault

FULL = "full"
READ_ONLY = "read-only"
UNWRITABLE = "unwritable"
IN_USE = "in use"  # another program holds the file's write lock (a database browser)
_ERRNO_CAUSE = {errno.ENOSPC: FULL, errno.EDQUOT: FULL, errno.EROFS: READ_ONLY,
                errno.EACCES: UNWRITABLE, errno.EPERM: UNWRITABLE}
# How MLX's CPU backend reports a kernel it could not compile or load.
_MLX_COMPILE = "[Compile::eval_cpu] Failed to"
_TEXT_CAUSE = (("No space left on device", FULL), ("Disk quota exceeded", FULL),
               ("Read-only file system", READ_ONLY), ("Permission denied", UNWRITABLE))


def cause_of_errno(number: int | None) -> str | None:
    """"full", "read-only" or "unwritable" for a write's errno; None for any other."""
    return _ERRNO_CAUSE.get(number) if number is not None else None


def probe(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder`` cannot take a small file now ("full", …), or None when it can.

    Writes and removes one small file: permission bits say nothing to root, and
    a full disk often still has room for a name but not for its bytes.
    """
    try:
        if shutil.disk_usage(folder).free == 0:
            return FULL
        with tempfile.TemporaryFile(dir=folder) as handle:
            handle.write(b"\0" * 4096)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        return cause_of_errno(error.errno) or UNWRITABLE
    return None


def kernel_folder() -> Path:
    """Where MLX compiles kernels: ``$TMPDIR`` as Longleaf set it.

    Not ``tempfile.gettempdir()``: that skips a folder it cannot write a file
    into (the very folder that is full or read-only) and names ``/tmp`` instead.
    """
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir())


def fault(cause: str, folder: str | os.PathLike[str], doing: str, retry: str) -> DiskFault:
    """A ``DiskFault`` saying ``doing`` failed because ``folder`` is ``cause``.

    Args:
        cause: "full", "read-only", "unwritable" or "in use".
        folder: the folder (or file) the write was for.
        doing: what failed, as the sentence's start ("Longleaf could not …").
        retry: what to do once the folder is fixed ("send the message again").
    """
    where = str(folder)
    if cause == FULL:
        text = (f"{doing}: the disk holding {where} is full. Free some space on it, "
                f"then {retry}.")
    elif cause == IN_USE:
        text = (f"{doing}: another program is writing to {where} (a database browser or "
                f"a sync tool may hold it open). Close it, then {retry}.")
    elif cause == READ_ONLY:
        text = (f"{doing}: {where} is on a read-only disk. Make it writable, or start "
                f"Longleaf with its data folder on a writable disk (LONGLEAF_HOME), then "
                f"{retry}.")
    else:
        text = (f"{doing}: Longleaf may not write to {where}. Fix the folder's "
                f"permissions, then {retry}.")
    return DiskFault(text, folder=where, cause=cause)


def fault_of(error: BaseException, *, retry: str = "try again",
             folder: str | os.PathLike[str] | None = None) -> DiskFault | None:
    """The ``DiskFault`` that ``error`` stands for, or None when it is not about a disk.

    Recognizes an ``OSError`` whose errno says full, read-only or not permitted
    (named by its file's folder, else ``folder``), and MLX's failed kernel
    compile (in ``$TMPDIR``, which Longleaf points at its cache folder), whose
    cause is read from the compiler's words or, failing that, from a probe of
    the folder.
    """
    if isinstance(error, DiskFault):
        return error
    if isinstance(error, OSError):
        cause = cause_of_errno(error.errno)
        if cause is None:
            return None
        where = (Path(error.filename).parent if error.filename
                 else Path(folder) if folder is not None else kernel_folder())
        return fault(cause, where, "Longleaf could not write a file it needs", retry)
    text = str(error)
    if not isinstance(error, RuntimeError) or _MLX_COMPILE not in text:
        return None
    kernels = kernel_folder()
    cause = next((c for words, c in _TEXT_CAUSE if words in text), None) or probe(kernels)
    doing = "Longleaf could not prepare the model's compute kernels"
    if cause is None:
        # The folder takes files again (space came back meanwhile): it may pass now.
        return DiskFault(
            f"{doing}: the compiler could not write into {kernels}. Check that the disk "
            f"holding it has free space and can be written, then {retry}.",
            folder=str(kernels), cause=UNWRITABLE)
    return fault(cause, kernels, doing, retry)
