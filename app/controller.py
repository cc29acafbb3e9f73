"""What the window does, without widgets: sessions, sending, streaming, saving.

The controller is the only writer to the history store. It saves a user
message when it is sent, the growing answer at least once a second, and how
the answer ended; engine events arrive through the bridge on the GUI thread.

It owns a few collaborators, each given what it needs when it is made:
``Activity`` (the one answer or ingest running), ``LoadedModel`` (which model
the engine runs), ``SessionCaches`` (which sessions' KV caches the engine
holds), ``SessionActions`` (the sessions and the one shown) and ``Answers``
(starting answers and re-ingests and following their events). The controller
sends user turns, routes each engine event to the collaborator that made the
request, and re-emits their signals as its own.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal

from app.activity import Activity
from app.chat.answers import Answers
from app.chat.model import ChatMessage, ChatModel
from app.chat.recorder import CLOSED_WHILE_ANSWERING, AnswerRecorder
from app.engine_bridge import EngineBridge
from app.format import title_from
from app.loaded_model import LoadedModel
from app.sessions.actions import NEW_TITLE, SessionActions
from app.sessions.caches import SessionCaches
from app.settings import Settings
from app.store import AttachmentRecord, HistoryStore, SessionRecord
from engine import (
    Failed,
    Finished,
    IngestProgress,
    ModelLoaded,
    Notice,
    SessionOpened,
    StatsSample,
    TokenChunk,
)

STATS_POLL_MS = 400
CONTINUE_PROMPT = "Continue."  # the user turn the Continue button sends
MIN_RATE_TOKENS = 256  # a shorter read is mostly fixed overhead, not a rate


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
        self.activity = Activity(self)
        self.loaded_model = LoadedModel(bridge, settings, self)
        self.caches = SessionCaches(bridge, settings, self)
        self.sessions = SessionActions(store, settings, self.model, self.caches, self.activity,
                                       before_switch=self.cancel_edit, parent=self)
        self.answers = Answers(bridge, settings, store, self.model, self.activity, self.caches,
                               self.sessions, self)
        self._editing: tuple[int, int] | None = None  # row, message id
        self._last_stats_time = 0.0
        self.closed = False
        for source, target in (
            (self.activity.busyChanged, self.busyChanged),
            (self.activity.refused, self.errorRaised),
            (self.loaded_model.stateChanged, self.modelStateChanged),
            (self.loaded_model.errorRaised, self.errorRaised),
            (self.caches.changed, self.cacheChanged),
            (self.sessions.sessionsChanged, self.sessionsChanged),
            (self.sessions.currentSessionChanged, self.currentSessionChanged),
            (self.answers.answerFinished, self.answerFinished),
            (self.answers.errorRaised, self.errorRaised),
            (self.answers.notice, self.notice),
            (self.answers.ingestProgress, self.ingestProgress),
        ):
            source.connect(target)
        self.answers.measured.connect(self._on_measured)
        self._poll = QTimer(self, interval=STATS_POLL_MS)
        self._poll.timeout.connect(self._poll_stats)
        bridge.tokenChunk.connect(self._on_token)
        bridge.finished.connect(self._on_finished)
        bridge.failed.connect(self._on_failed)
        bridge.modelLoaded.connect(self._on_model_loaded)
        bridge.sessionOpened.connect(self._on_session_opened)
        bridge.noticeReceived.connect(self._on_engine_notice)
        bridge.statsSample.connect(self._on_stats)
        bridge.ingestProgress.connect(self._on_ingest_progress)
        self.recovered = store.mark_interrupted()

    # State the window reads -----------------------------------------------

    @property
    def current(self) -> SessionRecord | None:
        """The session shown in the window."""
        return self.sessions.current

    @property
    def model_id(self) -> str:
        """The model folder (or "demo") loaded or loading."""
        return self.loaded_model.path

    @property
    def model_info(self) -> object | None:
        """The loaded model's ``ModelInfo``."""
        return self.loaded_model.info

    @property
    def model_ready(self) -> bool:
        """Whether a model is loaded and chats can use it."""
        return self.loaded_model.ready

    @property
    def opened(self) -> dict[str, str]:
        """Session ids whose KV caches the engine holds -> their modes, oldest use first."""
        return self.caches.opened

    @property
    def session_bytes(self) -> dict[str, int]:
        """Each session's KV bytes, from its latest stats sample."""
        return self.caches.kv_bytes

    @property
    def recorder(self) -> AnswerRecorder:
        """Saves the streaming answer."""
        return self.answers.recorder

    @property
    def active_request(self) -> int | None:
        """The running answer or ingest's request id (-1 while its cache opens)."""
        return self.activity.request

    @property
    def active_kind(self) -> str | None:
        """"chat" or "ingest" while one runs."""
        return self.activity.kind

    @property
    def answering_session(self) -> str | None:
        """The session an answer or ingest runs in now, shown or not."""
        return self.activity.session_id

    @property
    def busy(self) -> bool:
        """True while an answer streams or a conversation is ingested."""
        return self.activity.busy

    # Lifecycle ------------------------------------------------------------

    def start(self, model: str | None = None) -> None:
        """Start the engine, load the model and reopen the latest session."""
        self.bridge.start()
        # Also lists the stored KV for the memory panel, first thing.
        self.bridge.set_snapshot_budget(self.settings.stored_kv_budget_bytes)
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
        if self.activity.kind == "chat" and self.recorder.recording:
            self.answers.finish_answer("stopped", CLOSED_WHILE_ANSWERING)
        # Events still queued from the worker must not touch the closing store.
        self.closed = True
        self.activity.forget()
        self.bridge.cancel()

    def shutdown(self, timeout: float = 2.0) -> bool:
        """``close``, then join the engine thread; True once it has ended."""
        self.close()
        return self.bridge.shutdown(timeout)

    # Models ---------------------------------------------------------------

    def load_model(self, path: str) -> None:
        """Load a model folder or "demo"; every open session cache is dropped."""
        if self.activity.refuse("switching models"):
            return
        self.caches.close_all()
        self.loaded_model.load(path)

    # Sessions -------------------------------------------------------------

    def new_session(self, mode: str | None = None) -> SessionRecord | None:
        """Start an empty chat in ``mode`` (default from settings)."""
        return self.sessions.new_session(mode, self.model_id)

    def select_session(self, session_id: str) -> None:
        """Show a stored session; its KV cache is rebuilt on the next send if dropped."""
        self.sessions.select_session(session_id)

    def rename_session(self, session_id: str, title: str) -> None:
        """Rename a session."""
        self.sessions.rename_session(session_id, title)

    def delete_session(self, session_id: str) -> None:
        """Delete a session and free its cache."""
        self.sessions.delete_session(session_id)

    def reopen_in(self, mode: str) -> SessionRecord | None:
        """Copy the conversation into a new session in ``mode`` and re-ingest it."""
        record = self.sessions.reopen_in(mode, self.model_id)
        if record is not None and self.model_ready and self.model.rowCount():
            self.answers.start_ingest(record)
        return record

    def prefill_rate(self) -> float | None:
        """Tokens per second the loaded model last read a long prompt in, on this machine."""
        return self.store.prefill_rate(self.model_id)

    def _on_measured(self, stats) -> None:
        if stats.prompt_tokens >= MIN_RATE_TOKENS and stats.prefill_tps > 0:
            self.store.set_prefill_rate(self.model_id, stats.prefill_tps)

    def cache_state(self, session_id: str | None) -> str:
        """Whether a session's KV cache is held now or rebuilt when it is next used."""
        return self.caches.state(session_id)

    def total_kv_bytes(self) -> int:
        """KV bytes held by every open session, from their latest samples."""
        return self.caches.total_bytes()

    # Sending --------------------------------------------------------------

    def send(self, text: str, attachments: tuple[AttachmentRecord, ...] = ()) -> bool:
        """Save and send a user turn; False (with an error shown) when it can't be sent."""
        if not text.strip() and not attachments:
            return False
        if self.activity.refuse("sending another message"):
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
        self.answers.start_chat(self.current)
        return True

    def stop(self) -> None:
        """Cancel the running answer or ingest (Esc)."""
        if self.active_request is not None and self.active_request >= 0:
            self.bridge.cancel(self.active_request)

    def continue_answer(self) -> bool:
        """Ask the model to go on after an answer cut at the length limit."""
        return self.send(CONTINUE_PROMPT)

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
        self.answers.start_chat(self.current)

    def last_user_row(self) -> int | None:
        """Row of the last user message, when it can be edited and resent."""
        for row in range(self.model.rowCount() - 1, -1, -1):
            if self.model.message(row).role == "user":
                return row
        return None

    def begin_edit(self) -> None:
        """Put the last user message back in the composer; sending replaces it."""
        row = self.last_user_row()
        if row is None or self.activity.refuse("editing"):
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

    # Engine events: each goes to the collaborator that made the request ----

    def _on_model_loaded(self, event: ModelLoaded) -> None:
        if not self.closed:
            self.loaded_model.on_loaded(event)

    def _on_session_opened(self, event: SessionOpened) -> None:
        if not self.closed:
            self.caches.on_opened(event)
            if event.cache_note:  # the model runs on mlx-lm's own cache: say why
                self.notice.emit(event.cache_note)

    def _on_engine_notice(self, event: Notice) -> None:
        if not self.closed:
            self.notice.emit(event.message)

    def _on_token(self, event: TokenChunk) -> None:
        if not self.closed:
            self.answers.on_token(event)

    def _on_ingest_progress(self, event: IngestProgress) -> None:
        if not self.closed:
            self.answers.on_ingest_progress(event)

    def _on_finished(self, event: Finished) -> None:
        if not self.closed:
            self.answers.on_finished(event)  # loads and opens end in their own events

    def _on_failed(self, event: Failed) -> None:
        if self.closed:
            return
        if self.loaded_model.owns(event.request_id):
            self.loaded_model.on_failed(event)  # says why itself
            return
        self.errorRaised.emit(event.message)
        if self.caches.owns(event.request_id):
            self.caches.open_failed(event.request_id)
            self.answers.on_open_failed(event.message)
        else:
            self.answers.on_failed(event)

    def _on_stats(self, sample: StatsSample) -> None:
        if self.closed:
            return
        if sample.timestamp <= self._last_stats_time:
            return
        self._last_stats_time = sample.timestamp
        self.caches.note(sample)
        self.statsUpdated.emit(sample)

    def _poll_stats(self) -> None:
        sample = self.bridge.latest_stats()
        if sample is not None:
            self._on_stats(sample)
