"""The Qt face of the engine worker, and the one registry of its requests.

``EngineWorker`` calls ``on_event`` from its own threads; the bridge hands every
event to the GUI thread through a queued signal. There, an event of a request
goes to exactly the handler that request was submitted with (answer, ingest,
quality check, open, load), and the request's ending (``Finished`` or
``Failed``) unregisters it. Events of no one request (stats samples, notices,
the stored-KV listing, a lost pipeline), and an answer's wait to join those
answering together, go to whoever subscribed to their signal. The GUI thread
never calls into MLX: it only enqueues requests and reads thread-safe snapshots
(stats, fit checks, token counts).

The worker can be replaced (the in-process engine by a pipeline over other
Macs, and back): each worker numbers its requests from 1, so the bridge adds a
per-worker offset to the ids it hands out and to its events' ids, and the
requests of the worker replaced still end at their handlers.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, Signal, Slot

from engine import (
    DEFAULT_READ_SHARE,
    AnswerWaiting,
    EngineStopped,
    Event,
    Failed,
    Finished,
    FitReport,
    KvMode,
    Notice,
    PipelineLost,
    SamplingParams,
    SnapshotInfo,
    StatsSample,
    StoredKv,
    TurnOverhead,
    WaitEnded,
    Worker,
    renumbered,
    request_id_of,
)

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.001
Handler = Callable[[Event], None]  # gets every event of its one request, on the GUI thread
# Builds a worker from (on_event, budget_bytes, chunk_size, read_share).
WorkerFactory = Callable[[Callable[[Event], None], int | None, int, float], Worker]
ID_SPAN = 1 << 40  # request ids of one worker: the next worker's are offset past them
STORE_POLL_S = 0.1  # how often a wait for the exit's store looks whether it still stores
RETIRE_TIMEOUT_S = 30.0  # a replaced worker's thread gets this long to end (off the GUI thread)


def _default_worker(on_event: Callable[[Event], None], budget_bytes: int | None,
                    chunk_size: int, read_share: float) -> Worker:
    from engine import EngineWorker, SnapshotStore, server_snapshots_dir

    # A chat's KV cache goes to disk when it leaves memory and comes back from there;
    # the local server's, kept apart, counts against the same budget (one user, one
    # disk), as the server counts the app's.
    try:
        snapshots = SnapshotStore(counted_with=(server_snapshots_dir(),))
    except OSError as error:  # an unwritable data folder: chats are read again instead
        log.warning("stored KV is off: its folder cannot be used (%s)", error)
        snapshots = None
    return EngineWorker(on_event, budget_bytes=budget_bytes, chunk_size=chunk_size,
                        snapshots=snapshots, read_share=read_share)


class EngineBridge(QObject):
    """Owns the engine worker, routes each request's events to its handler.

    Args:
        budget_bytes: KV byte budget passed to the worker (None: engine default).
        chunk_size: tokens per prefill chunk.
        read_share: the share of the time a document being read takes beside
            other chats' answers.
        worker_factory: builds the worker from ``(on_event, budget_bytes, chunk_size,
            read_share)``.

    Signals:
        statsSample(StatsSample), noticeReceived(Notice), storedKv(StoredKv),
            pipelineLost(PipelineLost): events of no one request, for their subscribers.
        answerWaiting(AnswerWaiting): an answer waits to join those answering
            together; for the subscriber that keeps each chat's job state.
        waitEnded(WaitEnded): a request told it waits goes on; for the same.
        failed(Failed): a request submitted without a handler failed (configure,
            stored-KV budget or clearing): its message is for the user.
        ended(object): the ending of any request, after its handler has seen it.
    """

    statsSample = Signal(object)
    noticeReceived = Signal(object)  # engine.Notice: a request goes on, with news
    answerWaiting = Signal(object)  # engine.AnswerWaiting: an answer waits for memory
    waitEnded = Signal(object)  # engine.WaitEnded: it waits no more
    storedKv = Signal(object)  # engine.StoredKv: the KV snapshots on disk changed
    pipelineLost = Signal(object)  # engine.PipelineLost: the worker's machines are gone
    failed = Signal(object)
    ended = Signal(object)
    _relay = Signal(object)

    def __init__(
        self,
        budget_bytes: int | None = None,
        chunk_size: int = 512,
        read_share: float = DEFAULT_READ_SHARE,
        worker_factory: WorkerFactory = _default_worker,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._relay.connect(self._dispatch, Qt.ConnectionType.QueuedConnection)
        # What a replacing worker is built with.
        self._settings = (budget_bytes, chunk_size, read_share)
        self._own_factory = worker_factory
        self._offset = 0  # added to the ids of the current worker's requests
        self._refused = itertools.count(-1, -1)  # ids of requests no worker took
        self._worker = worker_factory(self._events_from(0), *self._settings)
        self._retiring: list[tuple[Worker, int]] = []  # replaced workers, their offsets
        self._handlers: dict[int, Handler | None] = {}
        self._cancels: dict[int, threading.Event] = {}
        self._started = False
        self.last_stored_kv: StoredKv | None = None
        # Front ends beside the window on the same worker (the local server): each
        # takes its own requests' events on the engine thread, before the GUI sees them;
        # a claim sees only the events of the worker current when it was added.
        self._claims: tuple[Callable[[Event], bool], ...] = ()
        self._claim_owners: dict[Callable[[Event], bool], int] = {}  # claim -> its offset

    # Worker thread side ---------------------------------------------------

    def _events_from(self, offset: int) -> Callable[[Event], None]:
        """The ``on_event`` of the worker whose request ids are offset by ``offset``."""

        def on_event(event: Event) -> None:
            # Runs on the engine thread: only hand the event over.
            for claim in self._claims:
                if self._claim_owners.get(claim, offset) == offset and claim(event):
                    return
            request_id = request_id_of(event)
            if offset and request_id is not None:
                event = renumbered(event, request_id + offset)
            with contextlib.suppress(RuntimeError):  # the bridge is gone after shutdown
                self._relay.emit(event)

        return on_event

    @property
    def worker(self) -> Worker:
        """The engine worker, for another front end on the same engine thread."""
        return self._worker

    def add_claim(self, claim: Callable[[Event], bool]) -> None:
        """Offer every worker event to ``claim`` first (on the engine thread); an event
        it returns True for is its own and never reaches the window."""
        self._claims = (*self._claims, claim)
        self._claim_owners[claim] = self._offset

    def remove_claim(self, claim: Callable[[Event], bool]) -> None:
        """Stop offering events to ``claim``."""
        self._claims = tuple(c for c in self._claims if c != claim)
        self._claim_owners.pop(claim, None)

    def replace_worker(self, worker_factory: WorkerFactory | None = None) -> None:
        """Run every request from now on on a new worker built by ``worker_factory``
        (None: the factory this bridge was made with, the in-process engine).

        The handlers stay registered: the old worker's running and queued
        requests still end at theirs, and the old worker is shut down once the
        last of them has ended. Front ends holding ``worker`` must take the new one.
        """
        old, old_offset = self._worker, self._offset
        self._offset = old_offset + ID_SPAN
        factory = worker_factory or self._own_factory
        self._worker = factory(self._events_from(self._offset), *self._settings)
        if self._started:
            self._worker.start()
        self._retiring.append((old, old_offset))
        self._retire_idle()

    def _retire_idle(self) -> None:
        """Shut down each replaced worker none of whose requests is pending any more."""
        for entry in list(self._retiring):
            worker, offset = entry
            if any(offset <= rid < offset + ID_SPAN for rid in self._handlers):
                continue
            self._retiring.remove(entry)
            if self._started:  # joined off the GUI thread: a load or chunk may be inside MLX
                threading.Thread(target=worker.shutdown, args=(RETIRE_TIMEOUT_S,),
                                 name="retire-engine", daemon=True).start()

    # GUI thread side ------------------------------------------------------

    @Slot(object)
    def _dispatch(self, event: Event) -> None:
        if isinstance(event, StatsSample):
            self.statsSample.emit(event)
        elif isinstance(event, Notice):
            self.noticeReceived.emit(event)
        elif isinstance(event, AnswerWaiting | WaitEnded):
            if event.request_id in self._handlers:  # not one forgotten as the window closed
                signal = self.answerWaiting if isinstance(event, AnswerWaiting) else self.waitEnded
                signal.emit(event)
        elif isinstance(event, StoredKv):
            self.last_stored_kv = event
            self.storedKv.emit(event)
        elif isinstance(event, PipelineLost):
            self.pipelineLost.emit(event)
        else:
            self._deliver(event)

    def _deliver(self, event: Event) -> None:
        request_id = request_id_of(event)
        if request_id is None:
            return  # news of no one request: the signals above carry it
        ending = isinstance(event, Finished | Failed)
        if ending:
            if request_id not in self._handlers:
                return  # forgotten (the window closed) or never submitted here
            handler = self._handlers.pop(request_id)
            self._cancels.pop(request_id, None)
        else:
            handler = self._handlers.get(request_id)
        if handler is not None:
            handler(event)
        elif ending and isinstance(event, Failed):
            self.failed.emit(event)
        if ending:
            self.ended.emit(event)
            if self._retiring:
                self._retire_idle()

    def _submit(self, request: Callable[[], int], handler: Handler | None,
                cancel: threading.Event | None = None) -> int:
        """Send ``request`` (a call that queues it on the worker, returning its id);
        the id its events carry here."""
        try:
            request_id = request() + self._offset  # unique across workers
        except EngineStopped as stopped:
            # No engine thread will end it: it fails here, once its handler is set.
            request_id = next(self._refused)
            self._relay.emit(Failed(request_id, str(stopped), type(stopped).__name__))
        self._handlers[request_id] = handler
        if cancel is not None:
            self._cancels[request_id] = cancel
        return request_id

    @property
    def pending(self) -> int:
        """Requests submitted here whose ending has not arrived yet."""
        return len(self._handlers)

    def forget_all(self) -> None:
        """Unregister every handler: the window is closing, late events reach no one.

        ``cancel`` still reaches every request that has not ended.
        """
        self._handlers.clear()

    def start(self) -> None:
        """Start the worker thread."""
        # The engine thread runs Python between MLX calls; a short GIL switch
        # interval hands the GUI thread the GIL back within ~1 ms instead of 5.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._worker.start()
        self._started = True

    def load_model(self, path: str, handler: Handler) -> int:
        """Load a model folder (or "demo"); ``handler`` gets ``ModelLoaded``, then the ending."""
        return self._submit(lambda: self._worker.load_model(path), handler)

    def open_session(self, session_id: str, mode: KvMode, page_size: int, rotate: bool | None,
                     handler: Handler) -> int:
        """Open a paged cache for a session in a fixed KV mode (rows rotated or not).

        ``handler`` gets ``SessionOpened``, then the ending.
        """
        return self._submit(
            lambda: self._worker.open_session(session_id, mode, page_size, rotate), handler)

    def chat(self, session_id: str, messages: list[dict[str, str]],
             sampling: SamplingParams, handler: Handler) -> int:
        """Ingest what is new in ``messages`` and stream an answer into ``handler``."""
        cancel = threading.Event()
        return self._submit(lambda: self._worker.chat(session_id, messages, sampling, cancel),
                            handler, cancel)

    def ingest(self, session_id: str, messages: list[dict[str, str]], handler: Handler) -> int:
        """Prefill ``messages`` without generating; ``handler`` gets its progress and ending."""
        cancel = threading.Event()
        return self._submit(lambda: self._worker.ingest(session_id, messages, cancel), handler,
                            cancel)

    def check_quality(self, session_id: str, messages: list[dict[str, str]],
                      handler: Handler) -> int:
        """Measure the session's KV mode against fp16 on the conversation's last tokens."""
        cancel = threading.Event()
        return self._submit(lambda: self._worker.check_quality(session_id, messages, cancel),
                            handler, cancel)

    def cancel(self, request_id: int | None = None) -> None:
        """Cancel one request, or every running one."""
        for rid, event in list(self._cancels.items()):
            if request_id is None or rid == request_id:
                event.set()

    def configure(self, budget_bytes: int | None, chunk_size: int,
                  read_share: float) -> int | None:
        """Apply a new KV budget, ingest chunk and reads' share beside answers (a new
        chunk size once the answers running end); None where nothing changed, and
        nothing is sent."""
        settings = (budget_bytes, chunk_size, read_share)
        if settings == self._settings:
            return None
        self._settings = settings
        return self._submit(lambda: self._worker.configure(
            budget_bytes=budget_bytes, chunk_size=chunk_size, read_share=read_share), None)

    def set_snapshot_budget(self, budget_bytes: int | None) -> int:
        """Apply the stored-KV disk budget (None: default); answers with storedKv."""
        return self._submit(lambda: self._worker.set_snapshot_budget(budget_bytes), None)

    def clear_stored_kv(self, session_id: str | None = None) -> int:
        """Delete one chat's stored KV (None: all), on the worker; answers with storedKv."""
        return self._submit(lambda: self._worker.clear_snapshots(session_id), None)

    def close_session(self, session_id: str, store: bool = True) -> None:
        """Free a session's pages, storing its KV first unless ``store`` is False."""
        self._submit(lambda: self._worker.close_session(session_id, store), None)

    def latest_stats(self) -> StatsSample | None:
        """The worker's last stats snapshot (thread-safe, no MLX call)."""
        return self._worker.latest_stats()

    def stored_snapshot(self, session_id: str) -> SnapshotInfo | None:
        """The KV snapshot the worker keeps on disk for a session, or None (an ``SnapshotInfo``).

        Reads the snapshot's small manifest only; no MLX call.
        """
        from engine import snapshot_info, snapshots_dir

        try:
            folder = snapshots_dir()
        except OSError:  # an unusable data folder holds no stored KV (it is off)
            return None
        return snapshot_info(folder, session_id)

    def fit_check(self, session_id: str | None, token_count: int,
                  page_size: int | None = None) -> FitReport:
        """Per-mode fit of ``token_count`` tokens (an ``engine.memory.fit.FitReport``);
        a chat not opened yet's at ``page_size`` (None: the engine's default)."""
        return self._worker.fit_check(session_id, token_count, page_size)

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` under the loaded model's tokenizer (any thread)."""
        return self._worker.count_tokens(text)

    def turn_overhead(self, system_prompt: str) -> TurnOverhead:
        """Tokens the chat template adds to a message (a ``prompt_ids.TurnOverhead``)."""
        return self._worker.turn_overhead(system_prompt)

    def token_ends(self, text: str) -> list[int]:
        """Where each token of ``text`` ends, in characters (any thread; one tokenization)."""
        return self._worker.token_ends(text)

    @property
    def running(self) -> bool:
        """True while the engine thread is alive (it may be finishing a prefill chunk)."""
        return self._worker.alive

    @property
    def storing_at_exit(self) -> bool:
        """True while the stopping engine stores its open chats' KV (any thread)."""
        return self._worker.storing_at_exit

    def finish_storing(self, timeout: float) -> bool:
        """After ``shutdown``: wait while the engine stores the open chats' KV, at most
        ``timeout`` seconds; True once its thread has ended.

        Returns as soon as the engine is not storing: a thread still inside an MLX
        call is not waited for here.
        """
        deadline = time.monotonic() + timeout
        while self._worker.storing_at_exit and time.monotonic() < deadline:
            self._worker.join(min(STORE_POLL_S, max(0.0, deadline - time.monotonic())))
        return self._worker.join(0)

    def shutdown(self, timeout: float = 2.0) -> bool:
        """Cancel all work and join the worker thread; True once the thread has ended.

        A chunk of prefill or a model load already inside MLX cannot be interrupted,
        so the thread may outlive ``timeout``; calling again waits again.
        """
        self.cancel()
        if not self._started:
            return not self.running
        # A replaced worker still owed an ending stops now too (a pipeline's processes).
        for worker, _offset in self._retiring:
            worker.shutdown(timeout)
        self._worker.shutdown(timeout)  # asks once; a second call only waits again
        return self._worker.join(0)
