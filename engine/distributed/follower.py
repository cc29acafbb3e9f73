"""A pipeline rank other than 0: its layers' caches, driven by rank 0's commands.

A follower has no tokenizer use, no sampling and no schedule of its own: it
reads a command header (``engine.distributed.rank_commands``), does what it says to
the session it names (the same ``Session`` class rank 0 uses, so pages,
checkpoints and rewinds happen the same way on its layers) and reads the next.
A cancel on rank 0 is simply the end of its commands: a follower stops after
the chunk in flight. A command it cannot follow (another protocol version, a
cache that disagrees with rank 0's token count) ends the follower with an error,
which the launcher's watchdog turns into the group's error naming this rank.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.cache import adapter
from engine.cache.adapter import CacheStats
from engine.cache.batched import BatchedCache, check_batchable
from engine.cache.modes import MODES
from engine.distributed import rank_commands as c
from engine.errors import EngineError, KvBudgetExceeded
from engine.memory import fit
from engine.memory.guard import MemoryGuard
from engine.models.loader import LoadedModel
from engine.session import reuse
from engine.session.prefill import Chunk, activation_value_bytes
from engine.session.session import DEFAULT_PAGE_SIZE, Session
from engine.snapshots.files import manifest_path, rank_folder
from engine.snapshots.manifest import Corrupt, delete_snapshot, list_snapshots, read_manifest
from engine.snapshots.snapshot import load_snapshot, save_snapshot

log = logging.getLogger(__name__)
_ROTATIONS = {code: rotate for rotate, code in c.ROTATE_CODES.items()}


class Follower:
    """Follows rank 0 until it says stop.

    Args:
        group: the pipeline's ``mx.distributed`` group (this rank is not 0).
        loaded: this rank's stage of the model (``engine.models.loader.load_model``).
        guard: this rank's own page budget and memory guard.
    """

    def __init__(self, group: mx.distributed.Group, loaded: LoadedModel, guard: MemoryGuard,
                 snapshots: Path | None = None) -> None:
        self.group = group
        self.rank = group.rank()
        self.names, fingerprint = c.pipeline_identity(group, loaded)
        self.loaded = dataclasses.replace(loaded, fingerprint=fingerprint)
        self.guard = guard
        self.snapshots = snapshots  # this rank's folder of stored KV (None: none)
        self.sessions: dict[int, Session] = {}
        self.ends: list[int] = []  # tokens held at each request's end, as rank 0 held them
        self.cancelled = 0
        self.last: dict[str, Any] = {}  # this rank's stats at the last request's end
        self._step: mx.array | None = None  # the decode step in flight
        self._unopened_prefill: fit.PrefillFacts | None = None  # of chats not opened yet
        self._handlers: dict[int, Callable[..., None]] = {
            c.OPEN: self._open, c.PREFILL: self._prefill, c.DECODE: self._decode,
            c.CHECKPOINT: self._checkpoint, c.REWIND: self._rewind, c.RESET: self._reset,
            c.CLOSE: self._close, c.END: self._end, c.FIT: self._fit,
            c.SAVE: self._save, c.RESTORE: self._restore, c.ADOPT: self._adopt,
            c.PRUNE: self._prune, c.DECODE_ROWS: self._decode_rows,
            c.CEILING: self._ceiling, c.CHUNK_SIZE: self._chunk_size,
        }

    def run(self) -> dict[str, Any]:
        """Follow commands until ``STOP``; this rank's report."""
        while True:
            fields = c.int_list(c.receive(self.group, mx.zeros((c.HEADER,), dtype=mx.int32)))
            version, op, slot, *args = fields
            if version != c.VERSION:
                raise c.PipelineDesync(
                    f"rank 0 speaks command version {version}, this rank {c.VERSION}: run the "
                    "same Longleaf version on every machine.")
            if op == c.STOP:
                return self.report()
            handler = self._handlers.get(op)
            if handler is None:
                raise c.PipelineDesync(f"rank 0 sent an unknown command ({op}).")
            handler(slot, *args)

    def report(self) -> dict[str, Any]:
        """This rank's share of the cache at the last request's end (plain values)."""
        return {"rank": self.rank, "host": self.names[self.rank], "ends": self.ends,
                "cancelled": self.cancelled, **self.last}

    # -- commands ------------------------------------------------------------

    def _session(self, slot: int, op: int) -> Session:
        session = self.sessions.get(slot)
        if session is None:
            raise c.PipelineDesync(f"rank 0 sent a {c.OP_NAMES[op]} for a session this rank "
                                   "does not hold.")
        return session

    def _expect(self, session: Session, tokens: int, op: int) -> None:
        if len(session.tokens) != tokens:
            raise c.PipelineDesync(
                f"this rank holds {len(session.tokens):,} tokens where rank 0 holds "
                f"{tokens:,} (at a {c.OP_NAMES[op]}).")

    def _open(self, slot: int, mode: int, page_size: int, rotate: int, chunk: int,
              _token: int) -> None:
        old = self.sessions.pop(slot, None)
        if old is not None:
            old.close()
        self.sessions[slot] = Session(f"rank{self.rank}-{slot}", self.loaded, MODES.at(mode),
                                      page_size, chunk_size=chunk, guard=self.guard,
                                      rotate=_ROTATIONS[rotate])
        c.gather_replies(self.group, memory_reply(self.sessions[slot], 0))

    def _prefill(self, slot: int, count: int, position: int, boundary: int, *_: int) -> None:
        session = self._session(slot, c.PREFILL)
        ids = c.int_list(c.receive(self.group, mx.zeros((count,), dtype=mx.int32)))
        self._expect(session, position, c.PREFILL)
        self._hold(session, len(ids))
        # Checkpointed here, right after the chunk: rank 0 may have sent the next
        # chunk already, so a checkpoint command of its own would come too late.
        session.forward(Chunk(ids, bool(boundary)))

    def _decode(self, slot: int, *args: int) -> None:
        session = self._session(slot, c.DECODE)
        token = args[-1]
        self._hold(session, 1)
        # The inner model's output ends in mlx-lm's all_gather, which rank 0 waits
        # on; only rank 0 samples, so this rank skips the vocabulary projection.
        # Not waited for: the next command's receive queues behind it, so it
        # starts the moment the step ends, without a host sync in between.
        self._step = session.model.model(mx.array([[token]]), cache=session.cache)
        mx.async_eval(self._step)
        last = session.cache[-1]
        if getattr(last, "pipeline_dependency", None) is not None:
            # mlx-lm chains each step's send onto the last layer's ``keys`` hook; the
            # step's output reaches the send already, and the chain, never evaluated
            # in decode, would grow by a node (and a hidden state) per token.
            last.keys = None
        session.tokens.append(token)

    def _decode_rows(self, _slot: int, count: int, *_: int) -> None:
        """One pass of rank 0's batch: a token for each of ``count`` sessions."""
        fields = c.int_list(c.receive(self.group, mx.zeros((2 * count,), dtype=mx.int32)))
        sessions = [self._session(slot, c.DECODE_ROWS) for slot in fields[:count]]
        tokens = fields[count:]
        for session in sessions:
            self._hold(session, 1)
        # The pass's views drop mlx-lm's ``keys`` hook (``engine.cache.batched``),
        # so no chain grows as in :meth:`_decode`; the rest as there.
        batched = BatchedCache([session.cache for session in sessions])
        self._step = sessions[0].model.model(mx.array(tokens, dtype=mx.int32)[:, None],
                                             cache=batched.layers)
        batched.write_back()
        mx.async_eval(self._step)
        for session, token in zip(sessions, tokens, strict=True):
            session.tokens.append(token)

    def _hold(self, session: Session, tokens: int) -> None:
        """Reserve the pages of ``tokens`` more tokens of ``session``: rank 0 sends
        them once it counted this rank's room for them (its fit checks).

        Raises:
            KvBudgetExceeded: this machine's memory shrank since (the rank named).
        """
        try:
            adapter.ensure_capacity(session.cache, tokens)
            return
        except KvBudgetExceeded:
            # The pool's limit is the one set at its last refresh (the session's
            # open, a ceiling); the room this rank reported since may be larger.
            session.guard.refresh(session.session_id)
        try:
            adapter.ensure_capacity(session.cache, tokens)
        except KvBudgetExceeded as error:
            raise KvBudgetExceeded(
                f"On rank {self.rank} ({self.names[self.rank]}): {error}",
                tokens_requested=error.tokens_requested, tokens_fit=error.tokens_fit,
                suggested_mode=error.suggested_mode) from error

    def _checkpoint(self, slot: int, boundary: int, position: int, *_: int) -> None:
        session = self._session(slot, c.CHECKPOINT)
        self._expect(session, position, c.CHECKPOINT)
        session.checkpoint(boundary=bool(boundary))

    def _rewind(self, slot: int, _length: int, kept: int, *_: int) -> None:
        session = self._session(slot, c.REWIND)
        # Where rank 0 went: its checkpoints are this rank's (taken at the same
        # commands), so the same count is reachable here, whatever length rank 0 asked for.
        session.rewind(kept)
        self._expect(session, kept, c.REWIND)

    def _reset(self, slot: int, *_: int) -> None:
        self._session(slot, c.RESET).reset()

    def _close(self, slot: int, *_: int) -> None:
        self._session(slot, c.CLOSE).close()
        del self.sessions[slot]

    def _end(self, slot: int, held: int, cancelled: int, answer: int, *_: int) -> None:
        session = self._session(slot, c.END)
        self._expect(session, held, c.END)
        session.let_go()  # its next request may answer alone
        self.ends.append(held)
        self.cancelled += cancelled
        self.last = rank_stats(session, self.rank)
        mx.clear_cache()
        if answer:
            c.gather_replies(self.group, memory_reply(session, held))

    def _ceiling(self, slot: int, tokens: int, *_: int) -> None:
        self._session(slot, c.CEILING).hold_to(tokens)

    def _chunk_size(self, slot: int, chunk_size: int, *_: int) -> None:
        self._session(slot, c.CHUNK_SIZE).set_chunk_size(chunk_size)

    def _fit(self, slot: int, token_count: int, chunk: int, decode_rows: int, *_: int) -> None:
        if slot == c.UNOPENED:
            c.gather_replies(self.group, self._unopened_reply(token_count, chunk))
            return
        session = self._session(slot, c.FIT)
        c.gather_replies(self.group, memory_reply(session, token_count, decode_rows))

    def _unopened_reply(self, token_count: int, chunk: int) -> list[int]:
        """This rank's memory for ``token_count`` tokens of a new session of its layers."""
        if self._unopened_prefill is None:
            self._unopened_prefill = fit.prefill_facts(self.loaded.model,
                                                       activation_value_bytes())
        # The loaded info describes this rank's layers only.
        inputs = fit.FitInputs(fit.facts_from_info(self.loaded.info), DEFAULT_PAGE_SIZE,
                               self.guard.view(), prefill=self._unopened_prefill,
                               chunk_tokens=chunk)
        return _memory_row(fit.guarded_fit_report(inputs, self.guard.read(), token_count),
                           None, needs_checkpoints=False, batches=True)  # no session: unread

    def _adopt(self, slot: int, donor_slot: int, tokens: int, *_: int) -> None:
        session, donor = self._session(slot, c.ADOPT), self._session(donor_slot, c.ADOPT)
        # The same offer rank 0 took: this rank holds the same ids and checkpoints.
        found = reuse.offer(donor, tokens) if reuse.compatible(session, donor) else None
        held = reuse.adopt(session, found) if found is not None and found.tokens == tokens else 0
        if held != tokens:
            session.reset()  # rank 0 resets too: every rank reads the prompt again
        c.gather_replies(self.group, [int(held == tokens), held])

    def _prune(self, _slot: int, length: int, *_: int) -> None:
        kept = set(self._name(length).split("\n")) if length else set()
        if self.snapshots is None:
            return
        for info in list_snapshots(self.snapshots):
            if info.name not in kept:
                delete_snapshot(self.snapshots, info.name)

    def _name(self, length: int) -> str:
        raw = c.int_list(c.receive(self.group, mx.zeros((length,), dtype=mx.int32)))
        return bytes(raw).decode("utf-8")

    def _save(self, slot: int, length: int, *_: int) -> None:
        session, name = self._session(slot, c.SAVE), self._name(length)
        folder = self.snapshots
        ok = folder is not None
        if folder is not None:
            try:
                save_snapshot(session, folder, name)
            except EngineError as error:  # rank 0 then stores nothing either
                log.warning("rank %d: KV snapshot %s not saved: %s", self.rank, name, error)
                ok = False
        c.gather_replies(self.group, [int(ok)])

    def _restore(self, slot: int, length: int, tokens: int, low: int, high: int,
                 *_: int) -> None:
        session, name = self._session(slot, c.RESTORE), self._name(length)
        kept = 0
        if self.snapshots is not None:
            try:
                stored = read_manifest(manifest_path(self.snapshots, name))["tokens"]
                if c.ids_digest(stored[:tokens]) != (low, high):
                    raise EngineError("its tokens are not the ones rank 0 restored (one of "
                                      "the two saves was refused)")
                kept = load_snapshot(session, self.snapshots, name, stored[:tokens],
                                     keep_last=False)
            except (EngineError, Corrupt, OSError, KeyError) as error:
                log.warning("rank %d: KV snapshot %s not restored: %s", self.rank, name, error)
                session.reset()
        c.gather_replies(self.group, [1, kept])


def memory_reply(session: Session, token_count: int, decode_rows: int = 0) -> list[int]:
    """A rank's memory for ``token_count`` tokens of ``session`` (``rank_commands.memory_row``),
    beside a decode step of ``decode_rows`` rows (``Session.fit_report``)."""
    return _memory_row(session.fit_report(token_count, decode_rows=decode_rows),
                       session.stats() if session.cache else None,
                       needs_checkpoints=session.needs_checkpoints,
                       batches=_batches(session))


def _batches(session: Session) -> bool:
    """Whether ``session``'s layers here can share a batch's pass (``BatchedCache``)."""
    try:
        check_batchable([session.cache])
    except EngineError:
        return False
    return True


def _memory_row(report: fit.FitReport, stats: CacheStats | None, *,
                needs_checkpoints: bool, batches: bool) -> list[int]:
    return c.memory_row(report.fits, [m.tokens_fit if m.supported else None for m in report.modes],
                        report.free_bytes, int(stats.bytes_used) if stats else 0,
                        int(stats.pages_in_use) if stats else 0, report.available_bytes,
                        needs_checkpoints, batches,
                        [_room_tokens(m) if m.supported else None for m in report.modes])


def _room_tokens(mode_fit: fit.ModeFit) -> int:
    """Tokens of the mode the room holds, past the context if it does (free RAM and
    the KV budget only)."""
    if mode_fit.tokens_fit_budget is None:
        return mode_fit.tokens_fit_ram
    return min(mode_fit.tokens_fit_ram, mode_fit.tokens_fit_budget)


def rank_stats(session: Session, rank: int) -> dict[str, Any]:
    """A rank's layers, KV bytes, pages, free RAM and tokens that fit per mode."""
    stats = session.stats()
    report = session.fit_report(len(session.tokens))
    return {
        "rank": rank,
        "layers": [layer.layer for layer in stats.layers],
        "kv_bytes": int(stats.bytes_allocated),
        "pages_in_use": int(stats.pages_in_use),
        "free_bytes": int(report.free_bytes),
        "tokens_fit": {m.mode: (m.tokens_fit if m.supported else None) for m in report.modes},
    }


def follow(path: str, group: mx.distributed.Group, snapshots: Path | None = None,
           split: Sequence[int] | None = None) -> dict[str, Any]:
    """Load this rank's stage of ``path`` and follow rank 0 until it stops; the report.

    ``snapshots`` is the folder rank 0 stores its KV in; this rank keeps its own
    layers' snapshots in its ``rank<N>`` subfolder (None: no stored KV); ``split``
    the layers per rank, rank 0 first, as rank 0 was given it.

    Raises:
        InsufficientMemory: the weights do not fit this machine's free RAM (named).
        ModelLoadError: the model cannot be loaded or split (as on rank 0).
    """
    from engine.errors import InsufficientMemory
    from engine.models.loader import estimate_load_bytes, load_model, resolve_model_path
    from engine.snapshots.fingerprint import model_fingerprint

    guard = MemoryGuard()
    folder = resolve_model_path(path)
    needed, quantized = estimate_load_bytes(folder)
    try:
        guard.check_load(needed, name=folder.name, releasable_bytes=0, quantized=quantized)
    except InsufficientMemory as error:
        raise InsufficientMemory(f"On rank {group.rank()} ({socket.gethostname()}): "
                                 f"{error}") from error
    loaded = load_model(folder, pipeline=group, split=split)
    loaded = dataclasses.replace(loaded, fingerprint=model_fingerprint(folder))
    folder_kv = None if snapshots is None else rank_folder(Path(snapshots), group.rank())
    follower = Follower(group, loaded, guard, folder_kv)
    try:
        return follower.run()
    finally:
        for session in follower.sessions.values():
            session.close()
