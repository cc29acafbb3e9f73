"""The loaded model and the sessions open on it, as the engine worker holds them.

A session leaves memory (replaced by one of the same id, closed, or its model
unloaded) through its snapshot on disk, and an empty session about to read a
conversation comes back from it; any session may also take a longer prefix
another open chat holds (``engine.session.reuse``).

Every method but ``fit_inputs`` is called on the engine worker thread (most run
MLX); ``fit_inputs`` reads, under a lock, the frozen values ``publish_fit`` left.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.cache import sharing
from engine.cache.modes import MODES, KvMode
from engine.errors import EngineError
from engine.events import Event, Notice, RankShare
from engine.format import human_bytes
from engine.memory import fit
from engine.memory.guard import MemoryGuard
from engine.runtime.interface import Conductor, Pipeline
from engine.runtime.stats_reporter import StatsReporter
from engine.session import reuse
from engine.session.prefill import activation_value_bytes
from engine.session.session import (
    DEFAULT_PAGE_SIZE,
    Session,
    check_sizes,
    new_chat_cache,
    new_chat_outside_pages,
)
from engine.snapshots.fingerprint import code_fingerprint, model_fingerprint
from engine.snapshots.stored_sessions import StoredSessions

if TYPE_CHECKING:
    from engine.models.info import ModelInfo
    from engine.models.loader import LoadedModel

log = logging.getLogger(__name__)

# Sessions of the local API server are named with this prefix. Cached tokens and
# response times tell a client whether a text is already held, so API sessions
# and the app's chats never take each other's prefixes.
API_SESSION_PREFIX = "api-"


def same_partition(a: str, b: str) -> bool:
    """Whether sessions ``a`` and ``b`` may reuse each other's KV (both API or neither)."""
    return a.startswith(API_SESSION_PREFIX) == b.startswith(API_SESSION_PREFIX)


def may_reuse(a: str, b: str, *, share_chats: bool) -> bool:
    """Whether ``a`` may take ``b``'s KV: within a partition always, across it only when
    the user shares the app's chats with the local server (``share_chats``)."""
    return share_chats or same_partition(a, b)


class HeldSessions:
    """Loads a model, opens and closes its sessions, and refills them before a read.

    Args:
        guard: the memory guard the model load and every session's pages go through.
        stored: saves a session's cache to disk as it leaves memory and restores it on return.
        stats: publishes a session's stats when its pages change hands.
        emit: sends events (the notice of a prefix taken from another chat).
        pipeline: rank 0 of a pipeline (``engine.distributed.rank_commands.Pipeline``):
            load only this rank's stage of the model (``engine.models.loader.load_model``)
            and send every session's cache operations to the other ranks; None:
            every layer, here.
    """

    def __init__(
        self,
        guard: MemoryGuard,
        stored: StoredSessions,
        stats: StatsReporter,
        emit: Callable[[Event], None],
        *,
        pipeline: Pipeline | None = None,
    ) -> None:
        self._pipeline = pipeline
        # Rank 0's command channel to the pipeline's other ranks (made at the load).
        self._conductor: Conductor | None = None
        self._guard = guard
        self._stored = stored
        self._stats = stats
        self._emit = emit
        self._lock = threading.Lock()
        self.loaded: LoadedModel | None = None
        self.prefill: fit.PrefillFacts | None = None  # the loaded model's prefill needs
        self._sessions: dict[str, Session] = {}
        # Set between requests by the worker: API sessions and chats reuse each other.
        self.share_chats = False
        self._fit: dict[str | None, fit.FitInputs] = {}  # replaced whole, never mutated
        # A pipeline's machines for a chat not opened yet, as they last answered.
        self._unopened: tuple[RankShare, ...] = ()
        # A new chat's reserve outside its pages, for the chunk it was made with.
        self._new_chat_reserve = (0, 0)

    def publish_fit(self, chunk_size: int) -> None:
        """Freeze what fit checks need of the model and each open session.

        ``chunk_size`` is the engine's chunk for a chat not opened yet.
        """
        board: dict[str | None, fit.FitInputs] = {}
        if self.loaded is not None:
            board = {sid: session.fit_inputs() for sid, session in self._sessions.items()}
            board[None] = self._unopened_fit(self.loaded, chunk_size)
        with self._lock:
            self._fit = board

    def refresh_unopened(self, chunk_size: int) -> None:
        """On a pipeline, ask every follower for its share of a chat not opened yet.

        Between requests that ended well only: after a failure the group may be
        gone, and a gather would wait on it. Stats samples reuse the answer.
        """
        if self._conductor is not None and self.loaded is not None:
            self._unopened = self._conductor.unopened_machines(chunk_size)

    def _unopened_fit(self, loaded: LoadedModel, chunk_size: int) -> fit.FitInputs:
        # On a pipeline the loaded info describes this rank's layers only; each
        # follower answered for its own share.
        if self._new_chat_reserve[0] != chunk_size:
            self._new_chat_reserve = (
                chunk_size, new_chat_outside_pages(loaded, chunk_size).reserve_bytes)
        return fit.FitInputs(fit.facts_from_info(loaded.info), DEFAULT_PAGE_SIZE,
                             self._guard.view(), prefill=self.prefill, chunk_tokens=chunk_size,
                             ranks=self._unopened if self._conductor is not None else (),
                             new_chat_reserve_bytes=self._new_chat_reserve[1])

    def fit_inputs(self, session_id: str | None) -> fit.FitInputs:
        """The last frozen fit inputs of ``session_id`` (None: a chat not opened yet).

        Raises:
            EngineError: no model is loaded, or the session is not open.
        """
        with self._lock:
            board = self._fit
        if not board:
            raise EngineError("Load a model first.")
        inputs = board.get(session_id)
        if inputs is None:
            raise EngineError(f"No open session named {session_id!r}; open it first.")
        return inputs

    def get(self, session_id: str) -> Session:
        """The open session ``session_id``.

        Raises:
            EngineError: no session of that id is open.
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise EngineError(f"No open session named {session_id!r}; open it first.")
        return session

    def use(self, session_id: str) -> Session:
        """The open session ``session_id``, now the most recently used (the last
        to be set aside).

        Raises:
            EngineError: no session of that id is open.
        """
        session = self.get(session_id)
        with self._lock:
            self._sessions[session_id] = self._sessions.pop(session_id)
        return session

    # -- room for a conversation (engine.session.batch.Room) -------------------

    def idle(self, keep: Collection[str]) -> list[str]:
        """The open sessions holding pages that are not in ``keep``, least recently
        used first; not one that shares pages with a session in ``keep`` (setting it
        aside would free none of them)."""
        kept = [self._sessions[name] for name in keep if name in self._sessions]
        return [name for name, session in self._sessions.items()
                if name not in keep and session.cache and session.stats().bytes_allocated
                and not any(sharing.same_group(session.cache, k.cache) for k in kept)]

    def make_room(self, fits: Callable[[frozenset[str]], bool], keep: Collection[str],
                  request_id: int) -> bool:
        """Set idle sessions (not in ``keep``) aside, least recently used first, until
        ``fits(frozenset())``; only when ``fits`` of them all gone holds, else none.
        Whether the conversation fits now.

        A session set aside is stored on disk (when snapshots are kept) and its
        pages dropped; it stays open, and its next request brings it back from the
        snapshot (:meth:`restore`) or reads it again.
        """
        if fits(frozenset()):
            return True
        idle = self.idle(keep)
        if not idle or not fits(frozenset(idle)):
            return False
        for name in idle:
            self._set_aside(name, request_id)
            if fits(frozenset()):
                return True
        return False

    def make_room_for(self, session: Session, prompt: list[int], tokens: int,
                      keep: Collection[str], request_id: int, *, answer: bool) -> bool:
        """:meth:`make_room` for ``tokens`` tokens of ``prompt`` in ``session``, before
        :meth:`restore` fills it: an open chat that would lend it a prefix is kept,
        and only what that chat does not hold is counted (its pages are shared, not
        copied). Whether it fits now."""
        if session.holds(tokens):
            # The usual case, and then no lender need be looked for: comparing every
            # open chat's tokens with the prompt is what restore does next anyway.
            return True
        found = reuse.best_offer(session, self._donors(session), prompt, keep_last=answer)
        lent = 0 if found is None else found.tokens
        kept = {*keep, session.session_id}
        if found is not None:
            kept.add(found.donor.session_id)
        return self.make_room(lambda gone: session.holds(tokens - lent, gone), kept,
                              request_id)

    def _donors(self, session: Session) -> list[Session]:
        """The open sessions whose pages ``session`` may take (``reuse.adopt``)."""
        with self._lock:
            return [s for s in self._sessions.values()
                    if s.tokens and reuse.compatible(session, s)
                    and may_reuse(session.session_id, s.session_id,
                                  share_chats=self.share_chats)]

    def _set_aside(self, session_id: str, request_id: int) -> None:
        session = self.get(session_id)
        held = int(session.stats().bytes_allocated)
        stored = self._stored.store(session, self._emptied())
        partners = self._partners(session)
        session.reset()
        self._stats.publish(session)
        for partner in partners:  # their pages are no longer shared: say so
            self._stats.publish(partner)
        after = ("it is on disk and comes back from there" if stored
                 else "it is read again")
        self._emit(Notice(request_id, (
            f"Made room for this conversation: set aside another chat's cache "
            f"({human_bytes(held)}), the one used longest ago; {after} when that chat "
            "is next used.")))
        log.info("session %s set aside (%d bytes, stored: %s) for request %d",
                 session_id, held, stored, request_id)

    def _emptied(self) -> frozenset[str]:
        """The open sessions holding no tokens: set aside, or opened and not yet used,
        their snapshot (if any) is the only copy of their KV."""
        with self._lock:
            return frozenset(name for name, s in self._sessions.items() if not s.tokens)

    def _partners(self, session: Session) -> list[Session]:
        """The other open sessions that share pages with ``session``."""
        with self._lock:
            return [s for s in self._sessions.values()
                    if s is not session and sharing.same_group(s.cache, session.cache)]

    def load(self, path: str) -> ModelInfo:
        """Load "demo" or a model folder in place of the current model; its facts.

        Raises:
            InsufficientMemory: the weights would not fit in free RAM, even with
                the current model gone.
        """
        # Heavy: imports mlx-lm's loaders.
        from engine.models.loader import estimate_load_bytes, load_model, resolve_model_path

        folder = resolve_model_path(path)
        if self._conductor is not None:
            raise EngineError("A model split across machines stays the one it was started "
                              "with; restart the pipeline to load another.")
        needed, quantized = estimate_load_bytes(folder)
        held = self.prefill  # the weights held now, not the peak they loaded with
        releasable = (0 if held is None else held.weights_bytes) + self._guard.held_bytes()
        if self._guard.check_load(needed, name=folder.name, releasable_bytes=releasable,
                                  quantized=quantized):
            # Only fits once the current model is gone: unload it first rather
            # than hold both and swap.
            self.release()
            # The chats' share is an upper bound (their reserves): a new reading
            # says what unloading gave back, and a load that still does not fit
            # is refused rather than pushed past the headroom.
            self._guard.check_load(needed, name=folder.name, quantized=quantized)
        # Once per load, here on the worker thread: every save and reopen of this
        # model's sessions checks stored KV against these weights.
        fingerprint = model_fingerprint(folder)
        pipeline = self._pipeline
        loaded = load_model(folder, pipeline=None if pipeline is None else pipeline.group,
                            split=None if pipeline is None else pipeline.split)
        # The code that runs is the code imported now: an mlx-lm updated on disk
        # later must not vouch for KV this process computes.
        loaded = dataclasses.replace(loaded, fingerprint=fingerprint,
                                     code=code_fingerprint(folder))
        if pipeline is not None and pipeline.group.size() > 1:
            # The other ranks' weights and the split join the fingerprint stored KV
            # is checked against.
            self._conductor = pipeline.conduct(loaded)
            self._unopened = ()
            loaded = dataclasses.replace(loaded, fingerprint=self._conductor.fingerprint)
        self.release()
        prefill = fit.prefill_facts(loaded.model, activation_value_bytes())
        with self._lock:
            self.loaded = loaded
            self.prefill = prefill
        self._new_chat_reserve = (0, 0)
        self._stored.announce()  # which stored chats this model reopens changed
        return loaded.info

    def loaded_digest(self) -> str:
        """The loaded weights' fingerprint stored KV is checked against ("": none)."""
        fingerprint = self.loaded.fingerprint if self.loaded is not None else None
        return str(fingerprint.get("digest", "")) if fingerprint else ""

    def new_cache(self) -> list[Any]:
        """The per-layer cache a new fp16 session of the loaded model holds (its
        layers' kinds are every mode's).

        Raises:
            EngineError: no model is loaded, or the load-time probe refused it.
        """
        loaded = self.loaded
        if loaded is None:
            raise EngineError("Load a model first.")
        return new_chat_cache(loaded)

    def release(self) -> None:
        """Unload the model, saving and closing every session first."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self.loaded = None
            self.prefill = None
        self._store_and_close(sessions)
        # The next load checks free memory right after this: nothing here may
        # still hold the old model's arrays then (left to the collector, they
        # were still held in tests).
        sessions.clear()
        gc.collect()
        mx.clear_cache()

    def _store_and_close(self, sessions: list[Session]) -> None:
        emptied = {s.session_id for s in sessions if not s.tokens}
        for session in sessions:
            self._stored.store(session, emptied)
            session.close()

    def open(
        self, session_id: str, mode: KvMode, page_size: int, rotate: bool | None, *,
        chunk_size: int,
    ) -> Session:
        """Open session ``session_id`` empty, saving and closing one it replaces."""
        if self.loaded is None:
            raise EngineError("Load a model before opening a conversation.")
        MODES[mode]  # an unknown mode raises here, before a session it would replace closes
        # And bad sizes, before a pipeline's other ranks are sent them: a rank that
        # fails a command ends the whole group.
        check_sizes(page_size, chunk_size)
        with self._lock:
            replaced = self._sessions.pop(session_id, None)
        if replaced is not None:
            self._stored.store(replaced, self._emptied())
            replaced.close()
        rotate = self._stored.kept_rotation(session_id, mode, rotate)
        followers = (None if self._conductor is None
                     else self._conductor.open(mode, page_size, rotate, chunk_size))
        try:
            session = Session(
                session_id, self.loaded, mode, page_size,
                chunk_size=chunk_size, guard=self._guard,
                rotate=rotate, followers=followers,
            )
        except EngineError:
            if followers is not None:  # their pages of it would never be let go
                followers.close()
            raise
        with self._lock:
            self._sessions[session_id] = session
        self._stats.publish(session)
        return session

    def close(self, session_id: str, store: bool = True) -> None:
        """Save (``store``) and close session ``session_id``, if open, and free its pages."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return
        if store:
            self._stored.store(session, self._emptied())
        partners = self._partners(session)
        session.close()
        # Hand the freed pages back to the OS, not just to MLX's buffer cache.
        mx.clear_cache()
        for partner in partners:  # their pages are no longer shared: say so
            self._stats.publish(partner)

    def prune_followers(self, names: list[str]) -> None:
        """A pipeline's other ranks keep their parts of these stored snapshots only
        (nothing on one machine)."""
        if self._conductor is not None:
            self._conductor.prune(names)

    def stop_followers(self) -> None:
        """Tell a pipeline's other ranks to end (after ``release``; nothing on one machine)."""
        if self._conductor is not None:
            self._conductor.stop()
            self._conductor = None

    def set_chunk_size(self, chunk_size: int) -> None:
        """Prefill every open session in chunks of ``chunk_size`` tokens from now on,
        and have the guard re-plan their reserves under its (new) budget."""
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.set_chunk_size(chunk_size)
            self._guard.refresh(session.session_id)

    def restore(
        self, session: Session, prompt: list[int], request_id: int, *, answer: bool
    ) -> int:
        """Reopen an empty session from its snapshot, then take a longer prefix another
        open chat holds (``engine.session.reuse``); the tokens it brought back.

        ``prompt`` is the request's ids of the conversation (rendered once, by the
        request); ``answer`` says whether its last token is still to be fed.
        """
        # The pool's limit as memory stands now (sessions may have been set aside
        # for this one since it was last refreshed).
        self._guard.refresh(session.session_id)
        others = self._donors(session)
        from_disk = not session.tokens and self._stored.snapshots is not None
        if not others and not from_disk:
            return 0
        reused = 0
        if from_disk:
            def allowed(name: str) -> bool:
                return may_reuse(session.session_id, name, share_chats=self.share_chats)
            reused = self._stored.restore(session, prompt, request_id, keep_last=answer,
                                          allow=allowed)
        found = reuse.best_offer(session, others, prompt, keep_last=answer)
        if found is None:
            return reused
        taken = reuse.adopt(session, found)
        if taken:
            self._stats.publish(found.donor)  # its pages are shared now: the panel says so
            self._emit(Notice(request_id, f"Reused {taken:,} tokens another open chat had "
                                          "already read; reading only the rest."))
        return taken
