"""A follower's own handling of rank 0's commands, without a group: what it does to
its sessions and its memory guard."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.distributed import rank_commands as c
from engine.distributed.follower import Follower
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


def test_a_fit_check_for_a_batch_leaves_room_for_its_decode_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(make_tiny_model_dir(tmp_path, "llama")))
    monkeypatch.setattr(c, "pipeline_identity", lambda group, loaded: (["mac1", "mac2"], {}))
    replies: list[list[int]] = []
    monkeypatch.setattr(c, "gather_replies",
                        lambda group, row: replies.append(list(row)) or [list(row)])
    reading = MemoryReading(total_bytes=2**34, available_bytes=2**32)
    follower = Follower(SimpleNamespace(rank=lambda: 1), loaded,
                        MemoryGuard(headroom_bytes=2**30, probe=lambda: reading))
    handle = follower._handlers
    handle[c.OPEN](1, c.MODES.index("fp16"), 16, c.ROTATE_CODES[None], 64, 0)
    session = follower.sessions[1]
    replies.clear()

    def room(decode_rows: int) -> int:
        handle[c.FIT](1, 100, 0, decode_rows, 0, 0)
        return replies.pop()[c.ROOM_TOKENS + c.MODES.index("fp16")]

    facts = session.prefill_facts
    chunk = facts.transient_bytes(session.chunk_size)
    rows = 1 + chunk // facts.step_transient_bytes(1)  # past the chunk's transient
    alone = room(0)
    assert room(1) == alone  # one row's step needs less than a chunk: kept free already
    taken = (alone - room(rows)) * session.kv_token_bytes
    step = facts.step_transient_bytes(rows) - chunk
    page = session.page_size * session.kv_token_bytes
    assert step - page < taken <= step + page


def test_a_new_chunk_size_moves_the_room_a_follower_keeps_for_a_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(make_tiny_model_dir(tmp_path, "llama")))
    monkeypatch.setattr(c, "pipeline_identity", lambda group, loaded: (["mac1", "mac2"], {}))
    replies: list[list[int]] = []
    monkeypatch.setattr(c, "gather_replies",
                        lambda group, row: replies.append(list(row)) or [list(row)])
    reading = MemoryReading(total_bytes=2**34, available_bytes=2**32)
    follower = Follower(SimpleNamespace(rank=lambda: 1), loaded,
                        MemoryGuard(headroom_bytes=2**30, probe=lambda: reading))
    handle = follower._handlers
    handle[c.OPEN](1, c.MODES.index("fp16"), 16, c.ROTATE_CODES[None], 64, 0)
    session = follower.sessions[1]

    def room() -> int:
        handle[c.FIT](1, 100, 0, 0, 0, 0)
        return replies.pop()[c.ROOM_TOKENS + c.MODES.index("fp16")]

    before = room()
    handle[c.CHUNK_SIZE](1, 4096, 0, 0, 0, 0)  # rank 0's Configure: larger chunks
    assert session.chunk_size == 4096
    facts = session.prefill_facts
    grown = facts.transient_bytes(4096) - facts.transient_bytes(64)
    page = session.page_size * session.kv_token_bytes
    assert (before - room()) * session.kv_token_bytes > grown - page
