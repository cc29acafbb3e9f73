"""Reopen in…: other modes only, asked first, answer stats kept, its notice stays in its chat."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QMessageBox

from app.sessions.reopen import ask_reopen, fill_reopen_menu
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait


def _answer_with(monkeypatch, wanted: str, seen: list[str]) -> None:
    def answer(box: QMessageBox) -> int:
        seen.append(box.informativeText())
        next(b for b in box.buttons() if b.text().replace("&", "") == wanted).click()
        return 0

    monkeypatch.setattr(QMessageBox, "exec", answer)


@pytest.mark.parametrize("mode", ["fp16", "q6"])
def test_the_menu_offers_every_mode_but_the_chats_own(qtbot, window, mode) -> None:
    window.controller.new_session(mode)
    fill_reopen_menu(window.reopen_menu, window.controller, window)
    offered = [a.text() for a in window.reopen_menu.actions()]
    assert offered == [f"Reopen in {m}…" for m in ("fp16", "q8", "q6", "q4") if m != mode]
    assert window.controller.reopen_in(mode) is None  # and asking for it directly does nothing
    # Each says what the mode is; the button says what reopening does.
    assert all(a.toolTip().startswith("A copy of this chat in ") for a in
               window.reopen_menu.actions())
    assert "reads the conversation in again" in window.reopen_button.toolTip()


def test_reopen_asks_first_keeps_answer_stats_and_its_notice_stays_in_its_chat(
        qtbot, window, monkeypatch) -> None:
    c = window.controller
    other = c.new_session("q4")
    source = c.new_session("q8")
    assert send_and_wait(qtbot, window, "Remember the pines") == "complete"
    source = c.current
    seen: list[str] = []
    _answer_with(monkeypatch, "Cancel", seen)
    ask_reopen(c, "q6", window)
    assert c.current.id == source.id and len(c.store.sessions()) == 2
    assert source.tokens > 0, (source, c.bridge.latest_stats())
    assert "new chat with a q6 KV cache" in seen[0] and "original chat stays" in seen[0]
    assert f"({source.tokens:,} tokens)" in seen[0]

    _answer_with(monkeypatch, "Reopen in q6", seen)
    with qtbot.waitSignal(c.notice, timeout=ANSWER_TIMEOUT_MS) as notice:
        ask_reopen(c, "q6", window)
    assert notice.args == ["Read the conversation in: it is in memory in q6."]
    qtbot.waitUntil(lambda: not c.busy, timeout=ANSWER_TIMEOUT_MS)
    assert c.current.kv_mode == "q6" and c.current.id != source.id
    old = c.store.messages(source.id)
    new = c.store.messages(c.current.id)
    assert [(m.role, m.content, m.stats) for m in new] == [
        (m.role, m.content, m.stats) for m in old]
    assert new[-1].stats and new[-1].stats["generated_tokens"] > 0
    assert window.banner.isVisible() and "in memory in q6" in window.banner.label.text()
    c.select_session(other.id)
    assert not window.banner.isVisible()  # the notice was about the reopened chat


def test_reopen_keeps_an_answer_cut_short_marked_so_with_its_reason(qtbot, window) -> None:
    c = window.controller
    chat = c.new_session("q8")
    store = c.store
    store.add_message(chat.id, "user", "Tell me a story")
    stopped = store.add_message(chat.id, "assistant", "Once upon", "streaming")
    store.update_message(stopped, status="stopped", reason="Stopped")
    store.add_message(chat.id, "user", "Go on")
    cut = store.add_message(chat.id, "assistant", "a time", "streaming")
    store.update_message(cut, status="interrupted",
                         reason="Longleaf quit before this answer finished")
    c.select_session(chat.id)

    copy = c.reopen_in("q4")
    qtbot.waitUntil(lambda: not c.busy, timeout=ANSWER_TIMEOUT_MS)
    # Before, both answers were copied as "complete", with no reason.
    assert [(m.role, m.content, m.status, m.reason) for m in store.messages(copy.id)] == [
        (m.role, m.content, m.status, m.reason) for m in store.messages(chat.id)]
    assert [m.status for m in store.messages(copy.id)][1::2] == ["stopped", "interrupted"]
