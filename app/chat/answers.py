"""Answers and re-ingests, from the request to how they ended.

Tokens stream into the open chat, the answer is saved as it grows and as it
ends (complete, stopped, failed), and failures are shown.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.activity import Activity
from app.chat.model import ChatModel
from app.chat.recorder import AnswerRecorder
from app.engine_bridge import EngineBridge
from app.sessions.actions import SessionActions
from app.sessions.caches import SessionCaches
from app.settings import Settings
from app.store import HistoryStore, SessionRecord
from engine import Failed, Finished, IngestProgress, TokenChunk

TOO_LONG_TURN = ("Too long for the model's context; kept here but not sent with later "
                 "messages. Edit it to a shorter one, or reopen the chat in a smaller KV mode.")
MEMORY_STOP = ("Stopped to protect your computer: system memory turned critical or free RAM ran "
               "out. Close other apps or chats, or reopen this chat in a smaller KV mode.")


class Answers(QObject):
    """Starts chat and ingest requests and follows their engine events to the end.

    One runs at a time (``activity``); it waits for its session's KV cache to
    open first (``caches``). The answer streams into ``model`` and the
    recorder saves it; the shown session (``sessions``) learns its new length.
    """

    answerFinished = Signal(str)  # final status of the answer
    errorRaised = Signal(str)
    notice = Signal(str)
    ingestProgress = Signal(object)

    def __init__(self, bridge: EngineBridge, settings: Settings, store: HistoryStore,
                 model: ChatModel, activity: Activity, caches: SessionCaches,
                 sessions: SessionActions, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.settings, self.store, self.model = bridge, settings, store, model
        self.activity, self.caches, self.sessions = activity, caches, sessions
        self.recorder = AnswerRecorder(store, model, self)
        self._kinds: dict[int, str] = {}  # request id -> "chat" or "ingest"
        self._sent_row: int | None = None  # the user turn the running answer replies to

    # Starting -------------------------------------------------------------

    def start_chat(self, session: SessionRecord) -> None:
        """Answer the conversation in ``model``, which ends with a user turn."""
        messages = self.model.engine_messages(self.settings.system_prompt)
        self._sent_row = self.model.rowCount() - 1  # the user turn (sent or regenerated)
        self.recorder.start(session.id)
        self.activity.set(-1, "chat")

        def go() -> None:
            rid = self.bridge.chat(session.id, messages, self.settings.sampling)
            self._kinds[rid] = "chat"
            self.activity.set(rid, "chat")

        self.caches.ensure_open(session, go)

    def start_ingest(self, session: SessionRecord) -> None:
        """Read the conversation in ``model`` into ``session``'s new KV cache."""
        self.activity.set(-1, "ingest")  # reserved until the real id is known

        def go() -> None:
            messages = self.model.engine_messages(self.settings.system_prompt)
            rid = self.bridge.ingest(session.id, messages)
            self._kinds[rid] = "ingest"
            self.activity.set(rid, "ingest")

        self.caches.ensure_open(session, go)

    # Engine events --------------------------------------------------------

    def on_token(self, event: TokenChunk) -> None:
        """Streamed text of the running answer."""
        if event.request_id == self.activity.request and self.activity.kind == "chat":
            self.model.append_text(event.text)
            self.recorder.mark_dirty()

    def finish_answer(self, status: str, reason: str | None, stats: dict | None = None) -> None:
        """Save how the answer ended and say so."""
        self.recorder.finish(status, reason, stats)
        self.sessions.touched()
        self.answerFinished.emit(status)

    def on_finished(self, event: Finished) -> None:
        """A request ended: the answer is saved, the ingest reported."""
        kind = self._kinds.pop(event.request_id, None)
        if event.request_id != self.activity.request:
            return
        if kind == "chat":
            status = "stopped" if event.reason in ("cancelled", "memory") else "complete"
            reason = {"cancelled": "Stopped", "length": "Reached the answer length limit",
                      "memory": MEMORY_STOP}.get(event.reason)
            if event.reason == "memory":
                self.errorRaised.emit(MEMORY_STOP)
            self.finish_answer(status, reason, _stats_dict(event.stats))
        elif kind == "ingest":
            done = "Cancelled re-ingest" if event.reason == "cancelled" else "Conversation ingested"
            current = self.sessions.current
            self.notice.emit(f"{done} in {current.kv_mode if current else ''}.")
        self.sessions.record_tokens(self.bridge.latest_stats())
        self.activity.clear()

    def on_failed(self, event: Failed) -> None:
        """A chat or ingest failed (the failure is already shown)."""
        kind = self._kinds.pop(event.request_id, None)
        if event.request_id != self.activity.request:
            return
        if kind == "chat":
            if event.error_type == "ContextTooLong":
                self._set_aside_sent_turn()
            self.finish_answer("failed", event.message)
        self.activity.clear()

    def on_open_failed(self, message: str) -> None:
        """The session's KV cache could not be opened: the request waiting on it ends."""
        if self.activity.request == -1:
            if self.activity.kind == "chat":
                self.finish_answer("failed", message)
            self.activity.clear()

    def on_ingest_progress(self, event: IngestProgress) -> None:
        """Progress of the running ingest (or a long prompt's prefill)."""
        if event.request_id == self.activity.request:
            self.ingestProgress.emit(event)

    def _set_aside_sent_turn(self) -> None:
        # A turn the context can't hold would make every later turn fail as well:
        # keep it in the history, marked failed, and leave it out of what the
        # model sees (ChatModel.engine_messages skips it).
        row = self._sent_row
        if row is None or row >= self.model.rowCount():
            return
        message = self.model.message(row)
        if message.role != "user":
            return
        self.store.update_message(message.message_id, status="failed", reason=TOO_LONG_TURN)
        self.model.update_row(row, status="failed", reason=TOO_LONG_TURN)


def _stats_dict(stats) -> dict | None:
    if stats is None:
        return None
    return {
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "ttft": stats.time_to_first_token,
        "prefill_tps": stats.prefill_tps,
        "decode_tps": stats.decode_tps,
    }
