"""The history database and the settings file are user-only: they hold what the user wrote."""

from __future__ import annotations

import stat
from pathlib import Path

from app.settings import Settings, config_dir
from app.store import HistoryStore
from engine.paths import data_dir


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_history_database_and_its_wal_files_are_user_only(loose_umask: None) -> None:
    store = HistoryStore()
    try:
        session = store.create_session("Taxes", "q8", "tiny")
        store.add_message(session.id, "user", "my salary is 1,000,000")
        files = sorted(store.path.parent.glob(store.path.name + "*"))

        assert [p.name for p in files] == [
            "history.sqlite3", "history.sqlite3-shm", "history.sqlite3-wal"]
        assert [_mode(p) for p in files] == [0o600] * 3
        assert _mode(data_dir()) == 0o700
    finally:
        store.close()


def test_settings_file_is_user_only_and_stays_so_after_writes(loose_umask: None) -> None:
    settings = Settings()
    settings.system_prompt = "I am writing a novel about my neighbour."
    settings.sync()
    Settings().sync()

    assert settings.path.parent == config_dir()
    assert _mode(config_dir()) == 0o700
    assert "neighbour" in settings.path.read_text()
    assert _mode(settings.path) == 0o600


def test_files_left_open_by_an_older_version_are_tightened(loose_umask: None) -> None:
    for name in ("history.sqlite3", "settings.ini"):
        (data_dir() / name).touch(mode=0o644)

    HistoryStore().close()
    Settings().sync()

    assert _mode(data_dir() / "history.sqlite3") == 0o600
    assert _mode(config_dir() / "settings.ini") == 0o600  # moved there, still user-only
