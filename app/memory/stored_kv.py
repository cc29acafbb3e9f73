"""The memory panel's "Stored KV" section: chats' KV caches kept on disk.

The worker sends an ``engine.StoredKv`` listing (plain values) after every save,
eviction and clear, so nothing here reads a snapshot or calls MLX. Clearing asks
the worker, which deletes between requests and never while it writes a snapshot;
the panel changes when the worker's next listing arrives.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.controller import ChatController
from app.format import human_bytes, relative_time, visible_text
from app.memory.labels import section_heading, value_label
from engine import API_SESSION_PREFIX, StoredKv

# The chat's name gets the room: its tokens and mode are in the row's tooltip (and in
# the chat's own state sentence), so a narrow panel does not cut names to a few letters.
COLUMNS = ("Chat", "Size", "Last used")
ROW_HEIGHT = 24
UNKNOWN_CHAT = "(chat not in the history)"
API_SESSION = "Local server (API session)"



def clear_all_question(chats: int) -> str:
    """What Clear all asks before deleting the stored KV of ``chats`` listed chats."""
    if chats == 1:
        return ("Delete the stored KV of the one chat listed from disk? Its conversation "
                "stays; it is read again on its next send.")
    if chats:
        return (f"Delete the stored KV of all {chats:,} chats from disk? Their conversations "
                "stay; each is read again on its next send.")
    return ("Delete the stored-KV files on disk? None is a chat's listed here (they were set "
            "aside for another model, or are parts of other machines'); no conversation "
            "changes.")

class StoredKvSection(QWidget):
    """Bytes on disk against the budget, one row per stored chat, and clear buttons.

    Signals:
        clearRequested: a session id to clear one chat's stored KV, or None for all
            (already confirmed by the user).
    """

    clearRequested = Signal(object)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(6)
        layout.addWidget(section_heading("Stored KV"))
        self.summary = value_label("Nothing stored yet")
        layout.addWidget(self.summary)
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setMaximumHeight(8)
        self.bar.setMaximum(1000)
        self.bar.setAccessibleName("Stored KV on disk, of its budget")  # a bar without text
        layout.addWidget(self.bar)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("storedKvTable")
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().setVisible(False)
        # One line per chat: a long title is shortened at its end (whole in its tooltip)
        # rather than wrapped into a row too short for two lines.
        self.table.setWordWrap(False)
        self.table.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
        # As tall as its rows: the panel scrolls, never a table inside it.
        self.table.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        self.table.verticalHeader().setDefaultSectionSize(ROW_HEIGHT)
        self._fit_height()
        self.table.itemSelectionChanged.connect(self._update_buttons)
        layout.addWidget(self.table)
        buttons = QHBoxLayout()
        self.clear_one = QPushButton("Delete selected")
        self.clear_one.setToolTip("Delete the selected chat's stored KV; its next send "
                                  "reads the conversation again.")
        self.clear_one.clicked.connect(self._clear_selected)
        self.clear_all = QPushButton("Clear all…")
        self.clear_all.setToolTip("Delete every chat's stored KV from disk.")
        self.clear_all.clicked.connect(self._confirm_clear_all)
        buttons.addWidget(self.clear_one)
        buttons.addWidget(self.clear_all)
        buttons.addStretch(1)
        layout.addLayout(buttons)
        self.listing: StoredKv | None = None
        self._names: list[str] = []
        self._update_buttons()

    def show_listing(self, listing: StoredKv, title_of: Callable[[str], str | None]) -> None:
        """Show the worker's listing; ``title_of`` names a chat from its session id."""
        self.listing = listing
        budget = listing.budget_bytes
        count = len(listing.snapshots)
        elsewhere = (f" · the local server's {human_bytes(listing.elsewhere_bytes)} counts "
                     "too" if listing.elsewhere_bytes else "")
        self.summary.setText(f"<b>{human_bytes(listing.total_bytes)}</b> on disk of "
                             f"{human_bytes(budget)} budget · {_what(listing)}{elsewhere}")
        counted = listing.total_bytes + listing.elsewhere_bytes
        self.bar.setValue(min(1000, int(1000 * counted / budget)) if budget else 0)
        selected = self.selected_name()
        self._names = [info.name for info in listing.snapshots]
        self.table.setRowCount(count)
        for row, info in enumerate(listing.snapshots):
            title = title_of(info.name) or UNKNOWN_CHAT
            cells = (title, human_bytes(info.disk_bytes), relative_time(info.last_used))
            tip = f"{title}\n{info.tokens:,} tokens in {info.mode}, {human_bytes(info.disk_bytes)}"
            if not listing.reopenable(info):
                tip += (f"\nStored with {info.model or 'another model'}, not the model loaded "
                        "now: its chat reads the conversation again, and this copy goes.")
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(tip)
                if column:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight
                                          | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, column, item)
        # Rows move as chats are used: keep the selection on its chat, never on its row
        # (Qt moves the current row onto a neighbour when rows go).
        self.table.selectionModel().clearCurrentIndex()
        self.table.clearSelection()
        if selected in self._names:
            self.table.selectRow(self._names.index(selected))
        self._fit_height()
        self._update_buttons()

    def _fit_height(self) -> None:
        header = self.table.horizontalHeader().sizeHint().height()
        rows = max(1, self.table.rowCount())
        self.table.setFixedHeight(header + rows * ROW_HEIGHT + 2 * self.table.frameWidth())

    def selected_name(self) -> str | None:
        """The session id of the selected row, or None."""
        rows = self.table.selectionModel().selectedRows()
        return self._names[rows[0].row()] if rows else None

    def _update_buttons(self) -> None:
        self.clear_one.setEnabled(self.selected_name() is not None)
        # Files no row lists (snapshots set aside for another model, parts of other
        # machines') take room too: Clear all is the way to get it back.
        on_disk = self.listing is not None and self.listing.total_bytes > 0
        self.clear_all.setEnabled(bool(self._names) or on_disk)

    def _clear_selected(self) -> None:
        name = self.selected_name()
        if name is not None:
            self.clearRequested.emit(name)

    def _confirm_clear_all(self) -> None:
        question = clear_all_question(len(self._names))
        answer = QMessageBox.question(
            self, "Clear stored KV", question,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel,
            QMessageBox.StandardButton.Cancel)
        if answer == QMessageBox.StandardButton.Yes:
            self.clearRequested.emit(None)


def _what(listing: StoredKv) -> str:
    """"3 chats · 2 local-server sessions": the chats and the API's sessions apart."""
    api = sum(info.name.startswith(API_SESSION_PREFIX) for info in listing.snapshots)
    chats = len(listing.snapshots) - api
    text = f"{chats} chat{'s' if chats != 1 else ''}"
    if api:
        text += f" · {api} local-server session{'s' if api != 1 else ''}"
    return text


class StoredKvFeed(QObject):
    """Connects the section to the bridge's listings and the history's chat titles.

    Args:
        controller: the ``ChatController`` (its ``bridge``, its ``store`` of chat
            titles, and ``closed``: listings sent while the app quits are ignored,
            the history is closing).
        section: the section it fills.
    """

    def __init__(self, controller: ChatController, section: StoredKvSection,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.controller, self.section = controller, section
        bridge = controller.bridge
        bridge.storedKv.connect(self.show)
        section.clearRequested.connect(bridge.clear_stored_kv)
        if bridge.last_stored_kv is not None:
            self.show(bridge.last_stored_kv)

    def show(self, listing: StoredKv | None = None) -> None:
        """Show ``listing`` (None: the last one again, e.g. after a chat was renamed)."""
        listing = listing or self.section.listing
        if listing is not None and not self.controller.closed:
            self.section.show_listing(listing, self._title)

    def _title(self, session_id: str) -> str | None:
        if session_id.startswith(API_SESSION_PREFIX):
            return API_SESSION
        record = self.controller.store.session(session_id)
        return visible_text(record.title) if record is not None else None
