"""The icon and stylesheet come from the repository's resources/ folder."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QObject, Qt
from PySide6.QtGui import QIcon, QPalette
from PySide6.QtWidgets import QApplication

from app import style

REPO = Path(__file__).resolve().parents[2]


def test_resources_live_in_the_top_level_folder() -> None:
    assert style.resources_dir() == REPO / "resources"
    assert style.missing_resources() == []


def test_apply_style_sets_icon_and_stylesheet(qapp: QApplication) -> None:
    before = qapp.styleSheet()
    try:
        qapp.setStyleSheet("")
        qapp.setWindowIcon(QIcon())
        style.apply_style(qapp)
        assert qapp.styleSheet() == (REPO / "resources" / style.STYLESHEET).read_text()
        assert not qapp.windowIcon().isNull()
    finally:
        qapp.setStyleSheet(before)


def test_a_missing_folder_is_logged_not_fatal(qapp: QApplication, tmp_path: Path,
                                              monkeypatch, caplog) -> None:
    monkeypatch.setattr(style, "resources_dir", lambda: tmp_path)
    before = qapp.styleSheet()
    with caplog.at_level(logging.WARNING, logger="app.style"):
        style.apply_style(qapp)
    assert qapp.styleSheet() == before
    assert "longleaf.qss is missing" in caplog.text


def test_the_palette_follows_the_systems_colour_scheme(qapp: QApplication) -> None:
    if sys.platform == "darwin":
        pytest.skip("the native macOS style follows the system by itself")
    before, sheet = qapp.palette(), qapp.styleSheet()
    connection = style.follow_system_theme(qapp)
    try:
        window = QPalette.ColorRole.Window
        qapp.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Dark)
        assert qapp.palette().color(window).lightness() < 80
        assert qapp.styleSheet() == sheet  # set again, so palette(...) colours resolve anew
        qapp.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Light)
        assert qapp.palette().color(window).lightness() > 200
    finally:
        QObject.disconnect(connection)
        qapp.setPalette(before)
