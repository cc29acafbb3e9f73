"""The app's look: the icon and stylesheet in the repository's ``resources/`` folder."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

log = logging.getLogger(__name__)
ICON = "longleaf.png"
STYLESHEET = "longleaf.qss"


def resources_dir() -> Path:
    """``resources/`` next to the packages, or its copy inside a PyInstaller bundle."""
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle is not None:
        return Path(bundle) / "resources"
    return Path(__file__).resolve().parent.parent / "resources"


def missing_resources() -> list[str]:
    """Names of the resource files that are not where the app looks for them."""
    folder = resources_dir()
    return [name for name in (ICON, STYLESHEET) if not (folder / name).is_file()]


def apply_style(app: QApplication) -> None:
    """Give ``app`` Longleaf's icon and stylesheet (a warning in the log if missing)."""
    folder = resources_dir()
    for name in missing_resources():
        # The app still works, just unstyled: worth a log line, not a failure.
        log.warning("%s is missing from %s; the app runs without it", name, folder)
    if (folder / ICON).is_file():
        app.setWindowIcon(QIcon(str(folder / ICON)))
    if (folder / STYLESHEET).is_file():
        app.setStyleSheet((folder / STYLESHEET).read_text(encoding="utf-8"))
