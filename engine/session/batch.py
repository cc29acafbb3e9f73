"""Several conversations answering at once: one forward pass a step for all of them.

A decode step reads every weight of the model to make one token; a batch makes
one token for each of its conversations from the same read. Each conversation
keeps its own session: its paged cache in its own KV mode, its sampling
settings, its stop tokens, its length limit and its Stop. The layers see the
batch through :class:`engine.cache.batched.BatchedCache`, so no conversation is
padded to another's length.

Conversations join between steps and are read in a chunk at a time (the chunks
:meth:`Session.chat` reads), after that step's decode pass. Beside answering
conversations the reads and the decoding take turns by time (:class:`ReadShare`):
by default a chunk is read once the steps since the last one have decoded for as
long as that one took, so an answer keeps about half its pace or more while a long
document is read beside it, and the read goes on at about half its speed (the
reads' share of the time is a setting, ``read_share``). Only
when a chunk is read follows the clock, never how the ids are cut: an answer
does not depend on how busy the machine was. Conversations leave when their
answer ends or is cancelled, and the others go on with the next step. As an
answer alone does (and mlx-lm's BatchGenerator), each pass is queued before the
last one's tokens are read, so the device computes while Python reads and
streams them; a row goes into the next pass when its length limit, its Stop and
its pages allow (a row short of a page waits while another answer may give pages
back, then idle chats are set aside for it, and only then it ends as alone), and an
end-of-turn token is fed as alone. Rows decode plainly
(no speculative drafts). On a pipeline (a model split over machines) each pass
is sent to the other ranks first, as one decode step of every row
(``FollowerLink.decoding_rows``); a chunk read goes as a session's read alone
does. Every method runs MLX and must be called from the engine worker thread.

A conversation joins only when memory holds what it adds: the pages its read
and its answer up to its length limit take, beside the pages the batch's reads
and answers may still add up to theirs (so no answer runs out of pages sooner in
a batch than alone), and one more row of the step's transient
(``PrefillFacts.step_transient_bytes``), within the KV budget and free RAM the
memory guard counts, and on a pipeline when every other rank holds its share of
the conversation's layers beside what it holds (asked once this rank's memory
holds it, for the same tokens); once in, its pages are held to what was counted
for it, on every rank (:meth:`Session.hold_to`). Where pages of open sessions
outside the batch (chats that answered and sit idle) stand in the way, the least
recently used are set aside first, as far as that makes it fit (:class:`Room`).
Otherwise it waits, in the order it came, with a sentence saying why
(:attr:`BatchDecoder.waiting`), and every step tries again (another machine's
"no room" is asked again once a conversation left the batch, or after
``ASK_AGAIN_S``). One that would not fit even with the batch's other
conversations gone and the idle sessions set aside is refused at once, with the
error :meth:`Session.chat` raises for it alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import mlx.core as mx

from engine.cache import adapter, pages
from engine.cache.batched import BatchedCache, check_batchable
from engine.cache.modes import KvMode
from engine.cache.paged_cache import cache_tokens
from engine.errors import (
    Cancelled,
    EngineError,
    KvBudgetExceeded,
    MachineShort,
)
from engine.events import Event, GenerationStats, IngestProgress, WaitEnded
from engine.format import human_bytes
from engine.session.followers import DecodeStep
from engine.session.prefill import Emit, finish
from engine.session.prompt_ids import Prompt, common_prefix
from engine.session.sampling import REPETITION_CONTEXT, SamplingParams
from engine.session.session import AnswerStart, Session


class StepFailed(Exception):
    """A batch step failed: what failed, and what the step had done before.

    Attributes:
        error: what a pass (or a conversation's start) raised.
        results: what the step did for conversations that left the batch before
            it failed (:meth:`BatchDecoder.step`); they are ended as they are.
    """

    def __init__(self, error: Exception, results: list[RowToken]) -> None:
        super().__init__(str(error))
        self.error = error
        self.results = results


@dataclass(frozen=True)
class RowToken:
    """What one step did for one conversation.

    Attributes:
        request_id: the conversation's request.
        token: the token sampled (an end-of-turn token included); None when the
            row left without sampling (cancelled, or out of pages, before its pass).
        finish: None while the answer goes on; else "stop", "length",
            "cancelled" or "memory", as :meth:`Session.chat` says it, or "error"
            when reading the conversation in stopped short (``error`` says why).
        stats: the answer's timings once it finished, else None.
        error: what stopped the read (``Cancelled`` comes with "cancelled"); the
            chunks read stay held, as after :meth:`Session.chat` raised it.
    """

    request_id: int
    token: int | None
    finish: str | None = None
    stats: GenerationStats | None = None
    error: EngineError | None = None


# The limits a waiting conversation's reason names.
FREE_RAM = "is free"
KV_BUDGET = "the KV budget leaves"
# How a conversation waiting its turn names the one before it, which waits for memory.
WAITED_BEHIND = "the conversation before it"
# How long another machine's "no room" for a waiting conversation stands while the
# batch beside it is unchanged: one round trip a second, not one a step.
ASK_AGAIN_S = 1.0


@dataclass(frozen=True)
class _Short:
    """What memory lacks for a conversation to join now: ``bytes`` more than
    ``limit`` holds here, or room on ``machine``, another rank of a pipeline,
    for its share of the layers (None: nothing lacks there)."""

    bytes: int = 0
    limit: str = FREE_RAM
    machine: str | None = None

    @property
    def fits(self) -> bool:
        return self.bytes <= 0 and self.machine is None

    def reason(self) -> str:
        """Why the first waiting conversation waits, as a user reads it."""
        if self.machine is not None:
            return (f"Waiting for memory on {self.machine}: its share of this "
                    "conversation does not fit beside the other answers yet; it starts "
                    "when another answer ends.")
        return (f"Waiting for memory: {human_bytes(self.bytes)} more is needed than "
                f"{self.limit}; it starts when another answer ends.")

    def behind(self) -> str:
        """Why a conversation waits behind the first waiting one, which waits for this
        (``WAITED_BEHIND`` names that one: a front end that knows it by name puts the name)."""
        lacking = (f"memory on {self.machine}" if self.machine is not None
                   else f"{human_bytes(self.bytes)} more than {self.limit}")
        return f"Waiting for memory: {WAITED_BEHIND} needs {lacking}; it starts after that one."


@dataclass(frozen=True)
class Waiting:
    """A conversation waiting for memory to join the batch, or an answer of the
    batch waiting for its next page.

    Attributes:
        request_id: the conversation's request.
        reason: why it waits and for what, as a user reads it.
        short_bytes: bytes more than memory holds now that it needs to join (0
            while it waits its turn behind another), or its next page's bytes.
        behind: the request it waits its turn behind (its reason names it
            ``WAITED_BEHIND``); None when it waits for memory itself.
    """

    request_id: int
    reason: str
    short_bytes: int
    behind: int | None = None


class Room(Protocol):
    """The open sessions outside a batch whose pages may be set aside (stored and
    dropped) to make room for a conversation: the runtime's, which holds them all."""

    def idle(self, keep: Collection[str]) -> list[str]:
        """The sessions holding pages that are not in ``keep``, least recently used
        first."""
        ...

    def make_room(self, fits: Callable[[frozenset[str]], bool], keep: Collection[str],
                  request_id: int) -> bool:
        """Set idle sessions (not in ``keep``) aside, least recently used first, until
        ``fits(frozenset())``; only when ``fits`` of them all gone holds, else none.
        Whether it fits now. ``fits(gone)`` says whether the conversation of
        ``request_id`` fits with the pages of the sessions ``gone`` dropped."""
        ...


class NoRoom:
    """No sessions to set aside: a batch on its own."""

    def idle(self, keep: Collection[str]) -> list[str]:
        return []

    def make_room(self, fits: Callable[[frozenset[str]], bool], keep: Collection[str],
                  request_id: int) -> bool:
        return fits(frozenset())


@dataclass(eq=False)
class _Joining:
    """A conversation that asked to join, with everything its answer needs."""

    session: Session
    messages: list[dict[str, str]]
    sampling: SamplingParams
    request_id: int
    cancel: threading.Event
    emit: Emit
    tick: Callable[[], None]
    prompt: Prompt
    waiting: Waiting | None = None
    short: _Short = _Short()  # what it waits for, while it waits first


@dataclass(eq=False)  # a row is itself: compared (``in``, ``remove``) by identity
class _Row:
    """One answering conversation of the batch."""

    session: Session
    answer: AnswerStart
    pending: int  # sampled (or the prompt's last) and not fed yet
    # Its answer ended; a pass queued before it ended still feeds its last token.
    finished: bool = False
    # The pages could not hold the next token: the answer ends when this one is read.
    out_of_pages: bool = False

    @property
    def request_id(self) -> int:
        return self.answer.stream.request_id


@dataclass(eq=False)
class _Reading:
    """A conversation being read in, a chunk a step, before its answer joins."""

    session: Session
    request_id: int
    steps: Generator[bool, None, AnswerStart]
    cancel: threading.Event  # its Stop: seen at the next step, wherever it stands in line
    tokens: int  # tokens its pages hold once read in, its first answer token included
    max_tokens: int  # its answer's length limit

    @property
    def left(self) -> int:
        """Tokens it has still to read (the one that starts its answer aside): the
        read with the fewest goes first."""
        return self.tokens - 2 - len(self.session.tokens)

    @property
    def answered(self) -> int:
        """Tokens its pages may hold once its answer reaches its length limit."""
        return _answered(self.session, self.tokens - 1, self.max_tokens)


@dataclass(frozen=True)
class _Asked:
    """The other ranks' last answer that a waiting conversation does not fit there:
    for which request, beside which of the batch's sessions, when, and which machine."""

    request_id: int
    batch: frozenset[str]
    at: float
    machine: str


@dataclass(frozen=True)
class _Pass:
    """A queued forward pass: its rows and each row's next token (lazy)."""

    rows: list[_Row]
    sampled: mx.array


DEFAULT_READ_SHARE = 0.5  # equal turns: an answer beside a read keeps about half its pace


def check_read_share(share: float) -> float:
    """``share`` as the reads' share of the device's time beside answers.

    Raises:
        EngineError: not above 0 and at most 1.
    """
    if not 0.0 < share <= 1.0:  # NaN too
        raise EngineError(f"The reads' share of the time beside answers must be above 0 "
                          f"and at most 1 ({DEFAULT_READ_SHARE} by default: equal turns); "
                          f"got {share}.")
    return share


class ReadShare:
    """When a batch reads its next chunk: at every step while nothing answers;
    beside answers, once the steps since the last chunk have decoded long enough
    for the reads to have had ``share`` of the time (at 0.5, as long as reading
    it took; at 1, a chunk every step).

    Args:
        clock: seconds (monotonic).
        share: the reads' share of the device's time beside answers
            (:func:`check_read_share`).
    """

    def __init__(self, clock: Callable[[], float], share: float = DEFAULT_READ_SHARE) -> None:
        self.clock = clock
        self.set_share(share)
        self.owed = 0.0  # seconds of decoding due before the next chunk

    def set_share(self, share: float) -> None:
        """The reads' share from the next chunk on (what is owed now stays owed)."""
        self.share = check_read_share(share)
        self._decode_per_read = (1.0 - share) / share

    def due(self, answering: bool) -> bool:
        """Whether this step reads a chunk, with answers decoding beside it or not."""
        if not answering:
            self.owed = 0.0
        return self.owed <= 0.0

    def read(self, seconds: float) -> None:
        """A chunk was read in ``seconds``."""
        self.owed += seconds * self._decode_per_read

    def decoded(self, seconds: float) -> None:
        """A step decoded for ``seconds`` and read nothing."""
        self.owed = max(0.0, self.owed - seconds)


class BatchDecoder:
    """The answering conversations of one model, decoded together a token a step.

    Args:
        model: the mlx-lm model every joining session holds.
        clock: seconds, for the reads' share of the steps (:class:`ReadShare`) and
            how often the other ranks of a pipeline are asked again for room.
        room: the open sessions outside the batch that a joining conversation's
            pages may displace (:class:`Room`); None: none.
        read_share: the reads' share of the time beside answers (:class:`ReadShare`).
    """

    def __init__(self, model: Any, clock: Callable[[], float] = time.perf_counter,
                 room: Room | None = None, read_share: float = DEFAULT_READ_SHARE) -> None:
        self.model = model
        self._room: Room = room or NoRoom()
        self.rows: list[_Row] = []
        self.reading: list[_Reading] = []
        self._joining: list[_Joining] = []  # waiting for memory, in the order they came
        self._queued: _Pass | None = None
        self._share = ReadShare(clock, read_share)
        self._asked: _Asked | None = None  # the other ranks' last "no room" for a joiner
        self._paused: tuple[Waiting, ...] = ()  # answering rows short of a page

    def set_read_share(self, share: float) -> None:
        """The reads' share of the time beside answers from now on (:class:`ReadShare`)."""
        self._share.set_share(share)

    def __len__(self) -> int:
        """Conversations answering."""
        return len(self.rows)

    @property
    def idle(self) -> bool:
        """Whether nothing is read in or answered and no pass is left to read."""
        return (not self.rows and not self.reading and not self._joining
                and self._queued is None)

    @property
    def request_ids(self) -> tuple[int, ...]:
        """The requests answering, in batch order."""
        return tuple(row.request_id for row in self.rows)

    @property
    def reading_ids(self) -> tuple[int, ...]:
        """The requests whose conversation is being read in, in the order they joined."""
        return tuple(reading.request_id for reading in self.reading)

    def session_ids(self) -> frozenset[str]:
        """The sessions the batch holds in any way: answering, read in, waiting, or
        fed by the pass queued (an answer that ended on its end-of-turn token is fed
        it there: its session holds that token only once the pass is read)."""
        queued = self._queued.rows if self._queued is not None else []
        sessions = [*self._batch_sessions(), *(row.session for row in queued),
                    *(joining.session for joining in self._joining)]
        return frozenset(session.session_id for session in sessions)

    @property
    def waiting(self) -> tuple[Waiting, ...]:
        """The conversations waiting for memory, in the order they will join."""
        return tuple(joining.waiting for joining in self._joining
                     if joining.waiting is not None)

    @property
    def paused(self) -> tuple[Waiting, ...]:
        """The answers that sit out the passes until memory takes their next token,
        and why: another answer under the same memory may give pages back."""
        return self._paused

    def join(
        self,
        session: Session,
        messages: list[dict[str, str]],
        sampling: SamplingParams,
        *,
        request_id: int,
        cancel: threading.Event,
        emit: Emit,
        tick: Callable[[], None],
        prompt: Prompt | None = None,
    ) -> None:
        """Add ``session``'s answer to the batch: its conversation is read in a
        chunk a step beside the others' decoding, then it answers.

        Arguments as :meth:`Session.chat`'s; ``emit`` gets the read's progress and
        the answer's tokens as the steps make them. Speculative drafts are off in
        a batch. Of several conversations reading, the shortest read goes first,
        so a short question is not kept waiting behind a long document.

        When memory cannot hold it beside the batch now, it waits (see
        :attr:`waiting`) and joins at the first step that finds room, after those
        waiting before it; a cancel while it waits ends it without a token.

        Raises:
            EngineError: the session cannot join (another model, a layer the
                batch cannot carry, already answering or waiting), or
                the conversation cannot be answered even with the batch's other
                conversations gone (it does not fit, memory is critical), as
                :meth:`Session.chat` raises it before reading.
        """
        self._check_joins(session, request_id)
        rendered = prompt or session.prompt(messages, add_generation_prompt=True)
        joining = _Joining(session, messages, sampling, request_id, cancel, emit, tick,
                           rendered)
        session.guard.check_pressure("the answer")
        self._refuse_if_never(joining)
        if self._joining:
            self._joining.append(joining)
            self._hold_back(self._joining[0].short)
            return
        short = self._room_for(joining)
        if short.fits:
            self._start(joining)
        else:
            self._joining.append(joining)
            self._hold_back(short)

    def adopt(self, session: Session, answer: AnswerStart) -> None:
        """Go on with an answer that decoded alone until it paused
        (:meth:`Session.run_answer`): from the next step it answers in the batch,
        plainly, from the token it paused at.

        Raises:
            EngineError: the session cannot join (as :meth:`join` says).
        """
        self._check_joins(session, answer.stream.request_id)
        row = _Row(session, answer, answer.stream.paused_at)
        self.rows.append(row)
        session.hold_to(_still_to_answer(row))

    def adopt_read(self, session: Session, request_id: int,
                   steps: Generator[bool, None, AnswerStart], prompt: list[int],
                   max_tokens: int, cancel: threading.Event) -> None:
        """Go on with a conversation that was read in alone until it paused between
        two chunks (``steps``: :meth:`Session.answer_steps` past its checks): the
        rest is read a chunk a step, then it answers in the batch (``max_tokens``:
        its answer's length limit; ``cancel``: its Stop).

        Raises:
            EngineError: the session cannot join (as :meth:`join` says).
        """
        self._check_joins(session, request_id)
        self._read(_Reading(session, request_id, steps, cancel, len(prompt) + 1, max_tokens))

    def abandon(self) -> tuple[int, ...]:
        """Drop every answer, read and wait (after a pass failed); their requests.

        Each session keeps the tokens it holds: the pass that failed, and the
        one queued after it, are undone.
        """
        gone = (*self.request_ids, *self.reading_ids,
                *(joining.request_id for joining in self._joining))
        for reading in self.reading:
            reading.steps.close()
        for session in self._batch_sessions():
            session.rollback()
            session.let_go()
        for joining in self._joining:  # one may have failed as it started
            joining.session.let_go()
        self.rows, self.reading, self._joining, self._queued = [], [], [], None
        self._paused = ()
        return gone

    def _start(self, joining: _Joining) -> None:
        """Set up a conversation's answer: read a chunk a step, or answer next step."""
        session, rendered = joining.session, joining.prompt
        steps = session.answer_steps(
            joining.messages, replace(joining.sampling, speculative="off"),
            request_id=joining.request_id, cancel=joining.cancel,
            emit=self._read_beside(joining.emit), tick=joining.tick, prompt=rendered)
        next(steps)  # the checks: a conversation that cannot be answered fails here
        to_read = len(rendered.ids) - 1 - common_prefix(session.tokens, rendered.ids)
        if to_read <= 0:  # held already (e.g. a continued chat): it answers next step
            self._answer(session, finish(steps))
        else:
            self._read(_Reading(session, joining.request_id, steps, joining.cancel,
                                len(rendered.ids) + 1, joining.sampling.max_tokens))

    def _read_beside(self, emit: Emit) -> Emit:
        """``emit``, with a read's progress saying when answers decode beside it: its
        share of the time, and no chunk time (a decode pass runs in it too)."""
        def told(event: Event) -> None:
            if isinstance(event, IngestProgress) and self._queued is not None:
                event = replace(event, chunk_seconds=0.0, read_share=self._share.share)
            emit(event)
        return told

    def _read(self, reading: _Reading) -> None:
        reading.session.hold_to(reading.answered)
        self.reading.append(reading)

    # -- admission by memory -------------------------------------------------

    def _batch_sessions(self) -> list[Session]:
        """The sessions answering or being read in: their answers will end."""
        return [*(row.session for row in self.rows), *(r.session for r in self.reading)]

    def _held_ids(self, joining: _Joining) -> frozenset[str]:
        """The sessions the batch holds, and ``joining``'s: none of them may be set aside."""
        return self.session_ids() | {joining.session.session_id}

    def _refuse_if_never(self, joining: _Joining) -> None:
        """Raise what :meth:`Session.chat` raises alone when it could never fit: with
        the pages of the batch's other conversations, of the others waiting (alone,
        each would be idle at its turn) and of the idle sessions, gone."""
        # Session.answer_steps's checks, in its order and with its messages.
        count = len(joining.prompt.ids)
        gone = {s.session_id for s in self._batch_sessions()}
        gone.update(waiting.session.session_id for waiting in self._joining)
        gone.update(self._room.idle(self._held_ids(joining)))
        report = joining.session.fit_report(count, gone)
        report.raise_if_too_long()
        if report.for_mode(joining.session.mode).tokens_fit - count < 1:
            raise joining.session.fit_report(count + 1, gone).error()

    def _room_for(self, joining: _Joining) -> _Short:
        """What memory lacks for ``joining`` now (:meth:`_short_bytes`, and on a
        pipeline the other ranks' room), once idle sessions outside the batch were
        set aside for it where that makes it fit."""
        self._room.make_room(lambda gone: self._fits(joining, gone), self._held_ids(joining),
                             joining.request_id)
        short = _Short(*self._short_bytes(joining))
        if not short.fits or not (self.rows or self.reading):
            return short  # with nothing answering, its own checks decide, as alone
        return _Short(machine=self._other_machine_short(joining))

    def _other_machine_short(self, joining: _Joining) -> str | None:
        """On a pipeline, the machine that cannot hold ``joining``'s share of its
        layers beside the batch now (None: every one can, or one machine)."""
        followers = joining.session.followers
        if followers is None:
            return None
        # Their room grows only when a conversation leaves the batch, or now and
        # then as other programs free memory: asked again then, not at every step.
        batch = frozenset(session.session_id for session in self._batch_sessions())
        now, last = self._share.clock(), self._asked
        if (last is not None and last.request_id == joining.request_id
                and last.batch == batch and now - last.at < ASK_AGAIN_S):
            return last.machine
        # The reads and answers under way will still add pages there too, each in
        # its own mode, up to their length limits, as here: whole pages past the
        # one each fills now. (The room there is what its pools left, growth ahead
        # of their tokens taken: it errs toward waiting by that much.)
        coming: dict[KvMode, int] = {}
        for session, tokens in self._still_coming():
            coming[session.mode] = (coming.get(session.mode, 0)
                                    + _pages_past(session, tokens) * session.page_size)
        try:
            followers.room(self._joining_tokens(joining), joining.session.mode, coming,
                           decode_rows=self._rows_joined())
        except MachineShort as short:
            self._asked = _Asked(joining.request_id, batch, now, short.machine)
            return short.machine
        self._asked = None
        return None

    def _fits(self, joining: _Joining, gone: Collection[str]) -> bool:
        """Whether ``joining`` fits now with the sessions ``gone`` set aside: beside the
        batch, or with nothing answering or read in, as its own checks find alone."""
        if not self.rows and not self.reading:
            return joining.session.holds(len(joining.prompt.ids) + 1, gone)
        return self._short_bytes(joining, gone)[0] == 0

    def _short_bytes(self, joining: _Joining, gone: Collection[str] = ()) -> tuple[int, str]:
        """Bytes more than the guard holds now that joining needs (0: it fits),
        and the limit short of them ("is free", or the KV budget); with the
        sessions ``gone`` set aside (their pages back in the budget and in free
        RAM), when given.

        Its pages (the conversation and its answer up to its length limit) and
        those the reads and answers under way may still add up to theirs, within
        the KV budget the other sessions leave, and those pages plus the step's
        transient with one more row within free RAM: no answer of the batch then
        runs out of pages sooner than it would alone. With nothing answering or
        read in, nothing will free memory: it starts, and its own checks decide,
        as alone.
        """
        if not self.rows and not self.reading:
            return 0, FREE_RAM
        tokens = self._joining_tokens(joining)
        report = joining.session.fit_report(tokens, gone, decode_rows=self._rows_joined())
        # The report counts what the joining conversation's stores hold as its own
        # room: what every store must still grow by has to fit in the rest.
        grow = _bytes_to_grow([(joining.session, tokens), *self._still_coming()])
        held = joining.session.own_bytes()
        short, limit = grow - (report.free_bytes - held), FREE_RAM
        if report.budget_bytes is not None and grow - (report.budget_bytes - held) > short:
            short, limit = grow - (report.budget_bytes - held), KV_BUDGET
        return max(0, short), limit

    def _rows_joined(self) -> int:
        """Rows of a decode step once one more conversation answers beside the
        batch: every one answering or being read in, and the joining one."""
        return len(self.rows) + len(self.reading) + 1

    @staticmethod
    def _joining_tokens(joining: _Joining) -> int:
        """Tokens ``joining``'s pages may hold once it is answered (``_answered``)."""
        return _answered(joining.session, len(joining.prompt.ids), joining.sampling.max_tokens)

    def _still_coming(self) -> list[tuple[Session, int]]:
        """Each conversation being read in or answering, and the tokens its pages may
        hold once its answer reaches its length limit."""
        return [*((reading.session, reading.answered) for reading in self.reading),
                *((row.session, _still_to_answer(row)) for row in self.rows
                  if not row.finished)]

    def _hold_back(self, short: _Short) -> None:
        """Say why each waiting conversation waits: the first for what memory lacks
        (``short``), the rest for their turn."""
        first, *rest = self._joining
        first.short = short
        first.waiting = Waiting(first.request_id, short.reason(), max(0, short.bytes))
        for joining in rest:
            joining.waiting = Waiting(joining.request_id, short.behind(), 0,
                                      behind=first.request_id)

    def _admit(self, results: list[RowToken]) -> None:
        """Start the waiting conversations memory holds now, in the order they came;
        refuse those that could never fit, end those cancelled while waiting."""
        for joining in [j for j in self._joining if j.cancel.is_set()]:
            self._joining.remove(joining)
            results.append(RowToken(joining.request_id, None, "cancelled"))
        while self._joining:
            joining = self._joining[0]
            try:
                self._refuse_if_never(joining)
                short = self._room_for(joining)
                if not short.fits:
                    self._hold_back(short)
                    return
                # Waiting until it has started: a step that fails meanwhile
                # still finds it to end (abandon).
                self._start(joining)
                self._joining.pop(0)
                if joining.waiting is not None:  # said to wait: its first chunk is a while off
                    joining.emit(WaitEnded(joining.request_id))
            except EngineError as error:
                self._joining.remove(joining)
                joining.session.let_go()
                results.append(RowToken(joining.request_id, None, "error", error=error))

    def _check_joins(self, session: Session, request_id: int) -> None:
        if session.model is not self.model:
            raise EngineError("Only conversations of the same model can answer together.")
        queued = self._queued.rows if self._queued is not None else []
        busy = [row.session for row in [*self.rows, *queued]]
        busy += [r.session for r in self.reading] + [j.session for j in self._joining]
        if any(held is session for held in busy):
            raise EngineError(f"{session.session_id} is answering already.")
        waiting = tuple(joining.request_id for joining in self._joining)
        if request_id in self.request_ids + self.reading_ids + waiting:
            raise EngineError(f"Request {request_id} is answering already.")
        check_batchable([session.cache])

    def step(self) -> list[RowToken]:
        """Read one forward pass's tokens: the next pass, and one chunk of a
        conversation being read in when its turn has come (:class:`ReadShare`),
        are queued first.

        First the conversations waiting for memory join, in the order they came,
        as far as memory now holds them. The device runs the decode pass before
        the chunk, so the answering conversations keep their pace while a long
        document is read in. Rows cancelled or out of pages before their pass
        leave without a token. Returns what happened to each answering row, in
        batch order (and to a read that stopped short, and to a waiting
        conversation cancelled, or refused as it would be alone); rows that
        finished have left the batch.

        Raises:
            StepFailed: a pass (or a conversation's start) raised; every session
                involved is rolled back to the tokens it holds, and its row stays,
                fed its pending token again by the next step. It carries what the
                step did before (those conversations have left the batch).
        """
        results: list[RowToken] = []
        began = self._share.clock()
        involved = [*self.rows, *(self._queued.rows if self._queued is not None else [])]
        try:
            self._admit(results)
            if self._queued is None:
                self._queued = self._queue(self._next_rows(None, results), None)
            # Rows short of a page decode nothing: beside them alone a read goes on.
            # A stopped read ends now, not when the reads' share comes round again.
            read = bool(self.reading) and (
                self._share.due(answering=self._queued is not None)
                or any(reading.cancel.is_set() for reading in self.reading))
            if read:
                self._read_chunk(results)
                self._share.read(self._share.clock() - began)
            current = self._queued
            if current is None:
                return results
            # The next pass is queued before this one is read (mlx-lm's overlap).
            self._queued = self._queue(self._next_rows(current, results), current)
            ids: list[int] = current.sampled.tolist()  # type: ignore[assignment]
            if not read:
                self._share.decoded(self._share.clock() - began)
            for row, token in zip(current.rows, ids, strict=True):
                result = self._take(row, token)
                if result is not None:
                    results.append(result)
        except Exception as error:
            self._fail(involved)
            raise StepFailed(error, results) from error
        return results

    def _read_chunk(self, results: list[RowToken]) -> None:
        """Read one chunk of the read with the fewest tokens left; a read that ends
        joins the answering rows (no chunk then: its first pass goes before the next
        chunk). A stopped read goes first, and ends without reading."""
        if not self.reading:
            return
        stopped = [r for r in self.reading if r.cancel.is_set()]
        reading = stopped[0] if stopped else min(self.reading, key=lambda r: r.left)
        try:
            announced = next(reading.steps)
        except StopIteration as done:
            self.reading.remove(reading)
            self._answer(reading.session, done.value)
            return
        except EngineError as error:
            self.reading.remove(reading)
            reading.session.let_go()
            finish = "cancelled" if isinstance(error, Cancelled) else "error"
            results.append(RowToken(reading.request_id, None, finish, error=error))
            return
        # Any other error leaves the read to abandon(), which ends its request.
        if announced:
            # The next pass would take that chunk's messages on a pipeline's ranks.
            raise EngineError("A read beside other answers sent a chunk ahead; its "
                              "answers stop here rather than go on wrong.")

    def _answer(self, session: Session, answer: AnswerStart) -> None:
        """Add an answer whose conversation has been read in to the answering rows."""
        stream = answer.stream
        stream.history = mx.array(answer.prompt[-REPETITION_CONTEXT:-1], dtype=mx.int32)
        row = _Row(session, answer, answer.prompt[-1])
        session.hold_to(_still_to_answer(row))
        self.rows.append(row)

    def run(self) -> list[RowToken]:
        """Step until every answer finished; the finished rows, in the order they ended."""
        finished: list[RowToken] = []
        while not self.idle:
            finished.extend(r for r in self.step() if r.finish is not None)
        return finished

    def _next_rows(self, current: _Pass | None, results: list[RowToken]) -> list[_Row]:
        """The rows of the next pass; rows that leave before it go to ``results``."""
        rows: list[_Row] = []
        short: list[_Row] = []
        fed = [] if current is None else current.rows
        for row in list(self.rows):
            if row in fed:
                # As an answer alone queues its next pass: room left, no Stop.
                room = len(row.answer.stream.generated) + 1 < row.answer.max_tokens
                if not room or row.answer.watch.is_set():
                    continue
            elif row.answer.watch.is_set():
                results.append(self._finish(row, None, "cancelled"))
                continue
            if _holds_one_more(row.session) and _holds_beside(rows, row):
                rows.append(row)
            else:
                short.append(row)
        going = [row.session.guard for row in self.rows if row not in short]
        going += [reading.session.guard for reading in self.reading]
        paused = []
        for row in short:
            if any(guard is row.session.guard for guard in going):
                # Another answer under the same memory goes on or is ending, and its
                # end may give pages back (its chat closed or set aside): the row
                # sits this pass out, its next token kept, rather than end sooner
                # than alone (a pool's growth may have taken the room its admission
                # counted).
                paused.append(_pause(row.session, row.request_id))
                continue
            if self._make_room_for_one_more(row) and _holds_beside(rows, row):
                rows.append(row)
                continue
            # As an answer alone: the budget ends it as its length limit would.
            if row in fed:
                row.out_of_pages = True
            else:
                results.append(self._finish(row, None, "length"))
        self._paused = tuple(paused)
        return rows

    def _make_room_for_one_more(self, row: _Row) -> bool:
        """Set idle chats outside the batch aside (as for a joining conversation)
        until ``row``'s pages take its next token: the chats that answered beside it
        keep their pages once their answers end. Whether they take it now."""
        # A row the last pass fed holds that token in its cache already.
        tokens = cache_tokens(row.session.cache) + 1
        made = self._room.make_room(lambda gone: row.session.holds(tokens, gone),
                                    self.session_ids(), row.request_id)
        return made and _holds_one_more(row.session)

    def _queue(self, rows: list[_Row], current: _Pass | None) -> _Pass | None:
        """Build and start one pass for ``rows``: each fed its pending token, or the
        token ``current`` is computing for it."""
        if not rows:
            return None
        computing = {} if current is None else {id(row): current.sampled[index:index + 1]
                                                for index, row in enumerate(current.rows)}
        inputs = [computing.get(id(row), mx.array([row.pending], dtype=mx.int32))
                  for row in rows]
        tokens = mx.concatenate(inputs)[:, None]
        cache = BatchedCache([row.session.cache for row in rows])
        model = _pass_model(self.model, [row.session for row in rows])
        logits = model(tokens, cache=cache.layers)[:, -1, :]
        cache.write_back()
        sampled = mx.concatenate([row.answer.stream.sample(tokens[index], logits[index:index + 1])
                                  for index, row in enumerate(rows)])
        mx.async_eval(sampled)
        return _Pass(rows, sampled)

    def _fail(self, rows: list[_Row]) -> None:
        """Bring every row's session back to the tokens it holds."""
        # A failed pass may leave layers at different lengths, and a queued one
        # may have written pages past the tokens held.
        self._queued = None
        for row in rows:
            row.session.rollback()

    def _take(self, row: _Row, token: int) -> RowToken | None:
        """Hold the token the pass fed, then stream the one it sampled (or finish).

        None for a row whose answer had ended (the pass fed its last token).
        """
        row.session.tokens.append(row.pending)
        row.pending = token
        stream = row.answer.stream
        stream.steps += 1
        if row.finished:
            return None
        reason = stream.receive(token, row.answer.max_tokens)
        if reason is None and row.out_of_pages:
            reason = "length"
        if reason is None:
            return RowToken(row.request_id, token)
        return self._finish(row, token, reason)

    def _finish(self, row: _Row, token: int | None, reason: str) -> RowToken:
        self.rows.remove(row)
        # Paused for the next pass, it may end on this pass's token: it waits no more.
        self._paused = tuple(w for w in self._paused if w.request_id != row.request_id)
        row.session.let_go()
        row.finished = True
        row.answer.stream.flush()
        reason, stats = row.session.finish_answer(row.answer, reason)
        return RowToken(row.request_id, token, reason, stats)


def _holds_one_more(session: Session) -> bool:
    """Whether ``session``'s pages can take its next token."""
    if _has_room(session):
        return True
    # Its pool's limit was set when its answer started: other chats' pages may
    # have gone since.
    session.guard.refresh(session.session_id)
    return _has_room(session)


def _holds_beside(rows: list[_Row], row: _Row) -> bool:
    """Whether ``row``'s next token fits beside those of ``rows`` (its pass's) in
    the page stores it shares with them (chats on one document): each alone may
    have counted the same free slot."""
    pool = row.session.page_pool()
    if pool is None or not pool.shared:
        return True
    wants = [(held, cache_tokens(each.session.cache) + 1) for each in [*rows, row]
             if (held := each.session.page_pool()) is not None]
    try:
        pages.ensure_together(wants)
    except KvBudgetExceeded:
        return False
    return True


def _pause(session: Session, request_id: int) -> Waiting:
    """Why the answer of ``session`` sits out the passes: its next page, and the
    limit it does not fit."""
    limit = FREE_RAM if session.guard.ram_bound(session.session_id) else KV_BUDGET
    page_bytes = session.page_size * session.kv_token_bytes
    return Waiting(request_id, (f"Waiting for memory: this answer's next page "
                                f"({human_bytes(page_bytes)}) does not fit in what {limit}; "
                                "it goes on when another answer ends."), page_bytes)


def _has_room(session: Session) -> bool:
    try:
        adapter.ensure_capacity(session.cache, 1)
    except KvBudgetExceeded:
        return False
    return True


def _answered(session: Session, tokens: int, answer_tokens: int) -> int:
    """Tokens ``session``'s pages may hold once an answer of at most ``answer_tokens``
    follows its ``tokens``: no more than the model's context, where it ends anyway."""
    return min(tokens + max(0, answer_tokens), session.max_context)


def _bytes_to_grow(wants: list[tuple[Session, int]]) -> int:
    """Bytes the page stores of the sessions in ``wants`` must still grow by for each
    to hold its tokens (the guard counts what they allocated so far only); stores
    that chats share count once, with what each of them needs."""
    return pages.bytes_to_grow((pool, tokens) for session, tokens in wants
                               if (pool := session.page_pool()) is not None)


def _pages_past(session: Session, tokens: int) -> int:
    """Pages ``session`` needs for ``tokens`` beyond those its held tokens fill."""
    def pages_for(count: int) -> int:
        return -(-count // session.page_size)
    return max(0, pages_for(tokens) - pages_for(len(session.tokens)))


def _still_to_answer(row: _Row) -> int:
    """Tokens ``row``'s pages may hold once its answer reaches its length limit."""
    answer = row.answer
    return _answered(row.session, len(row.session.tokens),
                     answer.max_tokens - len(answer.stream.generated))


def _pass_model(model: Any, sessions: list[Session]) -> DecodeStep:
    """``model`` for one pass over ``sessions``: on a pipeline, each call is sent to
    the other ranks first, as one decode step of every row."""
    links = [session.followers for session in sessions]
    held = [link for link in links if link is not None]
    if not held:
        return model
    if len(held) != len(links):
        raise EngineError("A conversation split over several machines cannot share a pass "
                          "with one that is not.")
    return held[0].decoding_rows(model, held)
