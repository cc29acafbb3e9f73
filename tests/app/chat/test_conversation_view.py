"""The conversation pane on its own: rows, labels, Copy."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication

from app.chat.conversation_view import (
    COLLAPSE_CHARS,
    COPIED_TEXT,
    SHOW_ALL,
    SPECULATIVE_TIP,
    ConversationView,
    MessageWidget,
    collapsed,
    stats_text,
)
from app.chat.model import ChatMessage, ChatModel
from app.chat.recorder import CLOSED_WHILE_ANSWERING
from app.store import AttachmentRecord


def _view(qtbot, rows: list[ChatMessage]) -> tuple[ChatModel, ConversationView]:
    model = ChatModel()
    model.set_messages(rows)
    view = ConversationView(model)
    qtbot.addWidget(view)
    view.show()
    return model, view


def _visible_rows(view: ConversationView) -> list[str]:
    """The rows the column lays out (a widget out of the layout and hidden is gone)."""
    layout = view.layout_
    widgets = [layout.itemAt(i).widget() for i in range(layout.count())]
    return [w.body.markdown() for w in widgets if isinstance(w, MessageWidget)]


def test_shift_enter_line_breaks_stay_in_a_sent_message(qtbot) -> None:
    _, view = _view(qtbot, [ChatMessage("user", "first line\nsecond line\n\nthird")])
    assert view.widgets[0].body.toPlainText() == "first line\nsecond line\n\nthird"


def test_another_chats_rows_replace_the_old_ones_at_once(qtbot) -> None:
    # No event loop turn between (as inside a context menu's own loop): the old
    # chat's rows must already be gone, not wait for their deferred deletion.
    model, view = _view(qtbot, [ChatMessage("user", "old question"),
                                ChatMessage("assistant", "old answer")])
    model.set_messages([ChatMessage("user", "new question")])
    assert _visible_rows(view) == ["new question"]
    model.truncate(0)
    assert _visible_rows(view) == []


def test_copy_says_it_copied(qtbot) -> None:
    _, view = _view(qtbot, [ChatMessage("assistant", "**an answer**")])
    widget = view.widgets[0]
    widget.copy_button.click()
    assert QGuiApplication.clipboard().text() == "**an answer**"
    assert widget.copy_button.text() == COPIED_TEXT
    qtbot.waitUntil(lambda: widget.copy_button.text() == "Copy", timeout=5000)


def test_an_answer_cut_by_closing_the_app_says_so(qtbot) -> None:
    _, view = _view(qtbot, [
        ChatMessage("assistant", "half", "stopped", reason=CLOSED_WHILE_ANSWERING),
        ChatMessage("assistant", "half", "stopped", reason="Stopped")])
    closed, stopped = view.widgets
    assert closed.status.text() == "Closed while answering"
    assert closed.status.toolTip() == CLOSED_WHILE_ANSWERING
    assert stopped.status.text() == "Stopped"


def test_a_long_user_message_is_collapsed_with_show_all(qtbot) -> None:
    paste = "\n".join(f"line {i}: " + "words " * 30 for i in range(100))  # ~18,000 characters
    _model, view = _view(qtbot, [ChatMessage("user", paste, "complete", 1),
                                 ChatMessage("user", "short", "complete", 2)])
    long_row, short_row = view.widgets
    assert not short_row.show_all.isVisible()
    assert short_row.body.markdown() == "short"
    shown = long_row.body.markdown()
    assert len(shown) <= COLLAPSE_CHARS + 2 and paste.startswith(shown.removesuffix(" …"))
    assert paste[len(shown) - 2] in " \n"  # cut at a word or line end, never inside a word
    assert long_row.show_all.isVisible() and long_row.show_all.text().startswith(SHOW_ALL)
    long_row.show_all.click()
    assert long_row.body.markdown() == paste and long_row.show_all.text() == "Show less"
    long_row.show_all.click()
    assert long_row.body.markdown() == shown
    long_row.copy_button.click()  # Copy takes the whole message, collapsed or not
    assert QGuiApplication.clipboard().text() == paste
    assert collapsed("\n".join(["x"] * 30)) is not None  # many short lines collapse too


def _plain(text: str) -> str:
    return text.replace("\u00a0", " ")


def test_stats_line_says_a_speculative_answers_tokens_a_step_in_plain_words(qtbot) -> None:
    plain = {"generated_tokens": 48, "ttft": 0.5, "decode_tps": 12.0, "draft_tokens": 0,
             "accepted_tokens": 0, "decode_steps": 48}
    assert _plain(stats_text(plain)) == "48 tokens · first word in 0.5 s · 12.0 tokens/s"
    drafted = {**plain, "draft_tokens": 40, "accepted_tokens": 30, "decode_steps": 18}
    assert _plain(stats_text(drafted)).endswith("12.0 tokens/s · 2.7 tokens a step")
    _, view = _view(qtbot, [ChatMessage("assistant", "ok", "complete", stats=drafted)])
    assert view.widgets[0].stats.toolTip() == SPECULATIVE_TIP


def test_a_long_first_word_wait_is_said_in_minutes_and_parts_never_break_inside() -> None:
    line = stats_text({"generated_tokens": 1_234, "ttft": 547.2, "decode_tps": 1.9})
    assert _plain(line) == "1,234 tokens · first word in 9m 07s · 1.9 tokens/s"
    assert all(" " not in part for part in line.split(" · "))  # wraps between parts only


def test_a_read_stopped_before_any_word_leaves_no_empty_stats_or_copy(qtbot) -> None:
    stats = {"generated_tokens": 0, "ttft": None, "decode_tps": 0.0, "prefill_tokens": 1536}
    _, view = _view(qtbot, [
        ChatMessage("user", "Summarise it", "complete", 1),
        ChatMessage("assistant", "", "stopped", 2,
                    reason="Stopped while reading: 1,536 of 7,757 tokens kept; the next send "
                           "continues from there", stats=stats)])
    row = view.widgets[1]
    assert row.stats.text() == "" and not row.copy_button.isVisibleTo(row)
    assert row.status.text() == "Stopped while reading: 1,536 of 7,757 tokens kept"
    assert row.regenerate_button.isVisibleTo(row)  # the way to ask again


def test_an_attachment_line_keeps_each_number_with_its_unit() -> None:
    line = MessageWidget("user")
    line.show_message("", "complete", None, None,
                      (AttachmentRecord("report.pdf", 1_200_000, "x", 3_393, "text"),))
    assert "3,393\u00a0tokens" in line.files.text() and "1.1\u00a0MB" in line.files.text()


def test_a_files_name_is_shown_as_written_never_as_markup(qtbot) -> None:
    """A file may be named like HTML: its name is text in the message, the composer's
    chip and its notices, never a heading, nor an image Qt would read from disk."""
    from app.chat.composer import AttachmentChip

    name = "<img src=secret.png width=3000 height=3000><h1>Hacked</h1>.txt"
    line = MessageWidget("user")
    qtbot.addWidget(line)
    line.show_message("", "complete", None, None,
                      (AttachmentRecord(name, 10, "x", 3, "text"),))
    chip = AttachmentChip(1, name)
    qtbot.addWidget(chip)
    for label in (line.files, chip.label):
        assert name in label.text()
        assert label.sizeHint().width() < 3000 and label.sizeHint().height() < 100, label


def test_a_flush_of_streamed_text_walks_no_other_row(qtbot, monkeypatch) -> None:
    """A long chat's streaming answer: each flush renders its row and leaves the
    others' actions alone (they follow statuses, not streamed text)."""
    rows = [ChatMessage("user" if i % 2 == 0 else "assistant", f"message {i}", "complete", i)
            for i in range(200)]
    model, view = _view(qtbot, [*rows, ChatMessage("assistant", "", "streaming", 200)])
    calls: list[object] = []
    original = MessageWidget.set_actions
    monkeypatch.setattr(MessageWidget, "set_actions",
                        lambda self, **kw: calls.append(self) or original(self, **kw))
    model.append_text("Pines grow")
    model.flush()
    assert calls == [] and view.widgets[-1].body.markdown() == "Pines grow"
    model.update_last(status="complete")  # the answer ends: the actions follow
    assert len(calls) == len(view.widgets)
    assert view.widgets[-1].copy_button.isVisibleTo(view.widgets[-1])
