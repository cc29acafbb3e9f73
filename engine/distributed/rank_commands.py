"""Rank 0's commands to a pipeline's other ranks, over ``mx.distributed`` itself.

Rank 0 owns the tokenizer, sampling, the sessions' token ids and every decision
(which chunk next, when to stop, cancel, save). The other ranks (followers,
``engine.distributed.follower``) hold only their layers' caches and do what each
command says. A command is a small int32 header, then, for a forward pass, the
token ids, each passed down the pipeline by ``mx.distributed`` send/recv: rank 0
sends to the first stage (the last rank) and each follower hands it on to the
rank after it, before its own work, so the command travels the way the hidden
states do. No second RPC stack, and the messages stay in the order both sides
queue them. A plain send/recv between neighbours is the ring backend's cheapest
message (no collective thread pool; measured in docs/benchmark-runs.md).

The header's first field is the protocol version: a follower that reads another
version stops with an error instead of guessing. A prefill chunk's header says
whether the chunk ends a message, and each follower checkpoints its layers right
after it: rank 0 may send the next chunk before its own stage of this one (its
prefill reads ahead), so a checkpoint command of its own would arrive too late.
A decode step's token rides in the header (one message per step). Questions
(open, fit, end, save, restore) are answered by an ``all_gather`` of one
fixed-size reply row per rank; open, fit and end answer with the rank's memory
(``memory_row``), so rank 0 knows every machine's share of a session once per
request, never per token.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from typing import Any, cast

import blake3
import mlx.core as mx
import numpy as np

from engine.cache.modes import MODES, KvMode
from engine.errors import EngineError, MachineShort
from engine.events import RankShare
from engine.models.loader import LoadedModel
from engine.session.followers import DecodeStep, FollowerLink
from engine.session.prefill import Chunk

VERSION = 10
HEADER = 8  # version, op, slot, four arguments, the decode token
REPLY = 16  # one follower answer: status, then op-specific values
NAME_BYTES = 64  # a rank's host name, as bytes in int32s

# Operations (the header's second field).
(OPEN, PREFILL, DECODE, CHECKPOINT, REWIND, RESET, CLOSE, END, FIT, SAVE, RESTORE, STOP,
 ADOPT, PRUNE, DECODE_ROWS, CEILING, CHUNK_SIZE) = range(1, 18)
OP_NAMES = {OPEN: "open", PREFILL: "prefill chunk", DECODE: "decode step",
            CHECKPOINT: "checkpoint", REWIND: "rewind", RESET: "reset", CLOSE: "close",
            END: "end of request", FIT: "fit check", SAVE: "save", RESTORE: "restore",
            STOP: "stop", ADOPT: "prefix from another chat", PRUNE: "stored KV kept",
            DECODE_ROWS: "batch's decode step", CEILING: "ceiling",
            CHUNK_SIZE: "chunk size"}
ROTATE_CODES = {None: -1, False: 0, True: 1}
UNOPENED = 0  # the slot of a fit check for a chat not opened yet (sessions count from 1)
# A rank's memory reply, field by field: whether the tokens asked about fit (1/0),
# the tokens that fit per mode (MODES order; -1: unsupported), free RAM its pages
# may take after the safety headroom (MiB), its KV bytes in use (two int32 halves,
# exact), its pages in use, free RAM before the headroom (MiB), whether its
# layers need checkpoints to rewind (1/0), whether they can share a batch's
# pass with other sessions' (1/0), and the tokens its room holds per mode as the
# tokens that fit, but not capped at the model's context (-1: unsupported).
FITS, TOKENS = 0, 1
ROOM_MIB = TOKENS + len(MODES)
KV_HIGH, KV_LOW, PAGES, FREE_MIB = ROOM_MIB + 1, ROOM_MIB + 2, ROOM_MIB + 3, ROOM_MIB + 4
RIGID = FREE_MIB + 1
BATCHES = RIGID + 1
ROOM_TOKENS = BATCHES + 1
_LOW_BITS = 31


class PipelineDesync(EngineError):
    """A rank's cache no longer agrees with rank 0's commands."""


def post(group: mx.distributed.Group, values: mx.array) -> mx.array:
    """On rank 0: ``values`` sent to the pipeline's first stage (lazy, like any send)."""
    return mx.distributed.send(values, group.size() - 1, group=group)


def receive(group: mx.distributed.Group, like: mx.array) -> mx.array:
    """On a follower: rank 0's values (shaped as ``like``), handed on to the next rank.

    Lazy: the forward to the rank after this one is part of the returned array, so
    reading the values sends them on, before this rank starts its own work.
    """
    rank, size = group.rank(), group.size()
    values = mx.distributed.recv_like(like, (rank + 1) % size, group=group)
    if rank > 1:
        values = mx.distributed.send(values, rank - 1, group=group)
    return values


def header(op: int, slot: int = 0, *args: int) -> mx.array:
    """A command header with up to four integer arguments (the token field zero)."""
    fields = [VERSION, op, slot, *args][:HEADER - 1]
    return mx.array(fields + [0] * (HEADER - len(fields)), dtype=mx.int32)


def ids_digest(ids: Sequence[int]) -> tuple[int, int]:
    """A digest of token ids, as two non-negative int32 header arguments (62 bits)."""
    raw = blake3.blake3(np.asarray(ids, dtype="<i8").tobytes())
    value = int.from_bytes(raw.digest(length=8), "little")
    return value & 0x7FFFFFFF, (value >> 31) & 0x7FFFFFFF


def int_list(values: mx.array) -> list[int]:
    """A 1-D integer array's values (MLX's stubs type ``tolist()`` as any nesting)."""
    return cast("list[int]", values.tolist())


def int_rows(values: mx.array) -> list[list[int]]:
    """A 2-D integer array's rows, as :func:`int_list` reads a 1-D one."""
    return cast("list[list[int]]", values.tolist())


def _gather_text(group: mx.distributed.Group, text: str) -> list[str]:
    raw = text.encode("utf-8")[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    gathered = mx.distributed.all_gather(mx.array(list(raw), dtype=mx.int32), group=group)
    rows = int_rows(gathered.reshape(group.size(), NAME_BYTES))
    return [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in rows]


def pipeline_identity(group: mx.distributed.Group,
                      loaded: LoadedModel) -> tuple[list[str], dict[str, Any]]:
    """Every rank's host name, and the fingerprint of the whole split model.

    Run by every rank at the same point after its load (two ``all_gather``). The
    fingerprint is this rank's own weights' (``LoadedModel.fingerprint``) with the
    split and every rank's weight digest folded into its digest, so stored KV of
    one rank is only ever restored under the same split of the same weights.
    """
    names = _gather_text(group, socket.gethostname())
    own = loaded.fingerprint or {}
    digests = _gather_text(group, str(own.get("digest", "")))
    inner = loaded.model.model
    layers = mx.distributed.all_gather(
        mx.array([inner.start_idx, inner.end_idx], dtype=mx.int32), group=group)
    split = int_rows(layers.reshape(group.size(), 2))
    record = {"split": split, "ranks": [{"rank": r, "host": names[r], "digest": digests[r]}
                                        for r in range(group.size())]}
    folded = blake3.blake3(json.dumps(record, sort_keys=True).encode()).hexdigest()
    return names, {**own, "digest": folded, "pipeline": record}


def memory_row(fits: bool, tokens_fit: Sequence[int | None], room_bytes: int, kv_bytes: int,
               pages: int, free_bytes: int, needs_checkpoints: bool,
               batches: bool, room_tokens: Sequence[int | None]) -> list[int]:
    """A rank's memory reply (see ``FITS``..``ROOM_TOKENS``), as int32 values."""
    return [int(fits), *_tokens(tokens_fit), room_bytes >> 20, kv_bytes >> _LOW_BITS,
            kv_bytes & (2**_LOW_BITS - 1), pages, free_bytes >> 20, int(needs_checkpoints),
            int(batches), *_tokens(room_tokens)]


def _tokens(per_mode: Sequence[int | None]) -> list[int]:
    return [-1 if t is None else min(t, 2**31 - 1) for t in per_mode]


def gather_replies(group: mx.distributed.Group, row: Sequence[int]) -> list[list[int]]:
    """Each rank's reply row (rank 0's is its own), in rank order."""
    values = mx.array(list(row)[:REPLY] + [0] * (REPLY - len(row)), dtype=mx.int32)
    return int_rows(mx.distributed.all_gather(values, group=group).reshape(group.size(), REPLY))


class Pipeline:
    """Rank 0's pipeline as its engine holds it: the group, and a channel per model."""

    def __init__(self, group: mx.distributed.Group, split: Sequence[int] | None = None) -> None:
        self.group = group
        self.split = split  # layers per rank, rank 0 first (None: mlx-lm's even split)

    def conduct(self, loaded: LoadedModel) -> Conductor:
        """The command channel for ``loaded``, this rank's stage (the followers' load
        of the same model meets it here)."""
        return Conductor(self.group, loaded)


class Conductor:
    """Rank 0's end of the command channel; one per pipeline group and model.

    Every method runs on rank 0's engine thread, in the order the engine acts,
    so the followers replay exactly the cache operations rank 0 performs.
    """

    def __init__(self, group: mx.distributed.Group, loaded: LoadedModel) -> None:
        self.group = group
        self.names, self.fingerprint = pipeline_identity(group, loaded)
        self.layers = [(first, end) for first, end in self.fingerprint["pipeline"]["split"]]
        self._slots = 0

    def machine(self, rank: int) -> str:
        """How a message names a rank: its number and host."""
        return f"rank {rank} ({self.names[rank]})"

    def share(self, rank: int, row: Sequence[int]) -> RankShare:
        """Rank ``rank``'s memory reply (``memory_row``) as its ``RankShare``."""
        tokens = tuple(None if t < 0 else t for t in row[TOKENS:ROOM_MIB])
        return RankShare(rank, self.names[rank], self.layers[rank],
                         (row[KV_HIGH] << _LOW_BITS) + row[KV_LOW], row[PAGES],
                         row[FREE_MIB] << 20, tokens)

    def send(self, op: int, slot: int = 0, *args: int, payload: list[int] | None = None) -> None:
        """A command (and its int32 ``payload``, if any), sent before this returns."""
        sent = post(self.group, header(op, slot, *args))
        if payload is not None:
            # Queued first: the order of two sends within one eval is not defined,
            # and the followers read the header first.
            mx.async_eval(sent)
            sent = post(self.group, mx.array(payload, dtype=mx.int32))
        mx.eval(sent)

    def ask(self, op: int, slot: int = 0, *args: int) -> list[list[int]]:
        """A command whose followers each answer one row; rank 0's row is zeros."""
        self.send(op, slot, *args)
        return gather_replies(self.group, [0])

    def open(self, mode: KvMode, page_size: int, rotate: bool | None,
             chunk_size: int) -> SessionLink:
        """Open a follower session; the link rank 0's session drives it through."""
        self._slots += 1
        replies = self.ask(OPEN, self._slots, MODES.index(mode), page_size,
                           ROTATE_CODES[rotate], chunk_size)
        link = SessionLink(self, self._slots, page_size)
        link.heard(replies)
        return link

    def unopened_machines(self, chunk_size: int) -> tuple[RankShare, ...]:
        """Every machine's share of a chat not opened yet, rank 0's a placeholder
        (its own fit check fills it in): each follower answers for a new session
        of its layers, read in ``chunk_size`` chunks."""
        replies = self.ask(FIT, UNOPENED, 0, chunk_size)
        own = RankShare(0, self.names[0], self.layers[0], 0, 0, 0, ())
        return (own, *(self.share(rank, row) for rank, row in enumerate(replies) if rank))

    def prune(self, names: Sequence[str]) -> None:
        """The followers delete their parts of every stored snapshot not in ``names``
        (rank 0's, after it stored, evicted or deleted one), so each machine's
        stored KV goes with rank 0's."""
        raw = list("\n".join(names).encode("utf-8"))
        self.send(PRUNE, 0, len(raw), payload=raw or None)

    def stop(self) -> None:
        """Tell the followers to write their reports and end."""
        self.send(STOP)


class SessionLink:
    """One session's commands: what rank 0's ``Session`` does, the followers repeat."""

    def __init__(self, conductor: Conductor, slot: int, page_size: int) -> None:
        self.conductor = conductor
        self.slot = slot
        self.page_size = page_size  # the session's on every rank
        # The followers' shares as they last replied (open, fit check, request end).
        self.shares: tuple[RankShare, ...] = ()
        # Whether any follower's layers need checkpoints to rewind: then rank 0
        # takes them and rewinds to them too, even where its own layers could trim.
        self.needs_checkpoints = False
        # Whether every follower's layers can share a batch's pass: else the
        # session's answers run alone, as rank 0's layers alone would decide.
        self.batches = True

    def heard(self, replies: list[list[int]]) -> None:
        """Keep the followers' memory replies (rank 0's own row is not one)."""
        self.shares = tuple(self.conductor.share(rank, row)
                            for rank, row in enumerate(replies) if rank)
        self.needs_checkpoints = any(row[RIGID] for row in replies[1:])
        self.batches = all(row[BATCHES] for row in replies[1:])

    def machines(self, kv_bytes: int, pages_in_use: int, free_bytes: int,
                 tokens_fit: tuple[int | None, ...] = ()) -> tuple[RankShare, ...]:
        """Every machine's share, rank 0's from these figures (its own, live)."""
        conductor = self.conductor
        own = RankShare(0, conductor.names[0], conductor.layers[0], kv_bytes, pages_in_use,
                        free_bytes, tokens_fit)
        return (own, *self.shares)

    def prefill(self, chunk: Chunk, position: int) -> None:
        """Feed ``chunk`` at ``position`` into the followers' layers; each checkpoints
        its layers after it, as rank 0 does."""
        self.conductor.send(PREFILL, self.slot, len(chunk.ids), position, int(chunk.boundary),
                            payload=chunk.ids)

    def decoding(self, model: DecodeStep) -> DecodeStep:
        """``model`` for the answer loop: each call is first sent as a decode step."""
        return _DecodeSteps(model, self)

    def decoding_rows(self, model: DecodeStep, links: Sequence[FollowerLink]) -> DecodeStep:
        """``model`` for a batch's passes over the sessions of ``links`` (this one
        among them), in row order: each call is first sent as one decode step of
        every row.

        Raises:
            EngineError: a link of another pipeline (or none), which cannot share
                the pass.
        """
        slots = []
        for link in links:
            if not isinstance(link, SessionLink) or link.conductor is not self.conductor:
                raise EngineError("Only conversations of one pipeline can answer together.")
            slots.append(link.slot)
        return _RowSteps(model, self.conductor, slots)

    def checkpoint(self, boundary: bool, position: int) -> None:
        self.conductor.send(CHECKPOINT, self.slot, int(boundary), position)

    def rewind(self, length: int, kept: int) -> None:
        """The followers go back to ``length`` tokens and must keep ``kept``, as rank 0 did."""
        self.conductor.send(REWIND, self.slot, length, kept)

    def reset(self) -> None:
        self.conductor.send(RESET, self.slot)

    def close(self) -> None:
        self.conductor.send(CLOSE, self.slot)

    def adopt(self, donor: FollowerLink, tokens: int) -> bool:
        """Each follower's session takes the first ``tokens`` tokens of ``donor``'s, as
        rank 0's did (``engine.session.reuse.adopt``); True when every one holds them."""
        if not isinstance(donor, SessionLink):  # only another session of this channel
            return False
        replies = self.conductor.ask(ADOPT, self.slot, donor.slot, tokens)
        return all(ok and held == tokens for ok, held, *_ in replies[1:])

    def save(self, name: str) -> bool:
        """Each follower stores its layers as snapshot ``name``; True when all did."""
        return all(ok for ok, *_ in self._named(SAVE, name)[1:])

    def restore(self, name: str, ids: Sequence[int]) -> bool:
        """Each follower restores the tokens ``ids`` from its snapshot ``name``, as rank
        0 did of its own; True when every one holds exactly those now.

        A follower's part is checked against ``ids`` (their digest), not only their
        count: its save and rank 0's may have parted (one of them refused), and
        layers of another conversation must never pass for these.
        """
        tokens = len(ids)
        replies = self._named(RESTORE, name, tokens, *ids_digest(ids))
        return all(ok and kept == tokens for ok, kept, *_ in replies[1:])

    def _named(self, op: int, name: str, *args: int) -> list[list[int]]:
        raw = list(name.encode("utf-8"))
        self.conductor.send(op, self.slot, len(raw), *args, payload=raw)
        return gather_replies(self.conductor.group, [0])

    def end(self, held: int, cancelled: bool, answer: bool = True) -> None:
        """A request ended with ``held`` tokens in the cache (the followers check theirs
        and, with ``answer``, reply with their memory). No reply after an unexpected
        error: the group may be gone, and a gather would race the watchdog's message."""
        if answer:
            self.heard(self.conductor.ask(END, self.slot, held, int(cancelled), 1))
        else:
            self.conductor.send(END, self.slot, held, int(cancelled), 0)

    def hold_to(self, tokens: int) -> None:
        """The followers hold their pages of the session to ``tokens`` tokens, as
        rank 0 does, until the request's end."""
        self.conductor.send(CEILING, self.slot, tokens)

    def set_chunk_size(self, chunk_size: int) -> None:
        """The followers read the session in chunks of ``chunk_size`` tokens from now
        on, as rank 0 does: the room each keeps for a chunk follows."""
        self.conductor.send(CHUNK_SIZE, self.slot, chunk_size)

    def room(self, token_count: int, mode: KvMode,
             coming: Mapping[KvMode, int] | None = None, decode_rows: int = 0) -> int:
        """Tokens that may follow ``token_count`` on the tightest follower, in ``mode``.

        Args:
            token_count: the tokens this session is to hold, in ``mode``.
            mode: this session's KV mode.
            coming: tokens other sessions will still add there, by their modes
                (reads under way beside it); each follower must hold those too.
            decode_rows: rows of the batch's decode step once this session answers
                in it: each follower's room is what its pages may take beside
                that step's transient (0: it answers alone).

        Raises:
            MachineShort: a follower's own pages or free RAM cannot hold them,
                named with its host, before any rank allocates for them.
        """
        conductor = self.conductor
        replies = conductor.ask(FIT, self.slot, token_count, 0, decode_rows)
        self.heard(replies)
        room: int | None = None
        for rank, row in enumerate(replies[1:], start=1):
            fit_tokens, free_mib = row[TOKENS + MODES.index(mode)], row[ROOM_MIB]
            if not row[FITS]:
                raise MachineShort(
                    f"This conversation needs {token_count:,} tokens but "
                    f"{conductor.machine(rank)} holds only {max(fit_tokens, 0):,} in {mode} "
                    f"for its layers (free RAM after its safety headroom: {free_mib:,} MiB). "
                    "Free memory on that machine, give it fewer layers, or choose a "
                    "smaller KV mode.", conductor.machine(rank))
            if coming and not _holds_beside(row, _whole_pages(token_count, self.page_size),
                                            mode, coming):
                raise MachineShort(
                    f"{conductor.machine(rank)} cannot hold this conversation's "
                    f"{token_count:,} tokens in {mode} beside the "
                    f"{sum(coming.values()):,} tokens still to be read there for the "
                    "others.", conductor.machine(rank))
            room = fit_tokens - token_count if room is None else min(room, fit_tokens - token_count)
        return 0 if room is None else room


def _whole_pages(tokens: int, page_size: int) -> int:
    """``tokens`` rounded up to whole pages: what their pages hold."""
    return -(-tokens // page_size) * page_size


def _holds_beside(row: Sequence[int], token_count: int, mode: KvMode,
                  coming: Mapping[KvMode, int]) -> bool:
    """Whether a follower's memory reply (``memory_row``) holds ``token_count`` tokens
    in ``mode`` and the tokens ``coming`` in theirs, all in the same room.

    A mode's tokens its room holds are that room over its bytes a token (this
    rank's layers' own), so each mode's tokens take their count over that figure
    of it (not capped at the context: the bytes' own share).
    """
    share = 0.0
    for each, tokens in [(mode, token_count), *coming.items()]:
        fit_tokens = row[ROOM_TOKENS + MODES.index(each)]
        if tokens <= 0:
            continue
        if fit_tokens <= 0:
            return False
        share += tokens / fit_tokens
    return share <= 1.0


class _DecodeSteps:
    """The model as the answer loop calls it, each call sent as a decode step first.

    The step's token rides in its header, sent lazily: the answer loop builds step
    n+1 before it reads step n's token, so the header leaves as soon as the device
    has sampled that token, with no host sync in between. It is queued ahead of the
    step's forward pass on purpose: mlx-lm's ``recv_like`` does not depend on the
    step's input, and a receive queued first would wait for a follower still
    waiting for the header.
    """

    def __init__(self, model: DecodeStep, link: SessionLink) -> None:
        self.model = model
        self.link = link

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        if inputs.size != 1:
            raise EngineError("Speculative decoding is not available over a pipeline yet; "
                              "turn it off for this model.")
        fixed = header(DECODE, self.link.slot)[:HEADER - 1]
        message = mx.concatenate([fixed, inputs.reshape(1).astype(mx.int32)])
        mx.async_eval(post(self.link.conductor.group, message))
        return self.model(inputs, cache=cache)


class _RowSteps:
    """The model as a batch calls it for one set of rows, each call sent first as
    one decode step of every row (their slots, then their tokens).

    Two messages a step: the header (the row count, known now) and the rows'
    slots and tokens, sent lazily as the single step's token is (the batch builds
    pass n+1 before it reads pass n's tokens); the header is queued first, as
    :meth:`Conductor.send` queues a payload's header, and both ahead of the
    forward pass, as in :class:`_DecodeSteps`.
    """

    def __init__(self, model: DecodeStep, conductor: Conductor, slots: Sequence[int]) -> None:
        self.model = model
        self.conductor = conductor
        self.slots = mx.array(list(slots), dtype=mx.int32)

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        rows = self.slots.size
        if inputs.shape != (rows, 1):
            raise EngineError("A batch over a pipeline decodes one token per row at a time.")
        group = self.conductor.group
        mx.async_eval(post(group, header(DECODE_ROWS, 0, rows)))
        mx.async_eval(post(group, mx.concatenate([self.slots,
                                                  inputs.reshape(rows).astype(mx.int32)])))
        return self.model(inputs, cache=cache)
