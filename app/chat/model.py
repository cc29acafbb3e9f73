"""The open conversation as a Qt list model.

Streamed text is buffered and flushed on a ~30 ms timer, and a flush touches
the last row only, so a fast model never floods the view with repaints.
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from PySide6.QtCore import (
    QAbstractListModel,
    QByteArray,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    Qt,
    QTimer,
    Signal,
)

from app.store import AttachmentRecord, MessageRecord, read_by_engine

FLUSH_INTERVAL_MS = 30
# Streamed text is shown at most so often that showing it keeps the GUI thread busy
# a third of the time: a long open code block costs more at each flush as it grows,
# so its flushes come further apart rather than the window stalling.
RENDER_SHARE = 1 / 3

RoleRole = Qt.ItemDataRole.UserRole + 1
StatusRole = Qt.ItemDataRole.UserRole + 2
StatsRole = Qt.ItemDataRole.UserRole + 3
AttachmentsRole = Qt.ItemDataRole.UserRole + 4
MessageIdRole = Qt.ItemDataRole.UserRole + 5
ReasonRole = Qt.ItemDataRole.UserRole + 6

_Index = QModelIndex | QPersistentModelIndex


@dataclass
class ChatMessage:
    """One row: a message as shown, possibly still streaming."""

    role: str
    content: str
    status: str = "complete"
    message_id: int = 0
    reason: str | None = None
    stats: dict | None = None
    attachments: tuple[AttachmentRecord, ...] = field(default_factory=tuple)

    @classmethod
    def from_record(cls, record: MessageRecord) -> ChatMessage:
        """Build a row from a stored message."""
        return cls(record.role, record.content, record.status, record.id, record.reason,
                   record.stats, record.attachments)


def engine_content(message: ChatMessage | MessageRecord) -> str:
    """The text the model sees for a message: attached documents, then the text."""
    parts = [f"<document name=\"{_attribute(a.name)}\">\n{_inside_document(a.text)}\n"
             "</document>" for a in message.attachments]
    if message.content:
        parts.append(message.content)
    return "\n\n".join(parts)


def _attribute(name: str) -> str:
    """``name`` as a quoted attribute's value: only what would end or confuse it is
    escaped (an apostrophe stays one for the model to read)."""
    return html.escape(name, quote=False).replace('"', "&quot;")


def _inside_document(text: str) -> str:
    """``text`` with its own closing tags escaped: a dropped HTML or XML file (or one
    about this format) must not end its block early and pass the rest off as the
    user's words."""
    return _CLOSING_TAG.sub("&lt;/document&gt;", text)


_CLOSING_TAG = re.compile(r"</document\s*>", re.IGNORECASE)


class ChatModel(QAbstractListModel):
    """The messages of the open session."""

    streamFlushed = Signal(str)  # the whole answer so far, after each flush

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._rows: list[ChatMessage] = []
        self._pending: list[str] = []
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(FLUSH_INTERVAL_MS)
        self._timer.timeout.connect(self.flush)

    # Qt model API ---------------------------------------------------------

    def rowCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: _Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        row = self._rows[index.row()]
        return {
            Qt.ItemDataRole.DisplayRole: row.content,
            RoleRole: row.role,
            StatusRole: row.status,
            StatsRole: row.stats,
            AttachmentsRole: row.attachments,
            MessageIdRole: row.message_id,
            ReasonRole: row.reason,
        }.get(role)

    def roleNames(self) -> dict[int, QByteArray]:
        names = {
            Qt.ItemDataRole.DisplayRole: b"content", RoleRole: b"role", StatusRole: b"status",
            StatsRole: b"stats", AttachmentsRole: b"attachments", MessageIdRole: b"messageId",
            ReasonRole: b"reason",
        }
        return {role: QByteArray(name) for role, name in names.items()}

    # Conversation API -----------------------------------------------------

    def messages(self) -> list[ChatMessage]:
        """A copy of the rows (flushing pending text first)."""
        self.flush()
        return [replace(row) for row in self._rows]

    def message(self, row: int) -> ChatMessage:
        """A copy of one row."""
        return replace(self._rows[row])

    def can_answer_again(self, row: int) -> bool:
        """Whether the answer at ``row`` answers a turn the engine reads, so making it
        again asks that turn again. An answer after a turn set aside (too long for the
        context) answers nothing the engine reads: made again, it would go on from the
        answer before it."""
        if not 0 < row < len(self._rows) or self._rows[row].role != "assistant":
            return False
        asked = next((m for m in reversed(self._rows[:row]) if m.role != "assistant"), None)
        return (asked is not None and asked.role == "user"
                and read_by_engine(asked.role, asked.content, asked.status))

    def row_of(self, message_id: int) -> int | None:
        """The row showing stored message ``message_id``, or None."""
        for row, message in enumerate(self._rows):
            if message.message_id == message_id:
                return row
        return None

    def set_messages(self, messages: list[ChatMessage]) -> None:
        """Replace the whole conversation (switching sessions)."""
        self._timer.stop()
        self._pending.clear()
        self.beginResetModel()
        self._rows = list(messages)
        self.endResetModel()

    def append(self, message: ChatMessage) -> int:
        """Add a row at the end; returns its row number."""
        self.flush()
        self._timer.setInterval(FLUSH_INTERVAL_MS)  # a new answer starts short
        row = len(self._rows)
        self.beginInsertRows(QModelIndex(), row, row)
        self._rows.append(message)
        self.endInsertRows()
        return row

    def truncate(self, row: int) -> None:
        """Remove ``row`` and every row after it."""
        self.flush()
        if row >= len(self._rows):
            return
        self.beginRemoveRows(QModelIndex(), row, len(self._rows) - 1)
        del self._rows[row:]
        self.endRemoveRows()

    def append_text(self, text: str) -> None:
        """Queue streamed text for the last row; shown on the next flush."""
        if not text:
            return
        self._pending.append(text)
        if not self._timer.isActive():
            self._timer.start()

    def flush(self) -> None:
        """Move queued text into the last row and repaint that row only."""
        self._timer.stop()
        if not self._pending or not self._rows:
            self._pending.clear()
            return
        last = self._rows[-1]
        last.content += "".join(self._pending)
        self._pending.clear()
        index = self.index(len(self._rows) - 1)
        began = time.perf_counter()
        self.dataChanged.emit(index, index, [Qt.ItemDataRole.DisplayRole])
        self.streamFlushed.emit(last.content)
        shown_in_ms = (time.perf_counter() - began) * 1000
        self._timer.setInterval(max(FLUSH_INTERVAL_MS, round(shown_in_ms / RENDER_SHARE)))

    def update_last(self, **changes: object) -> None:
        """Set fields (status, reason, stats, message_id, content) of the last row."""
        if self._rows:
            self.update_row(len(self._rows) - 1, **changes)

    def update_row(self, row: int, **changes: object) -> None:
        """Set fields (status, reason, stats, message_id, content) of one row."""
        self.flush()
        if not 0 <= row < len(self._rows):
            return
        for key, value in changes.items():
            setattr(self._rows[row], key, value)
        index = self.index(row)
        self.dataChanged.emit(index, index)

    def engine_messages(self, system_prompt: str) -> list[dict[str, str]]:
        """The conversation as the engine takes it, system prompt first.

        Failed or empty answers, and user turns set aside as too long for the
        context (status "failed"), are left out so the model never sees them.
        """
        self.flush()
        out = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for row in self._rows:
            if not read_by_engine(row.role, row.content, row.status):
                continue
            out.append({"role": row.role, "content": engine_content(row)})
        return out
