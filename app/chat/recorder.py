"""Keeps the streaming answer and saves it as it grows, so a crash loses at most a second.

A disk that fills up or turns read-only mid-answer never stops an answer from
ending: what cannot be written is kept here, said once, and written as soon as
the history takes writes again (tried every ``RETRY_INTERVAL_S``).
"""

from __future__ import annotations

import logging
import time

from PySide6.QtCore import QObject, QTimer, Signal

from app.chat.model import ChatMessage, ChatModel
from app.store import HistoryStore
from engine import DiskFault, disk

log = logging.getLogger(__name__)

SAVE_INTERVAL_S = 1.0
RETRY_INTERVAL_S = 5.0
CLOSED_WHILE_ANSWERING = "Longleaf was closed while answering"
LENGTH_LIMIT = "Reached the answer length limit"
# An answer the context could hold no more of: Continue cannot go on from it.
CONTEXT_END = "Reached the end of the model's context"
STOPPED_READING = "Stopped while reading"  # how a reason about a cut-short prefill begins


def stopped_reading(kept: int, total: int) -> str:
    """The reason of an answer stopped while the conversation was read in."""
    return (f"{STOPPED_READING}: {kept:,} of {total:,} tokens kept; "
            "the next send continues from there")


class AnswerRecorder(QObject):
    """The answer streaming now, bound to its session, written to the store as it grows.

    Its text lives here, not in the ``ChatModel``: the user may show another
    chat while it streams, and the answer keeps growing and being saved. The
    model gets the text only while the answer's session is the one shown
    (``show``). Saved when a second has passed since the last save, and by a
    one-second timer when tokens stop arriving; ``finish`` records how it ended.

    No method raises when the history cannot be written: the writes wait in
    ``pending`` (they are in the chat model already), ``unsaved`` says why once,
    and ``saved`` says so when they are written after all.
    """

    unsaved = Signal(str)  # why answers are kept in this window only, said once
    saved = Signal(str)  # the answers kept only here were written after all

    def __init__(self, store: HistoryStore, model: ChatModel,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.model = store, model
        self.message_id = 0
        self.session_id: str | None = None
        self.text = ""
        self.shown = False
        self.pending: dict[int, dict] = {}  # message id -> the fields not written yet
        self.unsaved_reason = ""  # why ``pending`` is not written ("" while none waits)
        self.earlier_stats: dict | None = None  # what a continued answer's pieces made
        self._saved_at = 0.0
        self._dirty = False
        self._timer = QTimer(self, interval=int(SAVE_INTERVAL_S * 1000))
        self._timer.timeout.connect(self.save)
        self._retry = QTimer(self, interval=int(RETRY_INTERVAL_S * 1000))
        self._retry.timeout.connect(self.flush)

    @property
    def recording(self) -> bool:
        """True while an answer streams."""
        return self.message_id != 0

    def start(self, session_id: str, shown: bool = True) -> int:
        """Save an empty streaming answer, its row added when its chat is ``shown``; its id.

        Raises:
            DiskFault: the history cannot take the answer's row (nothing started).
        """
        self.message_id = self.store.add_message(session_id, "assistant", "", "streaming")
        self.session_id, self.text, self.shown = session_id, "", shown
        self.earlier_stats = None
        if shown:
            self.model.append(ChatMessage("assistant", "", "streaming", self.message_id))
        self._saved_at, self._dirty = time.monotonic(), False
        self._timer.start()
        return self.message_id

    def resume(self, session_id: str, message_id: int, text: str, shown: bool = True,
               stats: dict | None = None) -> None:
        """Go on recording the saved answer ``message_id`` (Continue): its text grows.

        ``stats``: what the answer's earlier pieces made, added to this one's.
        """
        self.message_id, self.session_id, self.text, self.shown = (
            message_id, session_id, text, shown)
        self.earlier_stats = stats
        self._write(message_id, status="streaming", reason="")
        row = self.model.row_of(message_id) if shown else None
        if row is not None:
            self.model.update_row(row, content=text, status="streaming", reason=None)
        self._saved_at, self._dirty = time.monotonic(), False
        self._timer.start()

    def append(self, text: str) -> None:
        """Streamed text: kept, shown when its chat is, saved at most once a second."""
        if not self.recording or not text:
            return
        self.text += text
        if self.shown:
            self.model.append_text(text)
        self._dirty = True
        if time.monotonic() - self._saved_at >= SAVE_INTERVAL_S:
            self.save()

    def show(self, session_id: str | None) -> None:
        """Another chat is shown; when it is the answer's, its row gets the text so far."""
        self.shown = self.recording and session_id == self.session_id
        if self.shown:
            row = self.model.row_of(self.message_id)
            if row is not None:
                self.model.update_row(row, content=self.text, status="streaming")

    def save(self) -> None:
        """Write the text so far, if it changed."""
        if not self.message_id or not self._dirty:
            return
        self._write(self.message_id, content=self.text)
        self._saved_at, self._dirty = time.monotonic(), False

    def finish(self, status: str, reason: str | None, stats: dict | None = None) -> None:
        """Record the final text and how the answer ended (kept here if it cannot be)."""
        self._timer.stop()
        self._write(self.message_id, content=self.text, status=status, reason=reason,
                    stats=stats)
        row = self.model.row_of(self.message_id) if self.shown else None
        if row is not None:
            self.model.update_row(row, content=self.text, status=status, reason=reason,
                                  stats=stats)
        self.message_id, self.session_id, self.shown = 0, None, False
        self.earlier_stats = None

    def drop(self) -> None:
        """Forget the answer streaming now, its row deleted by the caller (it ended
        before any text and the turn it was to replace is back)."""
        self._timer.stop()
        self.pending.pop(self.message_id, None)
        self.message_id, self.session_id, self.shown = 0, None, False
        self.text, self.earlier_stats = "", None

    def flush(self) -> bool:
        """Write what waits in ``pending``; True when nothing waits any more."""
        for message_id in list(self.pending):
            try:
                self.store.update_message(message_id, **self.pending[message_id])
            except DiskFault as fault:
                self._cannot_save(fault)
                return False
            del self.pending[message_id]
        self._retry.stop()
        if self.unsaved_reason:
            self.unsaved_reason = ""
            self.saved.emit("The answers Longleaf could not save before are saved now.")
        return True

    def _write(self, message_id: int, **fields: object) -> None:
        # Later fields of a message replace earlier ones; None means "unchanged".
        waiting = self.pending.setdefault(message_id, {})
        waiting.update({name: value for name, value in fields.items() if value is not None})
        self.flush()

    def _cannot_save(self, fault: DiskFault) -> None:
        if not self._retry.isActive():
            self._retry.start()
        if self.unsaved_reason:
            return  # said once per spell
        log.warning("answer kept unsaved: %s", fault)
        self.unsaved_reason = str(disk.fault(
            fault.cause, fault.folder,
            "The answer is kept in this window but could not be saved", "Longleaf saves it "
            "by itself (until then, closing Longleaf loses it)"))
        self.unsaved.emit(self.unsaved_reason)
