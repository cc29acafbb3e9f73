"""Titles and numbers as the window writes them."""

from __future__ import annotations

import html

import pytest
from PySide6.QtCore import Qt

from app.format import compact_count, counted, percent, reopened_title, short_tokens, title_from


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("What is the capital of France?", "What is the capital of France?"),
        ("  first line\nsecond line", "first line"),
        ("Write a Python function that adds two numbers. Use a code block.",
         "Write a Python function that adds two numbers. Use a code block."),
        ("word " * 60, ("word " * 40).strip()),  # cut at a word, no "…"
        ("x" * 300, "x" * 200),  # one long word: cut inside it
        ("", ""),
    ],
)
def test_title_from_first_message(text: str, title: str) -> None:
    # Titles are stored whole (up to 200 characters) and elided only where painted.
    assert title_from(text) == title
    assert len(title_from(text)) <= 200 and "…" not in title_from(text)


def test_panel_shows_a_title_as_text(qtbot) -> None:
    from app.memory.panel import MemoryPanel

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("<b>a < b</b>", "q6", "kept in memory")
    assert "&lt;b&gt;a &lt; b&lt;/b&gt;" in panel.session_label.text()


def test_session_list_and_delete_prompt_show_a_title_as_text(qtbot, monkeypatch) -> None:
    import time

    from PySide6.QtWidgets import QMessageBox

    from app.sessions import session_list
    from app.store import SessionRecord

    title = "<b>a < b</b>"
    widget = session_list.SessionList()
    qtbot.addWidget(widget)
    now = time.time()
    widget.set_sessions([SessionRecord("s1", title, "q6", "demo", 12, now, now)], "s1")
    tip = widget.list.item(0).toolTip()
    assert html.escape(title) in tip and "<b>a" not in tip
    shown: list[QMessageBox] = []
    monkeypatch.setattr(QMessageBox, "exec", lambda box: shown.append(box) or 0)
    session_list.confirm_delete(widget, title)
    assert shown[0].textFormat() == Qt.TextFormat.PlainText and title in shown[0].text()


@pytest.mark.parametrize("figure", ["5.1 tokens/s", "3,393 / 4,096 tokens"])
def test_a_figure_made_unbroken_stays_on_one_line_however_narrow(qapp, figure: str) -> None:
    from PySide6.QtGui import QFont, QTextLayout

    from app.format import unbroken

    layout = QTextLayout(unbroken(figure), QFont())
    layout.beginLayout()
    lines = 0
    while (line := layout.createLine()).isValid():
        line.setLineWidth(1.0)  # narrower than any word: every break it may take, it takes
        lines += 1
    layout.endLayout()
    assert lines == 1


def test_a_reopened_chats_title_names_its_mode_once() -> None:
    assert reopened_title("Pine notes", "q6") == "Pine notes · q6"
    # Reopened again: the mode is replaced, not appended (was "… · q6 · q4 · q8").
    assert reopened_title(reopened_title("Pine notes", "q6"), "q4") == "Pine notes · q4"
    # A title that merely ends in other words after the separator keeps them.
    assert reopened_title("Budget · 2026", "q8") == "Budget · 2026 · q8"


def test_a_count_is_said_in_the_singular_for_one_only() -> None:
    assert counted(1, "token") == "1 token"
    assert counted(0, "token") == "0 tokens"
    assert counted(4096, "token") == "4,096 tokens"
    assert counted(2, "copy", "copies") == "2 copies"


def test_a_compact_count_moves_to_the_next_unit_when_rounding_reaches_it() -> None:
    assert [compact_count(n) for n in (999, 1_000, 5_170, 9_999, 99_999, 999_999,
                                       93_653_760, 999_600_000)] == [
        "999", "1.00 k", "5.17 k", "10.0 k", "100 k", "1.00 M", "93.7 M", "1.00 G"]


def test_short_tokens_round_down_so_a_part_never_reads_as_the_whole() -> None:
    assert [short_tokens(n) for n in (7_600, 8_192, 999_999, 1_048_576, 1_500_000)] == [
        "7.6k", "8.1k", "999k", "1M", "1.5M"]


def test_a_percent_says_0_and_100_only_when_exact() -> None:
    assert [percent(f) for f in (0.0, 1 / 256, 0.5, 255 / 256, 1.0)] == [
        "0%", "<1%", "50%", ">99%", "100%"]
