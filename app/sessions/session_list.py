"""The left sidebar: sessions with their KV mode, tokens and last activity."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping

from PySide6.QtCore import (
    QEvent,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    QPoint,
    QRect,
    QSize,
    Qt,
    QTimer,
    Signal,
)
from PySide6.QtGui import (
    QAction,
    QColor,
    QFont,
    QFontMetrics,
    QKeyEvent,
    QPainter,
    QPalette,
    QPen,
)
from PySide6.QtWidgets import (
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from app.format import relative_time, visible_text
from app.sessions.chat_state import ChatFacts, ChatState, sidebar_lines
from app.store import SessionRecord
from engine import MODES

UNKNOWN_MODE_COLOUR = "#777777"
RecordRole = Qt.ItemDataRole.UserRole + 1
StateRole = Qt.ItemDataRole.UserRole + 2  # the chat's ChatFacts (or its job's state, or "")
NO_MATCH = "No chats match"
NO_CHATS = "No chats yet"
SEARCH_PAUSE_MS = 150  # a pause in typing that runs the search
ANSWERING = ChatState.ANSWERING.value
ROW_HEIGHT = 54
ROW_MIN_WIDTH = 120
RENAME_WIDTH = (400, 700)  # the Rename dialog's title field in pixels: at least, at most
RENAME_FRAME = 24  # the line edit's frame and text margins around a title
BADGE_PADDING = 7  # pixels each side of the mode in its badge


def mode_colour(mode: str) -> QColor:
    """The badge colour of a KV mode, the same everywhere it is shown (grey for a
    name the registry lacks: a chat stored by a newer version)."""
    known = MODES.find(mode)
    return QColor(MODES[known].colour if known else UNKNOWN_MODE_COLOUR)


def confirm_delete(parent: QWidget, title: str) -> bool:
    """Ask before deleting a chat; Cancel is the default."""
    box = QMessageBox(QMessageBox.Icon.Warning, "Delete chat",
                      f"Delete “{visible_text(title)}” and all its messages?", parent=parent)
    box.setTextFormat(Qt.TextFormat.PlainText)  # a title is the user's text, never markup
    box.setInformativeText("This can't be undone.")
    delete = box.addButton("Delete", QMessageBox.ButtonRole.DestructiveRole)
    box.setDefaultButton(box.addButton(QMessageBox.StandardButton.Cancel))
    box.exec()
    return box.clickedButton() is delete


def mode_badge_font(font: QFont) -> QFont:
    """The mode badge's font: bold, a little smaller than the row's."""
    badge = QFont(font)
    badge.setPointSizeF(max(7.0, font.pointSizeF() * 0.8))
    badge.setBold(True)
    return badge


def mode_badge_width(badge_font: QFont, mode: str) -> int:
    """Pixels of a row's mode badge: the mode in the badge's own (bold) font, padded."""
    return QFontMetrics(badge_font).horizontalAdvance(mode) + 2 * BADGE_PADDING


def rename_dialog(parent: QWidget, title: str) -> QInputDialog:
    """The Rename dialog, wide enough to show the whole title being edited (within reason)."""
    dialog = QInputDialog(parent)
    dialog.setWindowTitle("Rename chat")
    dialog.setLabelText("Title:")
    dialog.setTextValue(title)
    # The dialog sizes itself to its line edit when shown: widen the edit, not the dialog.
    edit = dialog.findChild(QLineEdit)
    if edit is not None:  # QInputDialog's own text field
        room = edit.fontMetrics().horizontalAdvance(title) + RENAME_FRAME
        edit.setMinimumWidth(max(RENAME_WIDTH[0], min(room, RENAME_WIDTH[1])))
    return dialog


def detail_font(font: QFont) -> QFont:
    """A row's second line's font: a little smaller than the row's."""
    small = QFont(font)
    small.setPointSizeF(max(7.0, font.pointSizeF() * 0.88))
    return small


def detail_text(record: SessionRecord, state: ChatFacts | str = "") -> str:
    """The second line of a session: its state, tokens and last activity, or its job.

    ``state`` is the chat's ``ChatFacts``, or only its job's state ("" for none).
    """
    return detail_lines(record, state)[0]


def detail_lines(record: SessionRecord, state: ChatFacts | str = "") -> list[str]:
    """``detail_text`` and its shorter forms, longest first."""
    facts = state if isinstance(state, ChatFacts) else ChatFacts(
        job=state, history_tokens=record.tokens)
    return sidebar_lines(facts, relative_time(record.updated))


def fitting_detail(record: SessionRecord, state: ChatFacts | str, metrics: QFontMetrics,
                   width: int) -> str:
    """The longest form of a row's second line that fits ``width`` pixels (the shortest,
    elided, when none does)."""
    lines = detail_lines(record, state)
    fitting = next((line for line in lines if metrics.horizontalAdvance(line) <= width), None)
    return fitting or metrics.elidedText(lines[-1], Qt.TextElideMode.ElideRight, width)


class SessionDelegate(QStyledItemDelegate):
    """Two lines per session: title and mode badge; tokens and last activity."""

    def sizeHint(self, option: QStyleOptionViewItem,
                 index: QModelIndex | QPersistentModelIndex) -> QSize:
        # No width of its own: a row is as wide as the list, which never scrolls sideways.
        return QSize(ROW_MIN_WIDTH, ROW_HEIGHT)

    @staticmethod
    def detail_for(font: QFont, rect: QRect, record: SessionRecord,
                   state: ChatFacts | str) -> str:
        """The second line a row in ``rect`` shows, in the list's ``font``."""
        width = rect.adjusted(6, 3, -6, -3).adjusted(10, 6, -10, -6).width()
        return fitting_detail(record, state, QFontMetrics(detail_font(font)), width)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        record: SessionRecord = index.data(RecordRole)
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = option.rect.adjusted(6, 3, -6, -3)
        palette = option.palette
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        if selected:
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(palette.color(QPalette.ColorRole.Highlight))
            painter.drawRoundedRect(rect, 7, 7)
        elif option.state & QStyle.StateFlag.State_MouseOver:
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(palette.color(QPalette.ColorRole.Midlight))
            painter.drawRoundedRect(rect, 7, 7)
        text_colour = palette.color(
            QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text)
        font = QFont(option.font)
        badge_font = mode_badge_font(font)
        badge_width = mode_badge_width(badge_font, record.kv_mode)
        inner = rect.adjusted(10, 6, -10, -6)
        title_rect = QRect(inner.left(), inner.top(), inner.width() - badge_width - 6, 20)
        font.setBold(True)
        painter.setFont(font)
        painter.setPen(text_colour)
        title = painter.fontMetrics().elidedText(visible_text(record.title),
                                                 Qt.TextElideMode.ElideRight,
                                                 title_rect.width())
        painter.drawText(title_rect, Qt.AlignmentFlag.AlignVCenter, title)
        badge_rect = QRect(inner.right() - badge_width, inner.top() + 2, badge_width, 16)
        # On a selected row, outlined: a highlight of the badge's own colour (a green
        # selection under a green q8) would leave only its letters.
        painter.setPen(QPen(text_colour, 1.5) if selected else Qt.PenStyle.NoPen)
        painter.setBrush(mode_colour(record.kv_mode))
        painter.drawRoundedRect(badge_rect, 8, 8)
        painter.setFont(badge_font)
        painter.setPen(QColor("white"))
        painter.drawText(badge_rect, Qt.AlignmentFlag.AlignCenter, record.kv_mode)
        painter.setFont(detail_font(option.font))
        muted = QColor(text_colour)
        muted.setAlphaF(0.65)
        painter.setPen(muted)
        detail = self.detail_for(option.font, option.rect, record, index.data(StateRole) or "")
        painter.drawText(QRect(inner.left(), inner.top() + 22, inner.width(), 18),
                         Qt.AlignmentFlag.AlignVCenter, detail)
        painter.restore()


def _in_shown_order(sessions: list[SessionRecord],
                    shown: list[SessionRecord]) -> list[SessionRecord]:
    """``sessions`` with those already shown in their shown order, new ones first."""
    places = {record.id: place for place, record in enumerate(shown)}
    return sorted(sessions, key=lambda record: places.get(record.id, -1))


class SessionList(QWidget):
    """Search box and session list, with rename and delete (confirmed)."""

    sessionSelected = Signal(str)
    renameRequested = Signal(str, str)
    deleteRequested = Signal(str)
    searchChanged = Signal(str)
    # The user is done with the list: a chat clicked, or letters typed on it, that
    # belong in the message box (the text, "" for a click).
    typedAway = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("sidebar")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 10, 8, 8)
        layout.setSpacing(8)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats")
        # A placeholder is not a name: VoiceOver reads an unnamed field as "text field".
        self.search.setAccessibleName("Search chats")
        self.search.setClearButtonEnabled(True)
        # A search reads every message: run once the typing pauses, not per key
        # (cleared, the whole list comes back at once).
        self._search_pause = QTimer(self, singleShot=True, interval=SEARCH_PAUSE_MS)
        self._search_pause.timeout.connect(lambda: self.searchChanged.emit(self.search.text()))
        self.search.textChanged.connect(self._searched)
        layout.addWidget(self.search)
        self.list = QListWidget()
        self.list.setObjectName("sessionList")
        self.list.setAccessibleName("Chats")
        self.list.setItemDelegate(SessionDelegate(self.list))
        self.list.setMouseTracking(True)
        self.list.setFrameShape(QListWidget.Shape.NoFrame)
        # Rows elide their titles to the list's width; nothing is ever off to the side.
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setHorizontalScrollMode(QListWidget.ScrollMode.ScrollPerPixel)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._on_current)
        # A click picks the chat to write in: what is typed next goes to its message
        # box, not to the list's type-ahead, which would switch chats and eat the letters.
        self.list.itemClicked.connect(lambda _item: self.typedAway.emit(""))
        # ⌘⌫ (and Delete) on the list, as in a Mac list, deletes the selected chat,
        # asked first (``eventFilter``); on the list only: in the composer ⌘⌫
        # deletes text.
        self.list.installEventFilter(self)
        # Esc with a search typed clears it, as a Mac search field does, before the
        # window's Stop can take the key (``eventFilter``).
        self.search.installEventFilter(self)
        layout.addWidget(self.list, 1)
        self.no_match = QLabel(NO_MATCH)
        self.no_match.setObjectName("placeholder")
        self.no_match.setAlignment(Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop)
        self.no_match.hide()
        layout.addWidget(self.no_match, 1)
        self._updating = False
        # While the pointer is over the rows they keep their order (a click must land
        # on the row it was aimed at); the newest order comes when it leaves.
        self._pointer_in = False
        self._held: tuple | None = None
        self.list.viewport().installEventFilter(self)
        # Rows paint "5 min ago" from the clock: repaint them now and then so it stays true.
        self.clock = QTimer(self, interval=30_000)
        self.clock.timeout.connect(self.list.viewport().update)
        self.clock.start()

    def _searched(self, text: str) -> None:
        if text:
            self._search_pause.start()
        else:
            self._search_pause.stop()
            self.searchChanged.emit(text)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.search and _is_escape(event):
            # The override comes first and keeps Esc from the window's Stop: a second
            # Esc to make sure the search is gone must not stop an answer.
            event.accept()
            if event.type() == QEvent.Type.KeyPress:
                if self.search.text():
                    self.search.clear()
                else:  # nothing to clear: the search is left, for the chats' list
                    self.list.setFocus()
            return True
        if watched is self.list and isinstance(event, QKeyEvent) \
                and event.type() == QEvent.Type.KeyPress and _deletes(event):
            self._on_selected(self.ask_delete)
            return True
        if watched is self.list and isinstance(event, QKeyEvent) and _types_text(event):
            # Arrows, Home and End still move through the chats; letters are a message.
            self.typedAway.emit(event.text())
            return True
        if watched is self.list.viewport():
            if event.type() == QEvent.Type.Enter:
                self._pointer_in = True
            elif event.type() == QEvent.Type.Leave:
                self._pointer_in = False
                if self._held is not None:
                    held, self._held = self._held, None
                    self.set_sessions(*held)
        return super().eventFilter(watched, event)

    def set_sessions(self, sessions: list[SessionRecord], current: str | None,
                     states: Mapping[str, ChatFacts | str] | None = None) -> None:
        """Show ``sessions``, ``current`` selected; ``states``: chat id -> its ``ChatFacts``.

        Under the pointer the rows shown keep their places (new chats on top) until
        it leaves the list.
        """
        if self._pointer_in and self.list.count():
            self._held = (sessions, current, states)
            sessions = _in_shown_order(sessions, self.records())
        shown_before = self.selected()
        kept_scroll = self.list.verticalScrollBar().value()
        self._updating = True
        self.list.clear()
        # Empty, the list says why: a search found nothing, or there is no chat yet
        # (a blank sidebar at first launch looked broken).
        self.no_match.setText(NO_MATCH if self.search.text().strip() else NO_CHATS)
        self.no_match.setVisible(not sessions)
        self.list.setVisible(bool(sessions))
        for record in sessions:
            item = QListWidgetItem(visible_text(record.title))
            item.setData(RecordRole, record)
            item.setData(StateRole, (states or {}).get(record.id, ""))
            # Tooltips guess rich text from the content: make it rich, the title escaped.
            shown = html.escape(visible_text(record.title))
            item.setToolTip(f"<p style='white-space:pre'>{shown}<br>"
                            f"KV mode {record.kv_mode} · model {html.escape(record.model_id)}</p>")
            self.list.addItem(item)
            if record.id == current:
                self.list.setCurrentItem(item)
        # Refreshes come with every chunk read and every answer: one that keeps the
        # chat on screen must not pull a user scrolling for an older chat back to it.
        if (shown_before.id if shown_before else None) == current:
            self._restore_scroll(kept_scroll)
        self._updating = False

    def _restore_scroll(self, value: int) -> None:
        # The list lays its rows out later; the range is only right once it has.
        self.list.doItemsLayout()
        self.list.verticalScrollBar().setValue(value)

    def records(self) -> list[SessionRecord]:
        """The sessions shown, top to bottom."""
        return [self.list.item(i).data(RecordRole) for i in range(self.list.count())]

    def _on_current(self, item: QListWidgetItem | None,
                    _previous: QListWidgetItem | None) -> None:
        if item is not None and not self._updating:
            self.sessionSelected.emit(item.data(RecordRole).id)

    def _menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        record: SessionRecord = item.data(RecordRole)
        menu = QMenu(self)
        rename = QAction("Rename…", menu)
        rename.triggered.connect(lambda: self.ask_rename(record))
        delete = QAction("Delete…", menu)
        delete.triggered.connect(lambda: self.ask_delete(record))
        menu.addAction(rename)
        menu.addAction(delete)
        menu.exec(self.list.viewport().mapToGlobal(pos))

    def selected(self) -> SessionRecord | None:
        """The chat selected in the list, if any."""
        item = self.list.currentItem()
        return None if item is None else item.data(RecordRole)

    def _on_selected(self, ask: Callable[[SessionRecord], None]) -> None:
        record = self.selected()
        if record is not None:
            ask(record)

    def ask_rename(self, record: SessionRecord) -> None:
        """Ask for a new title."""
        dialog = rename_dialog(self, record.title)
        title = dialog.textValue().strip() if dialog.exec() else ""
        if title:
            self.renameRequested.emit(record.id, title)

    def ask_delete(self, record: SessionRecord) -> None:
        """Confirm, then delete."""
        if confirm_delete(self, record.title):
            self.deleteRequested.emit(record.id)


def _deletes(event: QKeyEvent) -> bool:
    """Whether a key press on the list asks to delete its chat: ⌘⌫ (Qt's Ctrl on
    a Mac) or Delete."""
    command = event.modifiers() & Qt.KeyboardModifier.ControlModifier
    return event.key() == Qt.Key.Key_Delete or (
        event.key() == Qt.Key.Key_Backspace and bool(command))


def _types_text(event: QKeyEvent) -> bool:
    """Whether ``event`` is a key press that types text (no ⌘ or Ctrl held)."""
    held = Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.MetaModifier
    return (event.type() == QEvent.Type.KeyPress and not event.modifiers() & held
            and event.text().isprintable() and bool(event.text()))


def _is_escape(event: QEvent) -> bool:
    return (isinstance(event, QKeyEvent) and event.key() == Qt.Key.Key_Escape
            and not event.modifiers()
            and event.type() in (QEvent.Type.ShortcutOverride, QEvent.Type.KeyPress))
