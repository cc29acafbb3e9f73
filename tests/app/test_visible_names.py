"""Names with bidi controls or zero-width characters are shown with them made visible."""

from __future__ import annotations

import time

import pytest

from app.format import visible_text
from app.store import AttachmentRecord, SessionRecord

TRICK = "invoice\u202efdp.exe"  # shows as "invoiceexe.pdf" when rendered as is


@pytest.mark.parametrize(("name", "shown"), [
    (TRICK, "invoice⟨U+202E⟩fdp.exe"),
    ("a\u2066b\u2069c\u200fd", "a⟨U+2066⟩b⟨U+2069⟩c⟨U+200F⟩d"),
    ("zero\u200bwidth\u200d\ufeff.txt", "zero⟨U+200B⟩width⟨U+200D⟩⟨U+FEFF⟩.txt"),
    ("line\nbreak\u2028", "line⟨U+000A⟩break⟨U+2028⟩"),
    ("plain ü 🌲 データ.md", "plain ü 🌲 データ.md"),
])
def test_visible_text(name: str, shown: str) -> None:
    assert visible_text(name) == shown


def test_chips_titles_and_the_window_title_show_hidden_characters(qtbot) -> None:
    from app.chat.composer import Composer
    from app.sessions.session_list import SessionList

    composer = Composer()
    qtbot.addWidget(composer)
    chip = composer.add_chip(1, TRICK)
    assert "\u202e" not in chip.label.text() and "⟨U+202E⟩" in chip.label.text()
    chip.set_record(AttachmentRecord(TRICK, 10, "0" * 64, 3, "text"))
    assert "\u202e" not in chip.label.text() and "⟨U+202E⟩" in chip.label.text()
    sessions = SessionList()
    qtbot.addWidget(sessions)
    now = time.time()
    sessions.set_sessions([SessionRecord("s1", f"about {TRICK}", "q6", "demo", 1, now, now)],
                          "s1")
    item = sessions.list.item(0)
    assert "\u202e" not in item.text() + item.toolTip() and "⟨U+202E⟩" in item.text()


def test_the_stored_name_keeps_its_characters(window, qtbot, tmp_path) -> None:
    name = "photo\u202egnp.txt"  # a text file that shows as "phototxt.png"
    path = tmp_path / name
    path.write_text("some text to read")
    window.add_files([str(path)])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=30_000)
    (record,) = window.attachments.values()
    assert record.name == name  # stored and sent as it is; only its display changes
    (chip,) = window.composer.chips.values()
    assert "⟨U+202E⟩" in chip.label.text()
    window.controller.new_session()
    window.controller.rename_session(window.controller.current.id, TRICK)
    qtbot.waitUntil(lambda: "⟨U+202E⟩" in window.windowTitle(), timeout=5_000)
