"""A folder that takes no write, as a read-only disk refuses it (``EROFS``).

Tests may run as root, where permission bits stop no write, and may not mount a
file system: the ``os`` calls that write are wrapped instead, and refuse any
path inside the folder the way the kernel does on a read-only mount.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def make_read_only(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse every write, rename, removal and time stamp inside ``folder``."""
    root = str(folder.resolve())

    def inside(path: object) -> bool:
        if isinstance(path, int):
            return False
        return os.path.abspath(os.fspath(path)).startswith(root)

    def refuse(path: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def guard(original, *, flags_at: int | None = None, paths: int = 1):
        def guarded(*args, **kwargs):
            if flags_at is not None and not (args[flags_at] & _WRITE_FLAGS):
                return original(*args, **kwargs)
            for path in args[:paths]:
                if inside(path):
                    refuse(path)
            return original(*args, **kwargs)
        return guarded

    monkeypatch.setattr(os, "open", guard(os.open, flags_at=1))
    for name in ("unlink", "remove", "rmdir", "utime", "chmod", "mkdir"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))
    for name in ("replace", "rename"):
        monkeypatch.setattr(os, name, guard(getattr(os, name), paths=2))
