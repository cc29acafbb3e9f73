"""Everything Longleaf creates for the user's data is user-only (folders 0700, files 0600)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from engine import paths


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_data_dir_and_its_subfolders_are_user_only(loose_umask: None) -> None:
    folders = [paths.data_dir(), paths.models_dir(), paths.snapshots_dir(), paths.logs_dir()]

    assert [_mode(folder) for folder in folders] == [0o700] * 4
    assert [folder.parent for folder in folders[1:]] == [paths.data_dir()] * 3


def test_private_dir_tightens_an_existing_open_folder(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)

    assert paths.private_dir(folder) == folder
    assert _mode(folder) == 0o700


def test_private_dir_refuses_a_folder_it_cannot_make_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Already 0700 is not enough: a folder whose mode Longleaf cannot set (another
    user's, a read-only disk) is refused, not trusted."""
    folder = tmp_path / "foreign"
    folder.mkdir(mode=0o700)

    def not_owner(self: Path, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "chmod", not_owner)
    with pytest.raises(PermissionError):
        paths.private_dir(str(folder))


def test_private_dir_leaves_existing_parents_alone(tmp_path: Path, loose_umask: None) -> None:
    tmp_path.chmod(0o755)
    paths.private_dir(tmp_path / "a" / "b")

    assert _mode(tmp_path) == 0o755
    assert _mode(tmp_path / "a" / "b") == 0o700


def test_private_file_is_created_user_only_and_keeps_its_content(
    tmp_path: Path, loose_umask: None
) -> None:
    new = paths.private_file(tmp_path / "new.db")
    old = tmp_path / "old.ini"
    old.write_text("[general]\nkept=1\n")
    old.chmod(0o644)

    paths.private_file(old)

    assert new.read_bytes() == b""
    assert _mode(new) == 0o600
    assert _mode(old) == 0o600
    assert old.read_text() == "[general]\nkept=1\n"


@pytest.mark.parametrize(("before", "after"), [(0o400, 0o400), (0o444, 0o400),
                                               (0o640, 0o600), (0o604, 0o600)])
def test_private_file_keeps_a_read_only_file_read_only(tmp_path: Path, before, after) -> None:
    history = tmp_path / "history.sqlite3"
    history.write_bytes(b"")
    history.chmod(before)
    paths.private_file(history)
    assert _mode(history) == after  # was 0600 for all: the user's 0400 made writable
