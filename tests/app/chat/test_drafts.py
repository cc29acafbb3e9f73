"""Nothing typed is lost: drafts per chat, the chat on screen at quit, quitting mid-answer."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox, QPushButton

from app.controller import QUIT_DRAFT_UNSAVED, QUIT_WHILE_ANSWERING
from app.store import EditRecord, HistoryStore, SessionRecord
from app.window.quit_box import QUIT
from tests.app.conftest import ANSWER_TIMEOUT_MS, close_window, open_window


def _type(qtbot, window, text: str) -> None:
    window.composer.edit.setFocus()
    window.composer.edit.clear()
    qtbot.keyClicks(window.composer.edit, text)


def test_each_chat_keeps_its_own_draft_across_switches(qtbot, window) -> None:
    c = window.controller
    first = c.new_session("q8")
    _type(qtbot, window, "half a thought for the first chat")
    second = c.new_session("q4")
    assert window.composer.text() == ""  # a new chat starts with an empty box
    _type(qtbot, window, "and one for the second")
    c.select_session(first.id)
    assert window.composer.text() == "half a thought for the first chat"
    c.select_session(second.id)
    assert window.composer.text() == "and one for the second"
    # Stored with the chat: deleting the chat deletes its draft.
    assert c.store.draft(first.id) == "half a thought for the first chat"
    c.delete_session(first.id)
    assert c.store.draft(first.id) == ""


def test_drafts_the_history_cannot_take_stay_in_memory_across_switches(qtbot, window) -> None:
    c = window.controller
    first = c.new_session("q8")
    second = c.new_session("q4")
    c.select_session(first.id)
    said: list[str] = []
    c.errorRaised.connect(said.append)
    c.store._db.execute("PRAGMA query_only = 1")  # a read-only disk, as SQLite reports it
    try:
        _type(qtbot, window, "typed while the disk refuses writes")
        c.select_session(second.id)  # saves the draft left: refused, kept in memory
        assert window.composer.text() == ""
        c.select_session(first.id)
        assert window.composer.text() == "typed while the disk refuses writes"
        # Said once, and asked before a quit would lose it.
        assert len(said) == 1 and said[0].startswith("Your draft is kept in this window only")
        assert "read-only disk" in said[0]
        assert window.drafts.kept_unsaved()
    finally:
        c.store._db.execute("PRAGMA query_only = 0")
    assert not window.drafts.kept_unsaved()  # tried again: the history takes it now
    assert c.store.draft(first.id) == "typed while the disk refuses writes"


def test_text_typed_before_any_chat_goes_with_the_chat_the_send_makes(qtbot, window) -> None:
    c = window.controller
    assert c.current is None
    _type(qtbot, window, "hello")
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert c.model.message(0).content == "hello"
    assert window.composer.text() == "" and c.store.draft(c.current.id) == ""
    assert c.store.draft(None) == ""


def test_a_draft_is_saved_while_typing_and_the_app_reopens_on_the_chat_shown(
        qtbot, tiny_llama) -> None:
    first = open_window(qtbot, tiny_llama)
    c = first.controller
    older = c.new_session("q8")
    newer = c.new_session("q6")
    _type(qtbot, first, "a draft for the newer chat")
    c.select_session(older.id)
    _type(qtbot, first, "typed, never sent")
    # Saved a moment after the typing stops, window still open: a crash keeps it.
    other = HistoryStore()
    try:
        qtbot.waitUntil(lambda: other.draft(older.id) == "typed, never sent", timeout=5000)
    finally:
        other.close()
    close_window(first)

    second = open_window(qtbot, tiny_llama)
    try:
        # The chat on screen at quit is shown again, not the most recent one.
        assert second.controller.current.id == older.id
        assert second.composer.text() == "typed, never sent"
        second.controller.select_session(newer.id)
        assert second.composer.text() == "a draft for the newer chat"
    finally:
        close_window(second)


def test_quitting_mid_answer_asks_and_keeps_the_partial_answer(qtbot, tiny_llama) -> None:
    window = open_window(qtbot, tiny_llama, max_tokens=4000)
    c = window.controller
    try:
        window.composer.set_text("Tell me a long story")
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: c.model.rowCount() == 2 and bool(c.model.message(1).content),
                        timeout=ANSWER_TIMEOUT_MS)
        window.close()
        box = window.quit_box
        assert window.isVisible() and box is not None and box.isVisible()
        assert box.text() == QUIT_WHILE_ANSWERING
        assert box.button(QUIT).text() == "Quit"
        assert box.defaultButton() is box.button(QMessageBox.StandardButton.Cancel)
        box.button(QMessageBox.StandardButton.Cancel).click()
        # Cancel: the window stays and the answer goes on.
        assert window.isVisible() and not c.closed
        grown = len(c.model.message(1).content)
        qtbot.waitUntil(lambda: len(c.model.message(1).content) > grown,
                        timeout=ANSWER_TIMEOUT_MS)
        session_id = c.current.id
        window.close()
        window.quit_box.button(QUIT).click()
        assert not window.isVisible() and c.closed
        answer = c.store.messages(session_id)[1]
        assert answer.status == "stopped" and len(answer.content) > grown
    finally:
        close_window(window)


def test_unsent_attachments_are_part_of_the_draft_across_switches_and_restarts(
        qtbot, tiny_llama, tmp_path) -> None:
    doc = tmp_path / "pines.md"
    doc.write_text("Longleaf pines grow in the sandy coastal plain.\n" * 10)
    first = open_window(qtbot, tiny_llama)
    c = first.controller
    with_file = c.new_session("q8")
    first.add_files([str(doc)])
    qtbot.waitUntil(lambda: bool(first.attachments), timeout=20_000)
    (record,) = first.attachments.values()
    _type(qtbot, first, "what grows here?")
    other = c.new_session("q6")
    assert not first.attachments and not first.composer.chips  # the new chat has none
    c.select_session(with_file.id)
    assert tuple(first.attachments.values()) == (record,)
    (chip,) = first.composer.chips.values()
    assert "pines.md" in chip.label.text()
    # Stored with the chat at once, text included: the file itself is not needed again.
    assert c.store.draft_attachments(with_file.id) == (record,)
    assert c.store.draft_attachments(other.id) == ()
    close_window(first)
    doc.unlink()

    second = open_window(qtbot, tiny_llama)
    try:
        assert second.controller.current.id == with_file.id
        assert second.composer.text() == "what grows here?"
        assert tuple(second.attachments.values()) == (record,)
        # Removing the chip removes it from the draft; sending leaves no draft.
        (chip_id,) = second.composer.chips
        second._remove_attachment(chip_id)
        assert second.controller.store.draft_attachments(with_file.id) == ()
        second.drafts.show_attachments((record,))
        second.drafts.save_now()
        with qtbot.waitSignal(second.controller.answerFinished, timeout=ANSWER_TIMEOUT_MS):
            second.send()
        assert second.controller.model.message(0).attachments == (record,)
        assert second.controller.store.draft_attachments(with_file.id) == ()
        assert second.controller.store.draft(with_file.id) == ""
    finally:
        close_window(second)


def test_a_pause_in_typing_beside_attached_files_does_not_write_them_again(
        qtbot, window, tmp_path) -> None:
    """The files of a draft are written when they change, not at every pause in
    typing (megabytes of documents, rewritten on the GUI thread each time)."""
    c = window.controller
    chat = _chat_with_a_file(qtbot, window, tmp_path)
    written = _typed_and_saved(qtbot, window, "what grows", "what grows here?")
    assert c.store.draft(chat.id) == "what grows here?"
    assert not [sql for sql in written if "draft_attachments" in sql]
    assert len(c.store.draft_attachments(chat.id)) == 1
    # A change of the files is written, with the text.
    (chip_id,) = window.composer.chips
    window._remove_attachment(chip_id)
    assert c.store.draft_attachments(chat.id) == ()


def test_a_pause_in_typing_an_edit_does_not_write_its_files_again(
        qtbot, window, tmp_path) -> None:
    c = window.controller
    chat = _chat_with_a_file(qtbot, window, tmp_path)
    _answered(qtbot, window, "what grows?")
    c.begin_edit()
    assert len(window.attachments) == 1
    _typed_and_saved(qtbot, window, "what grows")  # the edit and its files, written once
    written = _typed_and_saved(qtbot, window, "what grows here?", "what grows here now?")
    assert written and not [sql for sql in written if "Longleaf pines grow" in sql]
    kept = c.store.edit(chat.id)
    assert kept is not None and kept.text == "what grows here now?"
    assert [a.name for a in kept.attachments] == ["pines.md"]


def _chat_with_a_file(qtbot, window, folder) -> SessionRecord:
    """A new chat with one small document attached to its draft."""
    doc = folder / "pines.md"
    doc.write_text("Longleaf pines grow in the sandy coastal plain.\n" * 10)
    chat = window.controller.new_session("q8")
    window.add_files([str(doc)])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    return chat


def _typed_and_saved(qtbot, window, *texts: str) -> list[str]:
    """Type each of ``texts`` in turn and save the draft after each: the SQL the
    history ran meanwhile."""
    store = window.controller.store
    written: list[str] = []
    store._db.set_trace_callback(written.append)
    try:
        for text in texts:
            _type(qtbot, window, text)
            window.drafts.save_now()
    finally:
        store._db.set_trace_callback(None)
    return written


def _answered(qtbot, window, text: str) -> None:
    _type(qtbot, window, text)
    with qtbot.waitSignal(window.controller.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)


def _editing_beside_a_draft(qtbot, window) -> SessionRecord:
    """A chat whose question was answered, with a draft typed, then its question
    put back in the composer to edit."""
    chat = window.controller.new_session("q8")
    _answered(qtbot, window, "Original question")
    _type(qtbot, window, "a long draft I was typing")
    window.controller.begin_edit()
    assert window.composer.text() == "Original question"
    return chat


def test_deleting_the_chat_edited_with_no_chat_after_it_ends_the_edit(qtbot, window) -> None:
    c = window.controller
    chat = _editing_beside_a_draft(qtbot, window)
    for other in c.store.sessions():
        if other.id != chat.id:
            c.sessions.delete_session(other.id)
    c.sessions.delete_session(chat.id)
    assert c.current is None and not c.editing
    assert window.composer.editing_box.isHidden()
    assert c.store.edit(chat.id) is None


def test_an_edit_sets_the_draft_aside_and_gives_it_back_once_sent(qtbot, window) -> None:
    c = window.controller
    chat = _editing_beside_a_draft(qtbot, window)
    # What is saved stays the draft: a crash mid-edit loses none of it.
    window.drafts.save_now()
    assert c.store.draft(chat.id) == "a long draft I was typing"
    _answered(qtbot, window, "Edited question")
    assert [m.content for m in c.store.messages(chat.id) if m.role == "user"] == [
        "Edited question"]
    assert window.composer.text() == "a long draft I was typing"
    assert c.store.draft(chat.id) == "a long draft I was typing"


def test_leaving_a_chat_mid_edit_keeps_the_edit_and_the_draft_for_its_return(
        qtbot, window) -> None:
    c = window.controller
    chat = _editing_beside_a_draft(qtbot, window)
    window.composer.set_text("Original question, rewritten")
    other = c.new_session("q4")  # e.g. to follow another chat's answer
    # The other chat's box holds its own draft, and no edit.
    assert not c.editing and window.composer.text() == ""
    assert not window.composer.editing_box.isVisible()
    c.select_session(chat.id)
    # Back in edit mode, said so (not the old message as a plain draft: sent, it would
    # have come as a second question), with the draft still set aside.
    assert c.editing and window.composer.editing_box.isVisible()
    assert window.composer.text() == "Original question, rewritten"
    assert c.store.draft(chat.id) == "a long draft I was typing"
    assert c.store.draft(other.id) == ""
    window.cancel_edit()
    assert window.composer.text() == "a long draft I was typing"
    assert c.store.edit(chat.id) is None


def test_an_edit_kept_for_a_message_no_longer_last_joins_the_draft(qtbot, window) -> None:
    c = window.controller
    chat = c.new_session("q8")
    _answered(qtbot, window, "Original question")
    _type(qtbot, window, "my draft")
    # Kept for a message the chat no longer ends with: sending it must replace nothing.
    c.store.set_edit(chat.id, EditRecord(-1, "rewritten text", ()))
    c.new_session("q4")
    c.select_session(chat.id)
    assert not c.editing and not window.composer.editing_box.isVisible()
    assert window.composer.text() == "my draft\n\nrewritten text"
    assert c.store.edit(chat.id) is None
    assert c.store.draft(chat.id) == "my draft\n\nrewritten text"


def test_an_edit_under_way_comes_back_in_edit_mode_after_a_quit_or_crash(
        qtbot, tiny_llama) -> None:
    first = open_window(qtbot, tiny_llama)
    other = HistoryStore()
    try:
        chat = _editing_beside_a_draft(qtbot, first)
        _type(qtbot, first, "Original question, carefully rewritten")
        # Saved a moment after the typing stops, as a draft is: a crash keeps it too.
        qtbot.waitUntil(lambda: (kept := other.edit(chat.id)) is not None
                        and kept.text == "Original question, carefully rewritten",
                        timeout=5000)
        assert other.draft(chat.id) == "a long draft I was typing"
    finally:
        other.close()
        close_window(first)

    second = open_window(qtbot, tiny_llama)
    try:
        c = second.controller
        assert c.current.id == chat.id and c.editing
        assert second.composer.editing_box.isVisible()
        assert second.composer.text() == "Original question, carefully rewritten"
        _answered(qtbot, second, second.composer.text())
        assert _user_messages(second, chat) == ["Original question, carefully rewritten"]
        assert second.composer.text() == "a long draft I was typing"
        assert c.store.draft(chat.id) == "a long draft I was typing"
    finally:
        close_window(second)


def _user_messages(window, chat: SessionRecord) -> list[str]:
    return [m.content for m in window.controller.store.messages(chat.id) if m.role == "user"]


def test_an_edit_stays_shown_past_other_notices_and_cancel_gives_the_draft_back(
        qtbot, window) -> None:
    c = window.controller
    chat = _editing_beside_a_draft(qtbot, window)
    c.notice.emit("The model used last is not there any more.")  # the banner says another
    window.banner.hide()  # thing, and is dismissed: the edit is still said, beside the box
    box = window.composer.editing_box
    assert box.isVisible() and c.editing
    qtbot.mouseClick(box.findChild(QPushButton), Qt.MouseButton.LeftButton)
    assert not box.isVisible() and not c.editing
    assert window.composer.text() == "a long draft I was typing"
    # A question sent next comes after the last one; it replaces nothing.
    _answered(qtbot, window, "A new question")
    assert _user_messages(window, chat) == ["Original question", "A new question"]


def test_esc_in_the_box_cancels_an_edit_when_nothing_runs_in_its_chat(qtbot, window) -> None:
    c = window.controller
    chat = _editing_beside_a_draft(qtbot, window)
    window.composer.edit.setFocus()
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    assert not c.editing and not window.composer.editing_box.isVisible()
    assert window.composer.text() == "a long draft I was typing"
    assert _user_messages(window, chat) == ["Original question"]


def test_a_file_still_read_when_its_chat_is_left_goes_to_that_chats_draft(
        qtbot, window, tmp_path) -> None:
    doc = tmp_path / "pines.md"
    doc.write_text("Longleaf pines grow in the sandy coastal plain.\n" * 10)
    c = window.controller
    dropped_in = c.new_session("q8")
    other = c.new_session("q4")
    c.select_session(dropped_in.id)
    window.add_files([str(doc)])
    c.select_session(other.id)  # before the file is read: its read ends off screen
    qtbot.waitUntil(lambda: not window.loader.pending, timeout=20_000)
    qtbot.wait(50)
    assert not window.attachments and not window.composer.chips
    assert c.store.draft_attachments(other.id) == ()
    (record,) = c.store.draft_attachments(dropped_in.id)
    assert record.name == "pines.md"
    c.select_session(dropped_in.id)
    assert tuple(window.attachments.values()) == (record,)


def test_quitting_with_a_draft_the_history_cannot_take_asks_first(qtbot, tiny_llama) -> None:
    window = open_window(qtbot, tiny_llama)
    c = window.controller
    try:
        c.new_session("q8")
        c.store._db.execute("PRAGMA query_only = 1")  # a read-only disk
        _type(qtbot, window, "a reply I have not sent")
        window.close()
        box = window.quit_box
        assert window.isVisible() and box is not None and box.isVisible()
        assert box.text() == QUIT_DRAFT_UNSAVED
        box.button(QMessageBox.StandardButton.Cancel).click()
        assert window.isVisible() and window.composer.text() == "a reply I have not sent"
    finally:
        c.store._db.execute("PRAGMA query_only = 0")
        close_window(window)
