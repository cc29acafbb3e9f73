"""The requests that run on an open session's conversation: chat, ingest, check_quality.

Each handler is given its ``Command`` on the engine worker thread and returns
the event that ends it; on the way it streams the session's events and keeps
its stats flowing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple

from engine.errors import Cancelled, EngineError
from engine.events import Event, Finished, QualityChecked, QualityProgress
from engine.memory.guard import MemoryGuard
from engine.runtime.answering import Phase
from engine.runtime.commands import Chat, CheckQuality, Ingest
from engine.runtime.endings import read_cancelled
from engine.runtime.held_sessions import HeldSessions
from engine.runtime.stats_reporter import StatsReporter
from engine.session.prompt_ids import Prompt
from engine.session.session import AnswerStart, Session

log = logging.getLogger(__name__)


ReadSteps = Generator[bool, None, AnswerStart]
"""A conversation's read in, a chunk a ``next``, then its answer (``Session.answer_steps``)."""


class ChatStart(NamedTuple):
    """A chat request made ready to answer, alone or in a batch."""

    session: Session
    prompt: Prompt
    reused: int  # tokens brought back from disk or another chat


def _no_phase(phase: Phase) -> None:
    """Where a chat alone is, told to no one."""


class _AheadGate:
    """Whether a read alone may send its next chunk ahead to a pipeline's other
    ranks: until ``pause`` first says so, or the read paused (from then on it may
    go on in a batch, whose passes run between its chunks)."""

    def __init__(self, pause: Callable[[], bool]) -> None:
        self._pause = pause
        self._open = True

    def __call__(self) -> bool:
        self._open = self._open and not self._pause()
        return self._open

    def close(self) -> None:
        self._open = False


class _Read:
    """A request answered alone, as its read's end sees it."""

    def __init__(self) -> None:
        self.goes_on = False  # paused, to go on in the batch


class SessionRequests:
    """Answers, ingests and quality checks on the sessions ``held`` keeps open.

    Args:
        held: the open sessions, refilled before each read.
        stats: publishes the session's stats as the request runs.
        guard: refuses a quality check while system memory is critical.
        emit: sends the request's streamed events.
        between: runs between two chunks of a read or a quality check (the worker
            ends then the requests cancelled while they wait behind it).
    """

    def __init__(
        self,
        held: HeldSessions,
        stats: StatsReporter,
        guard: MemoryGuard,
        emit: Callable[[Event], None],
        between: Callable[[], None],
    ) -> None:
        self._held = held
        self._stats = stats
        self._guard = guard
        self._emit = emit
        self._between = between

    def prepare_chat(self, request_id: int, request: Chat,
                     keep: Collection[str] = ()) -> ChatStart:
        """The chat's session, its prompt (rendered and tokenized once for the whole
        request) and the tokens brought back for it from disk or another chat.

        Where idle sessions' pages stand in the way of the conversation, the least
        recently used are set aside first, never one of ``keep`` (the sessions
        answering).
        """
        session = self._held.use(request.session_id)
        prompt = session.prompt(request.messages, add_generation_prompt=True,
                                tools=request.tools, template=request.template)
        # Its answer's first token too, as the answer's own checks count it.
        self._held.make_room_for(session, prompt.ids, len(prompt.ids) + 1, keep, request_id,
                                 answer=True)
        reused = self._held.restore(session, prompt.ids, request_id, answer=True)
        return ChatStart(session, prompt, reused)

    def chat(self, request_id: int, request: Chat, cancel: threading.Event,
             start: ChatStart, pause: Callable[[], bool] | None = None,
             phase: Callable[[Phase], None] | None = None,
             ) -> Finished | AnswerStart | ReadSteps:
        """Answer the conversation's last user turn alone, streaming ``TokenChunk``
        events, until it ends or ``pause`` says so between two chunks of its read
        (then the read's steps) or two decode steps (then the answer): either goes
        on in a batch (``Answering.adopt_read``, ``Answering.adopt``). ``phase``
        is told where it is, and None once it ended or paused."""
        session, prompt, reused = start
        pause = pause or (lambda: False)
        phase = phase or _no_phase
        ahead = _AheadGate(pause)
        try:
            with self._reading(session, cancel) as read:
                phase("reading")
                steps = session.answer_steps(
                    request.messages, request.sampling, request_id=request_id, cancel=cancel,
                    emit=self._emit, tick=self._stats.tick_for(session), prompt=prompt,
                    ahead=ahead,
                )
                announced = next(steps)  # the checks: one that cannot be answered fails here
                while True:
                    # A chunk sent ahead is read first: the batch's passes go after it.
                    if not announced and pause():
                        ahead.close()
                        read.goes_on = True
                        return steps
                    try:
                        announced = next(steps)
                    except StopIteration as done:
                        answer: AnswerStart = done.value
                        break
                phase("decoding")
                reason = session.run_answer(answer, pause)
                read.goes_on = reason == "paused"
        except Cancelled as stop:
            return read_cancelled(request_id, stop, reused)
        finally:
            phase(None)
        if reason == "paused":
            return answer
        reason, stats = session.finish_answer(answer, reason)
        if session.memory_stop:
            log.warning("answer in %s stopped for memory: %s", session.session_id,
                        session.memory_stop)
        return Finished(request_id, reason, replace(stats, reused_tokens=reused))

    def ingest(self, request_id: int, request: Ingest, cancel: threading.Event) -> Finished:
        """Read the conversation into the session's cache without answering."""
        session = self._held.use(request.session_id)
        prompt = session.prompt(request.messages, add_generation_prompt=False)
        self._held.make_room_for(session, prompt.ids, len(prompt.ids), (), request_id,
                                 answer=False)
        reused = self._held.restore(session, prompt.ids, request_id, answer=False)
        tick = self._stats.tick_for(session)

        def between_chunks() -> None:
            tick()
            self._between()

        try:
            with self._reading(session, cancel):
                stats = session.ingest(
                    request.messages, request_id=request_id, cancel=cancel,
                    emit=self._emit, tick=between_chunks, prompt=prompt,
                )
        except Cancelled as stop:
            return Finished(request_id, "cancelled", None, stop.kept_tokens,
                            stop.total_tokens)
        return Finished(request_id, "done", replace(stats, reused_tokens=reused))

    def check_quality(self, request_id: int, request: CheckQuality,
                      cancel: threading.Event) -> Finished | QualityChecked:
        """Measure the session's KV mode against fp16 on the conversation's last tokens."""
        from engine.session.quality_check import check_quality

        session_id, messages = request.session_id, request.messages
        session = self._held.get(session_id)
        if session.followers is not None:
            raise EngineError("Check Quality is not available for a model split across "
                              "machines yet; it needs every layer in one process.")
        self._guard.check_pressure("the quality check")
        # An empty chat renders to a template's bare scaffolding: nothing of the user's.
        ids = session.render(messages, add_generation_prompt=False) if messages else []
        try:
            with self._stats.heartbeat():
                receipt = check_quality(
                    session.loaded, ids, session.mode, rotate=session.rotation is not None,
                    cancel=cancel, progress=self._progress(request_id),
                    page_size=session.page_size,
                )
        except Cancelled:
            return Finished(request_id, "cancelled")
        return QualityChecked(request_id, session_id, receipt)

    @contextmanager
    def _reading(self, session: Session, cancel: threading.Event) -> Iterator[_Read]:
        """Publish the session's stats around a read, with the heartbeat on during it
        (and a pipeline's other ranks told the read ended, so they check their tokens,
        unless the request goes on in the batch, which tells them when it ends)."""
        self._stats.publish(session)
        read = _Read()
        expected = True  # ended, or failed with an EngineError: the group still answers
        try:
            with self._stats.heartbeat():
                yield read
        except EngineError:
            raise
        except BaseException:
            expected = False
            raise
        finally:
            if session.followers is not None and not read.goes_on:
                session.followers.end(len(session.tokens), cancel.is_set(), answer=expected)
            self._stats.publish(session)

    def _progress(self, request_id: int) -> Callable[[int, int], None]:
        """A progress callback that sends ``QualityProgress`` with rate and time left."""
        started = time.perf_counter()

        def progress(done: int, total: int) -> None:
            rate = done / max(time.perf_counter() - started, 1e-9)
            self._emit(QualityProgress(request_id, done, total, rate, (total - done) / rate))
            self._between()
        return progress
