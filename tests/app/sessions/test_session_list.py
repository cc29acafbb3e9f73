"""The session list on its own: search, rename, confirmed delete."""

from __future__ import annotations

from PySide6.QtWidgets import QInputDialog, QMessageBox

from app.sessions.session_list import SessionList
from app.store import HistoryStore


def test_session_list_search_rename_and_confirmed_delete(qtbot, monkeypatch) -> None:
    store = HistoryStore()
    a = store.create_session("Tax return", "q8", "demo")
    b = store.create_session("Holiday", "q4", "demo")
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.set_sessions(store.sessions(), b.id)
    assert [r.id for r in sidebar.records()] == [b.id, a.id]
    with qtbot.waitSignal(sidebar.sessionSelected) as selected:
        sidebar.list.setCurrentRow(1)
    assert selected.args == [a.id]

    monkeypatch.setattr(QInputDialog, "getText", lambda *args, **kw: ("Taxes 2025", True))
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
