"""The toolbar's model picker: the demo, discovered models, and "Open folder…".

Discovery reads config files and safetensors headers only, but a big Hugging
Face cache still takes a moment, so it runs on a pool thread.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, QRunnable, Qt, QThreadPool, Signal
from PySide6.QtGui import QStandardItemModel
from PySide6.QtWidgets import QComboBox, QWidget

from app.format import human_bytes

DEMO = "demo"
OPEN_FOLDER = "__open_folder__"


class _Relay(QObject):
    done = Signal(object)


class _DiscoverJob(QRunnable):
    def __init__(self, folders: list[str], relay: _Relay) -> None:
        super().__init__()
        self.folders, self.relay = folders, relay

    def run(self) -> None:
        try:
            from engine import discover_models

            self.relay.done.emit(discover_models(self.folders))
        except Exception as exc:  # a broken cache must not take the picker down
            self.relay.done.emit(exc)


def describe(model) -> str:
    """A tooltip with the facts that matter for KV memory."""
    info = model.info
    q6 = "" if model.q6_supported else f"\nq6 unavailable: {model.q6_note}"
    return (f"{model.path}\n{info.architecture} · {human_bytes(model.size_bytes)} on disk · "
            f"{info.max_context:,} tokens context\n{info.attention_layers} attention layers × "
            f"{info.kv_heads} KV heads × head_dim {info.head_dim}{q6}")


class ModelPicker(QComboBox):
    """Pick a model; emits ``modelChosen(path)`` or ``openFolderRequested``."""

    modelChosen = Signal(str)
    openFolderRequested = Signal()
    discovered = Signal(int)  # number of loadable models found

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelPicker")
        self.setMinimumWidth(240)
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(1)
        self._relay = _Relay()
        self._relay.done.connect(self._on_discovered, Qt.ConnectionType.QueuedConnection)
        self.current_path = DEMO
        self.models: list = []
        self.skipped: list = []
        self._fill()
        self.activated.connect(self._on_activated)

    def refresh(self, folders: list[str]) -> None:
        """Rescan in the background (startup, or after the folders changed)."""
        self.pool.start(_DiscoverJob(list(folders), self._relay))

    def wait(self, msecs: int = 5000) -> bool:
        """Block until a running scan has finished (shutdown and tests)."""
        return self.pool.waitForDone(msecs)

    def set_current(self, path: str, name: str | None = None) -> None:
        """Show ``path`` as the loaded model, adding it when it was not listed."""
        self.current_path = path
        if self.findData(path) < 0:
            self.insertItem(1, name or Path(path).name, path)
        self.setCurrentIndex(self.findData(path))

    def _on_discovered(self, result) -> None:
        if isinstance(result, Exception):
            self.models, self.skipped = [], []
        else:
            self.models, self.skipped = list(result.models), list(result.skipped)
        self._fill()
        self.discovered.emit(len(self.models))

    def _fill(self) -> None:
        self.blockSignals(True)
        self.clear()
        self.addItem("Demo · SmolLM2-135M (built in)", DEMO)
        for model in self.models:
            self.addItem(model.name, str(model.path))
            self.setItemData(self.count() - 1, describe(model), Qt.ItemDataRole.ToolTipRole)
        if self.current_path != DEMO and self.findData(self.current_path) < 0:
            self.addItem(Path(self.current_path).name, self.current_path)
        model = self.model()
        for skipped in self.skipped:
            self.addItem(f"{skipped.name} — can't open", None)
            self.setItemData(self.count() - 1, skipped.reason, Qt.ItemDataRole.ToolTipRole)
            if isinstance(model, QStandardItemModel):
                model.item(self.count() - 1).setEnabled(False)
        self.insertSeparator(self.count())
        self.addItem("Open folder…", OPEN_FOLDER)
        self.setCurrentIndex(max(0, self.findData(self.current_path)))
        self.blockSignals(False)

    def _on_activated(self, index: int) -> None:
        data = self.itemData(index)
        if data == OPEN_FOLDER:
            self.setCurrentIndex(max(0, self.findData(self.current_path)))
            self.openFolderRequested.emit()
        elif data and data != self.current_path:
            self.modelChosen.emit(data)
