"""Toolbar and menu icons: the system theme's, or simple line icons from ``resources/icons``.

The bundled SVGs are drawn in one grey; they are tinted with the palette's text
colour when made, so they read on a light and a dark window alike (and are made
again when the palette changes). A desktop theme that has the icon wins.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QByteArray, Qt
from PySide6.QtGui import QIcon, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer

from app.style import resources_dir

ICONS_FOLDER = "icons"
DRAWN_IN = "#4a4a4f"  # the stroke colour the SVG files are drawn in
SIZES = (16, 32, 48)  # pixels: toolbar and menu sizes, and their Retina doubles
# Our file name -> the freedesktop theme name of the same idea.
THEME_NAMES = {
    "new-chat": "document-new",
    "reopen": "view-refresh",
    "memory": "utilities-system-monitor",
    "settings": "preferences-system",
    "models": "drive-harddisk",
}


def icon_path(name: str) -> Path:
    """Where the bundled SVG of ``name`` lives."""
    return resources_dir() / ICONS_FOLDER / f"{name}.svg"


def bundled_icon(name: str, palette: QPalette) -> QIcon:
    """The bundled SVG of ``name``, drawn in ``palette``'s button text colour."""
    path = icon_path(name)
    if not path.is_file():
        return QIcon()
    colour = palette.color(QPalette.ColorRole.ButtonText).name()
    svg = path.read_text(encoding="utf-8").replace(DRAWN_IN, colour)
    renderer = QSvgRenderer(QByteArray(svg.encode()))
    icon = QIcon()
    if not renderer.isValid():
        return icon
    for size in SIZES:  # drawn at each size, not scaled: thin lines stay crisp
        pixmap = QPixmap(size, size)
        pixmap.fill(Qt.GlobalColor.transparent)
        painter = QPainter(pixmap)
        renderer.render(painter)
        painter.end()
        icon.addPixmap(pixmap)
    return icon


def toolbar_icon(name: str, palette: QPalette) -> QIcon:
    """The theme's icon for ``name`` when the system has one, else ours."""
    theme = THEME_NAMES.get(name)
    if theme and QIcon.hasThemeIcon(theme):
        return QIcon.fromTheme(theme)
    return bundled_icon(name, palette)
