"""Answers and re-ingests, from the request to how they ended.

Tokens stream into the answer's own chat (shown or not: the user may read
other chats meanwhile), the answer is saved as it grows and as it ends
(complete, stopped, failed), and failures are shown.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.activity import Activity
from app.chat.model import ChatModel
from app.chat.recorder import LENGTH_LIMIT, AnswerRecorder, stopped_reading
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
    measured = Signal(object)  # the GenerationStats of a request that read tokens in

    def __init__(self, bridge: EngineBridge, settings: Settings, store: HistoryStore,
                 model: ChatModel, activity: Activity, caches: SessionCaches,
                 sessions: SessionActions, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.settings, self.store, self.model = bridge, settings, store, model
        self.activity, self.caches, self.sessions = activity, caches, sessions
        self.recorder = AnswerRecorder(store, model, self)
        self._kinds: dict[int, str] = {}  # request id -> "chat" or "ingest"
        self._sent_id = 0  # the stored user turn the running answer replies to
        sessions.currentSessionChanged.connect(
            lambda record: self.recorder.show(record.id if record else None))

    # Starting -------------------------------------------------------------

    def start_chat(self, session: SessionRecord) -> None:
        """Answer the conversation in ``model``, which ends with a user turn."""
        messages = self.model.engine_messages(self.settings.system_prompt)
        # The user turn (sent or regenerated) is the last row.
        self._sent_id = self.model.message(self.model.rowCount() - 1).message_id
        self.recorder.start(session.id)
        self.activity.set(-1, "chat", session.id)

        def go() -> None:
            rid = self.bridge.chat(session.id, messages, self.settings.sampling)
            self._kinds[rid] = "chat"
            self.activity.set(rid, "chat", session.id)

        self.caches.ensure_open(session, go)

    def start_ingest(self, session: SessionRecord) -> None:
        """Read the conversation in ``model`` into ``session``'s new KV cache."""
        self.activity.set(-1, "ingest", session.id)  # reserved until the real id is known
        messages = self.model.engine_messages(self.settings.system_prompt)

        def go() -> None:
            rid = self.bridge.ingest(session.id, messages)
            self._kinds[rid] = "ingest"
            self.activity.set(rid, "ingest", session.id)

        self.caches.ensure_open(session, go)

    # Engine events --------------------------------------------------------

    def on_token(self, event: TokenChunk) -> None:
        """Streamed text of the running answer."""
        if event.request_id == self.activity.request and self.activity.kind == "chat":
            self.recorder.append(event.text)

    def finish_answer(self, status: str, reason: str | None, stats: dict | None = None) -> None:
        """Save how the answer ended and say so."""
        self.recorder.finish(status, reason, stats)
        self.sessions.sessionsChanged.emit()
        self.answerFinished.emit(status)

    def on_finished(self, event: Finished) -> None:
        """A request ended: the answer is saved, the ingest reported."""
        kind = self._kinds.pop(event.request_id, None)
        if event.request_id != self.activity.request:
            return
        kept = self._kept(event)
        if event.stats is not None:
            self.measured.emit(event.stats)
        if kind == "chat":
            status = "stopped" if event.reason in ("cancelled", "memory") else "complete"
            reason = {"cancelled": "Stopped", "length": LENGTH_LIMIT,
                      "memory": MEMORY_STOP}.get(event.reason)
            if event.reason == "cancelled" and kept is not None:
                reason = stopped_reading(*kept)
            if event.reason == "memory":
                self.errorRaised.emit(MEMORY_STOP)
            self.finish_answer(status, reason, _stats_dict(event.stats))
        elif kind == "ingest":
            self._report_ingest(event, kept)
        self.sessions.record_tokens(self.activity.session_id, self.bridge.latest_stats())
        self.activity.clear()

    def _kept(self, event: Finished) -> tuple[int, int] | None:
        """(kept, total) tokens when reading the conversation in stopped short, else None."""
        kept, total = event.kept_tokens, event.total_tokens  # the engine's stop says
        if kept is None or total is None or kept >= total:
            return None
        return kept, total

    def _report_ingest(self, event: Finished, kept: tuple[int, int] | None) -> None:
        # Said only while its chat is on screen: it is about that chat.
        ingested = self.store.session(self.activity.session_id or "")
        current = self.sessions.current
        if ingested is None or current is None or current.id != ingested.id:
            return
        if event.reason != "cancelled":
            self.notice.emit(f"Conversation ingested in {ingested.kv_mode}.")
        elif kept is not None:
            self.notice.emit(f"Cancelled re-ingest in {ingested.kv_mode}: {kept[0]:,} of "
                             f"{kept[1]:,} tokens kept; the next send continues from there.")
        else:
            self.notice.emit(f"Cancelled re-ingest in {ingested.kv_mode}.")

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
        if not self._sent_id:
            return
        self.store.update_message(self._sent_id, status="failed", reason=TOO_LONG_TURN)
        row = self.model.row_of(self._sent_id)
        if row is not None:
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
