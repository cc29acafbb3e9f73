"""Models and downloads: every model on disk and the recommended ones, side by side.

One row per model: size, context, its KV cache at full context in each mode
against this machine's RAM, and the verdict in words (what fits, or what would);
"Loaded" for the model in use, "Load" for another on disk, "Download" for a
recommended one (one click, through ``ModelDownload``), "Cancel" while it runs.
A download that fails says why in the dialog, with Retry.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import psutil
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.format import human_bytes, human_duration
from app.window.model_library import ModelEntry, cost_text, fit_advice, short_tokens
from engine import MODES, DownloadProgress


def columns() -> tuple[str, ...]:
    """The table's headers: a cost column per registered KV mode, then the verdict
    and the action."""
    return ("Model", "Size", "Context", *MODES, "On this machine", "")
LOADED = "Loaded"
DIALOG_SIZE = (1000, 460)
FITS = "#2f7d5b"
TOO_BIG = "#c0392b"


class ModelsDialog(QDialog):
    """The model library; emits ``loadRequested(path)`` and ``downloadRequested(repo_id)``."""

    loadRequested = Signal(str)
    downloadRequested = Signal(str)
    cancelRequested = Signal(str)

    def __init__(self, installed: list[ModelEntry], recommended: list[ModelEntry],
                 downloading: Collection[str] = frozenset(), parent: QWidget | None = None, *,
                 loaded: str | None = None, total_ram: int | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Models")
        room = self.screen().availableSize()  # fits a 1024-px screen with a margin
        self.resize(min(DIALOG_SIZE[0], room.width() - 40), min(DIALOG_SIZE[1], room.height()))
        self.loaded = loaded  # the folder of the model in use
        self.total_ram = psutil.virtual_memory().total if total_ram is None else total_ram
        self.entries: dict[str, ModelEntry] = {}  # by path or repo id
        layout = QVBoxLayout(self)
        intro = QLabel(
            f"KV cache at each model's full context, per mode: <span style='color:{FITS}'>green"
            "</span> fits this machine's RAM with the model's weights, the room reading a "
            "document in takes and the memory Longleaf leaves free, "
            f"<span style='color:{TOO_BIG}'>red</span> does not. Recommended "
            "models are 4-bit mlx-community repos; their sizes are approximate.")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        headers = columns()
        self.verdict_column, self.action_column = len(headers) - 2, len(headers) - 1
        self.table = QTableWidget(0, len(headers))
        self.table.setObjectName("modelTable")
        self.table.setHorizontalHeaderLabels(list(headers))
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        header = self.table.horizontalHeader()
        for column in range(len(headers)):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        # The name and the verdict share the room; a long verdict wraps onto two lines.
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(self.verdict_column, QHeaderView.ResizeMode.Stretch)
        self.table.setWordWrap(True)
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        layout.addWidget(self.table, 1)
        self.error = DownloadError()
        self.error.retryRequested.connect(self._retry)
        layout.addWidget(self.error)
        self.rows: dict[str, int] = {}  # path or repo id -> row
        for entry in [*installed, *recommended]:
            self._add_row(entry, entry.repo_id in downloading)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        # A window of its own beside the main one (modeless): ⌘W closes it, as any
        # Mac window, instead of doing nothing.
        QShortcut(QKeySequence.StandardKey.Close, self, self.reject)

    def _add_row(self, entry: ModelEntry, downloading: bool) -> None:
        row = self.table.rowCount()
        self.table.insertRow(row)
        self.rows[entry.key] = row
        self.entries[entry.key] = entry
        name = QTableWidgetItem(entry.name)
        name.setToolTip("\n".join(filter(None, (entry.summary or entry.path,
                                                 entry.split_text()))))
        self.table.setItem(row, 0, name)
        self.table.setItem(row, 1, QTableWidgetItem(entry.size_text()))
        self.table.setItem(row, 2, QTableWidgetItem(f"{short_tokens(entry.max_context)} tokens"))
        for column, cost in enumerate(entry.costs, start=3):
            cell = QTableWidgetItem("—" if cost.kv_bytes is None else human_bytes(cost.kv_bytes))
            cell.setToolTip(cost_text(cost, entry.max_context))
            if cost.kv_bytes is not None:
                cell.setForeground(QColor(FITS if cost.fits else TOO_BIG))
            cell.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self.table.setItem(row, column, cell)
        fits, advice = fit_advice(entry, self.total_ram)
        verdict = QTableWidgetItem(advice)
        verdict.setToolTip("\n".join(entry.cost_lines()))
        if not fits:
            verdict.setForeground(QColor(TOO_BIG))
        self.table.setItem(row, self.verdict_column, verdict)
        self._set_action(entry, downloading)

    def _set_action(self, entry: ModelEntry, downloading: bool) -> None:
        key = entry.key
        if entry.downloaded and entry.path == self.loaded:
            label = QLabel(LOADED)
            label.setObjectName(f"action:{key}")
            label.setAlignment(Qt.AlignmentFlag.AlignCenter)
            label.setToolTip("The model in use now")
            self.table.setCellWidget(self.rows[key], self.action_column, label)
            return
        # Read out of its row, "Load" alone does not say which model: each names it.
        if entry.downloaded:
            button = QPushButton("Load")
            button.setAccessibleName(f"Load {entry.name}")
            button.clicked.connect(lambda: self._load(key))
        elif downloading:
            button = QPushButton("Cancel")
            button.setAccessibleName(f"Cancel the download of {entry.name}")
            button.clicked.connect(lambda: self.cancelRequested.emit(key))
        else:
            button = QPushButton("Download")
            button.setAccessibleName(f"Download {entry.name}")
            button.clicked.connect(lambda: self._download(entry))
        button.setObjectName(f"action:{key}")
        self.table.setCellWidget(self.rows[key], self.action_column, button)

    def action_button(self, key: str) -> QPushButton | QLabel:
        """The Load/Download/Cancel button of the row for ``key`` (a path or repo id),
        or its "Loaded" label for the model in use."""
        widget = self.table.cellWidget(self.rows[key], self.action_column)
        if not isinstance(widget, QPushButton | QLabel):  # _set_action puts one in every row
            raise LookupError(f"The row of {key} has no action.")
        return widget

    def _load(self, path: str) -> None:
        self.loadRequested.emit(path)
        self.accept()

    def _download(self, entry: ModelEntry) -> None:
        self.error.clear()
        self._set_action(entry, downloading=True)
        self.downloadRequested.emit(entry.repo_id)

    def _retry(self, repo_id: str) -> None:
        entry = self.entries.get(repo_id)
        if entry is not None:
            self._download(entry)

    def show_progress(self, progress: DownloadProgress) -> None:
        """Show a ``DownloadProgress`` in its row's size cell."""
        row = self.rows.get(progress.repo_id)
        if row is None:
            return
        share = progress.bytes_done / progress.bytes_total if progress.bytes_total else 0.0
        eta = (f" · {human_duration(progress.eta_seconds)} left"
               if progress.eta_seconds else "")
        self._size_cell(row).setText(f"{share:.0%} of {human_bytes(progress.bytes_total)}{eta}")

    def _size_cell(self, row: int) -> QTableWidgetItem:
        item = self.table.item(row, 1)
        if item is None:  # _add_row fills every cell of its row
            raise LookupError(f"Row {row} of the library has no size cell.")
        return item

    def download_ended(self, entry: ModelEntry, folder: str | None, message: str = "",
                       cancelled: bool = False) -> None:
        """The row of a download that stopped: Load once in ``folder``, else Download again.

        ``message`` says why it stopped; a failure shows it here with Retry.
        """
        row = self.rows.pop(entry.key)  # a download's row: keyed by its repo id
        self.entries.pop(entry.key, None)
        if folder is not None:
            entry = replace(entry, path=folder)
        key = entry.key
        self.rows[key], self.entries[key] = row, entry
        self._size_cell(row).setText(entry.size_text())
        self._set_action(entry, downloading=False)
        if folder is None and message:
            self.error.show_message(message, None if cancelled else entry.repo_id)


class DownloadError(QFrame):
    """Why a download stopped, in words, with Retry for a failure; hidden otherwise."""

    retryRequested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("errorBanner")
        self.setProperty("kind", "error")
        row = QHBoxLayout(self)
        row.setContentsMargins(10, 6, 6, 6)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.TextFormat.PlainText)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.retry = QPushButton("Retry")
        self.retry.clicked.connect(lambda: self.retryRequested.emit(self.repo_id or ""))
        row.addWidget(self.label, 1)
        row.addWidget(self.retry, 0, Qt.AlignmentFlag.AlignTop)
        self.repo_id: str | None = None
        self.hide()

    def show_message(self, text: str, retry: str | None) -> None:
        """Show ``text``; ``retry`` is the repo Retry downloads again (None: no Retry)."""
        self.repo_id = retry
        self.label.setText(text)
        self.setProperty("kind", "error" if retry else "info")
        self.style().unpolish(self)
        self.style().polish(self)
        self.retry.setVisible(retry is not None)
        self.show()

    def clear(self) -> None:
        """Hide it (a new download started)."""
        self.repo_id = None
        self.hide()
