"""Chunked prefill: how new ids reach a session's cache, and what stops them.

The chunk plan comes from token positions and the chunk size setting only:
chunks end at multiples of the chunk size, at message boundaries and at the end
of what is new. In a quantized mode the model's own matmuls round by chunk
length, so a plan that followed the clock or free RAM would give the same chat a
different answer on a busy machine. When free RAM cannot hold the planned chunk
the read waits for it (with a notice), and stops where it is if it never comes.

Whatever stops a prefill (a cancel, memory, the KV budget, a failed allocation),
the chunks that finished stay held, and the error in the result says how many.

On a pipeline the other ranks may be sent the next chunk ahead, so that they
read it while this rank runs its own layers of the current one; a chunk sent
ahead is read whatever happens meanwhile (a cancel, a memory stop), so a stop
lands one chunk later there than on one machine. A chunk sent ahead must be the
next thing the other ranks get: a read run a chunk at a time says after each
chunk whether it sent the next one ahead, and sends ahead only while its
caller's ``ahead`` allows (a batch's decode passes run between its chunks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import mlx.core as mx

from engine.errors import (
    Cancelled,
    EngineError,
    InsufficientMemory,
    KvBudgetExceeded,
    MemoryPressure,
    MemoryShort,
)
from engine.events import AnswerWaiting, Event, IngestProgress, WaitEnded
from engine.format import human_bytes
from engine.memory.fit import FitReport
from engine.memory.guard import MemoryGuard, PressureWatch

Emit = Callable[[Event], None]
# How long a read waits for free RAM to hold its next chunk before it stops.
MEMORY_WAIT_SECONDS = 30.0
# How often a waiting read looks at free RAM (and at Stop) again.
MEMORY_POLL_SECONDS = 0.25


@dataclass(frozen=True)
class PrefillResult:
    """What one prefill did.

    Attributes:
        read: tokens it fed through the model.
        kept: tokens the cache holds when it ended (of the conversation).
        total: tokens of the conversation it was reading in.
        seconds: how long it took.
        stop: why it ended before reading everything (an error that says how
            many tokens it kept), None when it read everything.
        memory: the memory reading that stopped it, for logs; None when memory
            did not.
    """

    read: int
    kept: int
    total: int
    seconds: float
    stop: EngineError | None = None
    memory: str | None = None

    def raise_if_stopped(self) -> None:
        """Raise ``stop``, if the prefill stopped short."""
        if self.stop is not None:
            raise self.stop


@dataclass(frozen=True)
class Chunk:
    """One chunk of the plan: its ids, and whether it ends where a message does."""

    ids: list[int]
    boundary: bool


class PrefillTarget(Protocol):
    """What a prefill needs of the session it reads into."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def reads_ahead(self) -> bool:
        """Whether ``forward`` can send the next chunk ahead (other ranks read it)."""

    def forward(self, chunk: Chunk, *, ahead: Chunk | None = None,
                announced: bool = False) -> bool:
        """Run ``chunk`` into the cache, hold and checkpoint it, or change nothing;
        whether ``ahead`` was sent on (then it is the next chunk forwarded, ``announced``)."""

    def rollback(self) -> None:
        """Bring every layer back to the tokens held, after a failed step."""

    def chunk_bytes(self, tokens: int) -> int:
        """Free RAM a chunk of ``tokens`` needs while it runs."""

    def fit_report(self, token_count: int) -> FitReport:
        """Whether ``token_count`` tokens fit (a ``fit.FitReport``)."""


def chunk_plan(start: int, stop: int, chunk_size: int,
               boundaries: list[int] | tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """The chunks that feed positions ``start`` to ``stop``, as (begin, end) positions.

    A chunk ends at the next multiple of ``chunk_size``, the next of ``boundaries``
    or ``stop``, whichever comes first: the same positions give the same chunks,
    however the read is paced or resumed.
    """
    cuts = sorted(b for b in boundaries if start < b < stop)
    chunks: list[tuple[int, int]] = []
    done = start
    while done < stop:
        end = min((done // chunk_size + 1) * chunk_size, stop)
        while cuts and cuts[0] <= done:
            cuts.pop(0)
        if cuts and cuts[0] < end:
            end = cuts.pop(0)
        chunks.append((done, end))
        done = end
    return chunks


class ChunkedPrefill:
    """Feeds ids to a session's cache along the chunk plan (see the module docstring).

    Args:
        target: the session read into.
        guard: the memory guard whose free RAM each chunk must fit.
        key: the session's name with ``guard``.
        chunk_size: tokens per chunk (the setting).
        clock: seconds, for timings and the memory wait.
        sleep: waits while free RAM cannot hold the next chunk.
        memory_wait: seconds to wait for free RAM before the read stops.
    """

    def __init__(
        self,
        target: PrefillTarget,
        guard: MemoryGuard,
        key: str,
        chunk_size: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        memory_wait: float = MEMORY_WAIT_SECONDS,
    ) -> None:
        self.target = target
        self.guard = guard
        self.key = key
        self.chunk_size = chunk_size
        self.clock = clock
        self.sleep = sleep
        self.memory_wait = memory_wait

    def run(
        self,
        ids: list[int],
        boundaries: list[int],
        *,
        request_id: int,
        watch: PressureWatch,
        emit: Emit,
        tick: Callable[[], None],
        total: int,
    ) -> PrefillResult:
        """Feed ``ids`` after the held tokens; what was read and why it stopped, if it did.

        ``boundaries`` (token positions, e.g. where messages end) also end a chunk;
        a model that needs checkpoints gets one there and after every chunk.
        ``total`` is the conversation's length, for the words of a stop.
        Exceptions that are neither memory nor a stop propagate, the cache rolled
        back to the tokens held.
        """
        return finish(self.chunks(ids, boundaries, request_id=request_id, watch=watch,
                                  emit=emit, tick=tick, total=total, ahead=always))

    def chunks(
        self,
        ids: list[int],
        boundaries: list[int],
        *,
        request_id: int,
        watch: PressureWatch,
        emit: Emit,
        tick: Callable[[], None],
        total: int,
        ahead: Callable[[], bool],
    ) -> Generator[bool, None, PrefillResult]:
        """:meth:`run`, one chunk a ``next``: yields after each chunk it read whether
        it sent the next one ahead (then the next ``next`` must come before anything
        else reaches a pipeline's other ranks), as far as ``ahead`` allows it.

        Its return value (``StopIteration.value``) is :meth:`run`'s result; the
        caller may do other work between two chunks (a batch's decode steps)
        where the last one sent nothing ahead.
        """
        start = self.clock()
        base = len(self.target.tokens)
        read = 0
        plan = [Chunk(ids[begin - base:end - base], end in boundaries or end == base + len(ids))
                for begin, end in chunk_plan(base, base + len(ids), self.chunk_size, boundaries)]
        announced = False
        try:
            for index, chunk in enumerate(plan):
                size = len(chunk.ids)
                # A chunk sent ahead is already in the other ranks' layers: read it.
                if not announced:
                    short = 0 if watch.is_set() else self._wait_for_room(
                        size, watch, request_id, emit, tick)
                    if short or watch.is_set():
                        return self._stopped(read, total, start, watch, short)
                following = self._ahead(plan[index + 1:index + 2], watch, ahead)
                chunk_began = self.clock()
                try:
                    announced = self.target.forward(chunk, ahead=following, announced=announced)
                except KvBudgetExceeded:
                    # Free RAM, not the budget, refused the pages: wait for it once, and
                    # try the same chunk again (a second refusal is the answer). Nothing
                    # was sent ahead: the refusal comes before any rank reads.
                    if not self.guard.ram_bound(self.key):
                        raise
                    short = self._wait_for_room(self.chunk_size, watch, request_id, emit,
                                                tick, pages=True)
                    if short or watch.is_set():
                        return self._stopped(read, total, start, watch, short)
                    chunk_began = self.clock()
                    announced = self.target.forward(chunk)
                read += size
                mx.clear_cache()
                now = self.clock()
                elapsed = max(now - start, 1e-9)
                rate = read / elapsed
                eta = (len(ids) - read) / rate if rate > 0 else None
                emit(IngestProgress(request_id, read, len(ids), rate, eta,
                                    size, base + read - size, now - chunk_began))
                tick()
                yield announced
        except KvBudgetExceeded as error:
            # Raised before the chunk touched any layer.
            return self._refused(error, read, total, start)
        except Exception as error:
            self.target.rollback()
            if not _out_of_memory(error):
                raise
            kept = len(self.target.tokens)
            stop = InsufficientMemory(
                f"Longleaf ran out of memory reading the conversation in ({error}). "
                f"It {_kept_words(kept, total)}; close other apps or conversations, or "
                "lower the ingest chunk, then send again to continue from there."
            ).stopped_reading(kept, total)
            return PrefillResult(read, kept, total, self.clock() - start, stop, str(error))
        return PrefillResult(read, len(self.target.tokens), total, self.clock() - start)

    def _ahead(self, following: list[Chunk], watch: PressureWatch,
               ahead: Callable[[], bool]) -> Chunk | None:
        """The next chunk, to send ahead, when there is one, the target sends chunks
        ahead, nothing asked the read to stop, the caller allows it and free RAM
        holds it now."""
        if not following or not self.target.reads_ahead or watch.is_set() or not ahead():
            return None
        chunk = following[0]
        if self.guard.free_bytes() < self.target.chunk_bytes(len(chunk.ids)):
            return None
        return chunk

    def _wait_for_room(self, tokens: int, watch: PressureWatch, request_id: int, emit: Emit,
                       tick: Callable[[], None], *, pages: bool = False) -> int:
        """Wait (with a notice) until free RAM holds a chunk of ``tokens``; 0 once it does
        or the read was stopped meanwhile, else the bytes that never came free.

        With ``pages`` the chunk's pages were just refused: wait even if free RAM
        seems to hold the chunk now (the pool's limit is brought up to date).
        """
        needed = self.target.chunk_bytes(tokens)
        if not pages and self.guard.free_bytes() >= needed:
            return 0
        # Said as a wait (not a notice): a front end shows it with the read's
        # progress, until the next chunk's progress replaces it.
        emit(AnswerWaiting(request_id, f"Waiting for {human_bytes(needed)} of free memory to "
                                       f"read the next {tokens:,} tokens; close other apps "
                                       "to continue.",
                           max(0, needed - self.guard.free_bytes())))
        # Counted in polls, not read off the clock: a test's sleep need not pass time.
        for _ in range(math.ceil(self.memory_wait / MEMORY_POLL_SECONDS)):
            self.sleep(MEMORY_POLL_SECONDS)
            tick()
            if watch.is_set():
                return 0
            if self.guard.free_bytes() >= needed:
                # The pool's limit was set while RAM was short: give it back its share.
                self.guard.refresh(self.key)
                emit(WaitEnded(request_id))
                return 0
        return needed

    def _stopped(self, read: int, total: int, start: float, watch: PressureWatch,
                 short: int) -> PrefillResult:
        """The result of a read stopped between two chunks: by Stop, memory or no room."""
        kept = len(self.target.tokens)
        words = _kept_words(kept, total)
        seconds = self.clock() - start
        if watch.cancel.is_set():
            stop: EngineError = Cancelled("Ingest cancelled.")
            return PrefillResult(read, kept, total, seconds, stop.stopped_reading(kept, total))
        if watch.tripped is not None:
            stop = MemoryPressure(
                f"Longleaf stopped reading the conversation in: {watch.tripped}. It {words}; "
                "close other apps or conversations to free memory, then send again "
                "to continue from there.")
            return PrefillResult(read, kept, total, seconds, stop.stopped_reading(kept, total),
                                 watch.tripped)
        reason = f"free RAM did not come to hold the next prefill chunk ({human_bytes(short)})"
        # Free RAM, not the configured budget, ran out: the fit report says so with numbers.
        stop = MemoryShort(
            f"{self.target.fit_report(total).message()} Longleaf waited "
            f"{self.memory_wait:g} s for the {human_bytes(short)} of free memory its next "
            f"chunk needs. Longleaf {words}.")
        return PrefillResult(read, kept, total, seconds, stop.stopped_reading(kept, total),
                             reason)

    def _refused(self, error: KvBudgetExceeded, read: int, total: int,
                 start: float) -> PrefillResult:
        """The result of a chunk the page pool refused: the budget, or free RAM, is full."""
        kept = len(self.target.tokens)
        words = f"Longleaf {_kept_words(kept, total)}."
        seconds = self.clock() - start
        if self.guard.ram_bound(self.key):
            # Free RAM, not the configured budget, ran out: say so with numbers.
            stop: EngineError = MemoryShort(
                f"{self.target.fit_report(total).message()} {words}")
            stop.__cause__ = error
            return PrefillResult(read, kept, total, seconds, stop.stopped_reading(kept, total),
                                 str(error))
        stop = KvBudgetExceeded(
            f"{error} {words}", tokens_requested=error.tokens_requested,
            tokens_fit=error.tokens_fit, suggested_mode=error.suggested_mode,
        )
        stop.__cause__ = error
        return PrefillResult(read, kept, total, seconds, stop.stopped_reading(kept, total))


ResultT = TypeVar("ResultT")


def always() -> bool:
    """A read's ``ahead`` when nothing runs between its chunks: send ahead where it can."""
    return True


def never() -> bool:
    """A read's ``ahead`` when other work runs between its chunks: send nothing ahead."""
    return False


def finish(steps: Generator[bool, None, ResultT]) -> ResultT:
    """Run a generator of steps (e.g. :meth:`ChunkedPrefill.chunks`) to its end;
    its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _kept_words(kept: int, total: int) -> str:
    """The words for where a read stopped ("kept 8 of 20 tokens")."""
    return f"kept {kept:,} of {total:,} tokens"


def activation_value_bytes() -> int:
    """Bytes of one activation value: MLX computes in fp32 on the CPU, 16-bit on a GPU."""
    return 4 if mx.default_device() == mx.cpu else 2


def _out_of_memory(error: Exception) -> bool:
    """Whether ``error`` is a failed allocation (Python's, or MLX's RuntimeError)."""
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("alloc" in text or "out of memory" in text)
