"""What the window does, without widgets: sessions, sending, streaming, saving.

The controller is the only writer to the history store. It saves a user
message when it is sent, the growing answer at least once a second, and how
the answer ended; engine events arrive through the bridge on the GUI thread.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer, Signal

from app.chat.answer_events import EngineEventHandlers
from app.chat.model import ChatMessage, ChatModel
from app.chat.recorder import AnswerRecorder
from app.engine_bridge import EngineBridge
from app.format import title_from
from app.sessions.actions import NEW_TITLE, SessionActions
from app.settings import Settings
from app.store import AttachmentRecord, HistoryStore, SessionRecord
from engine import EngineError, ModelLoaded

STATS_POLL_MS = 400
CLOSED_WHILE_ANSWERING = "Longleaf was closed while answering"


def model_name(info: object, fallback: str = "") -> str:
    """A short display name for an ``engine.models.info.ModelInfo``."""
    for attr in ("name", "model_id", "path"):
        value = getattr(info, attr, None)
        if value:
            return str(value).rstrip("/").rsplit("/", 1)[-1]
    return fallback


class ChatController(SessionActions, EngineEventHandlers, QObject):
    """Sessions, the open conversation and the requests that feed it.

    Session management lives in ``SessionActions`` and the handling of engine
    events in ``EngineEventHandlers``; this class holds the state they share.
    """

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
            title = title_from(text.strip() or attachments[0].name)
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
