"""What the window does, without widgets: sessions, sending, streaming, saving.

The controller saves a user message when it is sent; the answer is saved as it
grows and as it ends by its recorder (``Answers``). Engine events arrive
through the bridge on the GUI thread, each one at the handler of the request
it belongs to.

It owns a few collaborators, each given what it needs when it is made:
``Activity`` (each chat's job: those running together and those waiting),
``ModelState`` (which model the engine runs), ``SessionCaches`` (which
sessions' KV caches the engine holds), ``SessionActions`` (the sessions and the
one shown), ``Answers`` (starting answers and re-ingests and following their
events) and ``QualityCheck`` (the shown chat's mode against fp16, its receipts
kept with the chat). Each submits its own requests with its own handler; the
controller sends user turns and re-emits the collaborators' signals as its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal

from app.activity import Activity, Job
from app.chat.answers import Answers, Replaced
from app.chat.model import ChatMessage, ChatModel
from app.chat.recorder import CLOSED_WHILE_ANSWERING, CONTEXT_END, AnswerRecorder
from app.engine_bridge import EngineBridge
from app.format import api_chat_title, short_title, title_from, visible_text
from app.local_server import LocalServerHost
from app.machines import Machines
from app.memory.quality import QualityCheck
from app.model_state import ModelState, model_name
from app.sessions.actions import NEW_TITLE, SessionActions
from app.sessions.caches import KvTotal, SessionCaches
from app.sessions.chat_state import ChatFacts, facts_of, state_sentence
from app.settings import Settings
from app.store import AttachmentRecord, EditRecord, HistoryStore, SessionRecord
from engine import (
    API_SESSION_PREFIX,
    DEMO,
    WAITED_BEHIND,
    AnswerWaiting,
    ApiSession,
    ChunkTiming,
    DiskFault,
    EngineError,
    Failed,
    IngestProgress,
    KvMode,
    ModelInfo,
    Notice,
    PipelineLost,
    PrefillRate,
    SamplingParams,
    StatsSample,
    WaitEnded,
    fits_here,
    prefill_rate,
)

STATS_POLL_MS = 400
MAX_READS_TRACKED = 256  # reads whose first chunk was seen (ids only; a clear costs one sample)
QUIT_WHILE_ANSWERING = "An answer is still being written. Quit and keep the partial answer?"
QUIT_WHILE_READING = ("“{title}” is still being read{how_far}. Quit anyway? It will be read "
                      "again from the start next time.")
QUIT_UNSAVED = ("Longleaf could not save every answer of this session yet (its data folder "
                "is full or read-only). Quit anyway and lose what was not saved?")
QUIT_DRAFT_UNSAVED = ("Longleaf could not save a draft you wrote (its data folder is full, "
                      "read-only or in use). Quit anyway and lose it?")


class ChatController(QObject):
    """Sessions, the open conversation and the requests that feed it."""

    sessionsChanged = Signal()
    currentSessionChanged = Signal(object)  # SessionRecord | None
    modelStateChanged = Signal(str, bool)  # description, ready
    errorRaised = Signal(str)
    notice = Signal(str)
    busyChanged = Signal(bool)  # whether any chat has a job running or waiting
    activityChanged = Signal()  # a chat's job started, moved on, waits or ended
    ingestProgress = Signal(object)
    statsUpdated = Signal(object)
    editRequested = Signal(str, object)  # text, attachments
    answerFinished = Signal(str)  # final status of the answer
    cacheChanged = Signal()  # a session's KV cache was opened or dropped
    qualityChecked = Signal(str, object)  # session id, its new QualityReceipt

    def __init__(self, settings: Settings, store: HistoryStore, bridge: EngineBridge,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings, self.store, self.bridge = settings, store, bridge
        self.model = ChatModel(self)
        self.activity = Activity(self)
        self.model_state = ModelState(bridge, settings, self)
        self.caches = SessionCaches(bridge, settings, self, in_use=self._job_runs_in)
        self.sessions = SessionActions(store, settings, self.model, self.caches, self.activity,
                                       before_switch=self.cancel_edit, parent=self)
        self.answers = Answers(bridge, settings, store, self.model, self.activity, self.caches,
                               self.sessions, self, sampling=self.sampling,
                               max_context=lambda: getattr(self.model_info, "max_context",
                                                           None))
        self.quality = QualityCheck(bridge, store, self.activity, self.caches, self.sessions,
                                    self)
        # The OpenAI/Anthropic server on the same worker, when Settings turn it on.
        self.local_server = LocalServerHost(bridge, settings, self.model_state, self)
        # This Mac's engine thread, or a pipeline over other Macs for a model that splits.
        self.machines = Machines(bridge, settings, self)
        self._editing: tuple[int, int] | None = None  # row, message id
        # The newest sample seen per session: the poll's latest may be one chat's
        # while the queued samples of the others from the same step are on the way.
        self._last_stats_time: dict[str | None, float] = {}
        self._api_samples: dict[str, StatsSample] = {}  # each local server session's latest
        self.closed = False
        for source, target in (
            (self.activity.busyChanged, self.busyChanged),
            (self.activity.changed, self.activityChanged),
            (self.activity.refused, self.errorRaised),
            (self.model_state.stateChanged, self.modelStateChanged),
            (self.model_state.errorRaised, self.errorRaised),
            (self.caches.changed, self.cacheChanged),
            (self.caches.notice, self.notice),
            (self.sessions.sessionsChanged, self.sessionsChanged),
            (self.sessions.currentSessionChanged, self.currentSessionChanged),
            (self.answers.answerFinished, self.answerFinished),
            (self.answers.errorRaised, self.errorRaised),
            (self.answers.notice, self.notice),
            (self.answers.ingestProgress, self.ingestProgress),
            # The composer shows a check's progress as it shows a long read's.
            (self.quality.progress, self.ingestProgress),
            (self.quality.checked, self.qualityChecked),
            (self.quality.notice, self.notice),
            (self.quality.errorRaised, self.errorRaised),
            (self.local_server.errorRaised, self.errorRaised),
        ):
            source.connect(target)
        # Reads of answers and re-ingests teach the rate model; a quality check's
        # reads (two caches, one window) are not the reading a send does.
        self.answers.ingestProgress.connect(self._on_read_chunk)
        self.answers.editReturned.connect(self._edit_returned)
        self._reads_begun: set[int] = set()  # requests whose first chunk came
        self._poll = QTimer(self, interval=STATS_POLL_MS)
        self._poll.timeout.connect(self._poll_stats)
        # Events of no one request; each request's own go to its handler.
        self._subscriptions = ((bridge.statsSample, self._on_stats),
                               (bridge.noticeReceived, self._on_engine_notice),
                               (bridge.answerWaiting, self._on_answer_waiting),
                               (bridge.waitEnded, self._on_wait_ended),
                               (bridge.failed, self._on_failed),
                               (bridge.pipelineLost, self._on_pipeline_lost))
        for signal, slot in self._subscriptions:
            signal.connect(slot)
        self.recovered = store.mark_interrupted()
        # The chat on screen, kept as it changes: a crash reopens on it too.
        self.sessions.currentSessionChanged.connect(
            lambda record: store.set_last_session(record.id if record else None))

    # State the window reads -----------------------------------------------

    @property
    def current(self) -> SessionRecord | None:
        """The session shown in the window."""
        return self.sessions.current

    @property
    def model_id(self) -> str:
        """The model folder (or "demo") loaded or loading."""
        return self.model_state.path

    @property
    def model_info(self) -> ModelInfo | None:
        """The loaded model's ``ModelInfo``."""
        return self.model_state.info

    @property
    def model_ready(self) -> bool:
        """Whether a model is loaded and chats can use it."""
        return self.model_state.ready

    @property
    def opened(self) -> dict[str, str]:
        """Session ids whose KV caches the engine holds -> their modes, oldest use first."""
        return self.caches.opened

    def recorder_of(self, session_id: str) -> AnswerRecorder:
        """Saves chat ``session_id``'s streaming answer."""
        return self.answers.recorder_of(session_id)

    @property
    def active_request(self) -> int | None:
        """The request id of the shown chat's running job (None while it has none, or
        while it waits or its cache opens)."""
        job = self._running_here()
        return job.request if job else None

    @property
    def active_kind(self) -> str | None:
        """"chat", "ingest" or "quality" while the shown chat's job runs."""
        job = self._running_here()
        return job.kind if job else None

    def _running_here(self) -> Job | None:
        job = self.activity.job_of(self.current.id if self.current else None)
        return job if job is not None and job.started else None

    def answering_together(self) -> list[tuple[str, int | None]]:
        """Each chat whose answer the engine runs now, oldest first: its title and the
        KV bytes of its latest sample (None before its first)."""
        together = []
        for job in self.activity.running:
            # Held before it joined: not answering yet. Held while answering (for
            # its next page): its row and pages are still the batch's.
            if job.kind != "chat" or (job.held and not job.answering):
                continue
            sample = self.caches.sample_for(job.session_id)
            record = self.store.session(job.session_id)  # its title now, renamed or not
            title = record.title if record is not None else job.title
            together.append((title, sample.kv_bytes_used if sample is not None else None))
        # The local server's requests answer in the same batch.
        together += [(api_chat_title(number), None if held is None else held.kv_bytes_used)
                     for number, session, held in self.api_sessions() if session.answering]
        return together

    def api_sessions(self) -> list[tuple[int, ApiSession, StatsSample | None]]:
        """The local server's sessions, numbered as the panel names them, each with
        its latest stats sample (None before its first)."""
        sessions = self.local_server.sessions()
        held = {s.name for s in sessions}
        # A session the server let go of (stored, or its model unloaded) is forgotten.
        self._api_samples = {n: s for n, s in self._api_samples.items() if n in held}
        return [(number, session, self._api_samples.get(session.name))
                for number, session in enumerate(sessions, 1)]

    @property
    def busy(self) -> bool:
        """True while any chat's job runs or waits."""
        return self.activity.busy

    @property
    def busy_here(self) -> bool:
        """True while the shown chat has a job, running or waiting."""
        return self.activity.job_of(self.current.id if self.current else None) is not None

    def _job_runs_in(self, session_id: str) -> bool:
        job = self.activity.job_of(session_id)
        return job is not None and job.started

    # Lifecycle ------------------------------------------------------------

    def start(self, model: str | None = None) -> None:
        """Start the engine, load the model and show the chat on screen at the last quit."""
        self.bridge.start()
        # Also lists the stored KV for the memory panel, first thing.
        self.bridge.set_snapshot_budget(self.settings.stored_kv_budget_bytes)
        self._poll.start()
        self.local_server.apply()
        shown = self.store.last_session()
        sessions = self.store.sessions() if shown is None else [shown]
        if sessions:
            self.select_session(sessions[0].id)
        self.load_model(model or self._last_model())

    def _last_model(self) -> str:
        """The model used last, or the demo when its folder is gone (said why)."""
        last = self.settings.last_model
        if last == DEMO or Path(last).expanduser().is_dir():
            return last
        self.notice.emit(f"The model used last, {last}, is not there any more: moved, "
                         "deleted, or on a drive not connected now. Longleaf opened the "
                         "demo model; choose another in the toolbar's model list.")
        return DEMO

    def quit_question(self) -> str:
        """What to ask before quitting: "" unless an answer is being written or a
        chat read now (a long read lost to a quit costs minutes to do again)."""
        answering = any(job.kind == "chat" and job.answering for job in self.activity.running)
        if self.closed:
            return ""
        if self.answers.unsaved and not self.answers.flush():
            return QUIT_UNSAVED
        if answering:
            return QUIT_WHILE_ANSWERING
        reading = next((job for job in self.activity.running if job.state == "reading"), None)
        return "" if reading is None else QUIT_WHILE_READING.format(
            title=short_title(visible_text(reading.title)), how_far=_how_far(reading.progress))

    def close(self) -> None:
        """Save the partial answer and cancel all engine work, without waiting.

        The history is complete when this returns; the engine thread may still be
        finishing a prefill chunk (see ``shutdown``), so closing the window never
        waits on MLX.
        """
        if self.closed:
            return
        self.closed = True
        self._poll.stop()
        for job in self.activity.running:
            if job.kind == "chat" and self.recorder_of(job.session_id).recording:
                self.answers.finish_answer(job.session_id, "stopped", CLOSED_WHILE_ANSWERING)
        # Events still queued from the worker must not touch the closing store:
        # no handler or subscriber is left to get them.
        self.bridge.forget_all()
        for signal, slot in self._subscriptions:
            signal.disconnect(slot)
        self.activity.forget()
        self.local_server.request_stop()
        self.bridge.cancel()

    def shutdown(self, timeout: float = 2.0) -> bool:
        """``close``, then join the local server's and the engine's threads; True once
        both have ended."""
        self.close()
        started = time.monotonic()
        server_done = self.local_server.stop(timeout)
        left = max(0.05, timeout - (time.monotonic() - started))
        return self.bridge.shutdown(left) and server_done

    # Models ---------------------------------------------------------------

    def load_model(self, path: str) -> None:
        """Load a model folder or "demo"; every open session cache is dropped."""
        if self.activity.refuse("switching models"):
            return
        self.caches.close_all()
        self._choose_machines(path)
        self.model_state.load(path)

    def machines_changed(self) -> None:
        """Settings → Use other Macs changed: load the model again where it now runs.

        Compared with the settings the model was loaded under, not with where it runs:
        after a lost pipeline it runs here under unchanged settings, and a Save of
        other settings must not load it over the Macs again (minutes, for nothing).
        """
        if not self.model_id or not self.machines.changed_since_load(self.model_id):
            return
        if self.busy:
            self.notice.emit("The new Use other Macs setting applies when the model is "
                             "loaded next.")
            return
        self.load_model(self.model_id)

    def _choose_machines(self, path: str) -> None:
        try:
            changed = self.machines.prepare(path)
        except EngineError as error:  # the hostfile is gone or broken: this Mac alone
            self.errorRaised.emit(f"{error} Loading the model on this Mac alone.")
            changed = self.machines.fall_back()
        if changed:
            self._worker_replaced()

    def _worker_replaced(self) -> None:
        # The new worker starts with no API server and the default stored-KV budget.
        self.local_server.worker_replaced()
        self.bridge.set_snapshot_budget(self.settings.stored_kv_budget_bytes)

    def _on_pipeline_lost(self, event: PipelineLost) -> None:
        # Every running request has had its Failed (its bubble names the machine).
        if not self.machines.fall_back():
            return  # the pipeline was replaced already
        self._worker_replaced()
        path = self.model_id
        name = model_name(self.model_info, path)
        problem = fits_here(path)
        if problem:
            self.model_state.drop(f"No model ({name} does not fit on this Mac alone)")
            self.errorRaised.emit(
                f"{event.message} {name} does not fit on this Mac alone, so no model is "
                f"loaded: {problem} Your chats are kept; bring the other Mac back and "
                "load the model again, or choose a smaller one.")
            return
        self.notice.emit(f"{event.message} Longleaf goes on with {name} on this Mac "
                         "alone; your chats are kept.")
        # Not ready from now: the engine here has no model until the load below,
        # which may wait for the jobs in line.
        self.model_state.drop(f"Loading {name} on this Mac alone…")

        def load_here() -> None:  # not load_model: that would start the pipeline again
            self.caches.close_all()
            self.model_state.load(path)

        self._when_idle(load_here)

    def _when_idle(self, then: Callable[[], None]) -> None:
        if not self.activity.busy:
            then()
            return

        def check(busy: bool) -> None:
            if not busy:
                self.activity.busyChanged.disconnect(check)
                then()

        self.activity.busyChanged.connect(check)

    # Sessions -------------------------------------------------------------

    def new_session(self, mode: KvMode | None = None,
                    keep_blank: bool = False) -> SessionRecord | None:
        """Start an empty chat in ``mode`` (default from settings); with ``keep_blank``
        an empty chat on screen is kept instead (``SessionActions.new_session``).
        None when the history takes no write (said in the banner)."""
        try:
            return self.sessions.new_session(mode, self.model_id, keep_blank)
        except DiskFault as fault:
            self._not_done("No new chat was made", fault)
            return None

    def _not_done(self, what: str, fault: DiskFault) -> None:
        """Say that an action on the history did not happen, and why (nothing of it
        was written)."""
        self.errorRaised.emit(f"{what}. {fault}")

    def select_session(self, session_id: str) -> None:
        """Show a stored session; its KV cache is rebuilt on the next send if dropped."""
        self.sessions.select_session(session_id)

    def rename_session(self, session_id: str, title: str) -> None:
        """Rename a session."""
        try:
            self.sessions.rename_session(session_id, title)
        except DiskFault as fault:
            self._not_done("The chat was not renamed", fault)
            return
        record = self.store.session(session_id)
        if record is not None:  # what a waiting chat says it waits for follows
            self.activity.retitle(session_id, record.title)

    def delete_session(self, session_id: str, listed: Sequence[str] | None = None) -> None:
        """Delete a session and free its cache (``listed``: as
        ``SessionActions.delete_session``)."""
        try:
            self.sessions.delete_session(session_id, listed)
        except DiskFault as fault:
            self._not_done("The chat was not deleted", fault)

    def reopen_in(self, mode: KvMode) -> SessionRecord | None:
        """Copy the conversation into a new session in ``mode`` and re-ingest it."""
        try:
            record = self.sessions.reopen_in(mode, self.model_id)
        except DiskFault as fault:
            self._not_done(f"The chat was not reopened in {mode}", fault)
            return None
        if record is not None and self.model_ready and self.model.rowCount():
            self.answers.start_ingest(record)
        return record

    def sampling(self) -> SamplingParams:
        """How answers pick tokens: each key set in Settings, else the loaded model's
        own default (its generation_config.json), else the app's."""
        return self.settings.sampling_for(self.model_state.generation_defaults())

    def prefill_rate(self) -> PrefillRate | None:
        """How fast the loaded model reads on this machine at each context length
        (None before its first timed read)."""
        return prefill_rate.least_squares_rate(self.settings.prefill_timings(self.model_id))

    def read_eta(self, progress: IngestProgress) -> float | None:
        """Seconds left of a read, from the rate model at the context it has reached.

        The rest of the read runs from where the last chunk ended to the end, each
        token slower than the one before; the engine's own figure (an average
        rate so far) stands in before any chunk was timed, and for a quality
        check, whose progress times no chunk.
        """
        rate = self.prefill_rate()
        if rate is None or not progress.chunk_tokens:
            return progress.eta_seconds
        at = progress.chunk_start + progress.chunk_tokens
        # Beside answers the read has its share of the time, the rest goes to them.
        return (rate.seconds(at, at + progress.tokens_total - progress.tokens_done)
                / progress.read_share)

    def _on_read_chunk(self, progress: IngestProgress) -> None:
        if progress.request_id not in self._reads_begun:
            # A read's first chunk carries its start-up too (after a load, the first
            # run of every kernel: seconds for a few tokens), which the rate model
            # would take for attention's cost and carry to every long read.
            if len(self._reads_begun) >= MAX_READS_TRACKED:
                self._reads_begun.clear()
            self._reads_begun.add(progress.request_id)
            return
        if progress.chunk_tokens and progress.chunk_seconds > 0:
            timing = ChunkTiming(progress.chunk_tokens, progress.chunk_start,
                                 progress.chunk_seconds)
            timings = prefill_rate.remember(self.settings.prefill_timings(self.model_id), timing)
            self.settings.set_prefill_timings(self.model_id, timings)

    def quality_unavailable(self) -> str:
        """Why "Check quality" cannot run for the shown chat now; "" when it can."""
        has_text = bool(self.model.engine_messages(""))
        loading = self.model_state.loading and not self.model_ready
        return self.quality.unavailable(self.current, self.model_ready, has_text, loading)

    def check_quality(self) -> bool:
        """Measure the shown chat's KV mode against fp16 on its last tokens (Stop cancels)."""
        reason = self.quality_unavailable()
        if reason:
            self.errorRaised.emit(reason)
            return False
        assert self.current is not None
        self.quality.start(self.current, self.model.engine_messages(self.settings.system_prompt))
        return True

    def receipts(self, session_id: str | None) -> dict:
        """The chat's quality receipts by mode (``engine.QualityReceipt``)."""
        return self.store.receipts(session_id) if session_id else {}

    def outdated_receipts(self, session_id: str | None, receipts: dict) -> dict[str, str]:
        """Why each of the chat's ``receipts`` no longer speaks for it, by mode: it
        measured another model than the one loaded, text the chat no longer is, or
        (in the chat's mode) pages rotated otherwise than the chat's."""
        if not session_id:
            return {}
        changed = self.store.outdated_receipts(session_id, self.settings.system_prompt)
        loaded = self.model_info.name if self.model_info is not None else None
        record = self.store.session(session_id)
        why = {}
        for mode, receipt in receipts.items():
            if loaded is not None and receipt.model != loaded:
                why[mode] = f"it ran on {receipt.model}, not the model loaded now"
            elif mode in changed:
                why[mode] = "the chat has changed since"
            elif record is not None and mode == record.kv_mode and (
                    session_id in self.caches.rotations
                    and receipt.rotated != (self.caches.rotations[session_id] is not None)):
                # A copy of another chat's receipt (Reopen in…) made with the other setting.
                why[mode] = ("it measured rotated pages; this chat keeps them unrotated"
                             if receipt.rotated else
                             "it measured unrotated pages; this chat rotates them")
        return why

    def cache_state(self, session_id: str | None) -> str:
        """The chat's one state sentence ("In memory: …", "On disk: …", "Answering…")."""
        facts = self.chat_facts(session_id)
        return state_sentence(facts) if facts is not None else ""

    def chat_facts(self, session_id: str | None) -> ChatFacts | None:
        """What is known of a chat (its job, memory, snapshot, history), or None."""
        record = self.store.session(session_id) if session_id else None
        if record is None:
            return None
        snapshots = self.stored_snapshots()
        if record.id not in snapshots:  # the listing may not have come yet: its manifest
            info = self.bridge.stored_snapshot(record.id)
            if info is not None:
                snapshots[record.id] = info
        return facts_of(record, self.activity, self.caches, snapshots)

    def stored_snapshots(self) -> dict:
        """Session id -> ``SnapshotInfo`` of each chat's KV snapshot on disk that the
        model loaded now reopens, from the listing (one stored with another model's
        weights is read again, not reopened: its chat is "on disk as text")."""
        listing = getattr(self.bridge, "last_stored_kv", None)
        if listing is None:
            return {}
        return {info.name: info for info in listing.snapshots if listing.reopenable(info)}

    def all_chat_facts(self, records: Iterable[SessionRecord]) -> dict[str, ChatFacts]:
        """Each of ``records`` -> its facts, for the sidebar (no file is read)."""
        snapshots = self.stored_snapshots()
        return {r.id: facts_of(r, self.activity, self.caches, snapshots) for r in records}

    def total_kv(self) -> KvTotal:
        """The KV pages of every open session, from their latest samples."""
        return self.caches.total()

    # Sending --------------------------------------------------------------

    def send(self, text: str, attachments: tuple[AttachmentRecord, ...] = ()) -> bool:
        """Save and send a user turn; False (with an error shown) when it can't be sent."""
        if not text.strip() and not attachments:
            return False
        if self.activity.refuse_in(self.current.id if self.current else None,
                                   "sending another message"):
            return False
        if not self.model_ready:
            self.errorRaised.emit("The model is still loading; your message is kept — "
                                  "send it again in a moment.")
            return False
        try:
            saved = self._save_turn(text, attachments)
        except DiskFault as fault:
            self.errorRaised.emit(f"Your message was not sent; it is still in the box. {fault}")
            return False
        if saved is None:
            return False
        message_id, retitle, replaced = saved
        chat = self.current
        assert chat is not None  # _save_turn made one or kept the one shown
        self.model.append(ChatMessage("user", text, "complete", message_id,
                                      attachments=attachments))
        if retitle:
            self.rename_session(chat.id, _title_of(self.model.message(
                self.model.rowCount() - 1)))
            chat = self.current  # renamed: the record shown now
            assert chat is not None
        self.answers.start_chat(chat, replaced)
        return True

    def _save_turn(self, text: str, attachments: tuple[AttachmentRecord, ...]
                   ) -> tuple[int, bool, Replaced | None] | None:
        """Save the user turn; its id, whether the chat takes its title from it and,
        for an edit, the turn it replaces (kept until the answer has text), or None
        when no chat could be made.

        Raises:
            DiskFault: the history cannot be written now (the turn stays in the box).
        """
        if self.current is None and self.new_session() is None:
            return None
        assert self.current is not None
        retitle = self.current.title == NEW_TITLE
        editing = self._editing
        if editing is not None:
            row = editing[0]
            # The title came from the first message (not from a rename): it follows the edit.
            retitle = retitle or (row == self._first_user_row()
                                  and self.current.title == _title_of(self.model.message(row)))
        message_id = self.store.add_message(self.current.id, "user", text, "complete",
                                            attachments)
        replaced = None
        if editing is not None:
            self._editing = None
            replaced = Replaced(
                tuple(m.message_id for m in self.model.messages()[editing[0]:]),
                EditRecord(editing[1], text, attachments))
            self.model.truncate(editing[0])
        return message_id, retitle, replaced

    def stop(self) -> None:
        """Stop the shown chat's job (Esc): out of the line, or its request cancelled.

        Another chat's job goes on: Stop stops only what this chat started.
        """
        job = self.activity.job_of(self.current.id if self.current else None)
        if job is not None:
            self.activity.stop(job, self.bridge.cancel)

    def continue_answer(self) -> bool:
        """Let the last answer go on from where it ended; its bubble grows.

        The model reads the conversation up to the end of that answer's text (no
        new turn) and writes on; the answer's one message keeps all of it.
        """
        rows = self.model.rowCount()
        last = self.model.message(rows - 1) if rows else None
        if self.current is None or last is None or last.role != "assistant" \
                or not last.content:
            return False
        if last.reason == CONTEXT_END:
            self.errorRaised.emit("This answer filled the model's context: there is no room "
                                  "for more of it. Start a new chat to go on.")
            return False
        if self.activity.refuse_in(self.current.id, "continuing the answer"):
            return False
        if not self.model_ready:
            self.errorRaised.emit("The model is still loading; press Continue again in a "
                                  "moment.")
            return False
        self.answers.start_continue(self.current, last.message_id)
        return True

    def can_regenerate(self) -> bool:
        """Whether the last message is an answer that can be generated again."""
        return not self.busy_here and self.model.can_answer_again(self.model.rowCount() - 1)

    def regenerate(self) -> None:
        """Drop the last answer and generate it again."""
        if not self.can_regenerate() or not self.model_ready or self.current is None:
            return
        row = self.model.rowCount() - 1
        # The earlier answer stays in the history until the new one has text.
        replaced = Replaced((self.model.message(row).message_id,))
        self.model.truncate(row)
        self.answers.start_chat(self.current, replaced)

    def _first_user_row(self) -> int | None:
        return next((row for row in range(self.model.rowCount())
                     if self.model.message(row).role == "user"), None)

    def last_user_row(self) -> int | None:
        """Row of the last user message, when it can be edited and resent."""
        for row in range(self.model.rowCount() - 1, -1, -1):
            if self.model.message(row).role == "user":
                return row
        return None

    def begin_edit(self) -> None:
        """Put the last user message back in the composer; sending replaces it."""
        row = self.last_user_row()
        if row is None or self.activity.refuse_in(self.current.id if self.current else None,
                                                  "editing"):
            return
        message = self.model.message(row)
        self._editing = (row, message.message_id)
        self.editRequested.emit(message.content, message.attachments)

    def resume_edit(self, message_id: int) -> bool:
        """Edit message ``message_id`` again (an edit kept while its chat was left or
        the app closed), as ``begin_edit`` does but without its signal; False when
        that message is not the shown chat's last user message any more."""
        row = self.last_user_row()
        if row is None or self.model.message(row).message_id != message_id:
            return False
        self._editing = (row, message_id)
        return True

    def _edit_returned(self, session_id: str) -> None:
        # An edit's answer ended before any text: on screen, the edit is back in the
        # composer now; another chat's comes back when that chat is shown (Drafts).
        kept = self.store.edit(session_id) if self.sessions.shown(session_id) else None
        if kept is not None and self.resume_edit(kept.message_id):
            self.editRequested.emit(kept.text, kept.attachments)

    def cancel_edit(self) -> None:
        """Leave edit mode; the conversation is unchanged."""
        self._editing = None

    @property
    def editing(self) -> bool:
        """True while the composer holds an edited earlier message."""
        return self._editing is not None

    @property
    def edited_message_id(self) -> int | None:
        """The id of the message the composer edits, or None."""
        return self._editing[1] if self._editing is not None else None

    # Engine events of no one request -------------------------------------

    def _on_engine_notice(self, event: Notice) -> None:
        job = self.activity.job_with(event.request_id)
        # A chat's notice names that chat when another is on screen.
        self.notice.emit(event.message if job is None
                         else self.sessions.about(job.session_id, event.message))

    def _on_answer_waiting(self, event: AnswerWaiting) -> None:
        # The chat's state line says the engine's reason until the answer reads or goes on.
        job = self.activity.job_with(event.request_id)
        if job is not None:
            self.activity.hold(job, self._waiting_words(event))

    def _on_wait_ended(self, event: WaitEnded) -> None:
        # Its first chunk or token may be seconds off: the state line says it reads.
        job = self.activity.job_with(event.request_id)
        if job is not None:
            self.activity.go_on(job)

    def _waiting_words(self, event: AnswerWaiting) -> str:
        """The engine's reason, naming by its title the chat waited behind (the engine
        knows it as a request: "the conversation before it")."""
        ahead = None if event.behind is None else self.activity.job_with(event.behind)
        record = None if ahead is None else self.store.session(ahead.session_id)
        if record is None:  # a request of the local server's, or one already ended
            return event.reason
        return event.reason.replace(WAITED_BEHIND, f"‘{short_title(record.title)}’", 1)

    def _on_failed(self, event: Failed) -> None:
        # A request without a handler (settings applied, stored KV cleared) failed.
        self.errorRaised.emit(event.message)

    def _on_stats(self, sample: StatsSample) -> None:
        if sample.timestamp <= self._last_stats_time.get(sample.session_id, 0.0):
            return
        self._last_stats_time[sample.session_id] = sample.timestamp
        self.caches.note(sample)
        if sample.session_id and sample.session_id.startswith(API_SESSION_PREFIX):
            self._api_samples[sample.session_id] = sample
        self.statsUpdated.emit(sample)

    def _poll_stats(self) -> None:
        sample = self.bridge.latest_stats()
        if sample is not None:
            self._on_stats(sample)


def _title_of(message: ChatMessage) -> str:
    """The title a chat gets from its first message: its text, else its first file's name."""
    return title_from(message.content.strip() or
                      (message.attachments[0].name if message.attachments else ""))


def _how_far(progress: IngestProgress | None) -> str:
    """" (42%)", how much of a read is done (rounded down), or "" before it says."""
    if progress is None or progress.tokens_total <= 0:
        return ""
    return f" ({progress.tokens_done * 100 // progress.tokens_total}%)"
