"""Thousands of files given at once: one message takes the first ``MAX_FILES``, says so,
and saves its draft once for them all, not once per file; a draft that holds more
(left by an earlier version) opens with its first ``MAX_FILES``."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.chat.attachments import MAX_FILES
from app.store import AttachmentRecord, HistoryStore
from tests.app.chat.test_documents_drop import drop_files
from tests.app.conftest import close_window, open_window

GIVEN = 2_000


def many_files(folder: Path, count: int) -> list[Path]:
    folder.mkdir()
    paths = [folder / f"note-{i:05}.txt" for i in range(count)]
    for i, path in enumerate(paths):
        path.write_text(f"Note {i}: longleaf pines grow on sandy soil.\n")
    return paths


def test_a_drop_of_thousands_attaches_the_first_files_and_says_so(
        qtbot, window, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One save when the last file is read: no timer falls due while they are read.
    window.drafts._files_timer.setInterval(3_600_000)
    store = window.controller.store
    chat = window.controller.new_session("q8")
    saves: list[int] = []
    set_draft = store.set_draft

    def counted(session_id, text, attachments=()):
        if attachments is not None:  # None: the files stored are left as they are
            saves.append(len(attachments))
        return set_draft(session_id, text, attachments)

    monkeypatch.setattr(store, "set_draft", counted)
    paths = many_files(tmp_path / "notes", GIVEN)
    drop_files(window, paths)
    # Only the first MAX_FILES were queued to be read at all.
    assert len(window.composer.chips) == MAX_FILES
    assert len(window.loader.pending) <= MAX_FILES
    qtbot.waitUntil(lambda: len(window.attachments) == MAX_FILES and not window.loader.pending,
                    timeout=60_000)
    assert [r.name for r in window.attachments.values()] == [p.name for p in
                                                              paths[:MAX_FILES]]
    said = window.composer.notice.text()
    assert window.composer.notice.isVisible()
    assert (f"2,000 files were given, more than the {MAX_FILES} one message takes: the first "
            f"{MAX_FILES} files are attached and the other 1,980 are not.") in said
    assert "Send these, then attach the rest to a later message" in said
    # The draft was written once for the twenty, not once per file.
    assert saves == [MAX_FILES]
    assert len(store.draft_attachments(chat.id)) == MAX_FILES

    # A full message takes no more, and says why.
    drop_files(window, paths[MAX_FILES:MAX_FILES + 3])
    assert len(window.composer.chips) == MAX_FILES and not window.loader.pending
    assert window.composer.notice.text() == (
        f"This message already has {MAX_FILES} attached files, the most one message takes, "
        "so 3 more files were not attached. Send it or remove some files, then attach "
        "the others.")


def test_the_draft_holds_every_file_once_the_last_is_read(qtbot, window, tmp_path) -> None:
    # With the timer's own interval: whatever it saved meanwhile, the last read saves all.
    store = window.controller.store
    chat = window.controller.new_session("q8")
    paths = many_files(tmp_path / "notes", 5)
    window.add_files([str(p) for p in paths])
    qtbot.waitUntil(lambda: len(window.attachments) == 5 and not window.loader.pending,
                    timeout=60_000)
    assert [r.name for r in store.draft_attachments(chat.id)] == [p.name for p in paths]
    assert not window.drafts._files_timer.isActive()  # nothing left to save later


def test_a_stored_draft_of_thousands_opens_with_its_first_files(qtbot, tiny_llama) -> None:
    first = open_window(qtbot, tiny_llama)
    chat = first.controller.new_session("q8")
    records = tuple(AttachmentRecord(f"note-{i:05}.txt", 40, f"{i:064x}", 10, f"Note {i}.")
                    for i in range(GIVEN))
    close_window(first)  # it saves its own (empty) draft on the way out
    store = HistoryStore()
    store.set_draft(chat.id, "what do these say?", records)
    store.close()

    second = open_window(qtbot, tiny_llama)
    try:
        assert second.controller.current.id == chat.id
        assert len(second.composer.chips) == MAX_FILES
        assert tuple(second.attachments.values()) == records[:MAX_FILES]
        assert second.composer.text() == "what do these say?"
        assert second.composer.notice.text() == (
            f"This chat's draft held 2,000 attached files, more than the {MAX_FILES} one "
            f"message takes; the first {MAX_FILES} are kept. Attach the others to a later "
            "message.")
        # Kept as shown, so the next start does not read thousands again.
        assert second.controller.store.draft_attachments(chat.id) == records[:MAX_FILES]
        assert second.controller.store.draft(chat.id) == "what do these say?"
    finally:
        close_window(second)
