"""The Qt face of the engine worker.

``EngineWorker`` calls ``on_event`` from its own threads; the bridge re-emits
every event on the GUI thread through a queued signal, sorted by type. The GUI
thread never calls into MLX: it only enqueues requests and reads thread-safe
snapshots (stats, fit checks, token counts).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, Signal, Slot

from engine import (
    Failed,
    Finished,
    IngestProgress,
    ModelLoaded,
    Notice,
    QualityChecked,
    QualityProgress,
    SamplingParams,
    SessionOpened,
    StatsSample,
    StoredKv,
    TokenChunk,
)

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.001
ENGINE_THREAD = "longleaf-engine"  # the name the worker contract gives its thread


def _default_worker(on_event: Callable[[object], None], budget_bytes: int | None,
                    chunk_size: int):
    from engine import EngineWorker, SnapshotStore

    # A chat's KV cache goes to disk when it leaves memory and comes back from there.
    try:
        snapshots = SnapshotStore()
    except OSError as error:  # an unwritable data folder: chats are read again instead
        log.warning("stored KV is off: its folder cannot be used (%s)", error)
        snapshots = None
    return EngineWorker(on_event, budget_bytes=budget_bytes, chunk_size=chunk_size,
                        snapshots=snapshots)


class EngineBridge(QObject):
    """Owns the engine worker and turns its events into Qt signals.

    Args:
        budget_bytes: KV byte budget passed to the worker (None: engine default).
        chunk_size: tokens per prefill chunk.
        worker_factory: builds the worker from ``(on_event, budget_bytes, chunk_size)``.
    """

    tokenChunk = Signal(object)
    ingestProgress = Signal(object)
    statsSample = Signal(object)
    finished = Signal(object)
    failed = Signal(object)
    modelLoaded = Signal(object)
    sessionOpened = Signal(object)
    noticeReceived = Signal(object)  # engine.Notice: a request goes on, with news
    storedKv = Signal(object)  # engine.StoredKv: the KV snapshots on disk changed
    qualityProgress = Signal(object)
    qualityChecked = Signal(object)
    busyChanged = Signal(bool)
    _relay = Signal(object)

    def __init__(
        self,
        budget_bytes: int | None = None,
        chunk_size: int = 512,
        worker_factory: Callable = _default_worker,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._relay.connect(self._dispatch, Qt.ConnectionType.QueuedConnection)
        self._worker = worker_factory(self._on_worker_event, budget_bytes, chunk_size)
        self._pending: dict[int, str] = {}
        self._cancels: dict[int, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        self._alive = False
        self.last_stored_kv: StoredKv | None = None

    # Worker thread side ---------------------------------------------------

    def _on_worker_event(self, event: object) -> None:
        # Runs on the engine thread: only hand the event over.
        with contextlib.suppress(RuntimeError):  # the bridge is gone after shutdown
            self._relay.emit(event)

    # GUI thread side ------------------------------------------------------

    @Slot(object)
    def _dispatch(self, event: object) -> None:
        if isinstance(event, TokenChunk):
            self.tokenChunk.emit(event)
        elif isinstance(event, StatsSample):
            self.statsSample.emit(event)
        elif isinstance(event, QualityProgress):  # before its base class, IngestProgress
            self.qualityProgress.emit(event)
        elif isinstance(event, IngestProgress):
            self.ingestProgress.emit(event)
        elif isinstance(event, ModelLoaded):
            self.modelLoaded.emit(event)
        elif isinstance(event, SessionOpened):
            self.sessionOpened.emit(event)
        elif isinstance(event, Notice):
            self.noticeReceived.emit(event)
        elif isinstance(event, StoredKv):
            self.last_stored_kv = event
            self.storedKv.emit(event)
        elif isinstance(event, QualityChecked):
            self.qualityChecked.emit(event)
        elif isinstance(event, Finished | Failed):
            was_busy = self.busy
            self._pending.pop(event.request_id, None)
            self._cancels.pop(event.request_id, None)
            (self.finished if isinstance(event, Finished) else self.failed).emit(event)
            if was_busy != self.busy:
                self.busyChanged.emit(self.busy)

    def _track(self, request_id: int, kind: str, cancel: threading.Event | None = None) -> int:
        was_busy = self.busy
        self._pending[request_id] = kind
        if cancel is not None:
            self._cancels[request_id] = cancel
        if was_busy != self.busy:
            self.busyChanged.emit(self.busy)
        return request_id

    @property
    def busy(self) -> bool:
        """True while a chat, ingest or quality check is running or queued."""
        return any(kind in ("chat", "ingest", "quality") for kind in self._pending.values())

    def request_kind(self, request_id: int) -> str | None:
        """"load", "open", "chat", "ingest", "quality" or "configure" for a pending request."""
        return self._pending.get(request_id)

    def start(self) -> None:
        """Start the worker thread."""
        # The engine thread runs Python between MLX calls; a short GIL switch
        # interval hands the GUI thread the GIL back within ~1 ms instead of 5.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        before = set(threading.enumerate())
        self._worker.start()
        # Remember the engine thread itself, so closing can tell when it has ended.
        self._threads = [t for t in threading.enumerate()
                         if t not in before and t.name == ENGINE_THREAD]
        self._alive = True

    def load_model(self, path: str) -> int:
        """Load a model folder (or "demo"); answers with modelLoaded or failed."""
        return self._track(self._worker.load_model(path), "load")

    def open_session(self, session_id: str, mode: str, page_size: int = 256,
                     rotate: bool | None = None) -> int:
        """Open a paged cache for a session in a fixed KV mode (rows rotated or not)."""
        return self._track(self._worker.open_session(session_id, mode, page_size, rotate),
                           "open")

    def chat(self, session_id: str, messages: list[dict[str, str]],
             sampling: SamplingParams) -> int:
        """Ingest what is new in ``messages`` and stream an answer."""
        cancel = threading.Event()
        rid = self._worker.chat(session_id, messages, sampling, cancel)
        return self._track(rid, "chat", cancel)

    def ingest(self, session_id: str, messages: list[dict[str, str]]) -> int:
        """Prefill ``messages`` without generating."""
        cancel = threading.Event()
        return self._track(self._worker.ingest(session_id, messages, cancel), "ingest", cancel)

    def check_quality(self, session_id: str, messages: list[dict[str, str]]) -> int:
        """Measure the session's KV mode against fp16 on the conversation's last tokens."""
        cancel = threading.Event()
        rid = self._worker.check_quality(session_id, messages, cancel)
        return self._track(rid, "quality", cancel)

    def cancel(self, request_id: int | None = None) -> None:
        """Cancel one request, or every running one."""
        for rid, event in list(self._cancels.items()):
            if request_id is None or rid == request_id:
                event.set()

    def configure(self, budget_bytes: int | None, chunk_size: int) -> int:
        """Apply a new KV budget and ingest chunk once the running request ends."""
        return self._track(self._worker.configure(budget_bytes=budget_bytes,
                                                  chunk_size=chunk_size), "configure")

    def set_snapshot_budget(self, budget_bytes: int | None) -> int:
        """Apply the stored-KV disk budget (None: default); answers with storedKv."""
        return self._track(self._worker.set_snapshot_budget(budget_bytes), "stored_kv")

    def clear_stored_kv(self, session_id: str | None = None) -> int:
        """Delete one chat's stored KV (None: all), on the worker; answers with storedKv."""
        return self._track(self._worker.clear_snapshots(session_id), "stored_kv")

    def close_session(self, session_id: str, keep: bool = True) -> None:
        """Free a session's pages, storing its KV first unless ``keep`` is False."""
        self._worker.close_session(session_id, keep)

    def latest_stats(self) -> StatsSample | None:
        """The worker's last stats snapshot (thread-safe, no MLX call)."""
        return self._worker.latest_stats()

    def stored_snapshot(self, session_id: str):
        """The KV snapshot the worker keeps on disk for a session, or None (an ``SnapshotInfo``).

        Reads the snapshot's small manifest only; no MLX call.
        """
        from engine import snapshot_info, snapshots_dir

        return snapshot_info(snapshots_dir(), session_id)

    def fit_check(self, session_id: str | None, token_count: int):
        """Per-mode fit of ``token_count`` tokens (an ``engine.memory.fit.FitReport``)."""
        return self._worker.fit_check(session_id, token_count)

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` under the loaded model's tokenizer (any thread)."""
        return self._worker.count_tokens(text)

    @property
    def running(self) -> bool:
        """True while the engine thread is alive (it may be finishing a prefill chunk)."""
        return any(thread.is_alive() for thread in self._threads)

    def shutdown(self, timeout: float = 2.0) -> bool:
        """Cancel all work and join the worker thread; True once the thread has ended.

        A chunk of prefill or a model load already inside MLX cannot be interrupted,
        so the thread may outlive ``timeout``; calling again waits again.
        """
        self.cancel()
        if self._alive:
            self._worker.shutdown(timeout)
            self._alive = self.running
        return not self.running
