"""No text of the main window is cut, at 1024×700 and at the window's minimum size.

The window shows what a user sees after a few messages with the demo model:
its name and context in the picker, a chat in the sidebar, its numbers in the
memory panel and a Stored KV row with a long chat title.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import QSize
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QToolButton

from app.chat.composer import READING
from app.chat.model import ChatMessage
from app.controller import ChatController
from app.engine_bridge import EngineBridge
from app.memory.charts import CELL, GAP, MAX_ROWS, PagePoolView
from app.memory.fit_check import fit_html
from app.sessions.chat_state import ChatFacts
from app.sessions.session_list import RecordRole, SessionDelegate, StateRole, detail_lines
from app.settings import Settings
from app.store import AttachmentRecord, HistoryStore
from app.style import apply_style
from app.window.main_window import DEFAULT_SIZE, MINIMUM_SIZE, MainWindow
from app.window.model_picker import demo_item_text
from engine import StoredKv
from engine.cache.modes import MODES
from engine.events import QualityReceipt, RankShare
from engine.snapshots.manifest import SnapshotInfo
from tests.app.conftest import close_window, send_and_wait
from tests.app.layout import clipped_texts

LONG_TITLE = "Summarise the quarterly report and list every open question"


@pytest.fixture
def styled(qapp):
    """The app's own stylesheet, as ``python -m app`` applies it (fonts and paddings)."""
    apply_style(qapp)
    yield
    qapp.setStyleSheet("")


@pytest.fixture
def chatted(qtbot, styled, window):
    """The window after three short exchanges, dressed as the demo model."""
    window.controller.new_session("q8")
    for text in ("Hello there", "What is a KV cache?", "Thanks"):
        assert send_and_wait(qtbot, window, text) == "complete"
    record = window.controller.current
    window.controller.rename_session(record.id, LONG_TITLE)
    picker = window.model_picker
    picker.setItemText(picker.currentIndex(), demo_item_text(8192))
    window.model_state.setText("● SmolLM2-135M-Instruct")
    now = time.time()
    window.panel.stored_kv.show_listing(
        StoredKv(8_100_000_000, 12_000_000, (
            SnapshotInfo(record.id, 1_234, "q8", 256, 9_000_000, 11_900_000, now, now, "m"),)),
        lambda _id: LONG_TITLE)
    window.fit.schedule()
    qtbot.wait(300)  # the fit check and a stats sample land
    return window


def show_at(qtbot, window, size: QSize) -> None:
    window.resize(size)
    qtbot.waitUntil(lambda: window.size() == size, timeout=5_000)
    qtbot.wait(100)  # layouts settle after the resize


@pytest.mark.parametrize("size", [QSize(1024, 700), MINIMUM_SIZE, DEFAULT_SIZE])
def test_no_text_of_the_window_is_cut(qtbot, chatted, size, tmp_path) -> None:
    show_at(qtbot, chatted, size)
    shots = Path(os.environ.get("LONGLEAF_SHOTS", str(tmp_path)))
    chatted.grab().save(str(shots / f"window-{size.width()}x{size.height()}.png"))
    clipped = clipped_texts(chatted)
    assert not clipped, "\n".join(clipped)
    for widget in (chatted.model_picker, chatted.model_state, chatted.reopen_button):
        assert widget.isVisible(), "the toolbar folded a control into its overflow menu"
    overflow = chatted.findChild(QToolButton, "qt_toolbar_ext_button")
    assert overflow is None or not overflow.isVisible(), "the toolbar does not fit"


@pytest.mark.parametrize("size", [QSize(1024, 700), MINIMUM_SIZE])
def test_no_text_is_cut_when_both_columns_scroll(qtbot, chatted, size) -> None:
    # A long paste makes the conversation scroll, and the quality receipts make the
    # panel scroll too: each scroll bar takes width its column must still have.
    paste = "\n".join(f"Line {i} of a pasted report, with enough words to wrap." for i in range(40))
    assert send_and_wait(qtbot, chatted, paste) == "complete"
    receipt = QualityReceipt("q8", True, 1024, 5_007, 1_023, 0.996, 0.004, 0.05, "m", time.time())
    chatted.panel.show_receipts({"q8": receipt, "q4": replace(receipt, mode="q4", top1=0.871)})
    show_at(qtbot, chatted, size)
    assert chatted.conversation.verticalScrollBar().isVisible()
    clipped = clipped_texts(chatted)
    assert not clipped, "\n".join(clipped)


@pytest.mark.parametrize("size", [QSize(1024, 700), MINIMUM_SIZE])
def test_no_text_is_cut_with_a_model_split_across_machines(qtbot, chatted, size,
                                                           tmp_path) -> None:
    # Two machines with long host names, the small one short of the context in q8:
    # the panel's rows per machine, its projection and the fit line naming it.
    show_at(qtbot, chatted, size)
    controller, panel = chatted.controller, chatted.panel
    sample = controller.caches.sample_for(controller.current.id)
    now, full = chatted.fit.report_for(sample.tokens_in_context), chatted.fit.full_context_report()
    context = now.max_context
    ranks = (
        RankShare(0, "Johns-Mac-Studio.local", (12, 24), sample.kv_bytes_used // 2,
                  sample.pages_in_use // 2, 51 << 30, (context,) * len(MODES)),
        RankShare(1, "Johns-MacBook-Air.local", (0, 12), sample.kv_bytes_used // 2,
                  sample.pages_in_use // 2, 1 << 30, (context // 8, context // 4, 3 * context // 8,
                                                      context // 2)),
    )
    controller.statsUpdated.emit(replace(sample, ranks=ranks))
    panel.update_projection(replace(now, ranks=ranks), replace(full, ranks=ranks))
    html, ok = fit_html(replace(now, ranks=ranks), "q8", context // 2)
    chatted.composer.show_fit(html, ok)
    qtbot.wait(100)  # layouts settle after the new lines
    shots = Path(os.environ.get("LONGLEAF_SHOTS", str(tmp_path)))
    chatted.grab().save(str(shots / f"machines-{size.width()}x{size.height()}.png"))
    assert panel.machines_label.isVisible() and "Johns-MacBook-Air.local" in html
    assert "The tight one: Johns-MacBook-Air.local." in panel.fits_label.text()
    clipped = clipped_texts(chatted)
    assert not clipped, "\n".join(clipped)


def test_the_minimum_size_is_what_fits(qtbot, chatted) -> None:
    assert chatted.minimumSize().width() <= 1024 and chatted.minimumSize().height() <= 700
    show_at(qtbot, chatted, chatted.minimumSize())
    assert chatted.size() == chatted.minimumSize()


@pytest.mark.parametrize("size", [QSize(1024, 700), MINIMUM_SIZE])
def test_the_sidebar_never_scrolls_sideways(qtbot, chatted, size) -> None:
    show_at(qtbot, chatted, size)
    rows = chatted.sessions.list
    assert not rows.horizontalScrollBar().isVisible()
    assert rows.count() and all(rows.visualItemRect(rows.item(i)).right() <= rows.viewport().width()
                                for i in range(rows.count()))


@pytest.mark.parametrize("size", [QSize(1024, 700), MINIMUM_SIZE])
def test_the_panels_top_sections_show_without_scrolling(qtbot, chatted, size) -> None:
    show_at(qtbot, chatted, size)
    panel = chatted.panel
    assert panel.verticalScrollBar().value() == 0
    # Everything above the history chart is in view without scrolling.
    top = panel.chart.mapTo(panel.widget(), panel.chart.rect().topLeft()).y()
    assert top <= panel.viewport().height()


def test_a_big_page_pool_keeps_to_a_few_rows(qtbot) -> None:
    pool = PagePoolView()
    qtbot.addWidget(pool)
    pool.resize(280, 40)
    # The demo model after one answer: 30 layers' pages, most of the pool still free.
    pool.set_pages(30, 120, 90, 0.27, QColor("#2f7d5b"))
    assert pool.height() <= MAX_ROWS * (CELL + GAP)
    assert pool.pages_per_cell() > 1  # and the tooltip says how many pages a square is
    pool.set_pages(3, 8, 4, 0.5, QColor("#2f7d5b"))
    assert pool.pages_per_cell() == 1  # a small pool keeps a square per page


def test_the_top_sections_fit_with_the_demo_models_page_pool(qtbot, chatted) -> None:
    show_at(qtbot, chatted, MINIMUM_SIZE)
    panel = chatted.panel
    panel.pool.set_pages(30, 120, 90, 0.27, QColor("#2f7d5b"))
    qtbot.wait(50)
    top = panel.chart.mapTo(panel.widget(), panel.chart.rect().topLeft()).y()
    assert top <= panel.viewport().height()


def test_a_long_model_name_keeps_the_toolbar_on_one_row(qtbot, styled, tmp_path) -> None:
    settings = Settings()
    window = MainWindow(ChatController(settings, HistoryStore(), EngineBridge(
        settings.memory_budget_bytes, settings.ingest_chunk)))
    qtbot.addWidget(window)
    try:
        window._on_model_state("Loading Qwen3-Next-80B-A3B-Instruct-4bit-converted-here…", False)
        window.show()
        show_at(qtbot, window, MINIMUM_SIZE)
        overflow = window.findChild(QToolButton, "qt_toolbar_ext_button")
        assert overflow is None or not overflow.isVisible(), "the toolbar does not fit"
        assert clipped_texts(window.model_state) == []
        assert "converted-here" in window.model_state.toolTip()
    finally:
        close_window(window)


def sidebar_lines_cut(window) -> list[str]:
    """Each sidebar row whose second line no whole form of fits (it is painted elided)."""
    rows = window.sessions.list
    cut = []
    for i in range(rows.count()):
        item = rows.item(i)
        record, state = item.data(RecordRole), item.data(StateRole) or ""
        shown = SessionDelegate.detail_for(rows.font(), rows.visualItemRect(item), record,
                                           state)
        if shown not in detail_lines(record, state):
            cut.append(f"sidebar row {record.title!r}: {shown!r}")
    return cut


@pytest.mark.parametrize("size", [QSize(1024, 700), MINIMUM_SIZE])
def test_no_text_is_cut_while_a_long_chat_is_read(qtbot, chatted, size) -> None:
    # What a user sees while a 7,757-token chat is read: the progress row with its
    # rate and time left, a sidebar with that chat reading and others in memory with
    # five-digit counts, and a message whose attachment line has the file's figures.
    c, composer = chatted.controller, chatted.composer
    show_at(qtbot, chatted, size)
    c.model.append(ChatMessage("user", "Summarise it", attachments=(
        AttachmentRecord("Quarterly report for the board, final.pdf", 1_234_567, "x", 3_393,
                         "text"),)))
    composer.set_generating(True)
    composer.show_progress(512, 7_757, 15.4, 372.0, READING)
    records = c.store.sessions()
    reading = c.store.create_session("A long report", "q6", "demo")
    records = [reading, *records]
    facts = {r.id: ChatFacts(held_tokens=51_720, history_tokens=51_720) for r in records}
    facts[reading.id] = ChatFacts(job="reading", progress=(512, 7_757))
    chatted.sessions.set_sessions(records, c.current.id, facts)
    qtbot.wait(100)  # layouts settle after the new rows
    assert composer.progress_box.isVisible()
    clipped = clipped_texts(chatted) + sidebar_lines_cut(chatted)
    assert not clipped, "\n".join(clipped)
    shown = composer.progress_label.text().replace("\u2060", "")  # keeps "tokens/s" whole
    assert "tokens/s" in shown and "left" in shown
