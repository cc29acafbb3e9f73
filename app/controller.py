"""What the window does, without widgets: sessions, sending, streaming, saving.

The controller is the only writer to the history store. It saves a user
message when it is sent, the growing answer at least once a second, and how
the answer ended; engine events arrive through the bridge on the GUI thread.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer, Signal

from app.answer_recorder import AnswerRecorder
from app.chat_model import ChatMessage, ChatModel
from app.engine_bridge import EngineBridge
from app.settings import Settings
from app.store import AttachmentRecord, HistoryStore, SessionRecord
from engine.errors import EngineError
from engine.events import Failed, Finished, ModelLoaded, SessionOpened, StatsSample, TokenChunk

STATS_POLL_MS = 400
MAX_OPEN_SESSIONS = 3
NEW_TITLE = "New chat"
CLOSED_WHILE_ANSWERING = "Longleaf was closed while answering"
TOO_LONG_TURN = ("Too long for the model's context; kept here but not sent with later "
                 "messages. Edit it to a shorter one, or reopen the chat in a smaller KV mode.")
MEMORY_STOP = ("Stopped to protect your computer: system memory turned critical or free RAM ran "
               "out. Close other apps or chats, or reopen this chat in a smaller KV mode.")


def model_name(info: object, fallback: str = "") -> str:
    """A short display name for an ``engine.model_info.ModelInfo``."""
    for attr in ("name", "model_id", "path"):
        value = getattr(info, attr, None)
        if value:
            return str(value).rstrip("/").rsplit("/", 1)[-1]
    return fallback


class ChatController(QObject):
    """Sessions, the open conversation and the requests that feed it."""

    sessionsChanged = Signal()
    currentSessionChanged = Signal(object)  # SessionRecord | None
    modelStateChanged = Signal(str, bool)  # description, ready
    errorRaised = Signal(str)
    notice = Signal(str)
    busyChanged = Signal(bool)
    ingestProgress = Signal(object)
    statsUpdated = Signal(object)
    editRequested = Signal(str, object)  # text, attachments
    answerFinished = Signal(str)  # final status of the answer
    cacheChanged = Signal()  # a session's KV cache was opened or dropped

    def __init__(self, settings: Settings, store: HistoryStore, bridge: EngineBridge,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings, self.store, self.bridge = settings, store, bridge
        self.model = ChatModel(self)
        self.current: SessionRecord | None = None
        self.model_info: object | None = None
        self.model_id = ""
        self.model_ready = False
        self._load_request: int | None = None
        self._previous_model: tuple[str, object] | None = None  # kept while a load runs
        self._load_paths: dict[int, str] = {}
        self.opened: dict[str, str] = {}  # session id -> mode, oldest first
        self.session_bytes: dict[str, int] = {}
        self.active_request: int | None = None
        self.active_kind: str | None = None
        self._kinds: dict[int, str] = {}
        self._after_open: dict[int, Callable[[], None]] = {}
        self._editing: tuple[int, int] | None = None  # row, message id
        self._sent_row: int | None = None  # the user turn the running answer replies to
        self._last_stats_time = 0.0
        self.recorder = AnswerRecorder(store, self.model, self)
        self._poll = QTimer(self, interval=STATS_POLL_MS)
        self._poll.timeout.connect(self._poll_stats)
        bridge.tokenChunk.connect(self._on_token)
        bridge.finished.connect(self._on_finished)
        bridge.failed.connect(self._on_failed)
        bridge.modelLoaded.connect(self._on_model_loaded)
        bridge.sessionOpened.connect(self._on_session_opened)
        bridge.statsSample.connect(self._on_stats)
        bridge.ingestProgress.connect(self._on_ingest_progress)
        self.recovered = store.mark_interrupted()
        self.closed = False

    # Lifecycle ------------------------------------------------------------

    def start(self, model: str | None = None) -> None:
        """Start the engine, load the model and reopen the latest session."""
        self.bridge.start()
        self._poll.start()
        sessions = self.store.sessions()
        if sessions:
            self.select_session(sessions[0].id)
        self.load_model(model or self.settings.last_model)

    def close(self) -> None:
        """Save the partial answer and cancel all engine work, without waiting.

        The history is complete when this returns; the engine thread may still be
        finishing a prefill chunk (see ``shutdown``), so closing the window never
        waits on MLX.
        """
        if self.closed:
            return
        self._poll.stop()
        if self.active_kind == "chat" and self.recorder.recording:
            self._finish_answer("stopped", CLOSED_WHILE_ANSWERING)
        # Events still queued from the worker must not touch the closing store.
        self.closed = True
        self.active_request = self.active_kind = None
        self.bridge.cancel()

    def shutdown(self, timeout: float = 2.0) -> bool:
        """``close``, then join the engine thread; True once it has ended."""
        self.close()
        return self.bridge.shutdown(timeout)

    @property
    def busy(self) -> bool:
        """True while an answer streams or a conversation is ingested."""
        return self.active_request is not None

    def _set_active(self, rid: int | None, kind: str | None) -> None:
        self.active_request, self.active_kind = rid, kind
        self.busyChanged.emit(rid is not None)

    def _refuse_if_busy(self, what: str) -> bool:
        if self.busy:
            self.errorRaised.emit(f"Stop the current answer before {what}.")
            return True
        return False

    # Models ---------------------------------------------------------------

    def load_model(self, path: str) -> None:
        """Load a model folder or "demo"; every open session cache is dropped."""
        if self._refuse_if_busy("switching models"):
            return
        for session_id in list(self.opened):
            self.bridge.close_session(session_id)
        self.opened.clear()
        if self.model_ready:
            self._previous_model = (self.model_id, self.model_info)
        self.model_ready = False
        self.model_id = path
        self.modelStateChanged.emit(f"Loading {model_name(None, path) or path}…", False)
        self._load_request = self.bridge.load_model(path)
        self._kinds[self._load_request] = "load"
        self._load_paths[self._load_request] = path

    def _on_model_loaded(self, event: ModelLoaded) -> None:
        path = self._load_paths.pop(event.request_id, self.model_id)
        if self.closed:
            return
        if event.request_id != self._load_request:
            # A newer load is queued behind this one and decides; this model is
            # what the engine falls back on if that one fails.
            self._previous_model = (path, event.info)
            return
        self._previous_model = None
        self.model_info = event.info
        self.model_ready = True
        self.settings.last_model = self.model_id
        self.modelStateChanged.emit(model_name(event.info, self.model_id), True)

    # Sessions -------------------------------------------------------------

    def new_session(self, mode: str | None = None) -> SessionRecord | None:
        """Start an empty chat in ``mode`` (default from settings)."""
        if self._refuse_if_busy("starting a new chat"):
            return None
        record = self.store.create_session(NEW_TITLE, mode or self.settings.default_mode,
                                           self.model_id or self.settings.last_model)
        self.sessionsChanged.emit()
        self.select_session(record.id)
        return record

    def select_session(self, session_id: str) -> None:
        """Show a stored session; its KV cache is rebuilt on the next send if dropped."""
        if self.current and self.current.id == session_id:
            return
        if self._refuse_if_busy("switching chats"):
            return
        self._editing = None
        self.current = self.store.session(session_id)
        rows = [ChatMessage.from_record(m) for m in self.store.messages(session_id)]
        self.model.set_messages(rows)
        self.currentSessionChanged.emit(self.current)

    def rename_session(self, session_id: str, title: str) -> None:
        """Rename a session."""
        if title.strip():
            self.store.rename_session(session_id, title)
            if self.current and self.current.id == session_id:
                self.current = self.store.session(session_id)
                self.currentSessionChanged.emit(self.current)
            self.sessionsChanged.emit()

    def delete_session(self, session_id: str) -> None:
        """Delete a session and free its cache."""
        if self.current and self.current.id == session_id and self._refuse_if_busy("deleting it"):
            return
        if session_id in self.opened:
            self.bridge.close_session(session_id)
            del self.opened[session_id]
        self.store.delete_session(session_id)
        if self.current and self.current.id == session_id:
            self.current = None
            self.model.set_messages([])
            remaining = self.store.sessions()
            if remaining:
                self.select_session(remaining[0].id)
            else:
                self.currentSessionChanged.emit(None)
        self.sessionsChanged.emit()

    def cache_state(self, session_id: str | None) -> str:
        """Whether a session's KV cache is held now or rebuilt when it is next used."""
        if session_id is None:
            return ""
        return "kept in memory" if session_id in self.opened else "rebuilt on next send"

    def _ensure_open(self, session: SessionRecord, then: Callable[[], None]) -> None:
        if session.id in self.opened:
            self.opened[session.id] = self.opened.pop(session.id)  # most recent last
            then()
            return
        while len(self.opened) >= MAX_OPEN_SESSIONS:
            oldest = next(iter(self.opened))
            self.bridge.close_session(oldest)
            del self.opened[oldest]
        rid = self.bridge.open_session(session.id, session.kv_mode, self.settings.page_size)
        self._kinds[rid] = "open"
        self._after_open[rid] = then

    def _on_session_opened(self, event: SessionOpened) -> None:
        if self.closed:
            return
        self.opened[event.session_id] = event.kv_mode
        self.cacheChanged.emit()
        then = self._after_open.pop(event.request_id, None)
        if then is not None:
            then()

    def reopen_in(self, mode: str) -> SessionRecord | None:
        """Copy the conversation into a new session in ``mode`` and re-ingest it."""
        if self.current is None or self._refuse_if_busy("reopening the chat"):
            return None
        source = self.current
        record = self.store.create_session(f"{source.title} · {mode}", mode, self.model_id)
        for message in self.store.messages(source.id):
            if message.status in ("complete", "stopped", "interrupted") and (
                message.content or message.attachments
            ):
                self.store.add_message(record.id, message.role, message.content,
                                       "complete", message.attachments)
        self.sessionsChanged.emit()
        self.select_session(record.id)
        if self.model_ready and self.model.rowCount():
            self._set_active(-1, "ingest")  # reserved until the real id is known
            self._ensure_open(record, self._start_reingest)
        return record

    def _start_reingest(self) -> None:
        if self.current is None:
            return
        messages = self.model.engine_messages(self.settings.system_prompt)
        rid = self.bridge.ingest(self.current.id, messages)
        self._kinds[rid] = "ingest"
        self._set_active(rid, "ingest")

    # Sending --------------------------------------------------------------

    def send(self, text: str, attachments: tuple[AttachmentRecord, ...] = ()) -> bool:
        """Save and send a user turn; False (with an error shown) when it can't be sent."""
        if not text.strip() and not attachments:
            return False
        if self._refuse_if_busy("sending another message"):
            return False
        if not self.model_ready:
            self.errorRaised.emit("The model is still loading; your message is kept — "
                                  "send it again in a moment.")
            return False
        if self.current is None and self.new_session() is None:
            return False
        assert self.current is not None
        if self._editing is not None:
            row, message_id = self._editing
            self._editing = None
            self.store.delete_messages_from(self.current.id, message_id)
            self.model.truncate(row)
        message_id = self.store.add_message(self.current.id, "user", text, "complete", attachments)
        self.model.append(ChatMessage("user", text, "complete", message_id,
                                      attachments=attachments))
        if self.current.title == NEW_TITLE:
            title = (text.strip() or attachments[0].name).splitlines()[0][:60]
            self.rename_session(self.current.id, title)
        self._start_answer()
        return True

    def _start_answer(self) -> None:
        assert self.current is not None
        messages = self.model.engine_messages(self.settings.system_prompt)
        self._sent_row = self.model.rowCount() - 1  # the user turn (sent or regenerated)
        self.recorder.start(self.current.id)
        self._set_active(-1, "chat")
        session = self.current

        def go() -> None:
            rid = self.bridge.chat(session.id, messages, self.settings.sampling)
            self._kinds[rid] = "chat"
            self._set_active(rid, "chat")

        self._ensure_open(session, go)

    def stop(self) -> None:
        """Cancel the running answer or ingest (Esc)."""
        if self.active_request is not None and self.active_request >= 0:
            self.bridge.cancel(self.active_request)

    def can_regenerate(self) -> bool:
        """Whether the last message is an answer that can be generated again."""
        rows = self.model.rowCount()
        return not self.busy and rows >= 2 and self.model.message(rows - 1).role == "assistant"

    def regenerate(self) -> None:
        """Drop the last answer and generate it again."""
        if not self.can_regenerate() or not self.model_ready or self.current is None:
            return
        row = self.model.rowCount() - 1
        self.store.delete_messages_from(self.current.id, self.model.message(row).message_id)
        self.model.truncate(row)
        self._start_answer()

    def last_user_row(self) -> int | None:
        """Row of the last user message, when it can be edited and resent."""
        for row in range(self.model.rowCount() - 1, -1, -1):
            if self.model.message(row).role == "user":
                return row
        return None

    def begin_edit(self) -> None:
        """Put the last user message back in the composer; sending replaces it."""
        row = self.last_user_row()
        if row is None or self._refuse_if_busy("editing"):
            return
        message = self.model.message(row)
        self._editing = (row, message.message_id)
        self.editRequested.emit(message.content, message.attachments)

    def cancel_edit(self) -> None:
        """Leave edit mode; the conversation is unchanged."""
        self._editing = None

    @property
    def editing(self) -> bool:
        """True while the composer holds an edited earlier message."""
        return self._editing is not None

    # Engine events --------------------------------------------------------

    def _on_token(self, event: TokenChunk) -> None:
        if self.closed:
            return
        if event.request_id == self.active_request and self.active_kind == "chat":
            self.model.append_text(event.text)
            self.recorder.mark_dirty()

    def _finish_answer(self, status: str, reason: str | None, stats: dict | None = None) -> None:
        self.recorder.finish(status, reason, stats)
        if self.current is not None:
            self.sessionsChanged.emit()
        self.answerFinished.emit(status)

    def _on_finished(self, event: Finished) -> None:
        if self.closed:
            return
        kind = self._kinds.pop(event.request_id, None)
        if event.request_id != self.active_request:
            return
        if kind == "chat":
            status = "stopped" if event.reason in ("cancelled", "memory") else "complete"
            reason = {"cancelled": "Stopped", "length": "Reached the answer length limit",
                      "memory": MEMORY_STOP}.get(event.reason)
            if event.reason == "memory":
                self.errorRaised.emit(MEMORY_STOP)
            self._finish_answer(status, reason, _stats_dict(event.stats))
        elif kind == "ingest":
            done = "Cancelled re-ingest" if event.reason == "cancelled" else "Conversation ingested"
            self.notice.emit(f"{done} in {self.current.kv_mode if self.current else ''}.")
        self._record_tokens()
        self._set_active(None, None)

    def _on_failed(self, event: Failed) -> None:
        if self.closed:
            return
        kind = self._kinds.pop(event.request_id, None)
        self._load_paths.pop(event.request_id, None)
        if kind == "load" and event.request_id == self._load_request:
            self._on_load_failed(event.message)
            return
        self.errorRaised.emit(event.message)
        if kind == "open":
            self._after_open.pop(event.request_id, None)
            if self.active_request == -1:  # the chat or ingest waiting on this session
                if self.active_kind == "chat":
                    self._finish_answer("failed", event.message)
                self._set_active(None, None)
        elif event.request_id == self.active_request:
            if kind == "chat":
                if event.error_type == "ContextTooLong":
                    self._set_aside_sent_turn()
                self._finish_answer("failed", event.message)
            self._set_active(None, None)

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

    def _on_load_failed(self, message: str) -> None:
        previous = self._previous_model
        if previous is not None and self._engine_has_model():
            # The engine refused the new folder before letting go of the old
            # model (a broken folder, too little memory): keep using it.
            self.model_id, self.model_info = previous
            self.model_ready = True
            name = model_name(self.model_info, self.model_id)
            self.errorRaised.emit(f"{message} Still using {name}.")
            self.modelStateChanged.emit(name, True)
            return
        self.errorRaised.emit(message)
        self.model_ready = False
        self.modelStateChanged.emit(f"No model ({model_name(None, self.model_id)})", False)

    def _engine_has_model(self) -> bool:
        try:
            self.bridge.fit_check(None, 1)  # thread-safe; refuses when nothing is loaded
        except EngineError:
            return False
        return True

    def _on_ingest_progress(self, event) -> None:
        if self.closed:
            return
        if event.request_id == self.active_request:
            self.ingestProgress.emit(event)

    def _on_stats(self, sample: StatsSample) -> None:
        if self.closed:
            return
        if sample.timestamp <= self._last_stats_time:
            return
        self._last_stats_time = sample.timestamp
        if sample.session_id:
            self.session_bytes[sample.session_id] = sample.kv_bytes_used
        self.statsUpdated.emit(sample)

    def _poll_stats(self) -> None:
        sample = self.bridge.latest_stats()
        if sample is not None:
            self._on_stats(sample)

    def total_kv_bytes(self) -> int:
        """KV bytes held by every open session, from their latest samples."""
        return sum(self.session_bytes.get(sid, 0) for sid in self.opened)

    def _record_tokens(self) -> None:
        sample = self.bridge.latest_stats()
        if self.current and sample and sample.session_id == self.current.id:
            self.store.set_tokens(self.current.id, sample.tokens_in_context)
            self.current = self.store.session(self.current.id)
            self.sessionsChanged.emit()


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
