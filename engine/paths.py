"""Where Longleaf keeps its data; one place so tests can redirect it.

What the user wrote lives here (the history, settings, KV snapshots holding the
documents' text, logs), so every folder Longleaf makes is user-only (0700) and
every file it creates is user-only (0600), whatever the process umask says.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import platformdirs

APP_NAME = "Longleaf"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) and make it user-only (0700).

    Parents that already exist keep their mode: they are the user's folders,
    not Longleaf's. The mode is set even when it already reads 0700, so a
    folder Longleaf cannot chmod (another user's) is refused here rather than
    trusted; on a read-only disk a folder already ours and 0700 is accepted.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OSError: the folder cannot be made or made user-only.
    """
    folder = Path(path)
    # mkdir's mode is filtered by the umask and ignored for a folder that exists.
    folder.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    try:
        folder.chmod(PRIVATE_DIR_MODE)
    except OSError as error:
        # A read-only disk: nobody can write there, so a folder that is already
        # ours and user-only may still be read (the history opens read-only).
        if error.errno != errno.EROFS or not _already_private(folder):
            raise
    return folder


def _already_private(folder: Path) -> bool:
    stat = folder.stat()
    return stat.st_uid == os.getuid() and stat.st_mode & 0o777 == PRIVATE_DIR_MODE


def private_file(path: Path) -> Path:
    """Create ``path`` empty if missing (0600), and make it user-only.

    Call it before handing the path to a library that creates the file itself
    (SQLite, QSettings): they keep an existing file's mode, and SQLite gives its
    -wal and -shm files the database's mode.

    An existing file loses only what others may do with it: one the user made
    read-only (0400) stays read-only, never silently writable again.

    Returns:
        ``path``.
    """
    # O_CREAT with 0600 closes the window in which the file exists group-readable.
    descriptor = os.open(path, os.O_CREAT | os.O_RDONLY, PRIVATE_FILE_MODE)
    try:
        mode = os.fstat(descriptor).st_mode & 0o777
        if mode & 0o077:
            os.fchmod(descriptor, mode & 0o700 or PRIVATE_FILE_MODE)
    finally:
        os.close(descriptor)
    return path


def data_dir() -> Path:
    """Return the user data directory (history, converted models), creating it user-only.

    ``LONGLEAF_HOME`` overrides the platform location; tests always set it.
    """
    override = os.environ.get("LONGLEAF_HOME")
    path = Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, False))
    return private_dir(path)


def data_subdir(name: str) -> Path:
    """Return a user-only folder inside the data directory, creating it."""
    return private_dir(data_dir() / name)


def models_dir() -> Path:
    """Return the folder for models Longleaf converted or downloaded itself."""
    return data_subdir("models")


def snapshots_dir() -> Path:
    """Return the folder for saved KV caches; they hold the documents' text."""
    return data_subdir("kv-snapshots")


def server_snapshots_dir() -> Path:
    """Return the API server's own folder of saved KV caches, never shared with the app's."""
    return data_subdir("server-kv-snapshots")


def logs_dir() -> Path:
    """Return the folder for log files; they may quote what the user wrote."""
    return data_subdir("logs")


def cache_dir() -> Path:
    """Return the user-only folder for what Longleaf can rebuild (weight digests,
    MLX's compiled kernels): ``$LONGLEAF_HOME/cache`` when set, else the platform's
    cache location (``$XDG_CACHE_HOME/Longleaf`` on Linux)."""
    override = os.environ.get("LONGLEAF_HOME")
    path = Path(override) / "cache" if override else Path(
        platformdirs.user_cache_dir(APP_NAME, False))
    return private_dir(path)


def temp_dir() -> Path:
    """Return the user-only folder Longleaf's processes use as ``TMPDIR``.

    MLX's CPU backend compiles kernels into ``$TMPDIR/mlx/<version>/cpu`` and loads
    any library it finds there; in the shared ``/tmp`` another local user could
    plant one. This folder is the current user's alone, or this raises.

    Raises:
        PermissionError: the folder exists but belongs to another user.
    """
    path = private_dir(cache_dir() / "tmp")
    owner = path.stat().st_uid
    if hasattr(os, "getuid") and owner != os.getuid():
        raise PermissionError(f"{path} belongs to another user (uid {owner}).")
    return path


def use_private_temp_dir() -> Path:
    """Point ``TMPDIR`` (this process and every child it starts) at :func:`temp_dir`.

    Call before MLX is first imported: it looks its kernel folder up through the
    C++ temp-directory lookup, which reads ``TMPDIR``. When that folder cannot be
    made (a read-only or foreign cache folder), a fresh ``mkdtemp`` folder (0700,
    an unguessable name, so nobody can have planted anything in it) stands in and
    is removed when the process exits.

    Returns:
        The folder.
    """
    import tempfile

    try:
        path = temp_dir()
    except OSError as error:
        import atexit
        import logging
        import shutil

        path = Path(tempfile.mkdtemp(prefix="longleaf-"))
        atexit.register(shutil.rmtree, path, True)
        logging.getLogger(__name__).warning(
            "no private temp folder in Longleaf's cache folder (%s); using %s until exit",
            error, path)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # Python's own temp files follow on their next use
    return path
