"""The toolbar's model picker: the demo, discovered models, "Models…", "Open folder…".

Each model shows its size and context; its tooltip adds the KV cost at full
context in each mode against this machine's RAM (``app.window.model_library``).
Discovery reads config files and safetensors headers only, but a big Hugging
Face cache still takes a moment, so it runs on a pool thread with the arithmetic.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QFontMetrics, QStandardItemModel
from PySide6.QtWidgets import QComboBox, QStyle, QStyleOptionComboBox, QWidget

from app.background import Background
from app.format import human_bytes
from app.window.model_library import DEMO_SOURCE, ModelEntry, library, short_tokens
from engine import DEMO

if TYPE_CHECKING:
    from engine import DiscoveredModel, Discovery, SkippedModel

DEMO_LABEL = "Demo · SmolLM2-135M (built in)"
OPEN_FOLDER = "__open_folder__"
MANAGE = "__models__"
PICKER_TEXT_WIDTH = (180, 300)  # pixels of text the closed picker shows: at least, at most


def _discover(folders: list[str]) -> tuple[Discovery, tuple[list[ModelEntry], list[ModelEntry]]]:
    """The models in ``folders`` and the caches, and their library entries (a pool thread)."""
    from engine import discover_models

    found = discover_models(folders)
    return found, library(found.models)


def describe(model: DiscoveredModel, entry: ModelEntry | None = None) -> str:
    """A tooltip with the facts that matter for KV memory, and each mode's full-context cost."""
    info = model.info
    unavailable = "".join(f"\n{mode} unavailable: {note}"
                          for mode, note in model.mode_notes.items())
    costs = "\n".join(["", "KV cache at full context:", *entry.cost_lines()]) if entry else ""
    split = f"\n{entry.split_text()}" if entry else ""
    return (f"{model.path}\n{info.architecture} · {human_bytes(model.size_bytes)} on disk · "
            f"{info.max_context:,} tokens context\n{info.attention_layers} attention layers × "
            f"{info.kv_heads} KV heads × head_dim {info.head_dim}{unavailable}{split}{costs}")


def demo_item_text(max_context: int) -> str:
    """The Demo item once its facts are known: "Demo · SmolLM2-135M (built in) · 8k context"."""
    return f"{DEMO_LABEL} · {short_tokens(max_context)} context"


def item_text(entry: ModelEntry, metrics: QFontMetrics) -> str:
    """"mlx-community/Qwen3-4B · 2.3 GB · 262k context", the name shortened in the middle
    when the whole would not fit the closed picker (its tooltip has the full path)."""
    facts = f" · {entry.size_text()} · {short_tokens(entry.max_context)} context"
    return fitted_name(entry.name, facts, metrics) + facts


def fitted_name(name: str, after: str, metrics: QFontMetrics) -> str:
    """``name``, elided in the middle so that ``name + after`` fits the closed picker."""
    room = PICKER_TEXT_WIDTH[1] - metrics.horizontalAdvance(after)
    return metrics.elidedText(name, Qt.TextElideMode.ElideMiddle, max(room, 40))


class ModelPicker(QComboBox):
    """Pick a model; emits ``modelChosen(path)`` or ``openFolderRequested``."""

    modelChosen = Signal(str)
    openFolderRequested = Signal()
    manageRequested = Signal()
    discovered = Signal(int)  # number of loadable models found

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelPicker")
        # The box is as wide as the shown model's text (names are shortened to fit a
        # 1024-px window's toolbar); the popup list is as wide as its longest item.
        self.currentIndexChanged.connect(self.updateGeometry)
        self.jobs = Background(threads=1, parent=self)
        self.current_path = DEMO
        self.models: list[DiscoveredModel] = []
        self.skipped: list[SkippedModel] = []
        self.demo: DiscoveredModel | None = None  # the demo's converted folder, once discovered
        self.entries: dict[str, ModelEntry] = {}  # by path
        # Shown before the first scan ends; a scan drops those already downloaded.
        self.recommended: list[ModelEntry] = library([])[1]
        self._fill()
        self.activated.connect(self._on_activated)

    def refresh(self, folders: list[str]) -> None:
        """Rescan in the background (startup, or after the folders changed)."""
        folders = list(folders)
        self.jobs.run(lambda: _discover(folders), self._on_discovered)

    def wait(self, msecs: int = 5000) -> bool:
        """Block until a running scan has finished (shutdown and tests)."""
        return self.jobs.wait(msecs)

    def set_current(self, path: str, name: str | None = None) -> None:
        """Show ``path`` as the loaded model, adding it when it was not listed."""
        self.current_path = path
        if self.findData(path) < 0:
            self.insertItem(1, fitted_name(name or Path(path).name, "", self.fontMetrics()), path)
            self._fit_popup()
        self.setCurrentIndex(self.findData(path))

    def installed(self) -> list[ModelEntry]:
        """Entries of the models on disk, the demo first."""
        demo = [self.entries[str(self.demo.path)]] if self.demo is not None else []
        return demo + [self.entries[str(m.path)] for m in self.models]

    def _on_discovered(
        self, result: tuple[Discovery, tuple[list[ModelEntry], list[ModelEntry]]] | BaseException,
    ) -> None:
        found: Discovery | None
        installed: list[ModelEntry]
        if isinstance(result, BaseException):  # a broken cache must not take the picker down
            found, installed, self.recommended = None, [], []
        else:
            found, (installed, self.recommended) = result
        # Every model on disk has a path (only a download's entry has none).
        self.entries = {entry.path: entry for entry in installed if entry.path is not None}
        models = list(found.models) if found else []
        # The demo's converted folder is the "Demo" item: listed once, with its facts.
        self.demo = next((m for m in models if m.source == DEMO_SOURCE), None)
        self.models = [m for m in models if m.source != DEMO_SOURCE]
        self.skipped = list(found.skipped) if found else []
        self._fill()
        self.discovered.emit(len(self.models) + (self.demo is not None))

    def _fill(self) -> None:
        self.blockSignals(True)
        self.clear()
        if self.demo is None:
            self.addItem(DEMO_LABEL, DEMO)
        else:
            entry = self.entries[str(self.demo.path)]
            self.addItem(demo_item_text(entry.max_context), DEMO)
            self.setItemData(0, describe(self.demo, entry), Qt.ItemDataRole.ToolTipRole)
        for model in self.models:
            entry = self.entries[str(model.path)]
            self.addItem(item_text(entry, self.fontMetrics()), str(model.path))
            self.setItemData(self.count() - 1, describe(model, entry),
                             Qt.ItemDataRole.ToolTipRole)
        if self.current_path != DEMO and self.findData(self.current_path) < 0:
            self.addItem(fitted_name(Path(self.current_path).name, "", self.fontMetrics()),
                         self.current_path)
        items = self.model()
        for skipped in self.skipped:
            self.addItem(f"{skipped.name} — can't open", None)
            self.setItemData(self.count() - 1, skipped.reason, Qt.ItemDataRole.ToolTipRole)
            if isinstance(items, QStandardItemModel):
                items.item(self.count() - 1).setEnabled(False)
        self.insertSeparator(self.count())
        self.addItem("Models and downloads…", MANAGE)
        self.addItem("Open folder…", OPEN_FOLDER)
        self.setCurrentIndex(max(0, self.findData(self.current_path)))
        self._fit_popup()
        self.blockSignals(False)

    def sizeHint(self) -> QSize:
        """Room for the shown model's text, within ``PICKER_TEXT_WIDTH``."""
        option = QStyleOptionComboBox()
        self.initStyleOption(option)
        text = self.fontMetrics().horizontalAdvance(self.currentText())
        text = max(PICKER_TEXT_WIDTH[0], min(text, PICKER_TEXT_WIDTH[1]))
        size = self.style().sizeFromContents(QStyle.ContentsType.CT_ComboBox, option,
                                             QSize(text, self.fontMetrics().height()), self)
        return QSize(size.width(), super().sizeHint().height())

    def minimumSizeHint(self) -> QSize:
        return self.sizeHint()

    def setItemText(self, index: int, text: str) -> None:
        super().setItemText(index, text)
        self.updateGeometry()

    def _fit_popup(self) -> None:
        widest = max(self.fontMetrics().horizontalAdvance(self.itemText(i))
                     for i in range(self.count()))
        self.view().setMinimumWidth(widest + 40)  # room for the scroll bar and margins

    def _on_activated(self, index: int) -> None:
        data = self.itemData(index)
        if data in (OPEN_FOLDER, MANAGE):
            self.setCurrentIndex(max(0, self.findData(self.current_path)))
            (self.openFolderRequested if data == OPEN_FOLDER else self.manageRequested).emit()
        elif data and data != self.current_path:
            self.modelChosen.emit(data)
