"""Crash-safe files for KV snapshots: atomic replace, checksums.

A snapshot named ``N`` is two files in one folder: ``N.json`` (the manifest) and
``N.<nonce>.safetensors`` (the arrays) named by the manifest. The manifest is
renamed into place last, so it is the one commit point: a crash before it leaves
the previous snapshot (or none) in force plus an orphan data file, never a
manifest naming data that was not completely written.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

MANIFEST_SUFFIX = ".json"
DATA_SUFFIX = ".safetensors"
TEMP_MARK = ".partial-"
FILE_MODE = 0o600
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

log = logging.getLogger(__name__)

# Called with a step name at each stage of a write; tests install one that stops
# the process there (kill -9) to check what a crash at that step leaves behind.
write_hook: Callable[[str], None] | None = None


def checkpoint(step: str) -> None:
    """Tell the test hook (if any) that a write reached ``step``."""
    if write_hook is not None:
        write_hook(step)


def check_name(name: str) -> str:
    """A snapshot name safe to use as a file name; raises ValueError otherwise."""
    if not _NAME.fullmatch(name) or name.endswith(DATA_SUFFIX) or ".." in name:
        raise ValueError(
            f"Snapshot name {name!r} must be 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit."
        )
    return name


# A pipeline's other ranks keep their layers' snapshots in ``rank<N>`` beside rank 0's.
_RANK_FOLDER = re.compile(r"rank[1-9][0-9]*")


def rank_folder(directory: Path, rank: int) -> Path:
    """Where pipeline rank ``rank`` (not 0) keeps its layers' snapshots of ``directory``'s."""
    return directory / f"rank{rank}"


def rank_folders(directory: Path) -> list[Path]:
    """The pipeline ranks' snapshot folders inside ``directory`` (on this machine)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and _RANK_FOLDER.fullmatch(p.name))


def manifest_path(directory: Path, name: str) -> Path:
    return directory / f"{check_name(name)}{MANIFEST_SUFFIX}"


def new_data_name(name: str) -> str:
    """A data file name no earlier snapshot of ``name`` used, with this process's id.

    The id lets another process's sweep tell a data file whose manifest is still
    being written from one a dead writer left behind.
    """
    return f"{check_name(name)}.{secrets.token_hex(6)}-p{os.getpid()}{DATA_SUFFIX}"


def snapshot_name(file_name: str) -> str:
    """The snapshot a manifest or data file belongs to (see ``new_data_name``)."""
    if file_name.endswith(DATA_SUFFIX):
        return file_name.removesuffix(DATA_SUFFIX).rsplit(".", 1)[0]
    return file_name.removesuffix(MANIFEST_SUFFIX)


def temp_path(final: Path) -> Path:
    """A temporary sibling of ``final``, named with this process's id; ends in the
    same suffix (mx.save_safetensors appends ``.safetensors`` to names that lack it)."""
    return final.with_name(f"{TEMP_MARK}{os.getpid()}-{secrets.token_hex(6)}-{final.name}")


_TEMP_OWNER = re.compile(re.escape(TEMP_MARK) + r"(\d+)-[0-9a-f]{12}-")
_DATA_OWNER = re.compile(r"\.[0-9a-f]{12}-p(\d+)" + re.escape(DATA_SUFFIX) + "$")


def owner_pid(file_name: str) -> int | None:
    """The id of the process that wrote a temp or data file, None when not recorded."""
    found = _TEMP_OWNER.match(file_name) or _DATA_OWNER.search(file_name)
    return int(found.group(1)) if found else None


def left_by_dead_writer(file_name: str) -> bool:
    """Whether a leftover file may be swept: no other live process may still write it.

    A file of this process is sweepable (its store writes and sweeps on one thread,
    never both at once), and so is one that records no writer (written before ids
    were recorded). A live process of that id keeps the file, even when the id was
    reused by another program: a file kept too long costs disk until a later start,
    one swept too early loses another Longleaf's save.
    """
    pid = owner_pid(file_name)
    if pid is None or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, run by another user
        return False
    except OSError:  # no way to ask (e.g. a platform without signals): keep it
        return False
    return False


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    # Makes the renames durable; some platforms cannot open a folder, and there
    # the rename is as durable as the platform makes it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(temp: Path, final: Path) -> None:
    """Make ``temp`` private, durable, then atomically ``final``."""
    os.chmod(temp, FILE_MODE)
    fsync_file(temp)
    os.replace(temp, final)
    fsync_dir(final.parent)


def write_bytes_atomic(final: Path, data: bytes, label: str = "file") -> None:
    """Write ``data`` to ``final`` so a reader sees the old file or all of the new."""
    temp = temp_path(final)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        checkpoint(f"{label}:written")
        commit(temp, final)
    except BaseException:
        discard(temp)
        raise
    checkpoint(f"{label}:committed")


def remove(*paths: Path) -> None:
    """Delete ``paths`` (missing ones are fine).

    Raises:
        OSError: one cannot be deleted (a read-only disk); those before it are gone.
    """
    for path in paths:
        path.unlink(missing_ok=True)
    if paths:
        fsync_dir(paths[0].parent)


def discard(path: Path) -> None:
    """Delete ``path`` if it can be, for a handler cleaning up after a failed write.

    Never raises: on a read-only disk the write that failed left nothing to
    delete, and a second error would hide the first (a leftover is swept later).
    """
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        log.info("could not remove %s: %s", path, error)
