"""The answers the worker runs together: one batch, stepped between requests.

A chat request joins the batch (``engine.session.batch``) and the worker steps
it between the requests it takes from its queue, so a chat sent while another
answers starts at once instead of after it. Each answer ends with its own
``Finished`` or ``Failed``, sent as its row leaves the batch; one that memory
cannot hold beside the others yet is told so by ``AnswerWaiting``.

On a pipeline, the other ranks are told a request ended (``FollowerLink.end``)
once no pass the batch queued still feeds its session, so they and rank 0 hold
the same tokens when they check.

Everything here runs on the engine worker thread, except :meth:`Answering.counts`
and :meth:`Answering.cancel_in`, which read frozen values and set events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, Literal

from engine.cache.batched import check_batchable
from engine.errors import Cancelled, EngineError
from engine.events import AnswerWaiting, Event, Failed, Finished
from engine.runtime.commands import Chat, Command
from engine.runtime.endings import failed, read_cancelled
from engine.runtime.stats_reporter import StatsReporter
from engine.session.batch import (
    DEFAULT_READ_SHARE,
    BatchDecoder,
    Room,
    RowToken,
    StepFailed,
    check_read_share,
)
from engine.session.prompt_ids import Prompt
from engine.session.session import AnswerStart, Session

log = logging.getLogger(__name__)

DEFAULT_STREAMS = 4
"""Answers decoding together unless the front end sets its own limit."""

Phase = Literal["reading", "decoding"] | None
"""Where an answer running alone is: reading its conversation in, decoding, or neither."""


@dataclass(frozen=True)
class StreamCounts:
    """How many answers the worker runs together now, for any thread to read.

    Attributes:
        answering: answers decoding.
        reading: answers whose conversation is being read in beside them.
        waiting: answers waiting for memory to join.
        limit: answers that may run together; more wait in the worker's queue.
    """

    answering: int = 0
    reading: int = 0
    waiting: int = 0
    limit: int = DEFAULT_STREAMS

    @property
    def in_flight(self) -> int:
        """Answers running (alone or in the batch), reading, decoding or waiting
        for memory."""
        return self.answering + self.reading + self.waiting


def shares_passes(caches: list[list[Any]]) -> bool:
    """Whether conversations holding these per-layer caches can share a pass."""
    try:
        check_batchable(caches)
    except EngineError:
        return False
    return True


@dataclass(frozen=True)
class _Member:
    """A request the batch holds, as the worker ends it."""

    command: Command
    session: Session
    session_id: str  # a plain copy, for other threads: they never touch the session
    reused: int


@dataclass(frozen=True)
class _RanksEnd:
    """A request's end, to tell a pipeline's other ranks once no pass feeds its session."""

    session: Session
    cancelled: bool
    reply: bool  # whether they answer (not after an unexpected error: the group may be gone)


class Answering:
    """The chats answering together on the worker thread, and how each one ends.

    Args:
        stats: publishes each answering session's stats as the batch steps.
        emit: sends the answers' events and endings.
        after_end: called before an answer's ending is sent (the worker
            freezes what fit checks read).
        fault: how a request ends that a failed step took down (the worker's
            words for an error, its log line included).
        limit: answers that may run together.
        room: the open sessions a joining answer may set aside when their pages
            stand in its way (the worker's ``HeldSessions``); None: none.
        ranks_heard: called once a pipeline's other ranks answered the end of a
            request (the worker asks them again what a chat not opened yet takes).
        read_share: the reads' share of the time beside answers
            (``engine.session.batch.ReadShare``).
    """

    def __init__(self, stats: StatsReporter, emit: Callable[[Event], None],
                 after_end: Callable[[], None], fault: Callable[[Command, Exception], Failed],
                 limit: int = DEFAULT_STREAMS, room: Room | None = None,
                 ranks_heard: Callable[[], None] = lambda: None,
                 read_share: float = DEFAULT_READ_SHARE) -> None:
        self._stats = stats
        self._read_share = check_read_share(read_share)
        self._room = room
        self._emit = emit
        self._after_end = after_end
        self._ranks_heard = ranks_heard
        self._fault = fault
        self._batch: BatchDecoder | None = None
        self._members: dict[int, _Member] = {}
        self._told: dict[int, str] = {}  # the waiting reason last sent, per request
        self._ranks_ends: list[_RanksEnd] = []
        self._heartbeat = ExitStack()
        self._lock = threading.Lock()
        self._counts = StreamCounts()
        self._alone: Phase = None
        self.limit = limit

    # -- any thread ------------------------------------------------------------

    def counts(self) -> StreamCounts:
        """The answers running together now (a frozen value)."""
        return self._counts

    def cancel_in(self, session_id: str | None) -> None:
        """Cancel the answers running in ``session_id`` (None: every one)."""
        with self._lock:
            members = list(self._members.values())
        for member in members:
            if session_id is None or member.session_id == session_id:
                member.command.cancel.set()

    # -- the worker thread ---------------------------------------------------

    @property
    def limit(self) -> int:
        """Answers that may run together."""
        return self._counts.limit

    @limit.setter
    def limit(self, limit: int) -> None:
        if limit < 1:
            raise EngineError("At least one answer must be allowed to run.")
        self._counts = replace(self._counts, limit=limit)

    @property
    def busy(self) -> bool:
        """Whether an answer is held, or a pass queued for answers that ended is
        still to be read: the worker steps the batch between requests."""
        return bool(self._members) or (self._batch is not None and not self._batch.idle)

    @property
    def full(self) -> bool:
        """Whether the batch holds as many answers as may run together."""
        return len(self._members) >= self.limit

    def session_ids(self) -> set[str]:
        """The sessions the batch holds: their answers, and those an ended answer's
        last pass still feeds (a request on one waits for the next step)."""
        held = {member.session_id for member in self._members.values()}
        return held | (self._batch.session_ids() if self._batch is not None else set())

    def can_take(self, session: Session) -> bool:
        """Whether ``session``'s answer may run in the batch now (else it runs alone,
        once the batch is empty): its layers, and on a pipeline the other ranks'
        layers of it, can share a pass with those of the answers running."""
        if session.followers is not None and not session.followers.batches:
            return False
        caches = [member.session.cache for member in self._members.values()][:1]
        return shares_passes([*caches, session.cache])

    def join(self, command: Command, chat: Chat, session: Session, prompt: Prompt,
             reused: int) -> None:
        """Add ``chat`` (``command``'s request) to the batch: its conversation is
        read in beside the others' answers, then it answers.

        Raises:
            EngineError: it cannot be answered, as it could not alone.
        """
        batch = self._batch_for(session)
        answering = session.session_id in self.session_ids()
        try:
            batch.join(session, chat.messages, chat.sampling, request_id=command.request_id,
                       cancel=command.cancel, emit=self._emit, tick=_no_tick, prompt=prompt)
        except EngineError:
            if session.followers is not None and not answering:
                # As a read alone that fails its checks: the other ranks check their
                # tokens and let go of what they held for it. (A session that answers
                # already is told when that answer ends.)
                self._ranks_ends.append(_RanksEnd(session, command.cancel.is_set(), True))
                self._tell_ranks(batch)
            raise
        self._hold(command, session, reused)

    def adopt(self, command: Command, session: Session, answer: AnswerStart,
              reused: int) -> None:
        """Go on in the batch with an answer that decoded alone until it paused."""
        self._batch_for(session).adopt(session, answer)
        self._hold(command, session, reused)

    def adopt_read(self, command: Command, session: Session,
                   steps: Generator[bool, None, AnswerStart], prompt: Prompt,
                   max_tokens: int, reused: int) -> None:
        """Go on in the batch with a conversation read in alone until it paused
        (``max_tokens``: its answer's length limit)."""
        self._batch_for(session).adopt_read(session, command.request_id, steps, prompt.ids,
                                            max_tokens, command.cancel)
        self._hold(command, session, reused)

    def step(self) -> None:
        """One step of the batch: every answer's next token, a chunk of a read,
        the waiting ones that memory now holds; the answers that ended are ended."""
        batch = self._batch
        if batch is None:
            return
        broken: StepFailed | None = None
        try:
            results = batch.step()
        except StepFailed as step_failed:
            broken, results = step_failed, step_failed.results
        for result in results:
            if result.finish is not None:
                self._end(result)
        if broken is not None:  # the rest of the batch ends with the pass
            self._abandon(batch, broken.error)
        self._tell_ranks(batch)
        self._tell_waiting(batch)
        self._stats.publish_when_due([m.session for m in self._members.values()])
        self._count()

    def alone(self, phase: Phase) -> None:
        """An answer running alone, outside the batch, is reading its conversation in
        or decoding (None: it ended, or went on in the batch): counted with the
        batch's."""
        self._alone = phase
        self._count()

    def close(self) -> None:
        """Forget the batch (its model is going); nothing may be running in it."""
        self._batch = None

    def fail_all(self, error: Exception) -> None:
        """The engine thread stops on ``error``: every request the batch holds ends
        with it, in the worker's words for it (nothing of MLX or a session is touched)."""
        with self._lock:
            members = list(self._members.values())
            self._members.clear()
        self._heartbeat.close()
        self._batch, self._alone = None, None
        for member in members:
            self._emit(self._fault(member.command, error))
        self._count()

    @property
    def read_share(self) -> float:
        """The reads' share of the time beside answers."""
        return self._read_share

    def set_read_share(self, share: float) -> None:
        """The reads' share of the time beside answers from now on
        (``engine.session.batch.ReadShare``), for the batch under way too."""
        self._read_share = check_read_share(share)
        if self._batch is not None:
            self._batch.set_read_share(share)

    # -- inside ------------------------------------------------------------------

    def _batch_for(self, session: Session) -> BatchDecoder:
        if self._batch is None or self._batch.model is not session.model:
            if self._batch is not None and not self._batch.idle:
                raise EngineError("Only conversations of the same model can answer together.")
            self._batch = BatchDecoder(session.model, room=self._room,
                                       read_share=self._read_share)
        return self._batch

    def _hold(self, command: Command, session: Session, reused: int) -> None:
        if not self._members:
            # One heartbeat for as long as anything answers, not a thread a step.
            self._heartbeat.enter_context(self._stats.heartbeat())
        with self._lock:
            self._members[command.request_id] = _Member(command, session, session.session_id,
                                                         reused)
        self._stats.publish(session)
        if self._batch is not None:
            self._tell_waiting(self._batch)
        self._count()

    def _end(self, result: RowToken, ending: Failed | None = None,
             ranks_reply: bool = True) -> None:
        with self._lock:
            member = self._members.pop(result.request_id)
        session = member.session
        if session.followers is not None:
            self._ranks_ends.append(_RanksEnd(session, member.command.cancel.is_set(),
                                              ranks_reply))
        if session.memory_stop:
            log.warning("answer in %s stopped for memory: %s", session.session_id,
                        session.memory_stop)
        try:
            self._stats.publish(session)
            if not self._members:
                self._heartbeat.close()
            self._after_end()
        finally:  # out of the members: nothing else would end it
            self._count()  # before the ending: a front end may read the counts on it
            self._emit(ending or _ending(result, member.reused))

    def _abandon(self, batch: BatchDecoder, error: Exception) -> None:
        """A pass failed: every answer in the batch ends with it, each session at the
        tokens it holds."""
        expected = isinstance(error, EngineError)
        if not expected:  # the group may be gone: no end waits for its replies
            self._ranks_ends = [replace(end, reply=False) for end in self._ranks_ends]
        for request_id in batch.abandon():
            member = self._members.get(request_id)
            if member is not None:
                self._end(RowToken(request_id, None, "error"), self._fault(member.command, error),
                          ranks_reply=expected)

    def _tell_ranks(self, batch: BatchDecoder) -> None:
        """Tell a pipeline's other ranks of the requests that ended whose sessions no
        queued pass feeds any more: they then hold the tokens rank 0 holds."""
        fed = batch.session_ids()
        for end in [end for end in self._ranks_ends if end.session.session_id not in fed]:
            self._ranks_ends.remove(end)
            followers = end.session.followers
            if followers is None:
                continue
            try:
                followers.end(len(end.session.tokens), end.cancelled, answer=end.reply)
                if end.reply:
                    self._ranks_heard()
            except Exception:
                # The request has ended already; a group that cannot take the end is
                # lost, and its watch says so (the worker thread must go on).
                log.exception("the other ranks were not told %s's request ended",
                              end.session.session_id)
                continue
            self._stats.publish(end.session)  # their replies: each machine's share

    def _tell_waiting(self, batch: BatchDecoder) -> None:
        """Say why each answer waits, once a reason: to join, or for its next page."""
        waits = (*batch.waiting, *batch.paused)
        # Those that joined, went on or ended are forgotten: one that waits again
        # is told again.
        self._told = {wait.request_id: self._told[wait.request_id] for wait in waits
                      if wait.request_id in self._told}
        for wait in waits:
            if self._told.get(wait.request_id) != wait.reason:
                self._told[wait.request_id] = wait.reason
                self._emit(AnswerWaiting(wait.request_id, wait.reason, wait.short_bytes,
                                         behind=wait.behind))

    def _count(self) -> None:
        batch = self._batch
        answering = int(self._alone == "decoding")
        reading = int(self._alone == "reading")
        if batch is not None:
            answering, reading = answering + len(batch.rows), reading + len(batch.reading)
        waiting = 0 if batch is None else len(batch.waiting)
        self._counts = StreamCounts(answering, reading, waiting, self.limit)


def _no_tick() -> None:
    """Rows publish no stats themselves: the batch publishes all of them after a step."""


def _ending(result: RowToken, reused: int) -> Finished | Failed:
    """The event that ends the request of a row that left the batch."""
    request_id, error = result.request_id, result.error
    if isinstance(error, Cancelled):
        return read_cancelled(request_id, error, reused)
    if error is not None:
        return failed(request_id, error)
    ended = None if result.stats is None else replace(result.stats, reused_tokens=reused)
    return Finished(request_id, result.finish or "cancelled", ended)
