"""The engine in child processes: a pipeline group the app can stop, restart or drop.

``RemoteWorker`` has ``EngineWorker``'s public surface, so a front end drives
either one the same way. ``load_model`` (re)starts a pipeline group for that
model (``engine.distributed.link``): rank 0 (``engine.distributed.rank``) runs
an ``EngineWorker`` on the group and connects back over
``multiprocessing.connection``; the other ranks follow rank 0 as in the CLI's
pipeline run.

On the wire (pickled tuples of plain values and frozen events), app to rank 0:
``("call", request_id, request)`` (a frozen ``engine.runtime.commands`` value),
``("cancel", request_id)``, ``("read", call_id, name, args)``,
``("shutdown", timeout)``; rank 0 to app:
``("event", event)`` with the app's request ids, ``("reply", call_id, ok, value)``.
Request ids are this side's, numbered as ``EngineWorker`` numbers them.

A lost group (a rank died, a link dropped, the launcher ended) ends every
request in flight with ``Failed`` naming the rank and its machine, then sends
``PipelineLost`` once; later requests fail at once with that message until the
next ``load_model`` starts a new group.
"""

from __future__ import annotations

import copy
import itertools
import logging
import pickle
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import errors
from engine.cache.modes import KvMode
from engine.distributed.link import DROP_GRACE, Link
from engine.errors import EngineError, ModelLoadError
from engine.events import (
    Ending,
    Event,
    Failed,
    Finished,
    Notice,
    PipelineLost,
    StatsSample,
    request_id_of,
)
from engine.memory import fit
from engine.runtime.answering import DEFAULT_STREAMS, StreamCounts
from engine.runtime.commands import (
    CANCELLABLE,
    SETTINGS,
    Chat,
    CheckQuality,
    ClearSnapshots,
    CloseSession,
    Configure,
    Ingest,
    LoadModel,
    Message,
    OpenSession,
    Request,
    SetSnapshotBudget,
    ShareChats,
)
from engine.runtime.interface import OnEvent, Worker
from engine.runtime.worker import check_settings, copy_messages
from engine.session.batch import DEFAULT_READ_SHARE, check_read_share
from engine.session.prompt_ids import TurnOverhead
from engine.session.sampling import SamplingParams
from engine.session.session import DEFAULT_PAGE_SIZE

log = logging.getLogger(__name__)

NO_MODEL = "Load a model first."
# The window asks these questions (fit checks, token counts) on its own thread: a
# lost rank 0 must not freeze it for long.
READ_TIMEOUT = 5.0
STOP_TIMEOUT = 30.0
# How MLX's ring and JACCL backends begin their errors.
LINK_ERROR_TAGS = ("[ring]", "[jaccl]")
CANCEL_POLL = 0.05


class GroupLost(EngineError):
    """The pipeline group is gone; its message names the rank and machine."""


@dataclass
class _Request:
    cancellable: bool
    cancel: threading.Event
    sent: bool = False
    cancel_sent: bool = False


@dataclass(frozen=True)
class _Outgoing:
    """A request as it waits for the control thread."""

    request_id: int
    request: Request
    cancel: threading.Event


@dataclass
class _Read:
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    value: Any = None


class RemoteWorker(Worker):
    """``EngineWorker``'s surface over a pipeline group in child processes.

    Args:
        on_event: called with each event, in order, on one thread of this worker
            (never the one reading the connection, so it may ask rank 0 a question).
        budget_bytes: rank 0's KV page budget (None: free RAM minus its headroom);
            every other rank guards its own memory.
        chunk_size: tokens per prefill chunk.
        ranks: local ranks to start with the ring backend (ignored with ``hostfile``).
        hostfile: an MLX hostfile (``mlx.launch --hostfile``): its hosts are the
            ranks, the first of them this machine (127.0.0.1), where rank 0 runs.
        split: layers per rank, rank 0 (the last layers) first (None: mlx-lm's
            even split).
        kv_store: whose stored KV the ranks keep, in each machine's data folder:
            "app" (the app's chats) or "server" (the API server's own).
        streams: answers rank 0 may decode together (None: as free memory allows
            beside the model, ``EngineWorker``'s default).
        read_share: rank 0's ``EngineWorker`` ``read_share``.
    """

    def __init__(
        self,
        on_event: OnEvent,
        budget_bytes: int | None = None,
        chunk_size: int = 512,
        *,
        ranks: int = 2,
        hostfile: Path | None = None,
        split: Sequence[int] | None = None,
        kv_store: str = "app",
        streams: int | None = None,
        read_share: float = DEFAULT_READ_SHARE,
    ) -> None:
        self._on_event = on_event
        self._budget_bytes = budget_bytes
        self._chunk_size = chunk_size
        self._ranks = ranks
        self._hostfile = None if hostfile is None else Path(hostfile)
        self._split = None if split is None else [int(n) for n in split]
        self._kv_store = kv_store
        self._stream_limit = streams
        self._read_share = check_read_share(read_share)
        self._ids = itertools.count(1)
        self._reads = itertools.count(1)
        self._lock = threading.Lock()  # the state below
        self._pending: dict[int, _Request] = {}
        self._waiting: dict[int, _Read] = {}
        self._run: Link | None = None
        self._lost: str | None = None
        # Replayed on every new group, one of each kind.
        self._settings: dict[type[Request], Request] = {}
        self._last_stats: StatsSample | None = None
        self._streams = StreamCounts(limit=DEFAULT_STREAMS if streams is None else streams)
        self._outbox: queue.Queue[_Outgoing | None] = queue.Queue()
        # Every event goes out on one thread, in order, never the one that reads
        # the connection: ``on_event`` may ask rank 0 a question (a fit check).
        self._events: queue.Queue[Event | None] = queue.Queue()
        self._stopping = threading.Event()
        self._wake = threading.Condition(self._lock)
        self._control = threading.Thread(target=self._serve, name="longleaf-pipeline",
                                         daemon=True)
        self._canceller = threading.Thread(target=self._watch_cancels,
                                           name="longleaf-pipeline-cancel", daemon=True)
        self._delivery = threading.Thread(target=self._deliver_events,
                                          name="longleaf-pipeline-events", daemon=True)

    # -- public API (any thread), as EngineWorker's -----------------------------

    def start(self) -> None:
        """Start the control thread; the group starts with the first ``load_model``."""
        self._control.start()
        self._canceller.start()
        self._delivery.start()

    def load_model(self, path: str) -> int:
        """(Re)start the pipeline group for the model at ``path`` and load it there.

        -> ``ModelLoaded`` then ``Finished("done")``, or ``Failed`` (a model mlx-lm
        cannot split, a group that could not start, named by rank and machine).
        The previous group, if any, is stopped first (its sessions stored).
        """
        return self.submit(LoadModel(path))

    def open_session(self, session_id: str, mode: KvMode, page_size: int = DEFAULT_PAGE_SIZE,
                     rotate: bool | None = None) -> int:
        """As ``EngineWorker.open_session``, on rank 0 (each rank its layers)."""
        return self.submit(OpenSession(session_id, mode, page_size, rotate))

    def chat(self, session_id: str, messages: list[Message], sampling: SamplingParams,
             cancel: threading.Event, tools: list[dict[str, Any]] | None = None,
             template: bool = True) -> int:
        """As ``EngineWorker.chat``; setting ``cancel`` reaches every rank within a chunk."""
        return self.submit(Chat(session_id, copy_messages(messages), sampling,
                                copy.deepcopy(tools), template), cancel)

    def ingest(self, session_id: str, messages: list[Message],
               cancel: threading.Event) -> int:
        """As ``EngineWorker.ingest``."""
        return self.submit(Ingest(session_id, copy_messages(messages)), cancel)

    def check_quality(self, session_id: str, messages: list[Message],
                      cancel: threading.Event) -> int:
        """As ``EngineWorker.check_quality``."""
        return self.submit(CheckQuality(session_id, copy_messages(messages)), cancel)

    def configure(self, *, budget_bytes: int | None, chunk_size: int,
                  read_share: float) -> int:
        """As ``EngineWorker.configure``; also kept for the next group."""
        return self.submit(Configure(budget_bytes, chunk_size, read_share))

    def set_snapshot_budget(self, budget_bytes: int | None) -> int:
        """As ``EngineWorker.set_snapshot_budget``; also kept for the next group."""
        return self.submit(SetSnapshotBudget(budget_bytes))

    def clear_snapshots(self, session_id: str | None = None) -> int:
        """As ``EngineWorker.clear_snapshots`` (rank 0's, and each rank its own)."""
        return self.submit(ClearSnapshots(session_id))

    def share_chats_with_api(self, share: bool) -> int:
        """As ``EngineWorker.share_chats_with_api``; also kept for the next group."""
        return self.submit(ShareChats(bool(share)))

    def close_session(self, session_id: str, store: bool = True) -> int:
        """As ``EngineWorker.close_session`` (rank 0 cancels that session's request)."""
        return self.submit(CloseSession(session_id, store))

    def streams(self) -> StreamCounts:
        """Rank 0's answers running together, as it last said (after its last event);
        none once the group is lost. Never waits for rank 0."""
        with self._lock:
            streams, lost = self._streams, self._lost is not None
        return StreamCounts(limit=streams.limit) if lost else streams

    def latest_stats(self) -> StatsSample | None:
        """Rank 0's last stats sample, as it arrived; never waits for rank 0.

        Rank 0 sends every sample it takes, in order with the other events, so the
        last one received is the one its worker holds (the window polls this often,
        and must not wait on a busy or lost group).
        """
        return self._last_stats

    def fit_check(self, session_id: str | None, token_count: int,
                  page_size: int | None = None) -> fit.FitReport:
        """As ``EngineWorker.fit_check``, asked of rank 0.

        Raises:
            EngineError: no model is loaded, the session is unknown, or no group runs.
        """
        return self._read("fit_check", session_id, token_count, page_size)

    def count_tokens(self, text: str) -> int:
        """As ``EngineWorker.count_tokens``, asked of rank 0.

        Raises:
            EngineError: no model is loaded, or no group runs.
        """
        return self._read("count_tokens", text)

    def turn_overhead(self, system_prompt: str = "") -> TurnOverhead:
        """As ``EngineWorker.turn_overhead``, asked of rank 0.

        Raises:
            EngineError: no model is loaded, or no group runs.
        """
        return self._read("turn_overhead", system_prompt)

    def token_ends(self, text: str) -> list[int]:
        """As ``EngineWorker.token_ends``, asked of rank 0.

        Raises:
            EngineError: no model is loaded, or no group runs.
        """
        return self._read("token_ends", text)

    @property
    def alive(self) -> bool:
        """True from ``start`` until the control thread has ended."""
        return self._control.is_alive()

    @property
    def storing_at_exit(self) -> bool:
        """Always False: rank 0 stores its sessions within ``shutdown``'s timeout, after
        which the group is killed; nothing here is worth waiting longer for."""
        return False

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for this worker's threads; True once ended."""
        threads = (self._control, self._canceller, self._delivery)
        for thread in threads:
            if thread.ident is not None:
                thread.join(timeout)
        return not any(thread.is_alive() for thread in threads)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop the group (rank 0 stores its sessions, as ``EngineWorker`` does) and
        end its processes: what has not stopped within ``timeout`` is killed, so no
        process is left behind."""
        self._stopping.set()
        with self._lock:
            run = self._run
            self._wake.notify_all()
        if run is not None:
            self._stop_run(run, timeout)
        self._outbox.put(None)
        if not self.join(timeout):
            log.warning("pipeline worker did not stop within %.1f s", timeout)

    # -- requests ------------------------------------------------------------

    def submit(self, request: Request, cancel: threading.Event | None = None) -> int:
        """As ``EngineWorker.submit``: the request goes to rank 0 as this value."""
        request_id = next(self._ids)
        self._outbox.put(_Outgoing(request_id, request, cancel or threading.Event()))
        return request_id

    def _serve(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                break
            if self._stopping.is_set():
                self._emit(Finished(item.request_id, "cancelled"))
            else:
                self._handle(item.request_id, item.request, item.cancel)
        run = self._run  # one started while shutdown looked
        if run is not None:
            self._stop_run(run, 1.0)
        # Requests never answered, and those queued behind the stop, still end once.
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._emit(Finished(item.request_id, "cancelled"))
        with self._lock:
            left = sorted(self._pending)
            self._pending.clear()
        for request_id in left:
            self._emit(Finished(request_id, "cancelled"))
        self._events.put(None)

    def _handle(self, request_id: int, request: Request, cancel: threading.Event) -> None:
        if isinstance(request, SETTINGS):
            self._settings[type(request)] = request
        if isinstance(request, Configure):
            try:
                check_settings(request)
            except EngineError as error:
                self._settings.pop(Configure)
                self._emit(Failed(request_id, str(error), type(error).__name__))
                return
            # Also the next group's.
            self._budget_bytes, self._chunk_size = request.budget_bytes, request.chunk_size
            self._read_share = request.read_share
        if isinstance(request, LoadModel):
            self._start(request_id, request.path)
            return
        if not self._connected():
            self._answer_alone(request_id, request)
            return
        self._send_call(request_id, request, cancel)

    def _answer_alone(self, request_id: int, request: Request) -> None:
        # No group answers: settings wait for the next one, everything else fails.
        if isinstance(request, (*SETTINGS, CloseSession)):
            self._emit(Finished(request_id, "done"))
        elif self._lost is not None:
            self._emit(Failed(request_id, self._lost, GroupLost.__name__))
        else:
            self._emit(Failed(request_id, NO_MODEL, EngineError.__name__))

    def _send_call(self, request_id: int, request: Request, cancel: threading.Event) -> None:
        with self._lock:
            self._pending[request_id] = _Request(isinstance(request, CANCELLABLE), cancel)
        try:
            sent = self._send(("call", request_id, request))
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            self._end(request_id, Failed(request_id, f"This request cannot be sent to the "
                                         f"pipeline ({error}).", EngineError.__name__))
            return
        if not sent:
            return  # the group is going: its loss ends this request
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.sent = True
                self._wake.notify_all()

    def _send(self, message: tuple[Any, ...]) -> bool:
        link = self._run
        return link is not None and link.send(message)

    def _connected(self) -> bool:
        link = self._run
        return link is not None and link.connected

    def _read(self, name: str, *args: Any) -> Any:
        read = _Read()
        call_id = next(self._reads)
        with self._lock:
            if not self._connected():
                raise GroupLost(self._lost) if self._lost else EngineError(NO_MODEL)
            self._waiting[call_id] = read
        try:
            if not self._send(("read", call_id, name, args)):
                raise GroupLost(self._lost or "The pipeline's connection was lost.")
            if not read.done.wait(READ_TIMEOUT):
                raise EngineError(f"The pipeline's rank 0 did not answer within "
                                  f"{READ_TIMEOUT:.0f} s.")
        finally:
            with self._lock:
                self._waiting.pop(call_id, None)
        if read.ok:
            return read.value
        kind, message = read.value
        error_class = getattr(errors, kind, None)
        if not (isinstance(error_class, type) and issubclass(error_class, EngineError)):
            error_class = GroupLost if kind == GroupLost.__name__ else EngineError
        raise error_class(message)

    def _emit(self, event: Event) -> None:
        self._events.put(event)

    def _deliver_events(self) -> None:
        while True:
            event = self._events.get()
            if event is None:
                break
            try:
                self._on_event(event)
            except Exception:
                log.exception("on_event raised on %r; the engine carries on",
                              type(event).__name__)

    def _end(self, request_id: int, event: Ending) -> None:
        """Emit a request's ending, unless it has had one."""
        with self._lock:
            if self._pending.pop(request_id, None) is None:
                return
            self._emit(event)

    # -- the group -----------------------------------------------------------

    def _start(self, request_id: int, path: str) -> None:
        previous = self._run
        if previous is not None:
            self._stop_run(previous, STOP_TIMEOUT)
        self._lost = None
        with self._lock:
            self._pending[request_id] = _Request(False, threading.Event())
            self._streams = StreamCounts(limit=self._streams.limit)  # the new rank 0 says
        try:
            _check_splittable(path)
            argv = ["--model", str(path), "--chunk", str(self._chunk_size),
                    "--kv-store", self._kv_store]
            if self._budget_bytes is not None:
                argv += ["--budget", str(self._budget_bytes)]
            if self._split is not None:
                argv += ["--split", ",".join(map(str, self._split))]
            if self._stream_limit is not None:
                argv += ["--streams", str(self._stream_limit)]
            if self._read_share != DEFAULT_READ_SHARE:
                argv += ["--read-share", repr(self._read_share)]
            link = Link(argv, self._ranks, self._hostfile, self._on_message, self._lose,
                        lambda text: self._emit(Notice(request_id, text)))
        except EngineError as error:
            self._end(request_id, Failed(request_id, str(error), type(error).__name__))
            return
        with self._lock:  # before the watcher can report its loss
            self._run = link
        link.start()
        if not link.connect():
            return  # the watcher reports why the group ended
        for setting in self._settings.values():
            if not isinstance(setting, Configure):  # rank 0 started with the budget and chunk
                self._send(("call", 0, setting))
        self._send(("call", request_id, LoadModel(path)))
        with self._lock:
            request = self._pending.get(request_id)
            if request is not None:
                request.sent = True

    def _on_message(self, message: tuple[Any, ...]) -> None:
        if message[0] == "event":
            self._deliver(message[1])
        elif message[0] == "streams":
            with self._lock:
                self._streams = message[1]
        elif message[0] == "reply":
            _, call_id, ok, value = message
            with self._lock:
                read = self._waiting.get(call_id)
            if read is not None:
                read.ok, read.value = ok, value
                read.done.set()

    def _deliver(self, event: Event) -> None:
        if isinstance(event, StatsSample):
            self._last_stats = event
        request_id = request_id_of(event)
        if request_id is None:
            self._emit(event)
        elif isinstance(event, Failed) and _link_failure(event):
            # Rank 0's collective saw its peer go before the watcher did: the
            # watcher's Failed names the machine, so this one waits for it.
            timer = threading.Timer(DROP_GRACE, self._end, (request_id, event))
            timer.daemon = True
            timer.start()
        elif isinstance(event, Finished | Failed):
            self._end(request_id, event)
        else:
            with self._lock:
                if request_id in self._pending:  # a lost request has had its Failed
                    self._emit(event)

    def _lose(self, link: Link, message: str) -> None:
        with self._lock:
            if self._run is not link:
                return
            self._lost = message
            for request_id in sorted(self._pending):
                self._emit(Failed(request_id, message, GroupLost.__name__))
            self._pending.clear()
            self._emit(PipelineLost(message))
            reads = list(self._waiting.values())
        for read in reads:
            read.ok, read.value = False, (GroupLost.__name__, message)
            read.done.set()

    def _stop_run(self, link: Link, timeout: float) -> None:
        """Stop ``link``'s group; what rank 0 did not end ends cancelled."""
        link.stop(timeout)
        with self._lock:
            if self._run is link:
                self._run = None
            for request_id in sorted(self._pending):  # rank 0 stopped before ending them
                self._emit(Finished(request_id, "cancelled"))
            self._pending.clear()

    def _watch_cancels(self) -> None:
        # An Event cannot be waited on together with others: look at the in-flight
        # requests' every CANCEL_POLL while any can be cancelled.
        with self._lock:
            while not self._stopping.is_set():
                due = [request_id for request_id, request in self._pending.items()
                       if request.cancellable and request.sent
                       and not request.cancel_sent and request.cancel.is_set()]
                for request_id in due:
                    self._pending[request_id].cancel_sent = True
                watching = any(request.cancellable and not request.cancel_sent
                               for request in self._pending.values())
                if due:
                    self._lock.release()
                    try:
                        for request_id in due:
                            self._send(("cancel", request_id))
                    finally:
                        self._lock.acquire()
                    continue
                self._wake.wait(CANCEL_POLL if watching else None)


def _link_failure(event: Failed) -> bool:
    """Whether rank 0's request failed in one of MLX's distributed backends (a peer lost)."""
    return any(tag in event.message for tag in LINK_ERROR_TAGS)


def _check_splittable(path: str) -> None:
    """Refuse, before any process starts, a folder that is no model or cannot be split."""
    from engine.models.split import split_refusal

    refusal = split_refusal(path)
    if refusal is not None:
        raise ModelLoadError(refusal)
