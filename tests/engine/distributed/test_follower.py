"""A follower's own handling of rank 0's commands, without a group: what it does to
its sessions and its memory guard."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.distributed import rank_commands as c
from engine.distributed.follower import Follower
from engine.memory.guard import MemoryGuard
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
