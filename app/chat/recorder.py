"""Saves a streaming answer as it grows, so a crash loses at most a second of it."""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, QTimer

from app.chat.model import ChatMessage, ChatModel
from app.store import HistoryStore

SAVE_INTERVAL_S = 1.0


class AnswerRecorder(QObject):
    """Writes the last row of a ``ChatModel`` to the store while it streams.

    The answer is saved on a flush when a second has passed since the last
    save, and by a one-second timer when tokens stop arriving; ``finish``
    records how it ended.
    """

    def __init__(self, store: HistoryStore, model: ChatModel,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.model = store, model
        self.message_id = 0
        self._saved_at = 0.0
        self._dirty = False
        self._timer = QTimer(self, interval=int(SAVE_INTERVAL_S * 1000))
        self._timer.timeout.connect(self.save)
        model.streamFlushed.connect(self._on_flush)

    @property
    def recording(self) -> bool:
        """True while an answer streams."""
        return self.message_id != 0

    def start(self, session_id: str) -> int:
        """Save an empty streaming answer and add its row; returns its id."""
        self.message_id = self.store.add_message(session_id, "assistant", "", "streaming")
        self.model.append(ChatMessage("assistant", "", "streaming", self.message_id))
        self._saved_at, self._dirty = time.monotonic(), False
        self._timer.start()
        return self.message_id

    def mark_dirty(self) -> None:
        """New text arrived (it reaches the model on the next flush)."""
        self._dirty = True

    def _on_flush(self, _content: str) -> None:
        if time.monotonic() - self._saved_at >= SAVE_INTERVAL_S:
            self.save()

    def save(self) -> None:
        """Write the text so far, if it changed."""
        if not self.message_id or not self._dirty:
            return
        self.model.flush()
        rows = self.model.rowCount()
        if rows:
            self.store.update_message(self.message_id,
                                      content=self.model.message(rows - 1).content)
        self._saved_at, self._dirty = time.monotonic(), False

    def finish(self, status: str, reason: str | None, stats: dict | None = None) -> None:
        """Record the final text and how the answer ended."""
        self._timer.stop()
        self.model.flush()
        rows = self.model.rowCount()
        content = self.model.message(rows - 1).content if rows else ""
        self.store.update_message(self.message_id, content=content, status=status,
                                  reason=reason, stats=stats)
        self.model.update_last(status=status, reason=reason, stats=stats)
        self.message_id = 0
