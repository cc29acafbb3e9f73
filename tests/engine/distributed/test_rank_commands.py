"""Rank 0's side of the command channel, without a group: what it keeps of the
followers' replies."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from engine.distributed import rank_commands as c
from engine.errors import MachineShort


def _row(*, rigid: bool = False, batches: bool = True) -> list[int]:
    return c.memory_row(True, [100] * len(c.MODES), 1 << 30, 0, 0, 1 << 30,
                        needs_checkpoints=rigid, batches=batches,
                        room_tokens=[100] * len(c.MODES))


def test_a_session_batches_only_when_every_follower_says_its_layers_can() -> None:
    conductor: Any = SimpleNamespace(share=lambda rank, row: (rank, row))
    link = c.SessionLink(conductor, 1, 256)
    # Rank 0's own row comes first and is not a follower's.
    link.heard([[0] * c.REPLY, _row(), _row()])
    assert link.batches and not link.needs_checkpoints
    link.heard([[0] * c.REPLY, _row(), _row(batches=False, rigid=True)])
    assert not link.batches and link.needs_checkpoints
    assert len(_row()) == c.REPLY  # the whole row crosses: nothing is cut off


def _fitting(room_tokens: dict[str, int], context: int = 10**6) -> list[int]:
    """A follower's reply that holds a session's tokens alone: its room holds
    ``room_tokens`` in each mode, the tokens that fit no more than ``context``."""
    tokens = [room_tokens.get(mode, 0) for mode in c.MODES]
    return c.memory_row(True, [min(t, context) for t in tokens], 1 << 30, 0, 0,
                        1 << 30, needs_checkpoints=False, batches=True, room_tokens=tokens)


def _link(reply: list[int], asked: list[tuple[int, ...]] | None = None) -> c.SessionLink:
    """A session's link of 100-token pages whose one follower replies ``reply``
    (each command asked of it kept in ``asked``, when given)."""
    def ask(*args: int) -> list[list[int]]:
        if asked is not None:
            asked.append(args)
        return [[0] * c.REPLY, reply]

    conductor: Any = SimpleNamespace(share=lambda rank, row: (rank, row), ask=ask,
                                     machine=lambda rank: f"rank {rank} (mac2)")
    return c.SessionLink(conductor, 1, 100)


def test_room_counts_the_tokens_still_to_be_read_there_in_their_own_modes() -> None:
    # One room on rank 1: 4,000 tokens in q4, half as many in fp16's wider rows.
    link = _link(_fitting({"fp16": 1000, "q8": 2000, "q6": 2600, "q4": 4000}))
    assert link.room(1000, "q4") == 3000  # alone: the tokens after its own
    # Its 1,000 tokens take a quarter of the room; 1,500 more q4 tokens being read
    # there another 0.375, and 500 q8 with 650 q6 tokens a quarter each: they fit.
    assert link.room(1000, "q4", {"q4": 1500}) == 3000
    assert link.room(1000, "q4", {"q8": 500, "q6": 650}) == 3000
    # 2,000 q8 tokens fill the whole room: counted as tokens of this session's
    # mode (half the room in q4) they would have seemed to fit.
    with pytest.raises(MachineShort, match=r"rank 1 \(mac2\) cannot hold") as short:
        link.room(1000, "q4", {"q8": 2000})
    assert short.value.machine == "rank 1 (mac2)"
    with pytest.raises(MachineShort):
        link.room(1000, "q4", {"q4": 1000, "fp16": 600})  # 0.25 + 0.25 + 0.6


def test_room_counts_each_modes_bytes_where_the_context_caps_what_fits() -> None:
    # The same room, on a model of a 1,200-token context: each mode's tokens that
    # fit stop there, the room's share of them does not.
    link = _link(_fitting({"fp16": 1000, "q8": 2000, "q6": 2600, "q4": 4000}, context=1200))
    assert link.room(1000, "q4") == 200  # what may follow stops at the context
    # 1,000 q4 tokens and 1,500 more: 0.625 of the room (counted against the
    # context, 1000/1200 + 1500/1200, they seemed not to fit).
    assert link.room(1000, "q4", {"q4": 1500}) == 200
    with pytest.raises(MachineShort):
        link.room(1000, "q4", {"q4": 3100})


def test_room_counts_the_joining_conversations_tokens_in_whole_pages() -> None:
    # 1,010 tokens fill eleven 100-token pages there: 1,100 of the room's 4,000
    # q4 tokens, so 2,950 more do not fit beside them (as tokens, 3,960 seemed to).
    link = _link(_fitting({"q4": 4000}))
    assert link.room(1010, "q4", {"q4": 2900}) == 2990
    with pytest.raises(MachineShort):
        link.room(1010, "q4", {"q4": 2950})


def test_room_asks_each_follower_for_its_room_beside_the_batchs_decode_step() -> None:
    asked: list[tuple[int, ...]] = []
    link = _link(_fitting({"q4": 4000}), asked)
    link.room(1000, "q4", {"q4": 100}, decode_rows=3)
    link.room(1000, "q4")  # alone: no step beside it
    assert asked == [(c.FIT, 1, 1000, 0, 3), (c.FIT, 1, 1000, 0, 0)]


def test_a_new_chunk_size_is_sent_to_the_followers() -> None:
    sent: list[tuple[int, ...]] = []
    conductor: Any = SimpleNamespace(send=lambda *args: sent.append(args))
    c.SessionLink(conductor, 3, 16).set_chunk_size(1024)
    assert sent == [(c.CHUNK_SIZE, 3, 1024)]
