"""The icon and stylesheet come from the repository's resources/ folder."""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtGui import QIcon
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
