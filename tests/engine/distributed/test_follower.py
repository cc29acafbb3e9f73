"""A follower's own handling of rank 0's commands, without a group: what it does to
its sessions and its memory guard."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest

from engine.distributed import rank_commands as c
from engine.distributed.follower import Follower
from engine.errors import KvBudgetExceeded
from engine.memory.guard import MemoryGuard, MemoryReading
from engine.models.loader import load_model
from engine.session.prefill import Chunk
from tests.engine.tinymodels import make_tiny_model_dir


def test_a_ceiling_holds_a_sessions_pages_until_its_request_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(make_tiny_model_dir(tmp_path, "llama")))
    # Rank 1 of two: what the group's gathers would give it, given here.
    monkeypatch.setattr(c, "pipeline_identity", lambda group, loaded: (["mac1", "mac2"], {}))
    monkeypatch.setattr(c, "gather_replies", lambda group, row: [list(row)])
    follower = Follower(SimpleNamespace(rank=lambda: 1), loaded,
                        MemoryGuard(budget_bytes=64 * 2**20))
    handle = follower._handlers
    handle[c.OPEN](1, c.MODES.index("fp16"), 16, c.ROTATE_CODES[None], 64, 0)
    session = follower.sessions[1]
    session.forward(Chunk(list(range(10, 30)), False))  # 20 tokens
    guard, key = follower.guard, session.session_id
    alone = guard.refresh(key)

    handle[c.CEILING](1, 200, 0, 0, 0, 0)  # what rank 0 counted for its answer
    held_to = session.fit_report(200).for_mode("fp16").bytes_needed
    assert int(session.stats().bytes_allocated) < held_to < alone
    assert guard.refresh(key) == held_to
    handle[c.END](1, 20, 0, 0, 0, 0)  # the request ended: as alone again
    assert guard.refresh(key) == alone


@dataclass
class _Opened:
    """A follower (rank 1 of two) holding one fp16 session of 16-token pages, read
    in 64-token chunks, on a machine whose free memory stays as it is."""

    follower: Follower
    session: Any
    replies: list[list[int]]

    def handle(self, op: int, *args: int) -> None:
        self.follower._handlers[op](1, *args, *[0] * (5 - len(args)))

    def room(self, decode_rows: int = 0) -> int:
        """Tokens of fp16 its FIT reply says its room holds (for 100 tokens)."""
        self.handle(c.FIT, 100, 0, decode_rows)
        return self.replies.pop()[c.ROOM_TOKENS + c.MODES.index("fp16")]


@pytest.fixture
def opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Opened:
    loaded = load_model(str(make_tiny_model_dir(tmp_path, "llama")))
    monkeypatch.setattr(c, "pipeline_identity", lambda group, loaded: (["mac1", "mac2"], {}))
    replies: list[list[int]] = []
    monkeypatch.setattr(c, "gather_replies",
                        lambda group, row: replies.append(list(row)) or [list(row)])
    reading = MemoryReading(total_bytes=2**34, available_bytes=2**32)
    follower = Follower(SimpleNamespace(rank=lambda: 1), loaded,
                        MemoryGuard(headroom_bytes=2**30, probe=lambda: reading))
    follower._handlers[c.OPEN](1, c.MODES.index("fp16"), 16, c.ROTATE_CODES[None], 64, 0)
    replies.clear()
    return _Opened(follower, follower.sessions[1], replies)


def test_a_fit_check_for_a_batch_leaves_room_for_its_decode_step(opened: _Opened) -> None:
    session = opened.session
    facts = session.prefill_facts
    chunk = facts.transient_bytes(session.chunk_size)
    rows = 1 + chunk // facts.step_transient_bytes(1)  # past the chunk's transient
    alone = opened.room(0)
    assert opened.room(1) == alone  # one row's step needs less than a chunk: kept free
    taken = (alone - opened.room(rows)) * session.kv_token_bytes
    step = facts.step_transient_bytes(rows) - chunk
    page = session.page_size * session.kv_token_bytes
    assert step - page < taken <= step + page


def test_a_new_chunk_size_moves_the_room_a_follower_keeps_for_a_chunk(
        opened: _Opened) -> None:
    session = opened.session
    before = opened.room()
    opened.handle(c.CHUNK_SIZE, 4096)  # rank 0's Configure: larger chunks
    assert session.chunk_size == 4096
    facts = session.prefill_facts
    grown = facts.transient_bytes(4096) - facts.transient_bytes(64)
    page = session.page_size * session.kv_token_bytes
    assert (before - opened.room()) * session.kv_token_bytes > grown - page


def test_a_follower_takes_the_room_it_reported_when_memory_was_freed_since_it_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(make_tiny_model_dir(tmp_path, "llama")))
    monkeypatch.setattr(c, "pipeline_identity", lambda group, loaded: (["mac1", "mac2"], {}))
    replies: list[list[int]] = []
    monkeypatch.setattr(c, "gather_replies",
                        lambda group, row: replies.append(list(row)) or [list(row)])
    # Free memory is all headroom while the session opens, then another app quits.
    readings = [MemoryReading(total_bytes=2**34, available_bytes=2**30)]
    follower = Follower(SimpleNamespace(rank=lambda: 1), loaded,
                        MemoryGuard(headroom_bytes=2**30, probe=lambda: readings[-1]))
    handle = follower._handlers
    handle[c.OPEN](1, c.MODES.index("fp16"), 16, c.ROTATE_CODES[None], 64, 0)
    readings.append(MemoryReading(total_bytes=2**34, available_bytes=2**32))
    handle[c.FIT](1, 1, 0, 0, 0, 0)  # rank 0's check as its answer starts
    assert replies[-1][c.ROOM_TOKENS + c.MODES.index("fp16")] > 100
    # Rank 0 reads a conversation in and answers it within that room: this rank follows.
    monkeypatch.setattr(c, "receive", lambda group, like: mx.arange(10, 10 + like.size))
    handle[c.PREFILL](1, 20, 0, 0, 0, 0)
    for token in range(40):
        handle[c.DECODE](1, 0, 0, 0, 0, token + 10)
    assert len(follower.sessions[1].tokens) == 60


def test_a_follower_short_of_memory_names_its_machine(opened: _Opened) -> None:
    session = opened.session
    session.guard.probe = lambda: MemoryReading(total_bytes=2**34, available_bytes=2**30)
    session.guard.refresh(session.session_id)  # other apps took the room it reported
    with pytest.raises(KvBudgetExceeded, match=r"^On rank 1 \(mac2\): The KV memory"):
        opened.handle(c.DECODE, 0, 0, 0, 0, 10)


def test_a_follower_restores_its_part_only_for_the_tokens_rank_0_restored(
        opened: _Opened, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.snapshots.snapshot import save_snapshot

    follower, session = opened.follower, opened.session
    follower.snapshots = tmp_path / "rank1"
    session.forward(Chunk(list(range(10, 50)), False))  # 40 tokens, stored
    save_snapshot(session, follower.snapshots, "chat")
    monkeypatch.setattr(follower, "_name", lambda length: "chat")

    def restore(ids: list[int]) -> int:
        """The tokens the follower's RESTORE reply says it holds now."""
        session.reset()
        opened.handle(c.RESTORE, 4, len(ids), *c.ids_digest(ids))
        return opened.replies.pop()[1]

    assert restore(list(range(10, 42))) == 32
    assert session.tokens == list(range(10, 42))
    # Rank 0 restored as many tokens of another conversation under that name (its
    # own save was refused after this rank's): this rank's part is not used.
    assert restore([*range(10, 41), 99]) == 0
    assert session.tokens == []
