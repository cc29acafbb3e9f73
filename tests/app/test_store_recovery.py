"""The history opens whatever state its file is in: damaged, unreadable, unwritable."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest

from app import store as store_module
from app.store import HistoryStore, default_path, open_history

PAGE = 4096


def _fill(path: Path, chats: int = 12, per_chat: int = 20) -> None:
    store = HistoryStore(path)
    for c in range(chats):
        record = store.create_session(f"chat {c}", "q8", "demo")
        for m in range(per_chat):
            store.add_message(record.id, "user" if m % 2 == 0 else "assistant",
                              f"message {c}-{m} " + "words " * 300)
    store.close()


def _damage_page(path: Path, page: int) -> bytes:
    """Overwrite one page in the middle of the file with garbage; returns the new bytes."""
    data = bytearray(path.read_bytes())
    assert len(data) > (page + 1) * PAGE
    data[page * PAGE:(page + 1) * PAGE] = os.urandom(PAGE)
    path.write_bytes(bytes(data))
    return bytes(data)


def test_a_sound_history_opens_as_it_is() -> None:
    _fill(default_path(), chats=2, per_chat=2)
    store, opened = open_history()
    assert opened.damaged is None and not opened.unsaved
    assert len(store.sessions()) == 2
    store.close()


def test_a_page_of_garbage_is_moved_aside_and_the_rest_recovered() -> None:
    path = default_path()
    _fill(path)
    # A leaf of the messages table (the rows live in leaves), not an index page
    # (whose loss costs no row) nor an interior page (which costs many).
    leaf = path.read_bytes().index(b"message 6-10 ") // PAGE
    damaged_bytes = _damage_page(path, leaf)
    store, opened = open_history()
    try:
        assert opened.damaged is not None and opened.damaged.parent == path.parent
        assert opened.damaged.read_bytes() == damaged_bytes  # kept exactly as it was
        assert not opened.unsaved
        assert store.integrity_check() == "ok"
        # One page of ~2 KB messages holds a message or two: the rest came back.
        assert opened.chats == 12 and 200 <= opened.messages < 240
        assert "message 6-10 " not in " ".join(
            m.content[:13] for s in store.sessions() for m in store.messages(s.id))
        recovered = sum(len(store.messages(s.id)) for s in store.sessions())
        assert recovered == opened.messages
        texts = [m.content for s in store.sessions() for m in store.messages(s.id)]
        assert all(t.startswith("message ") for t in texts)
        store.add_message(store.sessions()[0].id, "user", "still works")  # writable again
    finally:
        store.close()
    again, reopened = open_history()  # the new file is sound: nothing more to recover
    assert reopened.damaged is None
    again.close()


def test_messages_whose_chat_row_was_lost_get_a_recovered_chat() -> None:
    path = default_path()
    _fill(path, chats=1, per_chat=4)
    db = sqlite3.connect(path)
    db.execute("DELETE FROM sessions")  # foreign keys are off by default
    db.commit()
    db.close()  # checkpoints the WAL into the file, where the damage goes
    _damage_page(path, 1)  # page 2: the sessions table's root, so the check fails too
    store, opened = open_history()
    try:
        assert opened.damaged is not None
        (chat,) = store.sessions()
        assert chat.title == "Recovered chat" and len(store.messages(chat.id)) == 4
    finally:
        store.close()


def test_a_file_that_is_not_a_database_is_kept_and_a_fresh_history_opens() -> None:
    path = default_path()
    path.write_bytes(b"this is not sqlite" * 1000)
    store, opened = open_history()
    try:
        assert opened.damaged is not None and opened.damaged.read_bytes().startswith(b"this")
        assert (opened.chats, opened.messages) == (0, 0) and store.sessions() == []
    finally:
        store.close()


def test_a_data_folder_under_a_file_gives_an_unsaved_history(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LONGLEAF_HOME", str(blocker / "longleaf"))
    store, opened = open_history()
    try:
        assert "cannot write" in opened.unsaved and "saved" in opened.unsaved
        record = store.create_session("t", "q8", "demo")  # works, in memory
        assert store.session(record.id) is not None
    finally:
        store.close()


def test_a_read_only_folder_shows_the_history_and_saves_nothing(monkeypatch) -> None:
    path = default_path()
    _fill(path, chats=3, per_chat=2)
    before = path.read_bytes()
    real = store_module.private_file

    def read_only(p: Path) -> Path:  # tests run as root, where chmod does not stop writes
        raise OSError(errno.EROFS, "Read-only file system", str(p))

    monkeypatch.setattr(store_module, "private_file", read_only)
    store, opened = open_history()
    try:
        assert "Read-only file system" in opened.unsaved
        assert (opened.chats, opened.messages) == (3, 6) and len(store.sessions()) == 3
        store.create_session("new", "q8", "demo")
    finally:
        store.close()
    monkeypatch.setattr(store_module, "private_file", real)
    assert path.read_bytes() == before


def test_a_full_disk_at_open_gives_an_unsaved_history(monkeypatch) -> None:
    _fill(default_path(), chats=1, per_chat=2)
    real_init = HistoryStore.__init__

    def full(self, path=None, *, memory=False):
        if not memory:
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = 13
            raise error
        real_init(self, path, memory=memory)

    monkeypatch.setattr(HistoryStore, "__init__", full)
    store, opened = open_history()
    try:
        assert "disk is full" in opened.unsaved and opened.messages == 2
    finally:
        store.close()


@pytest.mark.parametrize("code", [5, 14])
def test_busy_or_unopenable_is_not_mistaken_for_damage(monkeypatch, code: int) -> None:
    _fill(default_path(), chats=1, per_chat=1)

    def fail(self, path=None, *, memory=False):
        if not memory:
            raise sqlite3.OperationalError("database is locked")
        HistoryStore.__init__.__wrapped__(self, path, memory=memory)

    real_init = HistoryStore.__init__
    fail.__wrapped__ = real_init
    monkeypatch.setattr(HistoryStore, "__init__", fail)
    store, opened = open_history()
    try:
        assert opened.damaged is None and opened.unsaved
        assert default_path().exists() and not list(default_path().parent.glob("*damaged*"))
    finally:
        store.close()


def test_a_read_only_copy_keeps_a_row_with_a_byte_that_is_not_utf8() -> None:
    path = default_path()
    store = HistoryStore(path)
    chat = store.create_session("Trip", "q8", "demo")
    store.add_message(chat.id, "user", "hello ZZTEXT world")
    store.add_message(chat.id, "assistant", "fine")
    store.close()
    data = bytearray(path.read_bytes())
    data[data.index(b"ZZTEXT")] = 0xFF
    path.write_bytes(bytes(data))

    store, opened = open_history(writable=False)
    try:
        # Before, the row's read failed as a damaged page's would, and it was left out.
        assert (opened.chats, opened.messages) == (1, 2)
        assert [m.content for m in store.messages(chat.id)] == ["hello \ufffdZTEXT world", "fine"]
    finally:
        store.close()


def test_a_history_from_a_newer_longleaf_is_shown_and_never_written() -> None:
    path = default_path()
    _fill(path, chats=2, per_chat=2)
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE sessions ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    before = path.read_bytes()

    store, opened = open_history()  # before, its first read of the chats raised
    try:
        assert "written by a newer version of Longleaf" in opened.unsaved
        assert "nothing you do in this session will be saved" in opened.unsaved
        assert opened.damaged is None and (opened.chats, opened.messages) == (2, 4)
        assert sorted(s.title for s in store.sessions()) == ["chat 0", "chat 1"]
        store.create_session("new", "q8", "demo")  # works, in memory
    finally:
        store.close()
    assert path.read_bytes() == before
    assert not list(path.parent.glob("*damaged*"))


@pytest.mark.parametrize("writable", [True, False], ids=["recovered", "read_only"])
def test_the_draft_typed_with_no_chat_open_and_the_chat_on_screen_are_kept(
        writable: bool) -> None:
    path = default_path()
    _fill(path)
    store = HistoryStore(path)
    shown = store.sessions()[3]
    store.set_draft(None, "typed with no chat open")
    store.set_last_session(shown.id)
    store.close()
    if writable:  # a copy read into memory has nothing to step over
        _damage_page(path, path.read_bytes().index(b"message 6-10 ") // PAGE)

    store, opened = open_history(writable=writable)
    try:
        assert (opened.damaged is not None) == writable and opened.chats == 12
        # Before, the app_state table was not copied: both were lost.
        assert store.draft(None) == "typed with no chat open"
        assert store.last_session() == shown
    finally:
        store.close()
