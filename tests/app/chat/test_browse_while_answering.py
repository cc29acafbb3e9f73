"""Reading other chats while an answer streams into its own."""

from __future__ import annotations

from PySide6.QtCore import Qt

from engine.session.sampling import SamplingParams
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait, sidebar_line
from tests.app.memory.test_panel import _assert_panel_shows


def test_other_chats_can_be_read_while_an_answer_streams_into_its_own(qtbot, window) -> None:
    c = window.controller
    other = c.new_session("q4")
    assert send_and_wait(qtbot, window, "hello") == "complete"
    other_rows = [(m.role, m.content) for m in c.model.messages()]
    answering = c.new_session("q8")
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=4000)
    window.composer.set_text("Tell me a long story")
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS) as finished:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        recorder = c.recorder_of(answering.id)
        qtbot.waitUntil(lambda: len(recorder.text) > 0, timeout=ANSWER_TIMEOUT_MS)
        window.sessions.list.setCurrentRow(
            [r.id for r in window.sessions.records()].index(other.id))
        assert c.current.id == other.id and not window.banner.isVisible()
        assert [(m.role, m.content) for m in c.model.messages()] == other_rows
        grown_from = len(recorder.text)
        qtbot.waitUntil(lambda: len(recorder.text) > grown_from + 5, timeout=ANSWER_TIMEOUT_MS)
        c.model.flush()
        assert [(m.role, m.content) for m in c.model.messages()] == other_rows
        _assert_panel_shows(window, c.current)  # the answering chat's samples are not shown
        # This chat's composer shows this chat only: no Stop, no reading progress of the other.
        composer = window.composer
        assert composer.send_button.text() == "Send" and not composer.progress_box.isVisible()
        assert not composer.waiting_box.isVisible()
        # A message sent here starts at once, beside the answer streaming in the other chat.
        c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=8)
        composer.set_text("and another thing")
        qtbot.keyClick(composer.edit, Qt.Key.Key_Return)
        assert composer.text() == "" and not composer.waiting_box.isVisible()
        assert c.activity.states()[other.id] in ("reading", "answering")
        assert sidebar_line(window, answering.id) == "Answering…"
        # Back to the answering chat: the answer so far is there, and keeps streaming.
        c.select_session(answering.id)
        assert c.model.message(1).content == recorder.text
        assert c.model.message(1).status == "streaming"
        assert composer.send_button.text() == "Stop" and not composer.waiting_box.isVisible()
        c.stop()
    assert finished.args == ["stopped"]
    saved = c.store.messages(answering.id)[-1]
    assert saved.content == c.model.message(1).content and saved.status == "stopped"
    # The other chat's message was answered beside the long answer, in its own chat.
    qtbot.waitUntil(lambda: not c.busy, timeout=ANSWER_TIMEOUT_MS)
    rows = [(m.role, m.content, m.status) for m in c.store.messages(other.id)]
    assert [(r, t) for r, t, _s in rows[:len(other_rows)]] == other_rows
    assert [r[0] for r in rows[len(other_rows):]] == ["user", "assistant"]
    assert rows[-1][2] == "complete" and rows[-2][1] == "and another thing"
    assert c.store.session(answering.id).tokens > 0


def test_the_chat_answering_cannot_be_deleted_but_others_can(qtbot, window) -> None:
    c = window.controller
    spare = c.new_session("q4")
    c.new_session("q8")
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=4000)
    window.composer.set_text("Tell me a long story")
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        answering = c.current.id
        c.select_session(spare.id)
        c.delete_session(answering)
        assert c.store.session(answering) is not None and window.banner.isVisible()
        c.delete_session(spare.id)
        assert c.store.session(spare.id) is None
        c.stop()
