"""The engine worker: one dedicated thread that owns every MLX call.

MLX streams are thread-local, so the engine never hops threads: commands go into
a queue, one thread named "longleaf-engine" runs them in order, and events (frozen
dataclasses of plain values) come out through ``on_event``, called on that
thread (or, for stats repeated while one MLX step runs long, on the
``engine.runtime.heartbeat`` thread). Every request ends with exactly one ``Finished``
or ``Failed``.

The worker owns the thread, the queue and how a request ends; what a request
does is its collaborators': ``HeldSessions`` (the loaded model and its open
sessions), ``SessionRequests`` (chat, ingest, quality check) and
``StatsReporter`` (the stats samples).
"""

from __future__ import annotations

import copy
import itertools
import logging
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine import disk
from engine.cache.modes import DEFAULT_MODE, KvMode
from engine.errors import EngineError, EngineStopped
from engine.events import (
    AnswerWaiting,
    Event,
    Failed,
    Finished,
    ModelLoaded,
    QualityChecked,
    SessionOpened,
    StatsSample,
    WaitEnded,
)
from engine.memory import fit
from engine.memory.guard import MemoryGuard
from engine.runtime.answering import DEFAULT_STREAMS, Answering, StreamCounts, shares_passes
from engine.runtime.commands import (
    ALONE,
    CANCELLABLE,
    Chat,
    CheckQuality,
    ClearSnapshots,
    CloseSession,
    Command,
    Configure,
    Ingest,
    LoadModel,
    Message,
    OpenSession,
    Request,
    SetSnapshotBudget,
    ShareChats,
)
from engine.runtime.endings import failed
from engine.runtime.held_sessions import HeldSessions
from engine.runtime.interface import OnEvent, Pipeline, Worker
from engine.runtime.session_requests import SessionRequests
from engine.runtime.stats_reporter import StatsReporter
from engine.session.batch import DEFAULT_READ_SHARE, check_read_share
from engine.session.prompt_ids import TurnOverhead, clean_text, token_ends, turn_overhead
from engine.session.sampling import SamplingParams, reseed_at_random
from engine.session.session import DEFAULT_CHUNK, DEFAULT_PAGE_SIZE, AnswerStart, check_sizes
from engine.snapshots.snapshot_store import SnapshotStore
from engine.snapshots.stored_sessions import StoredSessions

if TYPE_CHECKING:
    from engine.models.info import ModelInfo

log = logging.getLogger(__name__)

THREAD_NAME = "longleaf-engine"
SHUT_DOWN = ("The engine has shut down (Longleaf is quitting, or the server stopping): it "
             "takes no more requests.")
UNEXPECTED = (
    "The engine hit an unexpected error ({detail}). The conversation's cache went back "
    "to its last finished step; send the message again, and if it keeps failing, "
    "reload the model."
)
RETRY = "send the message again"
JOINERS = (Chat, OpenSession)
"""The requests an answer running alone pauses for (a front end opens a chat's
session before it sends the chat)."""


class EngineWorker(Worker):
    """Runs engine commands on one thread and reports them as events.

    Args:
        on_event: called with each event, on the worker thread (stats samples also
            on the heartbeat thread); it must be thread-safe.
        budget_bytes: bytes the KV pages of ALL open sessions may take together,
            or None to be bounded only by free RAM minus the guard's headroom.
        chunk_size: tokens per prefill chunk (chunks end at its multiples, so
            the same conversation is read the same way under any load).
        stats_interval: seconds between ``StatsSample`` events while busy.
        headroom_bytes: RAM to keep free for the system and other apps; None
            keeps max(2 GiB, 15 % of RAM).
        memory_guard: the guard to use (tests inject one with a fake memory
            probe); when given, ``budget_bytes`` and ``headroom_bytes`` are ignored.
        snapshots: where a session's cache goes when it leaves memory (closed,
            model switched, quit) and comes back from on its next request; None
            keeps nothing on disk.
        pipeline: rank 0 of a pipeline (see ``HeldSessions``); None: every layer here.
        streams: answers that may decode together; a chat beyond them waits in
            the queue until one ends. None: chosen from free memory at each model
            load (``engine.memory.fit.default_streams``). One, whatever is
            asked, on a model whose layers cannot share a pass.
        read_share: the share of the time a prompt being read in takes beside
            answers, above 0 and at most 1 (``engine.session.batch.ReadShare``).

    Chats answer together (``engine.runtime.answering``): a chat sent while
    others answer joins them at the next step, and open, close and settings
    requests run between steps. An ingest, a quality check, a model load or a
    new chunk size runs alone: it waits for the answers running to end, and
    the requests behind it wait for it. A chat that starts with nothing else to
    do answers alone, with speculative drafts, until another chat comes; then
    both go on in the batch, plainly.
    """

    def __init__(
        self,
        on_event: OnEvent,
        *,
        budget_bytes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        stats_interval: float = 0.25,
        headroom_bytes: int | None = None,
        memory_guard: MemoryGuard | None = None,
        snapshots: SnapshotStore | None = None,
        pipeline: Pipeline | None = None,
        streams: int | None = None,
        read_share: float = DEFAULT_READ_SHARE,
    ) -> None:
        self._on_event = on_event
        self.guard = memory_guard or MemoryGuard(
            budget_bytes=budget_bytes, headroom_bytes=headroom_bytes
        )
        self.chunk_size = chunk_size
        self._queue: queue.Queue[Command | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._ids = itertools.count(1)
        self._current: Command | None = None
        self._stopping = threading.Event()
        # Set by the engine thread once it is past every MLX request and storing the
        # open sessions on its way out; read by the thread that waits for it to end.
        self._storing = threading.Event()
        # Set once the thread stopped on an error, under the lock every submit
        # holds: a request queued before is ended with the rest, one after refused.
        self._stopped_on: str | None = None  # why, in words
        self._submit_lock = threading.Lock()
        self._stop_taken = False  # the engine thread took the stop sentinel
        self._told: dict[int, str] = {}  # why each chat waiting to start waits, as said
        self._overhead: tuple[weakref.ref, str, TurnOverhead] | None = None
        self._stats = StatsReporter(self._emit, stats_interval,
                                    after_publish=self._publish_fit)
        self._stored = StoredSessions(
            snapshots, self._emit, mirror=lambda names: self._held.prune_followers(names),
            loaded_digest=lambda: self._held.loaded_digest())
        self._held = HeldSessions(
            self.guard, self._stored, self._stats, self._emit,
            pipeline=pipeline,
        )
        self._requests = SessionRequests(self._held, self._stats, self.guard, self._emit,
                                         self._while_reading)
        self._streams = streams
        self._answering = Answering(
            self._stats, self._emit, self._publish_fit, _unexpected_ending,
            limit=DEFAULT_STREAMS if streams is None else streams, room=self._held,
            ranks_heard=lambda: self._held.refresh_unopened(self.chunk_size),
            read_share=read_share)
        # Requests taken from the queue that wait for the batch: for their session's
        # answer to end, for room among the answers, or (one that runs alone) for
        # every answer to end.
        self._pending: list[Command] = []
        self._joiners_queued = 0  # JOINERS in the queue
        self._joiners_lock = threading.Lock()

    # -- public API (any thread) ---------------------------------------------

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def load_model(self, path: str) -> int:
        """Load "demo" or a model folder.

        -> ``ModelLoaded`` then ``Finished("done")``, or ``Failed``.

        Loading a model closes the sessions of the previous one. A model whose
        weights would not fit in free RAM (after the guard's headroom) fails with
        ``InsufficientMemory`` naming the numbers, before anything is loaded.
        """
        return self.submit(LoadModel(path))

    def open_session(
        self, session_id: str, mode: KvMode, page_size: int = DEFAULT_PAGE_SIZE,
        rotate: bool | None = None,
    ) -> int:
        """Open (or replace) a session with a fixed KV mode.

        ``rotate`` stores q8/q6/q4 rows after a Hadamard rotation (None: the mode's
        default, ``engine.cache.adapter.rotates_by_default``).

        -> ``SessionOpened`` then ``Finished("done")``, or ``Failed``.
        """
        return self.submit(OpenSession(session_id, mode, page_size, rotate))

    def chat(
        self,
        session_id: str,
        messages: list[Message],
        sampling: SamplingParams,
        cancel: threading.Event,
        tools: list[dict[str, Any]] | None = None,
        template: bool = True,
    ) -> int:
        """Answer the conversation's last user turn, streaming ``TokenChunk`` events.

        ``tools`` (OpenAI-style function definitions, plain JSON values) go to
        the chat template; messages may carry ``tool_calls`` and "tool" turns.
        ``template=False`` continues the contents as plain text instead (a text
        completion), without the chat template.

        Ends with ``Finished`` ("stop", "length", "cancelled", or "memory" when
        system memory turned critical or free RAM ran out mid-answer; the partial
        answer stays in the cache) or ``Failed`` (e.g. ``ContextTooLong``, or
        ``MemoryPressure`` when memory was critical before the answer began).
        """
        return self.submit(Chat(session_id, copy_messages(messages), sampling, copy.deepcopy(tools),
                                template), cancel)

    def ingest(
        self, session_id: str, messages: list[Message], cancel: threading.Event
    ) -> int:
        """Prefill the conversation without answering (e.g. a dropped document)."""
        return self.submit(Ingest(session_id, copy_messages(messages)), cancel)

    def check_quality(
        self, session_id: str, messages: list[Message], cancel: threading.Event
    ) -> int:
        """Measure the session's KV mode against fp16 on the conversation's last tokens.

        Reads the last ``engine.session.quality_check.WINDOW_TOKENS`` tokens as one window
        through two fresh caches (the session's own is untouched), with
        ``QualityProgress`` after every chunk.

        -> ``QualityChecked`` then ``Finished("done")``, ``Finished("cancelled")``,
        or ``Failed``.
        """
        return self.submit(CheckQuality(session_id, copy_messages(messages)), cancel)

    def configure(self, *, budget_bytes: int | None, chunk_size: int,
                  read_share: float) -> int:
        """Change the KV budget of all sessions, the prefill chunk and the reads'
        share of the time beside answers (``read_share``), between requests.

        -> ``Finished("done")``, or ``Failed`` for a negative budget, a chunk
        under one token or a share not above 0 and at most 1. Pages already held
        stay; the new budget limits the pages taken from now on.
        """
        return self.submit(Configure(budget_bytes, chunk_size, read_share))

    def set_snapshot_budget(self, budget_bytes: int | None) -> int:
        """Set the stored-KV disk budget (None: the smaller of 20 GB and 10% of free disk).

        -> ``StoredKv`` (after evicting least-recently-used snapshots down to a
        lower budget), then ``Finished("done")``; ``Failed`` for a negative budget.
        """
        return self.submit(SetSnapshotBudget(budget_bytes))

    def clear_snapshots(self, session_id: str | None = None) -> int:
        """Delete one chat's stored KV (None: all of it); -> ``StoredKv``, ``Finished``.

        Runs between requests on the worker thread, so it never races a save.
        """
        return self.submit(ClearSnapshots(session_id))

    def share_chats_with_api(self, share: bool) -> int:
        """Let API sessions (``api-…``) and the app's chats reuse each other's KV, in
        memory and on disk (``share``), or keep them apart (the default); between
        requests. -> ``Finished("done")``.
        """
        return self.submit(ShareChats(bool(share)))

    def close_session(self, session_id: str, store: bool = True) -> int:
        """Free a session's pages; -> ``Finished("done")`` (also for unknown ids).

        ``store``: store its KV on disk first, to reopen it later (False: the chat is deleted).
        An answer or read running in that session is cancelled first, so the close
        does not wait for it to finish; it ends ``Finished("cancelled")`` with what
        it had produced kept in the cache (and so in the stored KV).
        """
        return self.submit(CloseSession(session_id, store))

    def streams(self) -> StreamCounts:
        """The answers running together now; never calls MLX."""
        return self._answering.counts()

    def latest_stats(self) -> StatsSample | None:
        """The last snapshot taken; never calls MLX."""
        return self._stats.latest()

    def fit_check(self, session_id: str | None, token_count: int,
                  page_size: int | None = None) -> fit.FitReport:
        """Whether ``token_count`` tokens fit, per mode; pure arithmetic.

        ``page_size``: the pages a chat not opened yet will have (None: the
        engine's default); an open session's are its own.

        Raises:
            EngineError: no model is loaded, the session is unknown, or the page
                size is under one token.
        """
        # Frozen values the worker published, and a fresh reading of system memory:
        # nothing here touches a live session or pool.
        inputs = self._held.fit_inputs(session_id)
        if session_id is None and page_size is not None:
            check_sizes(page_size, 1)
            inputs = fit.with_page_size(inputs, page_size)
        return fit.guarded_fit_report(inputs, self.guard.read(), token_count)

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` encodes to with the loaded model's tokenizer.

        Raises:
            EngineError: no model is loaded.
        """
        loaded = self._held.loaded
        if loaded is None:
            raise EngineError("Load a model first.")
        return len(loaded.tokenizer.encode(clean_text(text), add_special_tokens=False))

    def turn_overhead(self, system_prompt: str = "") -> TurnOverhead:
        """Tokens the loaded model's chat template adds to a user message's text.

        Computed once per model and system prompt (a tiny conversation rendered
        three times; the tokenizer only, no MLX), so a count per keystroke is
        the text's tokens plus these, whatever the conversation's length.

        Raises:
            EngineError: no model is loaded.
        """
        loaded = self._held.loaded
        if loaded is None:
            raise EngineError("Load a model first.")
        # One model and system prompt at a time; a weak reference, so an unloaded
        # model is neither kept alive nor mistaken for the next one.
        held = self._overhead
        if held is not None and held[0]() is loaded and held[1] == system_prompt:
            return held[2]
        overhead = turn_overhead(loaded.tokenizer, system_prompt)
        self._overhead = (weakref.ref(loaded), system_prompt, overhead)
        return overhead

    def token_ends(self, text: str) -> list[int]:
        """Where each of ``text``'s tokens ends, in characters, from one tokenization
        with the loaded model's tokenizer (``len`` of it is the token count).

        Raises:
            EngineError: no model is loaded.
        """
        loaded = self._held.loaded
        if loaded is None:
            raise EngineError("Load a model first.")
        return token_ends(loaded.tokenizer, text)

    @property
    def alive(self) -> bool:
        """True from ``start`` until the worker thread has ended."""
        return self._thread.is_alive()

    @property
    def storing_at_exit(self) -> bool:
        """True from when the stopping thread begins storing its open sessions' KV
        until it has ended (any thread)."""
        return self._storing.is_set() and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for the thread to end; True once it has."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Cancel running and queued work and join the thread."""
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel.set()
        self._answering.cancel_in(None)
        self._queue.put(None)
        if not self.join(timeout):
            log.warning("engine thread did not stop within %.1f s", timeout)

    # -- worker thread ---------------------------------------------------------

    def submit(self, request: Request, cancel: threading.Event | None = None) -> int:
        """Queue ``request`` (setting ``cancel`` stops one of ``CANCELLABLE``); its id.

        What the public methods above do, for a caller holding the request as a
        value (a pipeline's rank 0 runs its front end's requests this way). A
        ``CloseSession`` first cancels the request running in that session; those
        waiting in it ahead of the close end cancelled too.
        """
        if isinstance(request, CloseSession):
            self._cancel_running_in(request.session_id)
        with self._submit_lock:
            if self._stopped_on is not None:
                raise EngineStopped(self._stopped_on)
            request_id = next(self._ids)
            command = Command(request_id, request, cancel or threading.Event())
            if self._stopping.is_set():
                command.cancel.set()
            if isinstance(request, JOINERS):
                with self._joiners_lock:
                    self._joiners_queued += 1
            self._queue.put(command)
        return request_id

    def _cancel_running_in(self, session_id: str) -> None:
        # A close must not wait for the answer or read running in its session.
        current = self._current
        if (current is not None and isinstance(current.request, CANCELLABLE)
                and current.request.session_id == session_id):
            current.cancel.set()
        self._answering.cancel_in(session_id)

    def _runs_alone(self, request: Request) -> bool:
        """Whether ``request`` waits for the answers running to end, then runs alone."""
        if isinstance(request, Configure):
            # A read under way keeps its chunks: only a new size waits for it.
            return request.chunk_size != self.chunk_size
        if isinstance(request, ALONE):
            return True
        if not isinstance(request, Chat):
            return False
        try:
            session = self._held.get(request.session_id)
        except EngineError:
            return False  # it fails when it runs, saying so
        return not self._answering.can_take(session)

    def _another_comes(self) -> bool:
        """Whether another chat (or the open before one) waits, queued or taken: an
        answer running alone pauses for it, to go on beside it in the batch (when
        the batch may hold two)."""
        if self._answering.limit < 2:
            return False
        return self._joiners_queued > 0 or any(isinstance(command.request, JOINERS)
                                               for command in self._pending)

    def _emit(self, event: Event) -> None:
        try:
            self._on_event(event)
        except Exception:
            log.exception("on_event raised on %r; the engine carries on", type(event).__name__)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:  # a bug past every request's own handling
            log.exception("the engine thread stopped")
            with self._submit_lock:
                self._stopped_on = (
                    f"The engine stopped on an unexpected error ({type(error).__name__}: "
                    f"{error}); quit Longleaf and open it again (or restart the server).")
            # In those words: "send it again" would only meet the stopped thread.
            self._fail_outstanding(EngineStopped(self._stopped_on))
        finally:
            # MLX does not clean a thread's streams up by itself; without this the
            # process aborts at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _fail_outstanding(self, error: Exception) -> None:
        """End every request still answering, waiting or queued with ``error``: no
        one waits for an ending from a thread that has stopped."""
        self._answering.fail_all(error)
        for command in [*self._pending, *self._drain()]:
            self._emit(_unexpected_ending(command, error))
        self._pending.clear()

    def _serve(self) -> None:
        while not self._stop_taken:
            # Between the batch's steps only what has come in; idle, wait for it.
            self._gather(block=not self._answering.busy and not self._pending)
            self._start_pending()
            if self._answering.busy:
                self._answering.step()
        # The answers running, and requests waiting or queued behind the sentinel,
        # still get their one ending.
        self._answering.cancel_in(None)
        while self._answering.busy:
            self._answering.step()
        with self._submit_lock:  # whatever comes from now on is refused at once
            self._stopped_on = SHUT_DOWN
            left = [*self._pending, *self._drain()]
            self._pending.clear()  # ended here, never again by a fault after this
        for command in left:
            self._emit(Finished(command.request_id, "cancelled"))
        self._answering.close()
        self._storing.set()
        self._held.release()
        self._held.stop_followers()

    def _gather(self, *, block: bool) -> None:
        """Move the commands that came in to the pending ones (waiting for the first
        when ``block``), up to the stop sentinel."""
        if self._stop_taken:
            return
        for command in self._take(block=block):
            if command is None:
                self._stop_taken = True
                return
            if isinstance(command.request, CloseSession):
                self._cancel_waiting_in(command.request.session_id)
            self._pending.append(command)

    def _cancel_waiting_in(self, session_id: str) -> None:
        """Stop the requests waiting in ``session_id`` ahead of its close: they would
        run on a session about to go (on the old model, in a model switch)."""
        for command in self._pending:
            request = command.request
            if isinstance(request, CANCELLABLE) and request.session_id == session_id:
                command.cancel.set()

    def _end_cancelled_waiting(self) -> None:
        """End now the requests cancelled while they wait, wherever they wait."""
        for command in [c for c in self._pending
                        if c.cancel.is_set() and isinstance(c.request, CANCELLABLE)]:
            self._pending.remove(command)
            self._told.pop(command.request_id, None)
            self._emit(Finished(command.request_id, "cancelled"))

    def _tell_held(self, commands: list[Command], reason: str) -> None:
        """Say why the chats among ``commands`` wait before they start (once per
        reason): their chats would otherwise seem to be reading."""
        for command in commands:
            if isinstance(command.request, Chat) and self._told.get(command.request_id) != reason:
                self._told[command.request_id] = reason
                self._emit(AnswerWaiting(command.request_id, reason, 0))

    def _while_alone(self) -> bool:
        """Between two steps of an answer running alone: the requests cancelled
        while they wait end (a server's places come free then, not when this
        answer ends); whether another chat comes, for the answer to pause and go
        on beside it in the batch."""
        self._gather(block=False)
        self._end_cancelled_waiting()
        if self._answering.limit < 2:
            self._tell_held(self._pending, _waits_for_a_place(self._answering.limit))
        return self._another_comes()

    def _while_reading(self) -> None:
        """Between two chunks of a document read or a quality check: the requests
        cancelled while they wait behind it end now, not when it ends."""
        self._gather(block=False)
        self._end_cancelled_waiting()

    def _while_alone_for_good(self) -> bool:
        """:meth:`_while_alone` for an answer that cannot join a batch: it never pauses."""
        self._gather(block=False)
        self._end_cancelled_waiting()
        self._tell_held(self._pending, ONE_AT_A_TIME)
        return False

    def _drain(self) -> list[Command]:
        """Every command queued, past any stop sentinels."""
        left: list[Command] = []
        while taken := self._take(block=False):
            left.extend(c for c in taken if c is not None)
        return left

    def _take(self, *, block: bool) -> list[Command | None]:
        """The commands in the queue (waiting for the first when ``block``)."""
        taken: list[Command | None] = []
        try:
            if block:
                taken.append(self._queue.get())
            while taken[-1:] != [None]:
                taken.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        joiners = sum(1 for c in taken if c is not None and isinstance(c.request, JOINERS))
        if joiners:
            with self._joiners_lock:
                self._joiners_queued -= joiners
        return taken

    def _start_pending(self) -> None:
        """Run, in order, the pending requests that need not wait for the batch.

        A request waits while its session answers in the batch, a chat while
        the batch is full (and the chats after it, in turn: places go in order),
        and a request that runs alone, with everything behind it, while anything
        answers. A chat waiting for its own session takes no place from the
        chats after it.
        """
        self._end_cancelled_waiting()
        blocked = self._answering.session_ids()
        chats_wait = False
        for command in list(self._pending):
            if command not in self._pending:  # ended while one before it ran alone
                continue
            request = command.request
            session_id = getattr(request, "session_id", None)
            if self._answering.busy and self._runs_alone(request):
                self._tell_held([command], ALONE_CHAT)
                behind = self._pending[self._pending.index(command) + 1:]
                self._tell_held(behind, _waits_for_answers(request))
                return
            no_place = isinstance(request, Chat) and (chats_wait or self._answering.full)
            if session_id in blocked or no_place:
                chats_wait = chats_wait or no_place
                if session_id is not None:
                    blocked.add(session_id)
                if no_place:
                    self._tell_held([command], _waits_for_a_place(self._answering.limit))
                continue
            self._pending.remove(command)
            if self._told.pop(command.request_id, None) is not None:
                self._emit(WaitEnded(command.request_id))
            self._current = command
            if self._stopping.is_set():
                command.cancel.set()
            self._execute(command)
            self._current = None
            blocked = self._answering.session_ids()

    def _execute(self, command: Command) -> None:
        try:
            if command.cancel.is_set() and isinstance(command.request, CANCELLABLE):
                ending: Event = Finished(command.request_id, "cancelled")
            else:
                result = self._dispatch(command)
                if result is None:  # it answers in the batch, which ends it
                    self._publish_fit()
                    return
                ending = result
                if isinstance(ending, ModelLoaded | SessionOpened | QualityChecked):
                    # Announce the result, then end the request like every other.
                    self._publish_fit()
                    self._emit(ending)
                    ending = Finished(command.request_id, "done")
            if isinstance(ending, Finished):
                # Only after a request that ended well: after a failure a pipeline's
                # group may be gone. A failing refresh fails the request like any step.
                self._held.refresh_unopened(self.chunk_size)
        except EngineError as error:
            ending = failed(command.request_id, error)
        except Exception as error:
            ending = _unexpected_ending(command, error)
        # Before the end is announced, so a fit check it prompts sees what it changed;
        # announced even when that fails (the thread then stops on the bug).
        try:
            self._publish_fit()
        finally:
            self._emit(ending)

    # -- handlers ------------------------------------------------------------

    def _publish_fit(self) -> None:
        self._held.publish_fit(self.chunk_size)

    def _dispatch(self, command: Command) -> Event | None:
        """Run ``command``'s request; the event that ends it (or announces its
        result), or None for a chat the batch goes on with."""
        request_id, request, cancel = command.request_id, command.request, command.cancel
        match request:
            case Chat():
                return self._chat(command, request)
            case Ingest():
                return self._requests.ingest(request_id, request, cancel)
            case CheckQuality():
                return self._requests.check_quality(request_id, request, cancel)
            case LoadModel():
                # The idle batch holds the model: let go of it before the load, which
                # may unload the model first so as never to hold two.
                self._answering.close()
                info = self._held.load(request.path)
                self._answering.limit = self._stream_limit(info)
                return ModelLoaded(request_id, info)
            case OpenSession():
                return self._open_session(request_id, request)
            case _:
                self._change(request)
                return Finished(request_id, "done")

    def _chat(self, command: Command, request: Chat) -> Finished | None:
        """Answer alone while nothing else answers or waits (speculative drafts
        work alone); join the batch otherwise, or once another chat comes."""
        start = self._requests.prepare_chat(command.request_id, request,
                                            keep=self._answering.session_ids())
        answering = self._answering
        if not answering.can_take(start.session):
            alone = self._requests.chat(command.request_id, request, command.cancel, start,
                                        pause=self._while_alone_for_good,
                                        phase=answering.alone)
            assert isinstance(alone, Finished)  # it never pauses
            return alone
        if answering.busy or self._another_comes():
            answering.join(command, request, *start)
            return None
        alone = self._requests.chat(command.request_id, request, command.cancel, start,
                                    pause=self._while_alone, phase=answering.alone)
        if isinstance(alone, Finished):
            return alone
        if isinstance(alone, AnswerStart):
            answering.adopt(command, start.session, alone, start.reused)
        else:
            answering.adopt_read(command, start.session, alone, start.prompt,
                                  request.sampling.max_tokens, start.reused)
        return None

    def _stream_limit(self, info: ModelInfo) -> int:
        """Answers that may run together on the model just loaded: one where its
        layers cannot share a pass (a server counts its queue beyond these)."""
        try:
            alone = not shares_passes([self._held.new_cache()])
        except EngineError:
            alone = False  # no chat opens on it: the open says why
        if alone:
            return 1
        return self._default_streams(info) if self._streams is None else self._streams

    def _default_streams(self, info: ModelInfo) -> int:
        """The stream limit free memory allows beside the model just loaded."""
        prefill = self._held.prefill
        per_token = info.kv_bytes_per_token.get(DEFAULT_MODE, 0)
        if prefill is None or not per_token:
            return DEFAULT_STREAMS
        return fit.default_streams(per_token, prefill, self.guard.free_bytes())

    def _change(self, request: Request) -> None:
        """Run a request that changes a setting or what the engine holds."""
        match request:
            case Configure():
                self._configure(request)
            case SetSnapshotBudget():
                self._stored.set_budget(request.budget_bytes)
            case ClearSnapshots():
                self._stored.clear(request.session_id)
            case ShareChats():
                self._held.share_chats = request.share
            case CloseSession():
                self._held.close(request.session_id, request.store)
            case _:
                raise EngineError(f"Unknown engine request {type(request).__name__}.")

    def _open_session(self, request_id: int, request: OpenSession) -> SessionOpened:
        session = self._held.open(request.session_id, request.mode, request.page_size,
                                  request.rotate, chunk_size=self.chunk_size)
        if session.followers is not None and not session.followers.batches:
            # The other ranks' layers of this model cannot share a pass (known once
            # they hold a session): every answer runs alone, as on a model whose
            # own layers cannot (a server counts its queue beyond this).
            self._answering.limit = 1
        return SessionOpened(request_id, request.session_id, session.mode, request.page_size,
                             session.cache_kind, session.cache_note, session.rotation)

    def _configure(self, request: Configure) -> None:
        check_settings(request)
        self.guard.budget_bytes = request.budget_bytes
        self.chunk_size = request.chunk_size
        self._held.set_chunk_size(request.chunk_size)
        self._answering.set_read_share(request.read_share)


ONE_AT_A_TIME = ("Waiting for the answer running now to end: this model answers one chat "
                 "at a time here.")
ALONE_CHAT = ("Waiting for the answers running now to end: this chat's model cannot share "
              "their steps here, so it answers alone.")


def _waits_for_a_place(limit: int) -> str:
    """Why a chat waits while the most answers run together."""
    answers = "answer runs" if limit == 1 else "answers run"
    return (f"Waiting for a place: {limit} {answers} at once here; this one starts when "
            "one of them ends.")


def _waits_for_answers(request: Request) -> str:
    """Why a chat waits behind ``request``, which runs once the answers running end."""
    match request:
        case Configure():
            first = "a new reading chunk size applies first"
        case LoadModel():
            first = "a model loads first"
        case Ingest():
            first = "a document is read in first"
        case CheckQuality():
            first = "a quality check runs first"
        case _:
            first = "an answer that cannot share the others' steps runs first"
    return f"Waiting for the answers running now to end: {first}."


def _unexpected_ending(command: Command, error: Exception) -> Failed:
    """How a request that raised ends: an ``EngineError`` in its own words.

    A disk that filled up or turned read-only is said as such, in one log line;
    anything else is a bug, logged with its traceback.
    """
    if isinstance(error, EngineError):
        return failed(command.request_id, error)
    # A raise inside one of mlx-lm's compiled samplers leaves MLX's random state,
    # which every answer draws from, an array with nothing behind it: each later
    # sampled answer would fail on it. A fresh seed replaces it.
    reseed_at_random()
    fault = disk.fault_of(error, retry=RETRY)
    if fault is not None:
        log.warning("engine request %s failed: %s", command.name, fault)
        return Failed(command.request_id, str(fault), type(fault).__name__)
    log.exception("engine request %s failed", command.name)
    detail = f"{type(error).__name__}: {error}"
    return Failed(command.request_id, UNEXPECTED.format(detail=detail), type(error).__name__)


def check_settings(settings: Configure) -> None:
    """Refuse settings ``configure`` cannot take.

    Raises:
        EngineError: a negative budget, a chunk under one token, or a reads' share
            not above 0 and at most 1.
    """
    if settings.budget_bytes is not None and settings.budget_bytes < 0:
        raise EngineError("The KV memory budget cannot be negative.")
    if settings.chunk_size < 1:
        raise EngineError("The ingest chunk must be at least 1 token.")
    check_read_share(settings.read_share)


# The keys of a message that templates read beside role and content: a tool turn's,
# and an assistant turn's thought (Qwen3's templates render it within a tool loop).
TEMPLATE_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def copy_messages(messages: list[Message]) -> list[Message]:
    """The keys of ``messages`` a template reads, copied: the caller's list may
    change while the request waits in the queue (the extra keys are plain JSON
    values). A key left out here would make the engine read another prompt than
    the server rendered."""
    return [{"role": m["role"], "content": m["content"],
             **copy.deepcopy({key: m[key] for key in TEMPLATE_KEYS if key in m})}
            for m in messages]
