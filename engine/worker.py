"""The engine worker: one dedicated thread that owns every MLX call.

MLX streams are thread-local, so the engine never hops threads: commands go into
a queue, one thread named "longleaf-engine" runs them in order, and events (frozen
dataclasses of plain values) come out through ``on_event``, called on that
thread (or, for stats repeated while one MLX step runs long, on the
``engine.heartbeat`` thread). Every request ends with exactly one ``Finished``
or ``Failed``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from engine import fit, reuse
from engine.cache import kvquant, sharing
from engine.errors import Cancelled, EngineError
from engine.events import (
    Failed,
    Finished,
    ModelLoaded,
    Notice,
    QualityChecked,
    QualityProgress,
    SessionOpened,
    StatsSample,
)
from engine.fit import facts_from_info
from engine.heartbeat import StatsChannel, StatsHeartbeat
from engine.memory_guard import MemoryGuard
from engine.prefill import MIN_CHUNK, activation_value_bytes
from engine.prompt_ids import clean_text
from engine.sampling import SamplingParams
from engine.session import DEFAULT_CHUNK, DEFAULT_PAGE_SIZE, Session
from engine.snapshots.keeper import SnapshotKeeper
from engine.snapshots.store import SnapshotStore
from engine.stats import StatsThrottle, stats_sample

log = logging.getLogger(__name__)

THREAD_NAME = "longleaf-engine"
UNEXPECTED = (
    "The engine hit an unexpected error ({detail}). The conversation's cache went back "
    "to its last finished step; send the message again, and if it keeps failing, "
    "reload the model."
)
# A request whose cancel was set while it waited in the queue ends before it starts.
_CANCELLABLE = ("chat", "ingest", "check_quality")


@dataclass
class _Command:
    request_id: int
    name: str
    args: tuple[Any, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
    # (kept, total) tokens when the request's prefill stopped short, for its ending.
    prefill_stop: tuple[int, int] | None = None


class EngineWorker:
    """Runs engine commands on one thread and reports them as events.

    Args:
        on_event: called with each event, on the worker thread (stats samples also
            on the heartbeat thread); it must be thread-safe.
        budget_bytes: bytes the KV pages of ALL open sessions may take together,
            or None to be bounded only by free RAM minus the guard's headroom.
        chunk_size: tokens per prefill chunk.
        stats_interval: seconds between ``StatsSample`` events while busy.
        adaptive_chunks: shrink prefill chunks that take longer than two stats
            intervals, so stats and progress arrive at >= 2 Hz on slow machines
            too; False keeps chunk boundaries fixed (reproducible prefill).
        headroom_bytes: RAM to keep free for the system and other apps; None
            keeps max(2 GiB, 15 % of RAM).
        memory_guard: the guard to use (tests inject one with a fake memory
            probe); when given, ``budget_bytes`` and ``headroom_bytes`` are ignored.
        snapshots: where a session's cache goes when it leaves memory (closed,
            model switched, quit) and comes back from on its next request; None
            keeps nothing on disk.
    """

    def __init__(
        self,
        on_event: Callable[[object], None],
        *,
        budget_bytes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        stats_interval: float = 0.25,
        adaptive_chunks: bool = True,
        headroom_bytes: int | None = None,
        memory_guard: MemoryGuard | None = None,
        snapshots: SnapshotStore | None = None,
    ) -> None:
        self._on_event = on_event
        self.guard = memory_guard or MemoryGuard(
            budget_bytes=budget_bytes, headroom_bytes=headroom_bytes
        )
        self.chunk_size = chunk_size
        self._queue: queue.Queue[_Command | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._loaded: Any = None
        self._loaded_bytes = 0  # estimated weight bytes of the loaded model
        self._prefill: fit.PrefillFacts | None = None  # the loaded model's prefill needs
        self._sessions: dict[str, Session] = {}
        self._stats = StatsChannel(self._emit)
        self._current: _Command | None = None
        self._stopping = threading.Event()
        self._throttle = StatsThrottle(stats_interval)
        self._chunk_seconds = 2 * stats_interval if adaptive_chunks else None
        self._snapshots = SnapshotKeeper(snapshots, self._emit)

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
        return self._submit("load_model", (path,))

    def open_session(
        self, session_id: str, mode: str, page_size: int = DEFAULT_PAGE_SIZE,
        rotate: bool | None = None,
    ) -> int:
        """Open (or replace) a session with a fixed KV mode.

        ``rotate`` stores q8/q6/q4 rows after a Hadamard rotation (None: the mode's
        default, ``engine.cache.adapter.rotates_by_default``).

        -> ``SessionOpened`` then ``Finished("done")``, or ``Failed``.
        """
        return self._submit("open_session", (session_id, mode, page_size, rotate))

    def chat(
        self,
        session_id: str,
        messages: list[dict[str, str]],
        sampling: SamplingParams,
        cancel: threading.Event,
    ) -> int:
        """Answer the conversation's last user turn, streaming ``TokenChunk`` events.

        Ends with ``Finished`` ("stop", "length", "cancelled", or "memory" when
        system memory turned critical or free RAM ran out mid-answer; the partial
        answer stays in the cache) or ``Failed`` (e.g. ``ContextTooLong``, or
        ``MemoryPressure`` when memory was critical before the answer began).
        """
        return self._submit("chat", (session_id, _copy(messages), sampling), cancel)

    def ingest(
        self, session_id: str, messages: list[dict[str, str]], cancel: threading.Event
    ) -> int:
        """Prefill the conversation without answering (e.g. a dropped document)."""
        return self._submit("ingest", (session_id, _copy(messages)), cancel)

    def check_quality(
        self, session_id: str, messages: list[dict[str, str]], cancel: threading.Event
    ) -> int:
        """Measure the session's KV mode against fp16 on the conversation's last tokens.

        Reads the last ``engine.quality_check.WINDOW_TOKENS`` tokens as one window
        through two fresh caches (the session's own is untouched), with
        ``QualityProgress`` after every chunk.

        -> ``QualityChecked`` then ``Finished("done")``, ``Finished("cancelled")``,
        or ``Failed``.
        """
        return self._submit("check_quality", (session_id, _copy(messages)), cancel)

    def configure(self, *, budget_bytes: int | None, chunk_size: int) -> int:
        """Change the KV budget of all sessions and the prefill chunk, between requests.

        -> ``Finished("done")``, or ``Failed`` for a negative budget or a chunk
        under one token. Pages already held stay; the new budget limits the pages
        taken from now on.
        """
        return self._submit("configure", (budget_bytes, chunk_size))

    def set_snapshot_budget(self, budget_bytes: int | None) -> int:
        """Set the stored-KV disk budget (None: the smaller of 20 GB and 10% of free disk).

        -> ``StoredKv`` (after evicting least-recently-used snapshots down to a
        lower budget), then ``Finished("done")``; ``Failed`` for a negative budget.
        """
        return self._submit("snapshot_budget", (budget_bytes,))

    def clear_snapshots(self, session_id: str | None = None) -> int:
        """Delete one chat's stored KV (None: all of it); -> ``StoredKv``, ``Finished``.

        Runs between requests on the worker thread, so it never races a save.
        """
        return self._submit("clear_snapshots", (session_id,))

    def close_session(self, session_id: str) -> int:
        """Free a session's pages; -> ``Finished("done")`` (also for unknown ids)."""
        return self._submit("close_session", (session_id,))

    def latest_stats(self) -> StatsSample | None:
        """The last snapshot taken; never calls MLX."""
        return self._stats.latest()

    def fit_check(self, session_id: str | None, token_count: int) -> fit.FitReport:
        """Whether ``token_count`` tokens fit, per mode; pure arithmetic.

        Raises:
            EngineError: no model is loaded, or the session is unknown.
        """
        with self._lock:
            loaded = self._loaded
            prefill = self._prefill
            session = self._sessions.get(session_id) if session_id is not None else None
        if loaded is None:
            raise EngineError("Load a model first.")
        if session_id is not None and session is None:
            raise EngineError(f"No open session named {session_id!r}; open it first.")
        if session is not None:
            return session.fit_report(token_count)
        # A chat not opened yet: the model's facts and the default page size.
        facts = facts_from_info(loaded.info)
        return fit.guarded_fit_report(self.guard, facts, token_count, DEFAULT_PAGE_SIZE,
                                      prefill=prefill,
                                      chunk_tokens=min(MIN_CHUNK, self.chunk_size))

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` encodes to with the loaded model's tokenizer.

        Raises:
            EngineError: no model is loaded.
        """
        loaded = self._loaded
        if loaded is None:
            raise EngineError("Load a model first.")
        return len(loaded.tokenizer.encode(clean_text(text), add_special_tokens=False))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Cancel running and queued work and join the thread."""
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.1f s", timeout)

    # -- worker thread ---------------------------------------------------------

    def _submit(
        self, name: str, args: tuple[Any, ...], cancel: threading.Event | None = None
    ) -> int:
        request_id = next(self._ids)
        command = _Command(request_id, name, args, cancel or threading.Event())
        if self._stopping.is_set():
            command.cancel.set()
        self._queue.put(command)
        return request_id

    def _emit(self, event: object) -> None:
        try:
            self._on_event(event)
        except Exception:
            log.exception("on_event raised on %r; the engine carries on", type(event).__name__)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX no longer cleans a thread's streams up by itself; without this the
            # process aborts at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _serve(self) -> None:
        while True:
            command = self._queue.get()
            if command is None:
                break
            self._current = command
            if self._stopping.is_set():
                command.cancel.set()
            self._execute(command)
            self._current = None
        # Requests queued behind the sentinel still get their one ending.
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                break
            if command is not None:
                self._emit(Finished(command.request_id, "cancelled"))
        self._release_model()

    def _execute(self, command: _Command) -> None:
        handler = getattr(self, f"_do_{command.name}")
        try:
            if command.cancel.is_set() and command.name in _CANCELLABLE:
                ending: object = Finished(command.request_id, "cancelled")
            else:
                ending = handler(command)
                if isinstance(ending, ModelLoaded | SessionOpened | QualityChecked):
                    # Announce the result, then end the request like every other.
                    self._emit(ending)
                    ending = Finished(command.request_id, "done")
        except EngineError as error:
            ending = Failed(command.request_id, str(error), type(error).__name__,
                            *_kept(command.prefill_stop))
        except Exception as error:
            log.exception("engine request %s failed", command.name)
            detail = f"{type(error).__name__}: {error}"
            ending = Failed(command.request_id, UNEXPECTED.format(detail=detail),
                            type(error).__name__, *_kept(command.prefill_stop))
        self._emit(ending)

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise EngineError(f"No open session named {session_id!r}; open it first.")
        return session

    def _tick_for(self, session: Session) -> Callable[[], None]:
        def tick() -> None:
            if self._throttle.due():
                self._publish(session)
        return tick

    def _publish(self, session: Session | None) -> None:
        live = session is not None and bool(session.cache)
        cache_stats = session.stats() if live else None
        peak = session.prefill_peak_bytes() if live else 0
        held = session.checkpoints.nbytes if live else 0
        others = session.other_layers() if live else None
        session_id = session.session_id if session else None
        self._stats.publish(lambda: stats_sample(
            session_id, cache_stats, prefill_peak_bytes=peak, checkpoint_bytes=held,
            other_layers=others))

    def _heartbeat(self) -> StatsHeartbeat:
        return StatsHeartbeat(self._stats, self._throttle.interval)

    def _release_model(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._loaded = None
            self._loaded_bytes = 0
            self._prefill = None
        for session in sessions:
            self._snapshots.keep(session)
            session.close()
        mx.clear_cache()

    def _do_load_model(self, command: _Command) -> object:
        # Heavy: imports mlx-lm's loaders.
        from engine.models.loader import estimate_load_bytes, load_model, resolve_model_path

        (path,) = command.args
        folder = resolve_model_path(path)
        needed, quantized = estimate_load_bytes(folder)
        releasable = self._loaded_bytes + self.guard.held_bytes()
        if self.guard.check_load(needed, name=folder.name, releasable_bytes=releasable,
                                 quantized=quantized):
            # Only fits once the current model is gone: unload it first rather
            # than hold both and swap.
            self._release_model()
        loaded = load_model(folder)
        self._release_model()
        prefill = fit.prefill_facts(loaded.model, activation_value_bytes())
        with self._lock:
            self._loaded = loaded
            self._loaded_bytes = needed
            self._prefill = prefill
        return ModelLoaded(command.request_id, loaded.info)

    def _do_open_session(self, command: _Command) -> object:
        session_id, mode, page_size, rotate = command.args
        if self._loaded is None:
            raise EngineError("Load a model before opening a conversation.")
        mode = kvquant.normalize_mode(mode)
        with self._lock:
            replaced = self._sessions.pop(session_id, None)
        if replaced is not None:
            self._snapshots.keep(replaced)
            replaced.close()
        session = Session(
            session_id, self._loaded, mode, page_size,
            chunk_size=self.chunk_size, chunk_seconds=self._chunk_seconds, guard=self.guard,
            rotate=rotate,
        )
        with self._lock:
            self._sessions[session_id] = session
        self._publish(session)
        return SessionOpened(command.request_id, session_id, session.mode, page_size,
                             session.cache_kind, session.cache_note, session.rotation)

    def _do_configure(self, command: _Command) -> object:
        budget_bytes, chunk_size = command.args
        if budget_bytes is not None and budget_bytes < 0:
            raise EngineError("The KV memory budget cannot be negative.")
        if chunk_size < 1:
            raise EngineError("The ingest chunk must be at least 1 token.")
        self.guard.budget_bytes = budget_bytes
        self.chunk_size = chunk_size
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.set_chunk_size(chunk_size)
            self.guard.refresh(session.session_id)
        return Finished(command.request_id, "done")

    def _do_snapshot_budget(self, command: _Command) -> object:
        self._snapshots.set_budget(*command.args)
        return Finished(command.request_id, "done")

    def _do_clear_snapshots(self, command: _Command) -> object:
        self._snapshots.clear(*command.args)
        return Finished(command.request_id, "done")

    def _do_close_session(self, command: _Command) -> object:
        (session_id,) = command.args
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            self._snapshots.keep(session)
            with self._lock:
                partners = [s for s in self._sessions.values()
                            if sharing.same_group(s.cache, session.cache)]
            session.close()
            # Hand the freed pages back to the OS, not just to MLX's buffer cache.
            mx.clear_cache()
            for partner in partners:  # their pages are no longer shared: say so
                self._publish(partner)
        return Finished(command.request_id, "done")

    def _do_chat(self, command: _Command) -> object:
        session_id, messages, sampling = command.args
        session = self._session(session_id)
        reused = self._restore(session, messages, command.request_id, answer=True)
        self._publish(session)
        try:
            with self._heartbeat():
                reason, stats = session.chat(
                    messages, sampling, request_id=command.request_id, cancel=command.cancel,
                    emit=self._emit, tick=self._tick_for(session),
                )
        finally:
            command.prefill_stop = session.prefill_stop
            self._publish(session)
        if session.memory_stop:
            log.warning("answer in %s stopped for memory: %s", session_id, session.memory_stop)
        stats = replace(stats, reused_tokens=reused)
        return Finished(command.request_id, reason, stats, *_kept(session.prefill_stop))

    def _do_ingest(self, command: _Command) -> object:
        session_id, messages = command.args
        session = self._session(session_id)
        reused = self._restore(session, messages, command.request_id, answer=False)
        self._publish(session)
        try:
            with self._heartbeat():
                stats = session.ingest(
                    messages, request_id=command.request_id, cancel=command.cancel,
                    emit=self._emit, tick=self._tick_for(session),
                )
        except Cancelled:
            return Finished(command.request_id, "cancelled", None, *_kept(session.prefill_stop))
        finally:
            command.prefill_stop = session.prefill_stop
            self._publish(session)
        return Finished(command.request_id, "done", replace(stats, reused_tokens=reused))

    def _do_check_quality(self, command: _Command) -> object:
        from engine.quality_check import check_quality

        session_id, messages = command.args
        session = self._session(session_id)
        self.guard.check_pressure("the quality check")
        # An empty chat renders to a template's bare scaffolding: nothing of the user's.
        ids = session.render(messages, add_generation_prompt=False) if messages else []
        started = time.perf_counter()

        def progress(done: int, total: int) -> None:
            rate = done / max(time.perf_counter() - started, 1e-9)
            self._emit(QualityProgress(command.request_id, done, total, rate,
                                       (total - done) / rate))

        try:
            with self._heartbeat():
                receipt = check_quality(
                    session.loaded, ids, session.mode, rotate=session.rotation is not None,
                    cancel=command.cancel, progress=progress, page_size=session.page_size,
                )
        except Cancelled:
            return Finished(command.request_id, "cancelled")
        return QualityChecked(command.request_id, session_id, receipt)

    def _restore(
        self, session: Session, messages: list[dict[str, str]], request_id: int, *, answer: bool
    ) -> int:
        """Reopen an empty session from its snapshot, then take a longer prefix another
        open chat holds (``engine.reuse``); the tokens it brought back."""
        with self._lock:
            others = [s for s in self._sessions.values()
                      if s.tokens and reuse.compatible(session, s)]
        from_disk = not session.tokens and self._snapshots.store is not None
        if not others and not from_disk:
            return 0
        prompt = session.render(messages, add_generation_prompt=answer)
        reused = 0
        if from_disk:
            reused = self._snapshots.restore(session, prompt, request_id, keep_last=answer)
        found = reuse.best_offer(session, others, prompt, keep_last=answer)
        if found is None:
            return reused
        taken = reuse.adopt(session, found)
        if taken:
            self._publish(found.donor)  # its pages are shared now: the panel says so
            self._emit(Notice(request_id, f"Reused {taken:,} tokens another open chat had "
                                          "already read; reading only the rest."))
        return taken


def _kept(stop: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """(kept, total) tokens of a prefill that stopped short, else Nones (for events)."""
    return stop or (None, None)


def _copy(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    # The caller's list may change while the request waits in the queue.
    return [{"role": m["role"], "content": m["content"]} for m in messages]
