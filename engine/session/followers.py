"""What a session asks of a pipeline's other ranks, declared where the session needs it.

On a pipeline, rank 0's session sends every cache operation to the ranks that
hold the other layers first (``engine.distributed.rank_commands.SessionLink``, a front
end above this layer); on one machine a session has no link.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import mlx.core as mx

from engine.cache.modes import KvMode
from engine.events import RankShare
from engine.session.prefill import Chunk

DecodeStep = Callable[..., mx.array]
"""The model as the answer loop calls it: ``step(inputs, cache=...)`` -> logits."""


class FollowerLink(Protocol):
    """A session's link to the same session on a pipeline's other ranks.

    Attributes:
        batches: whether the other ranks' layers of the session can share a
            batch's pass with other sessions' (``decoding_rows``).
    """

    batches: bool

    def machines(self, kv_bytes: int, pages_in_use: int, free_bytes: int,
                 tokens_fit: tuple[int | None, ...] = ()) -> tuple[RankShare, ...]:
        """Every machine's share, rank 0's from these figures."""
        ...

    def prefill(self, chunk: Chunk, position: int) -> None:
        """Feed ``chunk`` at ``position`` into the other ranks' layers."""
        ...

    def decoding(self, model: DecodeStep) -> DecodeStep:
        """``model`` for the answer loop, each call sent to the other ranks first."""
        ...

    def decoding_rows(self, model: DecodeStep,
                      links: Sequence[FollowerLink]) -> DecodeStep:
        """``model`` for a batch's passes over the sessions of ``links`` (this one
        among them, in row order), each call sent to the other ranks first."""
        ...

    def checkpoint(self, boundary: bool, position: int) -> None:
        """Checkpoint the other ranks' layers that cannot rewind."""
        ...

    def rewind(self, length: int, kept: int) -> None:
        """Cut the other ranks' caches back to ``length`` tokens."""
        ...

    def reset(self) -> None:
        """Empty the other ranks' caches."""
        ...

    def close(self) -> None:
        """Close the session on the other ranks."""
        ...

    def adopt(self, donor: FollowerLink, tokens: int) -> bool:
        """Take ``donor``'s first ``tokens`` tokens on every rank; True when all did."""
        ...

    def save(self, name: str) -> bool:
        """Store the other ranks' layers as snapshot ``name``; True when all did."""
        ...

    def restore(self, name: str, ids: Sequence[int]) -> bool:
        """Restore the tokens ``ids`` from snapshot ``name`` on every rank; True when
        every rank's part holds exactly those."""
        ...

    def end(self, held: int, cancelled: bool, answer: bool = True) -> None:
        """A request ended with ``held`` tokens in the cache (the other ranks then
        let go of the session's ceiling, :meth:`hold_to`)."""
        ...

    def hold_to(self, tokens: int) -> None:
        """Hold the other ranks' pages of the session to ``tokens`` tokens in its
        mode until its request ends (``MemoryGuard.set_ceiling``)."""
        ...

    def set_chunk_size(self, chunk_size: int) -> None:
        """The other ranks read the session in chunks of ``chunk_size`` tokens from
        now on (the room each keeps for a chunk follows)."""
        ...

    def room(self, token_count: int, mode: KvMode,
             coming: Mapping[KvMode, int] | None = None, decode_rows: int = 0) -> int:
        """Tokens that may follow ``token_count`` on the tightest other rank; with
        ``coming``, the tokens other sessions will still add there (by mode) held too,
        and with ``decode_rows``, a batch's decode step of that many rows beside them.

        Raises:
            MachineShort: a rank cannot hold them (named in it).
        """
        ...
