"""An edited message on a pipeline whose ranks rewind differently.

With ``--split 1,3`` rank 0 holds only the tiny hybrid's last layer (full attention,
which trims to any token) and rank 1 the linear-attention layers (which go back
only to a checkpoint). With ``--split 3,1`` rank 1 holds only the first layer, a
linear-attention one: no page at all, so its load-time probe runs other passes
than rank 0's. An edit in the middle of the last message makes the session go
back to where the prompts part: every rank must land on the same checkpoint, and
the answer must be the one a single process gives.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine.distributed.remote import RemoteWorker
from engine.events import Finished
from engine.runtime.worker import EngineWorker
from tests.engine.distributed.test_pipeline_cache import LAUNCH
from tests.engine.distributed.test_remote_worker import CHUNK, GREEDY, Recorder
from tests.engine.tinymodels import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")

TEXT = ("The longleaf pine grows in the southeast and survives fire by keeping its bud "
        "in a grass stage for years. ") * 3
FIRST = [{"role": "user", "content": TEXT},
         {"role": "assistant", "content": "It waits out the fires."}]
CHATS = (
    FIRST[:1],
    [*FIRST, {"role": "user", "content": "Tell me about its cones."}],
    # The last message edited: its start stays, so each rank goes back to the
    # checkpoint at the end of the messages before it.
    [*FIRST, {"role": "user", "content": "Tell me about its roots and what eats it."}],
)


def _answers(worker: EngineWorker | RemoteWorker, recorder: Recorder,
             model: Path) -> list[tuple[Finished, list[int]]]:
    worker.start()
    try:
        assert isinstance(recorder.ending(worker.load_model(str(model))), Finished)
        assert isinstance(recorder.ending(worker.open_session("s", "q8", 16)), Finished)
        answers = []
        for messages in CHATS:
            request = worker.chat("s", messages, GREEDY, threading.Event())
            ended = recorder.ending(request)
            assert isinstance(ended, Finished), ended
            answers.append((ended, recorder.tokens(request)))
        return answers
    finally:
        worker.shutdown(timeout=30.0)


@pytest.mark.parametrize("split", [[1, 3], [3, 1]])
def test_an_edit_rewinds_every_rank_to_the_same_checkpoint(tmp_path: Path,
                                                           split: list[int]) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    one = Recorder()
    expected = _answers(EngineWorker(one, chunk_size=CHUNK), one, model)
    two = Recorder()
    got = _answers(RemoteWorker(two, chunk_size=CHUNK, ranks=2, split=split), two, model)
    assert [tokens for _, tokens in got] == [tokens for _, tokens in expected]
    assert got[1][1] != got[2][1]  # the edit changes the answer
    # The edit reads again from the checkpoint before the change, as one process does.
    edited, alone = got[2][0].stats, expected[2][0].stats
    assert 0 < edited.prefill_tokens < edited.prompt_tokens
    assert edited.prefill_tokens == alone.prefill_tokens
