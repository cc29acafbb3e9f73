"""Rank 0's side of the command channel, without a group: what it keeps of the
followers' replies."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from engine.distributed import rank_commands as c


def _row(*, rigid: bool = False, batches: bool = True) -> list[int]:
    return c.memory_row(True, [100] * len(c.MODES), 1 << 30, 0, 0, 1 << 30,
                        needs_checkpoints=rigid, batches=batches)


def test_a_session_batches_only_when_every_follower_says_its_layers_can() -> None:
    conductor: Any = SimpleNamespace(share=lambda rank, row: (rank, row))
    link = c.SessionLink(conductor, 1)
    # Rank 0's own row comes first and is not a follower's.
    link.heard([[0] * c.REPLY, _row(), _row()])
    assert link.batches and not link.needs_checkpoints
    link.heard([[0] * c.REPLY, _row(), _row(batches=False, rigid=True)])
    assert not link.batches and link.needs_checkpoints
    assert len(_row()) == c.REPLY  # the whole row crosses: nothing is cut off
