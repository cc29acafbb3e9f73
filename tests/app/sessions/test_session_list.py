"""The session list on its own: search, rename, confirmed delete."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QInputDialog, QLineEdit, QMessageBox

from app.sessions.session_list import (
    ANSWERING,
    NO_CHATS,
    NO_MATCH,
    RecordRole,
    SessionList,
    StateRole,
    detail_text,
    rename_dialog,
)
from app.store import HistoryStore, SessionRecord


def _two_chats(qtbot, shown: int) -> tuple[HistoryStore, list[str], SessionList]:
    """A list of two chats ("Tax return", then "Holiday"), chat ``shown`` selected."""
    store = HistoryStore()
    ids = [store.create_session(title, "q8", "demo").id for title in ("Tax return", "Holiday")]
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.set_sessions(store.sessions(), ids[shown])
    return store, ids, sidebar


def test_session_list_search_rename_and_confirmed_delete(qtbot, monkeypatch) -> None:
    store, (a_id, b_id), sidebar = _two_chats(qtbot, shown=1)
    a, b = store.session(a_id), store.session(b_id)
    assert [r.id for r in sidebar.records()] == [b.id, a.id]
    with qtbot.waitSignal(sidebar.sessionSelected) as selected:
        sidebar.list.setCurrentRow(1)
    assert selected.args == [a.id]

    def rename(dialog: QInputDialog) -> int:
        dialog.setTextValue("Taxes 2025")
        return 1

    monkeypatch.setattr(QInputDialog, "exec", rename)
    with qtbot.waitSignal(sidebar.renameRequested) as renamed:
        sidebar.ask_rename(store.session(a.id))
    assert renamed.args == [a.id, "Taxes 2025"]

    clicks = iter(["Cancel", "Delete"])

    def answer(box: QMessageBox) -> int:
        wanted = next(clicks)
        next(b for b in box.buttons() if b.text().replace("&", "") == wanted).click()
        return 0

    monkeypatch.setattr(QMessageBox, "exec", answer)
    deleted: list[str] = []
    sidebar.deleteRequested.connect(deleted.append)
    sidebar.ask_delete(store.session(b.id))  # cancelled: nothing happens
    assert deleted == []
    sidebar.ask_delete(store.session(b.id))
    assert deleted == [b.id]
    store.close()


@pytest.mark.parametrize("key", ["Ctrl+Backspace", "Delete"])
def test_the_keyboard_deletes_the_selected_chat_after_asking(qtbot, monkeypatch,
                                                             key: str) -> None:
    store, (a_id, b_id), sidebar = _two_chats(qtbot, shown=0)
    sidebar.show()
    qtbot.waitExposed(sidebar)
    sidebar.list.setFocus()

    def confirm(box: QMessageBox) -> int:
        next(b for b in box.buttons() if b.text().replace("&", "") == "Delete").click()
        return 0

    monkeypatch.setattr(QMessageBox, "exec", confirm)
    deleted: list[str] = []
    sidebar.deleteRequested.connect(deleted.append)
    # Before, only the right-click menu could delete a chat.
    qtbot.keyClick(sidebar.list, QKeySequence(key)[0].key(),
                   QKeySequence(key)[0].keyboardModifiers())
    assert deleted == [a_id] and b_id not in deleted
    store.close()


def test_a_search_without_a_match_says_so(qtbot) -> None:
    store = HistoryStore()
    store.create_session("Tax return", "q8", "demo")
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.show()
    sidebar.set_sessions(store.sessions(), None)
    assert not sidebar.no_match.isVisible() and sidebar.list.isVisible()
    sidebar.search.setText("zebra")
    sidebar.set_sessions(store.sessions("zebra"), None)
    assert sidebar.no_match.isVisible() and sidebar.no_match.text() == NO_MATCH
    assert not sidebar.list.isVisible()
    sidebar.search.setText("tax")
    sidebar.set_sessions(store.sessions("tax"), None)
    assert not sidebar.no_match.isVisible() and sidebar.list.count() == 1
    store.close()


def test_a_chat_with_a_job_says_what_it_does_instead_of_a_token_count(qtbot) -> None:
    store = HistoryStore()
    answering = store.create_session("Answering", "q8", "demo")
    waiting = store.create_session("Waiting", "q6", "demo")
    idle = store.create_session("Idle", "q4", "demo")
    store.set_tokens(idle.id, 1234)
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.set_sessions(store.sessions(), idle.id,
                         {answering.id: "answering", waiting.id: "waiting"})
    lines = {}
    for row in range(sidebar.list.count()):
        item = sidebar.list.item(row)
        record = item.data(RecordRole)
        lines[record.id] = detail_text(record, item.data(StateRole))
    assert lines[answering.id] == ANSWERING
    assert lines[waiting.id] == "Waiting…"
    assert lines[idle.id].startswith("On disk · 1,234 tokens · ")
    assert detail_text(idle, "reading") == "Reading…"
    store.close()


def test_relative_times_are_repainted_as_the_clock_moves(qtbot, monkeypatch) -> None:
    import app.sessions.session_list as session_list

    store = HistoryStore()
    store.create_session("Tax return", "q8", "demo")
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.show()
    sidebar.set_sessions(store.sessions(), None)
    qtbot.waitExposed(sidebar)
    painted: list[str] = []
    real = session_list.detail_lines
    monkeypatch.setattr(session_list, "detail_lines",
                        lambda *a: painted.append(real(*a)) or painted[-1])
    qtbot.wait(50)
    painted.clear()
    clock = sidebar.clock
    assert clock is not None and clock.isActive() and clock.interval() <= 60_000
    clock.timeout.emit()
    qtbot.waitUntil(lambda: bool(painted), timeout=2_000)
    store.close()


def test_the_rename_dialog_shows_a_long_title_whole(qtbot) -> None:
    title = "Summarise the quarterly report and list every open question"
    dialog = rename_dialog(None, title)
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    edit = dialog.findChild(QLineEdit)
    assert edit.width() >= edit.fontMetrics().horizontalAdvance(title)



def test_a_narrow_row_leaves_out_whole_facts_instead_of_cutting_a_number(qtbot) -> None:
    from PySide6.QtGui import QFont, QFontMetrics

    from app.sessions.chat_state import ChatFacts
    from app.sessions.session_list import detail_lines, fitting_detail

    store = HistoryStore()
    record = store.create_session("Report", "q8", "demo")
    facts = ChatFacts(held_tokens=5_172, history_tokens=5_172)
    metrics = QFontMetrics(QFont())
    lines = detail_lines(record, facts)
    assert lines == ["In memory · 5,172 tokens · just now", "In memory · 5,172 tokens",
                     "In memory · 5.17 k tokens", "In memory"]
    for width in range(metrics.horizontalAdvance("In memory"), 400, 7):
        shown = fitting_detail(record, facts, metrics, width)
        assert shown in lines and metrics.horizontalAdvance(shown) <= width
    reading = ChatFacts(job="reading", progress=(512, 7_757))
    assert detail_lines(record, reading) == ["Reading… 6%", "Reading…"]
    store.close()


def test_rows_keep_their_places_under_the_pointer_and_move_when_it_leaves(qtbot) -> None:
    from PySide6.QtCore import QEvent
    from PySide6.QtWidgets import QApplication

    store = HistoryStore()
    a = store.create_session("A", "q8", "demo")
    b = store.create_session("B", "q8", "demo")
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.show()
    sidebar.set_sessions([b, a], None)
    QApplication.sendEvent(sidebar.list.viewport(), QEvent(QEvent.Type.Enter))
    c = store.create_session("C", "q8", "demo")
    sidebar.set_sessions([a, c, b], None)  # A answered: it would jump to the top
    assert [r.title for r in sidebar.records()] == ["C", "B", "A"]
    QApplication.sendEvent(sidebar.list.viewport(), QEvent(QEvent.Type.Leave))
    assert [r.title for r in sidebar.records()] == ["A", "C", "B"]
    store.close()


def test_a_selected_rows_badge_stands_out_from_a_highlight_of_its_own_colour(qtbot) -> None:
    """A green selection (the dark scheme's) under a green q8 badge: the badge keeps
    an edge of the selected text's colour, not only its letters."""
    from PySide6.QtCore import QRect
    from PySide6.QtGui import QColor, QFont, QImage, QPainter, QPalette
    from PySide6.QtWidgets import QStyle, QStyleOptionViewItem

    from app.sessions.session_list import (
        SessionDelegate,
        mode_badge_font,
        mode_badge_width,
        mode_colour,
    )

    _, _, sidebar = _two_chats(qtbot, 0)
    index = sidebar.list.model().index(0, 0)
    option = QStyleOptionViewItem()
    option.rect = QRect(0, 0, 260, 54)
    option.state = QStyle.StateFlag.State_Selected | QStyle.StateFlag.State_Enabled
    option.palette.setColor(QPalette.ColorRole.Highlight, mode_colour("q8"))
    option.palette.setColor(QPalette.ColorRole.HighlightedText, QColor("white"))
    image = QImage(260, 54, QImage.Format.Format_ARGB32)
    image.fill(QColor("black"))
    painter = QPainter(image)
    SessionDelegate(sidebar.list).paint(painter, option, index)
    painter.end()
    # The badge's left edge at the middle of its height (as the delegate lays it out:
    # the row inset 6 then 10 px, the badge 2 px below the top, 16 tall), not its letters.
    inner = option.rect.adjusted(16, 9, -16, -9)
    width = mode_badge_width(mode_badge_font(QFont(option.font)), "q8")
    left, middle = inner.right() - width, inner.top() + 2 + 8
    edge = [QColor(image.pixel(x, middle)) for x in (left, left + 1)]
    assert max(colour.lightness() for colour in edge) > 200


def _many_chats(count: int) -> list[SessionRecord]:
    return [SessionRecord(f"chat{i}", f"Chat {i}", "q8", "demo", 100, 1e9 - i, 1e9 - i)
            for i in range(count)]


def test_a_refresh_keeps_the_scroll_and_a_new_chat_is_scrolled_into_view(qtbot) -> None:
    chats = _many_chats(60)
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.resize(240, 400)
    sidebar.show()
    sidebar.set_sessions(chats, chats[0].id)
    bar = sidebar.list.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0)
    bar.setValue(bar.maximum())
    bottom = bar.value()
    assert bottom > 0
    # A refresh (a chunk read, an answer ended) with the same chat on screen.
    sidebar.set_sessions(chats, chats[0].id)
    assert bar.value() == bottom
    # Another chat becomes current: it is shown.
    bar.setValue(0)
    sidebar.set_sessions(chats, chats[45].id)
    row = sidebar.list.visualItemRect(sidebar.list.item(45))
    assert sidebar.list.viewport().rect().contains(row)



def test_a_search_runs_once_the_typing_pauses_and_a_clear_at_once(qtbot) -> None:
    """A search reads every message of every chat: one per word typed, not per key."""
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    searched: list[str] = []
    sidebar.searchChanged.connect(searched.append)
    with qtbot.waitSignal(sidebar.searchChanged):
        qtbot.keyClicks(sidebar.search, "pine")
    assert searched == ["pine"]
    sidebar.search.clear()
    assert searched == ["pine", ""]


def test_an_empty_list_says_there_are_no_chats_yet(qtbot) -> None:
    store = HistoryStore()
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.show()
    sidebar.set_sessions(store.sessions(), None)
    # Before, the first launch showed a blank sidebar.
    assert sidebar.no_match.isVisible() and sidebar.no_match.text() == NO_CHATS
    assert not sidebar.list.isVisible()
    chat = store.create_session("Tax return", "q8", "demo")
    sidebar.set_sessions(store.sessions(), chat.id)
    assert not sidebar.no_match.isVisible() and sidebar.list.isVisible()
    store.close()
