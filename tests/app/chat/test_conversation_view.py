"""The conversation pane on its own: rows, labels, Copy."""

from __future__ import annotations

from PySide6.QtCore import QModelIndex
from PySide6.QtGui import QGuiApplication

from app.chat.conversation_view import (
    COLLAPSE_CHARS,
    COPIED_TEXT,
    PAGE_ROWS,
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
    assert view.widget_for(0).body.toPlainText() == "first line\nsecond line\n\nthird"


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
    widget = view.widget_for(0)
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
    return text.replace("\u00a0", " ").replace("\u2060", "")


def test_stats_line_says_a_speculative_answers_tokens_a_step_in_plain_words(qtbot) -> None:
    plain = {"generated_tokens": 48, "ttft": 0.5, "decode_tps": 12.0, "draft_tokens": 0,
             "accepted_tokens": 0, "decode_steps": 48}
    assert _plain(stats_text(plain)) == "48 tokens · first word in 0.5 s · 12.0 tokens/s"
    drafted = {**plain, "draft_tokens": 40, "accepted_tokens": 30, "decode_steps": 18}
    assert _plain(stats_text(drafted)).endswith("12.0 tokens/s · 2.7 tokens a step")
    # A short answer whose drafts were all refused made a token a pass, not fewer (its
    # end token's pass and the one queued after it made none the line counts).
    refused = {**plain, "generated_tokens": 10, "draft_tokens": 6, "decode_steps": 12}
    assert _plain(stats_text(refused)).endswith("12.0 tokens/s · 1.0 tokens a step")
    _, view = _view(qtbot, [ChatMessage("assistant", "ok", "complete", stats=drafted)])
    assert view.widget_for(0).stats.toolTip() == SPECULATIVE_TIP


def test_a_long_first_word_wait_is_said_in_minutes_and_parts_never_break_inside() -> None:
    line = stats_text({"generated_tokens": 1_234, "ttft": 547.2, "decode_tps": 1.9})
    assert _plain(line) == "1,234 tokens · first word in 9m 07s · 1.9 tokens/s"
    assert all(" " not in part for part in line.split(" · "))  # wraps between parts only


def test_a_finished_answers_stats_line_takes_the_room_no_status_needs(qtbot) -> None:
    stats = {"generated_tokens": 40, "ttft": 0.4, "decode_tps": 5.1, "draft_tokens": 30,
             "decode_steps": 40}
    _, view = _view(qtbot, [ChatMessage("assistant", "ok", "complete", stats=stats)])
    view.resize(800, 400)
    qtbot.waitUntil(lambda: view.widget_for(0).width() > 700)
    row = view.widget_for(0)
    assert not row.status.isVisible()  # nothing to say: no empty column beside the stats
    assert row.stats.height() < 2 * row.stats.fontMetrics().lineSpacing()  # one line


def test_a_status_alone_takes_the_rows_width_not_a_few_words(qtbot) -> None:
    # Seen under Xvfb: "Reading the / conversation…" wrapped in a sliver of the row,
    # the empty stats label beside it holding the rest of the width.
    _, view = _view(qtbot, [ChatMessage("user", "Hello", "complete", 1),
                            ChatMessage("assistant", "", "streaming", 2)])
    view.set_busy(True, reading=True)
    view.resize(800, 400)
    qtbot.waitUntil(lambda: view.widget_for(1).width() > 700)
    status = view.widget_for(1).status
    assert status.isVisible() and status.text()
    assert status.height() < 2 * status.fontMetrics().lineSpacing(), status.width()


def test_a_read_stopped_before_any_word_leaves_no_empty_stats_or_copy(qtbot) -> None:
    stats = {"generated_tokens": 0, "ttft": None, "decode_tps": 0.0, "prefill_tokens": 1536}
    _, view = _view(qtbot, [
        ChatMessage("user", "Summarise it", "complete", 1),
        ChatMessage("assistant", "", "stopped", 2,
                    reason="Stopped while reading: 1,536 of 7,757 tokens kept; the next send "
                           "continues from there", stats=stats)])
    row = view.widget_for(1)
    assert row.stats.text() == "" and not row.copy_button.isVisibleTo(row)
    assert row.status.text() == "Stopped while reading: 1,536 of 7,757 tokens kept"
    assert row.regenerate_button.isVisibleTo(row)  # the way to ask again


def test_an_attachment_line_keeps_each_number_with_its_unit() -> None:
    line = MessageWidget("user")
    line.show_message("", "complete", None, None,
                      (AttachmentRecord("report.pdf", 1_200_000, "x", 3_393, "text"),))
    assert "3,393\u00a0tokens" in line.files.text() and "1.1\u00a0MB" in line.files.text()


def test_one_token_is_said_in_the_singular_in_the_stats_and_the_file_line() -> None:
    assert stats_text({"generated_tokens": 1}) == "1\u00a0token"
    line = MessageWidget("user")
    line.show_message("", "complete", None, None,
                      (AttachmentRecord("a.txt", 1, "x", 1, "text"),))
    assert line.files.text().endswith(" · 1\u00a0token")


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


def _long_chat(count: int, tag: str = "") -> list[ChatMessage]:
    """``count`` rows, user and assistant in turn, each saying its row number."""
    return [ChatMessage("user" if i % 2 == 0 else "assistant", f"{tag}message {i}",
                        "complete", i + 1) for i in range(count)]


def _texts(view: ConversationView) -> list[str]:
    return [widget.body.markdown() for widget in view.widgets]


def _at_bottom(qtbot, view: ConversationView) -> None:
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: 0 < bar.maximum() == bar.value())


def _scroll_to_top(qtbot, view: ConversationView) -> None:
    """Scroll to the top, as the user would, and wait for the page above."""
    first, bar = view.first_built, view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.value() > 0)  # at the bottom, or where the last page kept it
    bar.setValue(0)
    qtbot.waitUntil(lambda: view.first_built < first)


def _with_actions(view: ConversationView, button: str) -> list[int]:
    """The model rows whose ``button`` (an attribute of ``MessageWidget``) shows."""
    return [row for row, widget in enumerate(view.widgets, view.first_built)
            if getattr(widget, button).isVisibleTo(widget)]


def test_a_long_chat_opens_with_only_its_last_page_built(qtbot) -> None:
    _, view = _view(qtbot, _long_chat(300))
    assert len(view.widgets) == PAGE_ROWS and view.first_built == 300 - PAGE_ROWS
    assert _texts(view) == [f"message {i}" for i in range(300 - PAGE_ROWS, 300)]
    assert view.widget_for(299) is view.widgets[-1] and view.widget_for(0) is None
    _at_bottom(qtbot, view)  # follows the bottom, as before
    assert not view.placeholder.isVisible()


def test_scrolling_to_the_top_builds_the_page_above_keeping_the_rows_in_place(qtbot) -> None:
    _, view = _view(qtbot, _long_chat(300))
    view.resize(600, 500)
    _at_bottom(qtbot, view)
    bar = view.verticalScrollBar()
    bar.setValue(0)
    top = view.widgets[0]
    shown_at = top.y()  # where the top row is on screen, the scroll value being 0
    qtbot.waitUntil(lambda: view.first_built == 300 - 2 * PAGE_ROWS)
    assert view.widget_for(300 - PAGE_ROWS) is top
    assert _texts(view)[:2] == [f"message {300 - 2 * PAGE_ROWS}",
                                f"message {301 - 2 * PAGE_ROWS}"]
    # The scroll value moved by the height put above: the top row did not move on screen.
    qtbot.waitUntil(lambda: bar.value() > 0 and top.y() - bar.value() == shown_at)
    qtbot.wait(50)  # the new rows' heights settled: still in place
    assert bar.value() == top.y() - shown_at and view.first_built == 300 - 2 * PAGE_ROWS


def test_every_page_loaded_builds_every_row_in_order(qtbot) -> None:
    _, view = _view(qtbot, _long_chat(300))
    _at_bottom(qtbot, view)
    pages = [view.first_built]
    while view.first_built > 0:
        _scroll_to_top(qtbot, view)
        pages.append(view.first_built)
    assert pages == [300 - PAGE_ROWS * n for n in range(1, 300 // PAGE_ROWS + 1)] + [0]
    assert _texts(view) == [f"message {i}" for i in range(300)]
    assert [view.widget_for(row) for row in range(300)] == view.widgets


def test_actions_stay_on_the_last_rows_of_a_partly_built_chat(qtbot) -> None:
    # 30 answers after the last question, more than a page of rows after it.
    rows = [*_long_chat(100), *[ChatMessage("assistant", f"more {i}", "complete", 200 + i)
                                for i in range(PAGE_ROWS)]]
    model, view = _view(qtbot, rows)
    assert view.first_built == 100
    assert _with_actions(view, "regenerate_button") == [139]
    assert _with_actions(view, "edit_button") == []  # row 98, not built yet
    _scroll_to_top(qtbot, view)
    assert _with_actions(view, "edit_button") == [98]
    assert _with_actions(view, "regenerate_button") == [139]
    view.set_busy(True)
    assert _with_actions(view, "edit_button") == _with_actions(view, "regenerate_button") == []
    view.set_busy(False)
    model.append(ChatMessage("user", "a new question", "complete", 300))
    assert _with_actions(view, "edit_button") == [140]
    assert _with_actions(view, "regenerate_button") == []


def test_an_edit_of_the_last_rows_of_a_partly_built_chat(qtbot) -> None:
    model, view = _view(qtbot, _long_chat(300))
    model.truncate(298)  # edit the last question: it and its answer go
    assert view.first_built == 260 and _texts(view)[-1] == "message 297"
    assert _with_actions(view, "regenerate_button") == [297]
    assert _with_actions(view, "edit_button") == [296]
    model.append(ChatMessage("user", "edited", "complete", 400))
    model.append(ChatMessage("assistant", "", "streaming", 401))
    view.set_busy(True)
    model.append_text("Pines grow")
    model.flush()
    assert _texts(view)[-2:] == ["edited", "Pines grow"]
    assert view.widget_for(299) is view.widgets[-1] and len(view.widgets) == PAGE_ROWS
    model.truncate(100)  # every built row goes: the rows left open at their last page
    assert view.first_built == 100 - PAGE_ROWS
    assert _texts(view) == [f"message {i}" for i in range(100 - PAGE_ROWS, 100)]
    assert _visible_rows(view) == _texts(view)


def test_rows_put_in_or_taken_out_above_the_built_ones_keep_each_row_its_widget(qtbot) -> None:
    model, view = _view(qtbot, _long_chat(100))
    model.beginRemoveRows(QModelIndex(), 10, 69)  # 60 rows, some of them built
    del model._rows[10:70]
    model.endRemoveRows()
    assert view.first_built == 10 and _texts(view) == [f"message {i}" for i in range(70, 100)]
    model.beginInsertRows(QModelIndex(), 5, 6)
    model._rows[5:5] = [ChatMessage("user", "put in", "complete", 500),
                        ChatMessage("assistant", "put in", "complete", 501)]
    model.endInsertRows()
    assert view.first_built == 12 and view.widget_for(12) is view.widgets[0]
    assert _texts(view)[0] == "message 70" and len(view.widgets) == 30


def test_another_chat_opens_at_its_own_last_page(qtbot) -> None:
    model, view = _view(qtbot, _long_chat(300))
    _at_bottom(qtbot, view)
    _scroll_to_top(qtbot, view)
    model.set_messages(_long_chat(301, "other "))
    assert view.first_built == 301 - PAGE_ROWS and len(view.widgets) == PAGE_ROWS
    assert _texts(view)[-1] == "other message 300"
    _at_bottom(qtbot, view)
    qtbot.wait(50)
    assert view.first_built == 301 - PAGE_ROWS  # no page above was built on the way
    model.set_messages([])
    assert view.widgets == [] and view.placeholder.isVisibleTo(view)
