"""The question asked when the window closes while an answer is still being written."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox, QWidget

QUIT = QMessageBox.StandardButton.Close  # the button labelled "Quit"


def quit_box(question: str, parent: QWidget | None) -> QMessageBox:
    """Quit or Cancel (the default), window-modal: a sheet on macOS, never blocking."""
    box = QMessageBox(QMessageBox.Icon.Question, "Quit Longleaf", question, parent=parent)
    box.setTextFormat(Qt.TextFormat.PlainText)
    box.setStandardButtons(QUIT | QMessageBox.StandardButton.Cancel)
    box.button(QUIT).setText("Quit")
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    box.setWindowModality(Qt.WindowModality.WindowModal)
    return box
