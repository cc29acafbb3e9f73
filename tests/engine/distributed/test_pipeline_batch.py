"""Two chats answer together over a pipeline, as they do in one process.

Each pass of rank 0's batch goes to the other ranks as one decode step of every
row; a chunk read beside an answer goes as a read alone does, never sent ahead
of a pass (the ranks' messages would cross). The other ranks
hear of each request's end once, when no queued pass feeds its session any more,
so their token check holds, and the next turn of either chat goes on from there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.distributed.test_pipeline_cache import LAUNCH, _run
from tests.engine.tinymodels import make_tiny_model_dir

CHILD = Path(__file__).with_name("pipeline_batch_child.py")


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
def test_two_chats_answer_together_over_two_ranks_as_in_one_process(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    (one,) = _run(model, None, tmp_path / "one", ranks=1, child=CHILD)
    lead, follower = _run(model, None, tmp_path / "two", ranks=2, child=CHILD)
    # Both answered in one batch, and a read went on beside an answer, on one
    # machine and over the pipeline (where "a" paused its read, then its answer,
    # alone for "b").
    for run in (one, lead):
        assert run["answering"] == 2 and run["beside"] == 1, run
    # One answer ended on its end-of-turn token, fed to every rank by the pass
    # queued before it ended (its end is told them after that pass).
    assert "stop" in lead["reasons"], lead
    assert all(reason in ("stop", "length") for reason in lead["reasons"]), lead
    # Same tokens as one process, the follow-ups included (a follower whose tokens
    # disagreed with rank 0's would have stopped the group at its check).
    assert lead["rounds"] == one["rounds"], (one, lead)
    assert all(tokens for round_ in lead["rounds"] for tokens in round_.values())
    # One end a request, none for a read or an answer that went on in the batch.
    assert len(follower["ends"]) == 6 and follower["cancelled"] == 0, follower
