"""A Mac app's conventions: menu roles, standard shortcuts, toolbar icons, the system accent."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QColor, QKeySequence, QPalette
from PySide6.QtWidgets import QApplication, QMessageBox, QToolBar

from app.style import ACCENTS, NATIVE_ACCENT, resources_dir, stylesheet_for
from app.window.icons import THEME_NAMES, bundled_icon, icon_path
from tests.app.window.test_main_window import bare_window  # noqa: F401 - a fixture

Key = QKeySequence.StandardKey


def keys(action: QAction) -> set[str]:
    return {k.toString() for k in action.shortcuts()}


def standard(key: QKeySequence.StandardKey) -> set[str]:
    return {k.toString() for k in QKeySequence.keyBindings(key)}


def test_about_settings_and_quit_have_the_application_menus_roles(bare_window) -> None:  # noqa: F811
    w = bare_window
    assert w.about_action.menuRole() == QAction.MenuRole.AboutRole
    assert w.settings_action.menuRole() == QAction.MenuRole.PreferencesRole
    assert w.quit_action.menuRole() == QAction.MenuRole.QuitRole
    in_menus = {a for m in w.menuBar().actions() if m.menu() for a in m.menu().actions()}
    assert {w.about_action, w.settings_action, w.quit_action} <= in_menus
    assert w.settings_action.text() == "Settings…"


def test_shortcuts_are_the_platforms_standard_keys(bare_window) -> None:  # noqa: F811
    w = bare_window
    assert standard(Key.New) <= keys(w.new_chat_action)
    assert standard(Key.Preferences) | {"Ctrl+,"} <= keys(w.settings_action)
    assert standard(Key.Quit) | {"Ctrl+Q"} <= keys(w.quit_action)
    assert standard(Key.Close) <= keys(w.close_action)


def test_about_says_what_longleaf_is(bare_window, monkeypatch) -> None:  # noqa: F811
    shown: list[tuple[str, str]] = []
    monkeypatch.setattr(QMessageBox, "about", lambda parent, title, text: shown.append(
        (title, text)))
    bare_window.about_action.trigger()
    assert shown and shown[0][0] == "About Longleaf" and "KV cache" in shown[0][1]


def test_toolbar_actions_show_icons_beside_their_words(bare_window) -> None:  # noqa: F811
    w = bare_window
    bar = w.findChild(QToolBar, "mainToolbar")
    assert bar.toolButtonStyle() == Qt.ToolButtonStyle.ToolButtonTextBesideIcon
    for action in (w.new_chat_action, w.panel_action, w.settings_action, w.models_action):
        assert not action.icon().isNull(), action.text()
    assert not w.reopen_button.icon().isNull()


def test_every_icon_has_a_bundled_svg_in_resources() -> None:
    for name in THEME_NAMES:
        assert icon_path(name).is_file() and icon_path(name).parent.parent == resources_dir()


def test_bundled_icons_are_drawn_in_the_palettes_text_colour(qapp: QApplication) -> None:
    for text, dark in (("#f0f0f0", True), ("#101010", False)):
        palette = QPalette(qapp.palette())
        palette.setColor(QPalette.ColorRole.ButtonText, QColor(text))
        image = bundled_icon("settings", palette).pixmap(32).toImage()
        drawn = [image.pixelColor(x, y) for x in range(32) for y in range(32)
                 if image.pixelColor(x, y).alpha() > 200]
        assert drawn, "the icon drew nothing"
        assert all((c.lightness() > 200) == dark for c in drawn)


def test_on_macos_the_system_accent_replaces_longleafs_green() -> None:
    sheet = (resources_dir() / "longleaf.qss").read_text(encoding="utf-8")
    assert any(colour in sheet for colour in ACCENTS)
    mac = stylesheet_for(sheet, "darwin")
    assert not any(colour in mac for colour in ACCENTS) and NATIVE_ACCENT in mac
    assert stylesheet_for(sheet, "linux") == sheet
    assert "font-family" not in sheet  # the system font everywhere
