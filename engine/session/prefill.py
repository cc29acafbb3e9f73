"""Chunked prefill: how a session feeds a prompt to its cache, and what stops it.

A mixin of :class:`engine.session.session.Session`, which owns the state it uses (model,
cache, held ids, guard, checkpoints). Chunks are paced so progress and stats keep
flowing on slow machines; whatever stops a prefill (a cancel, memory pressure, the
KV budget, a failed allocation), the chunks that finished stay held and the error
says how many.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from engine.cache import adapter
from engine.errors import (
    Cancelled,
    ContextTooLong,
    InsufficientMemory,
    KvBudgetExceeded,
    MemoryPressure,
)
from engine.events import IngestProgress
from engine.memory.guard import PressureWatch

Emit = Callable[[object], None]
MIN_CHUNK = 64  # below this, prefill spends more on per-call overhead than on tokens


class _NoRoom(Exception):
    """Free RAM cannot hold even a one-token prefill chunk's scratch and activations."""


class ChunkedPrefill:
    """Prefill in chunks for a Session (see the module docstring)."""

    # Provided by Session.
    model: Any
    cache: list[Any]
    tokens: list[int]
    chunk_size: int
    chunk_seconds: float | None
    clock: Callable[[], float]
    _paced_chunk: int
    guard: Any
    prefill_facts: Any
    kv_token_bytes: int

    def _forward(self, ids: list[int]) -> None:
        # Raises KvBudgetExceeded before any layer changes.
        adapter.ensure_capacity(self.cache, len(ids))
        self.model(mx.array(ids)[None], cache=self.cache)
        # Evaluating the cache (not the logits) runs every layer but skips the
        # vocabulary projection of the whole chunk, as mlx-lm's prefill does.
        mx.eval(adapter.eval_targets(self.cache))
        # Only a finished chunk counts as held: a failure above rolls back to here.
        self.tokens.extend(ids)

    def prefill(
        self,
        ids: list[int],
        *,
        request_id: int,
        cancel: threading.Event | PressureWatch,
        emit: Emit,
        tick: Callable[[], None],
        boundaries: list[int] | None = None,
    ) -> float:
        """Feed ``ids`` to the cache in chunks; returns the seconds it took.

        ``boundaries`` (token counts, e.g. where messages end) also end a chunk;
        a model that needs checkpoints gets one there and after every chunk.

        Raises:
            Cancelled: ``cancel`` was set (or, for a ``PressureWatch``, memory turned
                critical) between two chunks; the chunks done stay held.
        """
        start = self.clock()
        base = len(self.tokens)
        newest = self.checkpoints.newest()
        if ids and (newest is None or newest.tokens != base):
            self._checkpoint(boundary=True)  # e.g. after an answer: a failure comes back here
        cuts = [b - base for b in boundaries or () if 0 < b - base < len(ids)]
        done = 0
        size = self._paced_chunk
        while done < len(ids):
            if cancel.is_set():
                raise Cancelled("Ingest cancelled.")
            end = min([done + self._fitting(size), len(ids), *(c for c in cuts if c > done)])
            chunk = ids[done:end]
            began = self.clock()
            self._forward(chunk)
            if len(chunk) == size:
                # Short chunks (the last one, or cut at a message) are mostly
                # per-call overhead: a poor guide for the next size.
                size = self._next_chunk(size, self.clock() - began)
                self._paced_chunk = size
            done += len(chunk)
            self.tokens_ingested += len(chunk)
            self._checkpoint(boundary=done in cuts or done == len(ids))
            mx.clear_cache()
            elapsed = max(self.clock() - start, 1e-9)
            rate = done / elapsed
            eta = (len(ids) - done) / rate if rate > 0 else None
            emit(IngestProgress(request_id, done, len(ids), rate, eta))
            tick()
        return self.clock() - start

    def _fitting(self, size: int) -> int:
        """``size``, or fewer tokens when free RAM holds no larger chunk's peak.

        Raises:
            _NoRoom: not even one token's chunk fits.
        """
        facts = self.prefill_facts
        room = self.guard.chunk_room(facts.activation_bytes_per_token + self.kv_token_bytes,
                                     facts.scratch_bytes)
        if room < 1:
            raise _NoRoom("free RAM cannot hold one more prefill chunk")
        return min(size, room)

    def set_chunk_size(self, chunk_size: int) -> None:
        """Use ``chunk_size`` as the largest prefill chunk from the next one on."""
        self.chunk_size = chunk_size
        paced = self.chunk_seconds is not None
        self._paced_chunk = min(self._paced_chunk, chunk_size) if paced else chunk_size
        self._attach_pool()  # the guard keeps the new chunk's transient free of pages

    def _next_chunk(self, last: int, seconds: float) -> int:
        if self.chunk_seconds is None or seconds <= 0:
            return self.chunk_size
        scaled = int(last * self.chunk_seconds / seconds)
        return max(min(MIN_CHUNK, self.chunk_size), min(self.chunk_size, scaled))

    def _kept(self, total: int) -> str:
        """Record where the prefill stopped; the words for it ("kept 8 of 20 tokens")."""
        self.prefill_stop = (len(self.tokens), total)
        return f"kept {len(self.tokens):,} of {total:,} tokens"

    def _guarded_prefill(
        self,
        ids: list[int],
        boundaries: list[int],
        request_id: int,
        watch: PressureWatch,
        emit: Emit,
        tick: Callable[[], None],
        *,
        total: int,
    ) -> float:
        # Whatever stops a prefill, the chunks that finished stay held: never a reset.
        try:
            return self.prefill(ids, request_id=request_id, cancel=watch, emit=emit, tick=tick,
                                boundaries=boundaries)
        except Cancelled:
            kept = self._kept(total)
            if watch.tripped is not None and not watch.cancel.is_set():
                self.memory_stop = watch.tripped
                raise MemoryPressure(
                    f"Longleaf stopped reading the conversation in: {watch.tripped}. It {kept}; "
                    "close other apps or conversations to free memory, then send again "
                    "to continue from there."
                ) from None
            raise
        except (_NoRoom, KvBudgetExceeded) as error:
            # Raised before the chunk touched any layer.
            kept = f"Longleaf {self._kept(total)}."
            if isinstance(error, _NoRoom) or self.guard.ram_bound(self.session_id):
                # Free RAM, not the configured budget, ran out: say so with numbers.
                self.memory_stop = str(error)
                raise ContextTooLong(f"{self.fit_report(total).message()} {kept}") from error
            raise KvBudgetExceeded(
                f"{error} {kept}", tokens_requested=error.tokens_requested,
                tokens_fit=error.tokens_fit, suggested_mode=error.suggested_mode,
            ) from error
        except Exception as error:
            self.rollback()
            if not _out_of_memory(error):
                raise
            self.memory_stop = str(error)
            raise InsufficientMemory(
                f"Longleaf ran out of memory reading the conversation in ({error}). "
                f"It {self._kept(total)}; close other apps or conversations, or "
                "lower the ingest chunk, then send again to continue from there."
            ) from error


def activation_value_bytes() -> int:
    """Bytes of one activation value: MLX computes in fp32 on the CPU, 16-bit on a GPU."""
    return 4 if mx.default_device() == mx.cpu else 2


def _out_of_memory(error: Exception) -> bool:
    """Whether ``error`` is a failed allocation (Python's, or MLX's RuntimeError)."""
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("alloc" in text or "out of memory" in text)
