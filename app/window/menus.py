"""The main window's toolbar and menus: the actions and where they lead.

The builders take the window as a ``MenuHost``, which names what they use of
it, so this module does not import ``app.window.main_window`` (which imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QAction, QKeySequence, QPalette
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QMenu,
    QMenuBar,
    QMessageBox,
    QToolBar,
    QToolButton,
    QWidget,
)

from app.controller import ChatController
from app.memory.panel import MemoryPanel
from app.sessions.reopen import REOPEN_TIP, fill_reopen_menu
from app.sessions.session_list import SessionList
from app.settings import Settings
from app.store import SessionRecord
from app.window.icons import toolbar_icon
from app.window.model_picker import ModelPicker

TOOLBAR_ICON = 18  # pixels: the size of a Mac toolbar's symbols beside their words
ABOUT = ("<b>Longleaf</b> {version}<br>Long-context chat with local models on Apple "
         "Silicon: a paged, quantized KV cache (fp16, q8, q6, q4) and a live view of the "
         "memory it takes.")


class MenuHost(Protocol):
    """What the toolbar and menus use of the main window (``MainWindow``).

    ``build_toolbar`` and ``build_menus`` also set the actions and widgets they
    make on it, declared here below the window's own.
    """

    controller: ChatController
    sessions: SessionList
    settings: Settings
    models_action: QAction
    new_chat_action: QAction
    reopen_button: QToolButton
    reopen_menu: QMenu
    model_label: QLabel
    model_picker: ModelPicker
    model_state: QLabel
    panel_action: QAction
    settings_action: QAction
    close_action: QAction
    quit_action: QAction
    about_action: QAction
    stop_action: QAction
    find_action: QAction

    @property
    def panel(self) -> MemoryPanel:
        """The memory panel (its Check Quality action joins the Chat menu)."""
        ...

    def as_widget(self) -> QWidget:
        """The window itself: the parent of the actions and boxes made for it."""
        ...


    def addToolBar(self, toolbar: QToolBar) -> None: ...
    def menuBar(self) -> QMenuBar: ...
    def focusWidget(self) -> QWidget | None: ...
    def close(self) -> bool: ...
    def ask_new_chat(self) -> None: ...
    def ask_attach(self) -> None: ...
    def choose_model(self, path: str) -> None: ...
    def open_model_folder(self) -> None: ...
    def open_models(self) -> None: ...
    def open_settings(self) -> None: ...
    def set_panel_visible(self, visible: bool) -> None: ...
    def palette(self) -> QPalette: ...
    def showMinimized(self) -> None: ...
    def isFullScreen(self) -> bool: ...
    def showFullScreen(self) -> None: ...
    def showNormal(self) -> None: ...


def build_toolbar(window: MenuHost) -> None:
    """Add the toolbar: new chat, reopen in a mode, model picker, memory, settings."""
    bar = QToolBar("Main")
    bar.setObjectName("mainToolbar")
    bar.setMovable(False)
    # Icon and word side by side: a Mac toolbar's symbols, and still one row at 1024 px.
    bar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
    bar.setIconSize(QSize(TOOLBAR_ICON, TOOLBAR_ICON))
    window.addToolBar(bar)
    window.models_action = QAction("Models and Downloads…", window.as_widget())
    window.models_action.triggered.connect(window.open_models)
    window.new_chat_action = QAction("New Chat", window.as_widget())
    window.new_chat_action.setShortcuts(QKeySequence.StandardKey.New)
    window.new_chat_action.triggered.connect(window.ask_new_chat)
    bar.addAction(window.new_chat_action)
    window.reopen_button = QToolButton()
    window.reopen_button.setObjectName("reopenButton")
    window.reopen_button.setText("Reopen in…")
    window.reopen_button.setToolTip(REOPEN_TIP)
    window.reopen_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
    window.reopen_menu = QMenu(window.reopen_button)
    # Filled as it opens: the shown chat's own mode is left out, and each asks first.
    window.reopen_menu.aboutToShow.connect(
        lambda: fill_reopen_menu(window.reopen_menu, window.controller, window.as_widget()))
    fill_reopen_menu(window.reopen_menu, window.controller, window.as_widget())
    window.reopen_button.setMenu(window.reopen_menu)
    window.reopen_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
    bar.addWidget(window.reopen_button)
    spacer = QWidget()
    spacer.setSizePolicy(spacer.sizePolicy().horizontalPolicy().Expanding,
                         spacer.sizePolicy().verticalPolicy())
    bar.addWidget(spacer)
    window.model_label = QLabel("Model")
    window.model_label.setObjectName("toolbarCaption")
    bar.addWidget(window.model_label)
    window.model_picker = ModelPicker()
    window.model_picker.set_current(window.settings.last_model)
    window.model_picker.modelChosen.connect(window.choose_model)
    window.model_picker.openFolderRequested.connect(window.open_model_folder)
    window.model_picker.manageRequested.connect(window.open_models)
    window.model_picker.refresh(window.settings.model_folders)
    bar.addWidget(window.model_picker)
    window.model_state = QLabel()
    window.model_state.setObjectName("modelState")
    bar.addWidget(window.model_state)
    window.panel_action = QAction("Memory", window.as_widget(), checkable=True)
    # isHidden, not isVisible: before the window is first shown nothing is visible.
    window.panel_action.setChecked(not window.panel.isHidden())
    window.panel_action.toggled.connect(window.set_panel_visible)
    bar.addAction(window.panel_action)
    window.settings_action = QAction("Settings…", window.as_widget())
    # Preferences is Cmd+, on macOS only; Ctrl+, is the convention elsewhere too.
    window.settings_action.setShortcuts(
        standard_keys(QKeySequence.StandardKey.Preferences, "Ctrl+,"))
    # macOS moves it to the application menu as "Settings…".
    window.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)
    window.settings_action.triggered.connect(window.open_settings)
    bar.addAction(window.settings_action)
    window.settings_action.setIconText("Settings")  # the toolbar's word, without the dots
    set_toolbar_icons(window)


def standard_keys(key: QKeySequence.StandardKey, fallback: str) -> list[QKeySequence]:
    """The platform's keys for ``key`` (⌘ on macOS), plus ``fallback`` where it has none."""
    keys = [*QKeySequence.keyBindings(key), QKeySequence(fallback)]
    return list({k.toString(): k for k in keys}.values())


def set_toolbar_icons(window: MenuHost) -> None:
    """Give the toolbar's actions their icons, in the window's palette (again on a change)."""
    palette = window.palette()
    window.new_chat_action.setIcon(toolbar_icon("new-chat", palette))
    window.reopen_button.setIcon(toolbar_icon("reopen", palette))
    window.panel_action.setIcon(toolbar_icon("memory", palette))
    window.settings_action.setIcon(toolbar_icon("settings", palette))
    window.models_action.setIcon(toolbar_icon("models", palette))


def show_about(window: QWidget) -> None:
    """The About box: what Longleaf is, and its version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("longleaf")
    except PackageNotFoundError:  # run from a source tree that was never installed
        number = ""
    QMessageBox.about(window, "About Longleaf", ABOUT.format(version=number))


def build_menus(window: MenuHost) -> None:
    """Add the File, Edit, Chat and View menus, sharing the toolbar's actions."""
    file_menu = window.menuBar().addMenu("&File")
    file_menu.addAction(window.new_chat_action)
    file_menu.addAction(window.models_action)
    file_menu.addAction("Open Model Folder…", window.open_model_folder)
    attach = file_menu.addAction("Attach Documents…", window.ask_attach)
    attach.setShortcut(QKeySequence.StandardKey.Open)
    file_menu.addSeparator()
    window.close_action = file_menu.addAction("Close Window", window.close)
    window.close_action.setShortcuts(QKeySequence.StandardKey.Close)
    # Closing the one window quits, with the same saving and engine shutdown.
    window.quit_action = file_menu.addAction("Quit Longleaf", window.close)
    window.quit_action.setShortcuts(standard_keys(QKeySequence.StandardKey.Quit, "Ctrl+Q"))
    window.quit_action.setMenuRole(QAction.MenuRole.QuitRole)
    # The roles put About, Settings… and Quit in macOS's application menu; elsewhere
    # they stay where they are added here.
    window.about_action = QAction("About Longleaf", window.as_widget())
    window.about_action.setMenuRole(QAction.MenuRole.AboutRole)
    window.about_action.triggered.connect(lambda: show_about(window.as_widget()))
    edit_menu = window.menuBar().addMenu("&Edit")
    edits: tuple[tuple[str, QKeySequence.StandardKey, str] | None, ...] = (
        ("Undo", QKeySequence.StandardKey.Undo, "undo"),
        ("Redo", QKeySequence.StandardKey.Redo, "redo"),
        None,
        ("Cut", QKeySequence.StandardKey.Cut, "cut"),
        ("Copy", QKeySequence.StandardKey.Copy, "copy"),
        ("Paste", QKeySequence.StandardKey.Paste, "paste"),
        ("Select All", QKeySequence.StandardKey.SelectAll, "selectAll"),
    )
    for edit in edits:
        if edit is None:
            edit_menu.addSeparator()
            continue
        title, key, slot = edit
        action = edit_menu.addAction(title, partial(_edit_focused_widget, window, slot))
        action.setShortcut(key)
    edit_menu.addSeparator()
    window.find_action = edit_menu.addAction("Find…", partial(_find_chats, window))
    window.find_action.setShortcuts(QKeySequence.StandardKey.Find)  # ⌘F on macOS
    edit_menu.addSeparator()
    edit_menu.addAction(window.settings_action)
    chat_menu = window.menuBar().addMenu("&Chat")
    window.stop_action = chat_menu.addAction("Stop", window.controller.stop)
    window.stop_action.setShortcut(QKeySequence(Qt.Key.Key_Escape))
    window.stop_action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
    regenerate_last = chat_menu.addAction("Regenerate Last Answer",
                                          window.controller.regenerate)
    edit_last = chat_menu.addAction("Edit Last Message", window.controller.begin_edit)

    chat_menu.addSeparator()
    rename_chat = chat_menu.addAction("Rename Chat…", lambda: _on_shown_chat(
        window, window.sessions.ask_rename))
    delete_chat = chat_menu.addAction("Delete Chat…", lambda: _on_shown_chat(
        window, window.sessions.ask_delete))

    def enable_for_the_chat() -> None:
        # None has a shortcut here, so set as the menu opens: greyed out where it
        # would do nothing (no chat, an empty one, the model still loading).
        c = window.controller
        regenerate_last.setEnabled(c.model_ready and c.can_regenerate())
        edit_last.setEnabled(c.last_user_row() is not None)
        rename_chat.setEnabled(c.current is not None)
        delete_chat.setEnabled(c.current is not None)

    chat_menu.aboutToShow.connect(enable_for_the_chat)
    chat_menu.addMenu(window.reopen_menu).setText("Reopen In")
    # The memory panel's button: enabled, or disabled with the reason, by its feed.
    chat_menu.addAction(window.panel.quality_action)
    view_menu = window.menuBar().addMenu("&View")
    view_menu.addAction(window.panel_action)
    full_screen = view_menu.addAction("Toggle Full Screen", lambda: (
        window.showNormal() if window.isFullScreen() else window.showFullScreen()))
    full_screen.setShortcuts(standard_keys(QKeySequence.StandardKey.FullScreen, "F11"))
    window_menu = window.menuBar().addMenu("&Window")
    minimize = window_menu.addAction("Minimize", window.showMinimized)
    minimize.setShortcut(QKeySequence("Ctrl+M"))  # ⌘M on macOS (Qt maps Ctrl to ⌘)
    help_menu = window.menuBar().addMenu("&Help")
    help_menu.addAction(window.about_action)
    help_menu.addAction("About Qt", QApplication.aboutQt).setMenuRole(
        QAction.MenuRole.AboutQtRole)


def _on_shown_chat(window: MenuHost, ask: Callable[[SessionRecord], None]) -> None:
    """Ask about the chat on screen (its rename or delete, as the list's menu does)."""
    if window.controller.current is not None:
        ask(window.controller.current)


def _find_chats(window: MenuHost) -> None:
    """Into the sidebar's search, its text selected so what is typed replaces it."""
    window.sessions.search.setFocus(Qt.FocusReason.ShortcutFocusReason)
    window.sessions.search.selectAll()


def _edit_focused_widget(window: MenuHost, slot: str) -> None:
    widget = window.focusWidget()
    if widget is not None and hasattr(widget, slot):
        getattr(widget, slot)()
