"""The app's look: the icon and stylesheet in ``resources/``, light or dark as the system is.

The stylesheet draws with ``palette(...)`` colours, so a dark palette makes the
whole window dark. macOS's native style follows the system by itself; elsewhere
the Fusion style keeps its light palette unless told, so the palette is set
from the system's colour scheme, and again whenever the scheme changes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from PySide6.QtCore import QMetaObject, Qt
from PySide6.QtGui import QColor, QIcon, QPalette
from PySide6.QtWidgets import QApplication

log = logging.getLogger(__name__)
ICON = "longleaf.png"
STYLESHEET = "longleaf.qss"
# Longleaf's green, where the stylesheet draws an accent (Send, progress, "ready").
# On macOS the user's own accent colour takes its place: the system's, not ours.
ACCENTS = ("#2f7d5b", "#276a4d")
NATIVE_ACCENT = "palette(highlight)"


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
        sheet = (folder / STYLESHEET).read_text(encoding="utf-8")
        app.setStyleSheet(stylesheet_for(sheet, sys.platform))


def stylesheet_for(sheet: str, platform: str) -> str:
    """``sheet`` as ``platform`` shows it: on macOS the system accent replaces ours.

    The stylesheet sets no font family and sizes only the small print, so the
    system font (San Francisco on macOS) is what every widget uses.
    """
    if platform != "darwin":
        return sheet
    for colour in ACCENTS:
        sheet = sheet.replace(colour, NATIVE_ACCENT)
    return sheet


def dark_palette() -> QPalette:
    """A dark palette for the Fusion style, close to macOS's dark appearance."""
    palette = QPalette()
    role = QPalette.ColorRole
    for name, colour in (
        (role.Window, "#2b2b2d"), (role.WindowText, "#e8e8ea"), (role.Base, "#1e1e20"),
        (role.AlternateBase, "#2b2b2d"), (role.Text, "#e8e8ea"), (role.Button, "#3a3a3d"),
        (role.ButtonText, "#e8e8ea"), (role.BrightText, "#ffffff"), (role.Light, "#5a5a5e"),
        (role.Midlight, "#3f3f43"), (role.Mid, "#55555a"), (role.Dark, "#18181a"),
        (role.Shadow, "#000000"), (role.Highlight, "#2f7d5b"),
        (role.HighlightedText, "#ffffff"), (role.Link, "#6fb3ff"),
        (role.ToolTipBase, "#3a3a3d"), (role.ToolTipText, "#e8e8ea"),
        (role.PlaceholderText, "#9a9aa0"),
    ):
        palette.setColor(name, QColor(colour))
    disabled = QPalette.ColorGroup.Disabled
    for name in (role.Text, role.WindowText, role.ButtonText):
        palette.setColor(disabled, name, QColor("#7a7a80"))
    return palette


def apply_color_scheme(app: QApplication, scheme: Qt.ColorScheme) -> None:
    """Make ``app`` dark for ``Qt.ColorScheme.Dark``, light otherwise (not on macOS)."""
    if sys.platform == "darwin":
        return  # the native style already follows the system appearance
    dark = scheme == Qt.ColorScheme.Dark
    app.setPalette(dark_palette() if dark else app.style().standardPalette())
    # palette(...) in a stylesheet is resolved when the sheet is set: set it again.
    sheet = app.styleSheet()
    if sheet:
        app.setStyleSheet("")
        app.setStyleSheet(sheet)


def follow_system_theme(app: QApplication) -> QMetaObject.Connection:
    """Use the system's colour scheme now and whenever it changes; returns the connection."""
    hints = app.styleHints()
    apply_color_scheme(app, hints.colorScheme())
    return hints.colorSchemeChanged.connect(lambda scheme: apply_color_scheme(app, scheme))
