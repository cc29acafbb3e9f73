"""Rank 0 commands, the other ranks follow: a cancel mid-prefill stops every rank.

The followers have no schedule of their own: rank 0's cancel is the end of its
commands, so they stop after the chunk in flight and hold what rank 0 holds; the
next request on the same group continues from there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.distributed.test_pipeline_cache import LAUNCH, _run
from tests.engine.tinymodels import make_tiny_model_dir

CHILD = Path(__file__).with_name("pipeline_worker_child.py")
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def test_a_cancel_mid_prefill_stops_every_rank_and_the_next_request_works(
        tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    (one,) = _run(model, None, tmp_path / "one", ranks=1, child=CHILD)
    lead, follower = _run(model, None, tmp_path / "two", ranks=2, child=CHILD)
    reason, kept, total = lead["first"]
    assert reason == "cancelled" and 0 < kept < total, lead
    # Stopped within one chunk of the cancel, on every rank at the same token.
    assert kept <= 2 * 16
    assert follower["ends"] == [kept, follower["ends"][1]] and follower["cancelled"] == 1
    # The next request continues from the kept chunks and answers as one process does.
    assert lead["second"] == one["second"] and lead["tokens"] == one["tokens"]
    assert lead["prefill_tokens"] == total - kept
    if lead["second"] == "length":  # every answer token but the last was fed
        assert follower["ends"][1] == total - 1 + len(lead["tokens"])
