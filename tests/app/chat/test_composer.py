"""The composer's attachment chips (a message's twenty files stay readable) and keys."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QToolButton

from app.chat.attachments import MAX_FILES
from app.chat.composer import Composer
from app.store import AttachmentRecord


def test_many_chips_wrap_onto_rows_instead_of_squeezing(qtbot) -> None:
    composer = Composer()
    qtbot.addWidget(composer)
    composer.resize(700, 400)
    composer.show()
    few_wide = composer.minimumSizeHint().width()
    chips = [composer.add_chip(job, f"chapter-{job:02d}-of-the-report.md")
             for job in range(MAX_FILES)]
    qtbot.waitUntil(lambda: all(chip.isVisible() for chip in chips))
    # Every chip keeps the width its name needs, and they take several rows.
    assert all(chip.width() >= chip.sizeHint().width() for chip in chips)
    assert len({chip.y() for chip in chips}) > 1
    assert all(chip.geometry().right() <= composer.width() for chip in chips)
    # The composer asks for no more width than it did with a single row.
    assert composer.minimumSizeHint().width() <= few_wide + chips[0].sizeHint().width()


def test_esc_cancels_an_edit_only_while_nothing_runs_in_its_chat(qtbot) -> None:
    composer = Composer()
    qtbot.addWidget(composer)
    composer.show()
    cancelled: list[bool] = []
    composer.editCancelled.connect(lambda: cancelled.append(True))
    qtbot.keyClick(composer.edit, Qt.Key.Key_Escape)  # no edit: Esc is the window's Stop
    composer.show_editing(True)
    composer.set_generating(True)
    qtbot.keyClick(composer.edit, Qt.Key.Key_Escape)  # an answer runs: Esc stops it first
    assert cancelled == []
    composer.set_generating(False)
    qtbot.keyClick(composer.edit, Qt.Key.Key_Escape)
    assert cancelled == [True] and composer.editing_box.isVisible()  # the window hides it


def test_a_chip_of_a_one_token_file_says_1_token(qtbot) -> None:
    composer = Composer()
    qtbot.addWidget(composer)
    chip = composer.add_chip(1, "a.txt")
    chip.set_record(AttachmentRecord("a.txt", 1, "x", 1, "text"))
    assert chip.label.text() == "a.txt · 1 B · 1 token"


def test_the_attach_and_remove_buttons_are_named_for_a_screen_reader(qtbot) -> None:
    composer = Composer()
    qtbot.addWidget(composer)
    chip = composer.add_chip(1, "report\u202efdp.exe")
    # The name as shown: a hidden character is said, never obeyed.
    [remove] = chip.findChildren(QToolButton)
    assert remove.accessibleName() == "Remove report⟨U+202E⟩fdp.exe"
    assert composer.attach_button.accessibleName() == "Attach documents"


def test_a_click_does_what_the_button_said_when_pressed(qtbot) -> None:
    """Stop pressed as the answer ends: the release sends nothing (before, the button
    read "Send" by then and sent the message still being written); Send pressed as a
    job starts still asks to send (the window refuses it in words), never stops it."""
    from PySide6.QtTest import QTest

    composer = Composer()
    qtbot.addWidget(composer)
    composer.show()
    said: list[str] = []
    composer.sendRequested.connect(lambda: said.append("send"))
    composer.stopRequested.connect(lambda: said.append("stop"))
    button = composer.send_button
    composer.set_generating(True)
    QTest.mousePress(button, Qt.MouseButton.LeftButton)
    composer.set_generating(False)  # the answer ended between press and release
    QTest.mouseRelease(button, Qt.MouseButton.LeftButton)
    assert said == []
    QTest.mousePress(button, Qt.MouseButton.LeftButton)
    composer.set_generating(True)
    QTest.mouseRelease(button, Qt.MouseButton.LeftButton)
    assert said == ["send"]
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)  # Stop, as shown
    assert said == ["send", "stop"]
