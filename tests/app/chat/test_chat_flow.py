"""Chatting with the real engine worker on a tiny model, through the window."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.chat.model import StatusRole
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait


def _rows(window) -> list[tuple[str, str, str]]:
    return [(m.role, m.content, m.status) for m in window.controller.model.messages()]


def _stored(window) -> list[tuple[str, str, str]]:
    c = window.controller
    return [(m.role, m.content, m.status) for m in c.store.messages(c.current.id)]


def test_answer_streams_into_the_model_and_is_saved(qtbot, window) -> None:
    c = window.controller
    flushes: list[str] = []
    c.model.streamFlushed.connect(flushes.append)
    status = send_and_wait(qtbot, window, "What is the capital of France?")
    assert status == "complete"
    (user, answer) = _rows(window)
    assert user == ("user", "What is the capital of France?", "complete")
    assert answer[0] == "assistant" and answer[2] == "complete" and answer[1]
    assert flushes and flushes[-1] == answer[1]  # streamed in, flush by flush
    assert all(answer[1].startswith(f) for f in flushes)
    assert _stored(window) == _rows(window)
    stats = c.model.message(1).stats
    assert stats["generated_tokens"] > 0 and stats["decode_tps"] > 0
    shown = window.conversation.widget_for(1).stats.text()
    assert f"{stats['generated_tokens']:,}\u00a0tokens" in shown
    assert c.current.title == "What is the capital of France?"
    assert window.composer.text() == ""  # sent text leaves the composer


def test_stop_keeps_the_partial_answer(qtbot, window) -> None:
    c = window.controller
    c.settings.sampling = c.settings.sampling.__class__(temperature=0.0, max_tokens=4000)
    window.composer.set_text("Tell me a long story")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(c.model.rowCount() == 2 and c.model.message(1).content),
                    timeout=ANSWER_TIMEOUT_MS)
    assert window.composer.send_button.text() == "Stop"
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS) as done:
        qtbot.keyClick(window, Qt.Key.Key_Escape)
    assert done.args == ["stopped"]
    role, content, status = _rows(window)[1]
    assert status == "stopped" and content
    assert _stored(window)[1] == (role, content, "stopped")
    assert window.composer.send_button.text() == "Send"
    assert "Stopped" in window.conversation.widget_for(1).status.text()


def test_regenerate_replaces_only_the_last_answer(qtbot, window) -> None:
    c = window.controller
    send_and_wait(qtbot, window, "First question")
    first_ids = [m.message_id for m in c.model.messages()]
    first_answer = c.model.message(1).content
    assert window.conversation.widget_for(1).regenerate_button.isVisibleTo(window)
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        window.conversation.widget_for(1).regenerate_button.click()
    rows = _rows(window)
    assert [r[0] for r in rows] == ["user", "assistant"]
    assert rows[0][1] == "First question" and rows[1][2] == "complete"
    assert c.model.message(1).message_id != first_ids[1]  # a new answer row
    assert _stored(window) == rows
    # Temperature 0 after trimming the cache back to the prompt: the same answer again.
    assert rows[1][1] == first_answer


def test_an_answer_to_a_turn_set_aside_is_not_made_again(qtbot, window) -> None:
    # Made again, it was sent ending on the answer before the turn set aside (which
    # the engine never reads), so the model went on from that answer.
    from tests.app.chat.test_documents_drop import TEXT

    c = window.controller
    send_and_wait(qtbot, window, "Hello")
    assert send_and_wait(qtbot, window, TEXT * 300) == "failed"
    last = c.model.rowCount() - 1
    assert c.model.message(last).role == "assistant"
    assert not c.can_regenerate()
    assert not window.conversation.widget_for(last).regenerate_button.isVisibleTo(window)
    rows = _rows(window)
    c.regenerate()  # the menu's Regenerate, were it reached: nothing happens
    assert _rows(window) == rows and not c.busy


def test_edit_and_resend_replaces_the_last_turn(qtbot, window) -> None:
    c = window.controller
    send_and_wait(qtbot, window, "Original question")
    window.conversation.widget_for(0).edit_button.click()
    assert window.composer.text() == "Original question"
    assert c.editing
    status = send_and_wait(qtbot, window, "Edited question")
    assert status == "complete"
    rows = _rows(window)
    assert [(r[0], r[1]) for r in rows][:1] == [("user", "Edited question")]
    assert len(rows) == 2
    assert _stored(window) == rows
    # The title came from the first message: it follows its edit.
    assert c.current.title == c.store.session(c.current.id).title == "Edited question"


def test_an_edit_too_long_for_the_context_comes_back_to_the_box(qtbot, window) -> None:
    """The chat stays as it was (the earlier turn and its answer), and the edit is in
    the composer again, in edit mode, to be shortened."""
    from tests.app.chat.test_documents_drop import TEXT

    c = window.controller
    send_and_wait(qtbot, window, "Original question")
    before = _stored(window)
    window.composer.set_text("a draft of the next question")
    window.conversation.widget_for(0).edit_button.click()
    assert send_and_wait(qtbot, window, TEXT * 300) == "failed"
    assert _stored(window) == _rows(window) == before
    assert c.editing and window.composer.text() == TEXT * 300
    said = window.banner.label.text()
    assert "only 4,096 fit" in said and said.endswith("your edit is back in the box.")
    window.cancel_edit()  # the draft the edit set aside is back
    assert window.composer.text() == "a draft of the next question"
    assert _stored(window) == before


def test_editing_the_first_message_keeps_a_title_the_user_chose(qtbot, window) -> None:
    c = window.controller
    send_and_wait(qtbot, window, "Original question")
    c.rename_session(c.current.id, "My own title")
    window.conversation.widget_for(0).edit_button.click()
    send_and_wait(qtbot, window, "Edited question")
    assert c.current.title == "My own title"


def test_sending_while_the_model_loads_keeps_the_text(qtbot, window) -> None:
    c = window.controller
    c.model_state.ready = False  # as during a model switch
    errors: list[str] = []
    c.errorRaised.connect(errors.append)
    window.composer.set_text("don't lose me")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert window.composer.text() == "don't lose me"
    assert errors and "still loading" in errors[0]
    assert window.banner.isVisible() and "still loading" in window.banner.label.text()
    c.model_state.ready = True


def test_interrupted_rows_show_their_status(qtbot, window) -> None:
    c = window.controller
    session = c.store.create_session("Old", "q8", "demo")
    c.store.add_message(session.id, "user", "hello")
    c.store.add_message(session.id, "assistant", "partial", "interrupted")
    c.select_session(session.id)
    assert c.model.data(c.model.index(1), StatusRole) == "interrupted"
    assert "Interrupted" in window.conversation.widget_for(1).status.text()


def test_deleting_a_chat_answering_behind_another_names_it(qtbot, window) -> None:
    # Stop and Esc act on the chat shown, which has nothing to stop: "Stop the current
    # answer before deleting its chat." pointed at nothing.
    c = window.controller
    answering = c.new_session("q8")
    said: list[str] = []
    c.activity.refused.connect(said.append)
    window.composer.set_text("Tell me about pines")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: c.activity.job_of(answering.id) is not None)
    c.new_session("q8")
    c.delete_session(answering.id)
    assert said and said[-1].startswith("Stop the answer in ‘")
    assert c.store.session(answering.id) is not None
    qtbot.waitUntil(lambda: c.activity.job_of(answering.id) is None, timeout=ANSWER_TIMEOUT_MS)
