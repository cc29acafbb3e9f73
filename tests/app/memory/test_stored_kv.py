"""The memory panel's "Stored KV" section lists chats on disk and clears them through the worker."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QMessageBox

from app.format import human_bytes
from app.memory.stored_kv import UNKNOWN_CHAT, StoredKvFeed, StoredKvSection
from engine import StoredKv
from engine.snapshots import SnapshotInfo
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait


class FakeBridge(QObject):
    storedKv = Signal(object)

    def __init__(self) -> None:
        super().__init__()
        self.last_stored_kv: StoredKv | None = None
        self.cleared: list[str | None] = []

    def clear_stored_kv(self, session_id: str | None = None) -> None:
        self.cleared.append(session_id)


class FakeHistory:
    def __init__(self, titles: dict[str, str]) -> None:
        self.titles = titles

    def session(self, session_id: str):
        title = self.titles.get(session_id)
        return None if title is None else SimpleNamespace(title=title)


def _info(name: str, tokens: int, mode: str, disk_bytes: int) -> SnapshotInfo:
    return SnapshotInfo(name=name, tokens=tokens, mode=mode, page_size=256, kv_bytes=disk_bytes,
                        disk_bytes=disk_bytes, created=0.0, last_used=0.0, model="tiny")


LISTING = StoredKv(budget_bytes=20 * 2**30, total_bytes=7 * 2**19, snapshots=(
    _info("chat-1", 5_500, "q8", 5 * 2**19), _info("gone", 1_000, "q4", 2**20)))


def _section(qtbot, titles: dict[str, str]) -> tuple[StoredKvSection, FakeBridge, StoredKvFeed]:
    section = StoredKvSection()
    qtbot.addWidget(section)
    bridge = FakeBridge()
    controller = SimpleNamespace(bridge=bridge, store=FakeHistory(titles), closed=False)
    feed = StoredKvFeed(controller, section, section)
    return section, bridge, feed


def _rows(section: StoredKvSection) -> list[list[str]]:
    table = section.table
    return [[table.item(r, c).text() for c in range(table.columnCount())]
            for r in range(table.rowCount())]


def test_each_stored_chat_is_listed_with_its_title_tokens_mode_and_size(qtbot) -> None:
    section, bridge, feed = _section(qtbot, {"chat-1": "Walden notes"})
    assert section.table.rowCount() == 0 and not section.clear_all.isEnabled()
    bridge.storedKv.emit(LISTING)
    rows = _rows(section)
    assert [r[:2] for r in rows] == [["Walden notes", "2.5 MB"], [UNKNOWN_CHAT, "1.0 MB"]]
    assert section.table.item(0, 0).toolTip() == "Walden notes\n5,500 tokens in q8, 2.5 MB"
    assert "3.5 MB</b> on disk of 20.0 GB budget · 2 chats" in section.summary.text()
    assert "local server" not in section.summary.text()
    bridge.storedKv.emit(replace(LISTING, elsewhere_bytes=1 << 30))
    assert section.summary.text().endswith(
        "· 2 chats · the local server's 1.0 GB counts too")
    bridge.storedKv.emit(LISTING)
    assert section.bar.value() == 0  # 3.5 MB of 20 GB rounds to nothing
    feed.controller.store.titles["chat-1"] = "Renamed"
    feed.show()  # the last listing again, with the history's titles now
    assert _rows(section)[0][0] == "Renamed"
    feed.controller.closed = True  # quitting: the history is closing, listings wait
    bridge.storedKv.emit(StoredKv(1, 0))
    assert section.listing is not None and section.listing.budget_bytes != 1


def test_clearing_one_chat_asks_the_worker_and_waits_for_its_listing(qtbot) -> None:
    section, bridge, _ = _section(qtbot, {"chat-1": "Walden notes"})
    bridge.storedKv.emit(LISTING)
    assert not section.clear_one.isEnabled()  # nothing selected
    section.table.selectRow(1)
    assert section.selected_name() == "gone" and section.clear_one.isEnabled()
    section.clear_one.click()
    assert bridge.cleared == ["gone"]
    assert section.table.rowCount() == 2  # on disk until the worker says otherwise
    bridge.storedKv.emit(StoredKv(LISTING.budget_bytes, 2_500_000, LISTING.snapshots[:1]))
    assert [r[0] for r in _rows(section)] == ["Walden notes"]
    assert not section.clear_one.isEnabled()
    section.table.selectRow(0)  # a selection follows its chat when rows move
    bridge.storedKv.emit(StoredKv(LISTING.budget_bytes, 3_500_000, LISTING.snapshots[::-1]))
    assert section.selected_name() == "chat-1"
    assert section.table.selectionModel().selectedRows()[0].row() == 1


def test_clear_all_needs_a_confirmation(qtbot, monkeypatch) -> None:
    section, bridge, _ = _section(qtbot, {})
    bridge.storedKv.emit(LISTING)
    answers = [QMessageBox.StandardButton.Cancel, QMessageBox.StandardButton.Yes]
    monkeypatch.setattr(QMessageBox, "question", lambda *args: answers.pop(0))
    section.clear_all.click()
    assert bridge.cleared == []
    section.clear_all.click()
    assert bridge.cleared == [None]
    # Files no chat's row lists (set aside for another model) still take room:
    # Clear all gets it back, and says what it deletes.
    bridge.storedKv.emit(StoredKv(LISTING.budget_bytes, 85_525))
    assert section.table.rowCount() == 0 and section.clear_all.isEnabled()
    asked: list[str] = []
    monkeypatch.setattr(QMessageBox, "question",
                        lambda *args: asked.append(args[2]) or QMessageBox.StandardButton.Yes)
    section.clear_all.click()
    assert bridge.cleared == [None, None] and "no conversation changes" in asked[0]
    bridge.storedKv.emit(StoredKv(LISTING.budget_bytes, 0))
    assert not section.clear_all.isEnabled()


def test_clear_all_of_one_chat_asks_of_that_chat_not_of_all_1_chats(qtbot, monkeypatch) -> None:
    section, bridge, _ = _section(qtbot, {"chat-1": "Notes"})
    bridge.storedKv.emit(replace(LISTING, snapshots=LISTING.snapshots[:1]))
    asked: list[str] = []
    monkeypatch.setattr(QMessageBox, "question",
                        lambda *args: asked.append(args[2]) or QMessageBox.StandardButton.Cancel)
    section.clear_all.click()
    assert asked[0].startswith("Delete the stored KV of the one chat listed from disk? Its "
                               "conversation stays"), asked


def test_a_cache_is_the_same_size_in_memory_and_on_disk(qtbot) -> None:
    # One formatter for every size: 46,032,896 bytes read 43.9 MB in the panel's
    # sentence, the Stored KV table and its summary alike.
    from app.memory.panel import MemoryPanel
    from app.sessions.chat_state import ChatFacts, state_sentence

    size = 46_032_896
    info = SnapshotInfo("s1", 4_662, "q8", 256, size, size, 0.0, 0.0, "m")
    section = StoredKvSection()
    qtbot.addWidget(section)
    section.show_listing(StoredKv(20 * 2**30, size, (info,)), lambda _id: "Report")
    assert _rows(section)[0][1] == "43.9 MB" == human_bytes(size)
    assert section.summary.text().startswith("<b>43.9 MB</b> on disk of 20.0 GB budget")
    sentence = state_sentence(ChatFacts(history_tokens=4_662, snapshot=info))
    assert "(43.9 MB)" in sentence
    assert MemoryPanel  # the panel says its sizes with the same human_bytes


def test_a_chat_stored_by_the_worker_is_listed_and_cleared_through_it(qtbot, window) -> None:
    c = window.controller
    section = window.panel.stored_kv
    qtbot.waitUntil(lambda: section.listing is not None, timeout=ANSWER_TIMEOUT_MS)
    assert section.table.rowCount() == 0
    c.new_session("q4")
    assert send_and_wait(qtbot, window, "hello") == "complete"
    record = c.current
    c.caches.close(record.id)  # leaves memory: the worker stores it and lists it
    qtbot.waitUntil(lambda: section.table.rowCount() == 1, timeout=ANSWER_TIMEOUT_MS)
    on_disk = c.bridge.stored_snapshot(record.id)
    row = _rows(section)[0]
    assert row[:2] == [record.title, human_bytes(on_disk.disk_bytes)]
    assert f"{on_disk.tokens:,} tokens in q4" in section.table.item(0, 0).toolTip()
    section.table.selectRow(0)
    section.clear_one.click()
    qtbot.waitUntil(lambda: section.table.rowCount() == 0, timeout=ANSWER_TIMEOUT_MS)
    assert c.bridge.stored_snapshot(record.id) is None
    assert section.listing.total_bytes == 0


def test_chats_and_local_server_sessions_are_counted_apart_and_nothing_scrolls_inside(
        qtbot) -> None:
    section = StoredKvSection()
    qtbot.addWidget(section)
    infos = tuple(_info(name, 1_000, "q8", 2**20) for name in
                  ("a", "b", "c", "api-b437e0b85135", "api-0c1d2e3f4a5b"))
    section.show_listing(StoredKv(20 * 2**30, 5 * 2**20, infos), lambda name: name.upper())
    assert section.summary.text().endswith("· 3 chats · 2 local-server sessions")
    table = section.table
    rows = sum(table.rowHeight(r) for r in range(table.rowCount()))
    assert table.height() >= table.horizontalHeader().height() + rows
    assert table.verticalScrollBarPolicy() == Qt.ScrollBarPolicy.ScrollBarAlwaysOff


def test_a_chat_stored_with_another_model_says_it_will_be_read_again(qtbot) -> None:
    mine = SnapshotInfo("s1", 100, "q8", 256, 10, 10, 0.0, 0.0, "Qwen3-4B", model_digest="a")
    theirs = SnapshotInfo("s2", 100, "q8", 256, 10, 10, 0.0, 0.0, "Llama-3B", model_digest="b")
    section = StoredKvSection()
    qtbot.addWidget(section)
    section.show_listing(StoredKv(2**30, 20, (mine, theirs), model_digest="a"), lambda _id: "Chat")
    assert "not the model loaded now" not in section.table.item(0, 0).toolTip()
    assert "Stored with Llama-3B, not the model loaded now" in section.table.item(1, 0).toolTip()
