"""Small pieces of the main window: the error banner, file drops, icon opens."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QEvent, QMimeData, QObject, Qt
from PySide6.QtGui import QFileOpenEvent
from PySide6.QtWidgets import (
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLayout,
    QToolButton,
    QWidget,
)


def local_files(mime: QMimeData) -> list[str]:
    """Local file paths in a drag's MIME data."""
    return [url.toLocalFile() for url in mime.urls() if url.isLocalFile()]


class FileOpenFilter(QObject):
    """Documents dropped on the app's icon (macOS sends QFileOpenEvent) become attachments."""

    def __init__(self, window: QObject, add_files: Callable[[list[str]], None]) -> None:
        super().__init__(window)
        self.add_files = add_files

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.FileOpen and isinstance(event, QFileOpenEvent):
            self.add_files([event.file()])
            return True
        return False


class Banner(QFrame):
    """The one place engine errors are shown; dismissable, never modal."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("errorBanner")
        row = QHBoxLayout(self)
        row.setContentsMargins(12, 6, 6, 6)
        self.label = QLabel()
        self.label.setTextFormat(Qt.TextFormat.PlainText)  # errors quote names and paths
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton()
        close.setText("✕")
        close.setAccessibleName("Dismiss")  # VoiceOver read "✕" as "multiplication x"
        close.setToolTip("Dismiss")
        close.setAutoRaise(True)
        close.clicked.connect(self.hide)
        row.addWidget(self.label, 1)
        row.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.hide()

    def show_message(self, text: str, kind: str = "error") -> None:
        """Show ``text``; kind is "error" or "info"."""
        self.label.setText(text)
        self.setProperty("kind", kind)
        self.style().unpolish(self)
        self.style().polish(self)
        self.show()


def add_field_row(form: QFormLayout, caption: str, field: QWidget, row: QLayout) -> None:
    """Add ``row`` (``field`` and its buttons) to ``form`` under ``caption``.

    QFormLayout makes its label the buddy of a widget, not of a layout: made here,
    the label still names ``field`` for VoiceOver, as a label beside a lone field does.
    """
    label = QLabel(caption)
    label.setBuddy(field)
    form.addRow(label, row)


class ProblemLabel(QLabel):
    """A settings page's line saying why its values cannot be saved; hidden when none."""

    def __init__(self) -> None:
        super().__init__()
        self.setObjectName("settingsProblem")
        self.setWordWrap(True)
        self.hide()

    def say(self, text: str) -> str:
        """Show ``text`` ("" hides the line); returns it."""
        self.setText(text)
        self.setVisible(bool(text))
        return text
