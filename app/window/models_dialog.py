"""Models and downloads: every model on disk and the recommended ones, side by side.

One row per model: size, context, and its KV cache at full context in each
mode against this machine's RAM; "Load" for a model on disk, "Download" for a
recommended one (one click, through ``ModelDownload``), "Cancel" while it runs.
"""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.format import human_bytes, human_duration
from app.window.model_library import ModelEntry, cost_text, short_tokens

COLUMNS = ("Model", "Size", "Context", "fp16", "q8", "q6", "q4", "")
ACTION_COLUMN = len(COLUMNS) - 1
FITS = "#2f7d5b"
TOO_BIG = "#c0392b"


class ModelsDialog(QDialog):
    """The model library; emits ``loadRequested(path)`` and ``downloadRequested(repo_id)``."""

    loadRequested = Signal(str)
    downloadRequested = Signal(str)
    cancelRequested = Signal(str)

    def __init__(self, installed: list[ModelEntry], recommended: list[ModelEntry],
                 downloading: set[str] = frozenset(), parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(900, 420)
        layout = QVBoxLayout(self)
        intro = QLabel(
            f"KV cache at each model's full context, per mode: <span style='color:{FITS}'>green"
            "</span> fits this machine's RAM with the model's weights and the memory Longleaf "
            f"leaves free, <span style='color:{TOO_BIG}'>red</span> does not. Recommended "
            "models are 4-bit mlx-community repos; their sizes are approximate.")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("modelTable")
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for column in range(1, len(COLUMNS)):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        layout.addWidget(self.table, 1)
        self.rows: dict[str, int] = {}  # path or repo id -> row
        for entry in [*installed, *recommended]:
            self._add_row(entry, entry.repo_id in downloading)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def _add_row(self, entry: ModelEntry, downloading: bool) -> None:
        row = self.table.rowCount()
        self.table.insertRow(row)
        self.rows[entry.path or entry.repo_id] = row
        name = QTableWidgetItem(entry.name)
        name.setToolTip(entry.summary or entry.path or "")
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
        self._set_action(entry, downloading)

    def _set_action(self, entry: ModelEntry, downloading: bool) -> None:
        key = entry.path or entry.repo_id
        if entry.downloaded:
            button = QPushButton("Load")
            button.clicked.connect(lambda: self._load(key))
        elif downloading:
            button = QPushButton("Cancel")
            button.clicked.connect(lambda: self.cancelRequested.emit(key))
        else:
            button = QPushButton("Download")
            button.clicked.connect(lambda: self._download(entry))
        button.setObjectName(f"action:{key}")
        self.table.setCellWidget(self.rows[key], ACTION_COLUMN, button)

    def action_button(self, key: str) -> QPushButton:
        """The Load/Download/Cancel button of the row for ``key`` (a path or repo id)."""
        return self.table.cellWidget(self.rows[key], ACTION_COLUMN)

    def _load(self, path: str) -> None:
        self.loadRequested.emit(path)
        self.accept()

    def _download(self, entry: ModelEntry) -> None:
        self._set_action(entry, downloading=True)
        self.downloadRequested.emit(entry.repo_id)

    def show_progress(self, progress) -> None:
        """Show a ``DownloadProgress`` in its row's size cell."""
        row = self.rows.get(progress.repo_id)
        if row is None:
            return
        share = progress.bytes_done / progress.bytes_total if progress.bytes_total else 0.0
        eta = (f" · {human_duration(progress.eta_seconds)} left"
               if progress.eta_seconds else "")
        self.table.item(row, 1).setText(
            f"{share:.0%} of {human_bytes(progress.bytes_total)}{eta}")

    def download_ended(self, entry: ModelEntry, folder: str | None) -> None:
        """The row of a download that stopped: Load once in ``folder``, else Download again."""
        row = self.rows.pop(entry.repo_id)
        if folder is not None:
            entry = replace(entry, path=folder)
        self.rows[entry.path or entry.repo_id] = row
        self.table.item(row, 1).setText(entry.size_text())
        self._set_action(entry, downloading=False)
