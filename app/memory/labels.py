"""The memory panel's two kinds of text: a section heading and a value line."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel


def section_heading(title: str) -> QLabel:
    """A section's heading, upper case in the panel's section style."""
    label = QLabel(title.upper())
    label.setObjectName("panelSection")
    return label


def value_label(text: str = "—") -> QLabel:
    """A wrapping line of the panel's values."""
    label = QLabel(text)
    label.setObjectName("panelValue")
    label.setWordWrap(True)
    return label
