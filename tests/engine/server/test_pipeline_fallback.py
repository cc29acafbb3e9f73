"""``PipelineBridge`` after its group is lost, without starting one.

The pipeline's worker here is an in-process ``EngineWorker`` that sends
``PipelineLost`` when told, as ``RemoteWorker`` does after failing its requests:
what the bridge does next (go on here, or refuse every request with why) is the
same whichever worker lost the group.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import ClassVar

import openai
import pytest

from engine.events import PipelineLost
from engine.runtime.worker import EngineWorker
from engine.server.pipeline import PipelineBridge
from tests.engine.server.conftest import Served, health_of, start_server
from tests.engine.tinymodels import make_tiny_model_dir

LOST = ("The pipeline run failed on rank 1 (mac2.local): its process was killed "
        "(signal 9). Load the model again to restart it.")
TOO_BIG = "The model needs 99.0 GB and 8.0 GB is free."
WAIT = 60.0


class LosableWorker(EngineWorker):
    """An in-process worker standing in for a pipeline's, which can lose its group."""

    built: ClassVar[list[LosableWorker]] = []

    def __init__(self, on_event, **pipeline) -> None:
        super().__init__(on_event)
        self.pipeline = pipeline
        self.events = on_event
        LosableWorker.built.append(self)

    def lose(self) -> None:
        self.events(PipelineLost(LOST))


@pytest.fixture
def pipeline(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Served, callable]]:
    LosableWorker.built.clear()
    monkeypatch.setattr("engine.server.pipeline.RemoteWorker", LosableWorker)
    model = make_tiny_model_dir(tmp_path, "llama")
    running, stop = start_server(model, tmp_path / "kv", bridge_type=PipelineBridge, ranks=3)
    yield running, LosableWorker.built[0]
    stop()


def _chat(served: Served) -> str:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)
    return client.chat.completions.create(model="m", max_tokens=3, temperature=0.0, messages=[
        {"role": "user", "content": "Hello"}]).choices[0].message.content


def _health(served: Served, status: int) -> dict:
    deadline = time.monotonic() + WAIT
    while (reply := health_of(served)).status_code != status:
        assert time.monotonic() < deadline, reply.json()
        time.sleep(0.05)
    return reply.json()


def test_the_server_goes_on_alone_when_the_model_fits_here(
        pipeline: tuple[Served, LosableWorker], monkeypatch: pytest.MonkeyPatch) -> None:
    served, worker = pipeline
    monkeypatch.setattr("engine.server.pipeline.fits_here", lambda path: "")
    assert worker.pipeline == {"ranks": 3, "hostfile": None, "split": None,
                               "kv_store": "server", "streams": None, "read_share": 0.5}
    assert _health(served, 200)["machines"] == 3
    before = _chat(served)
    worker.lose()
    assert _health(served, 200)["machines"] == 1
    assert served.bridge.worker is not worker and not worker.alive
    assert _chat(served) == before


def test_every_request_says_why_when_the_model_does_not_fit_here(
        pipeline: tuple[Served, LosableWorker], monkeypatch: pytest.MonkeyPatch) -> None:
    served, worker = pipeline
    monkeypatch.setattr("engine.server.pipeline.fits_here", lambda path: TOO_BIG)
    _health(served, 200)
    worker.lose()
    health = _health(served, 503)
    assert health["status"] == "error"
    for message in (health["message"], _refusal(served)):
        assert "rank 1 (mac2.local)" in message and TOO_BIG in message
        assert "does not fit on this machine alone" in message
        assert "Restart the server" in message and "Load the model again" not in message


def _refusal(served: Served) -> str:
    with pytest.raises(openai.InternalServerError) as refused:
        _chat(served)
    assert refused.value.status_code == 503
    return refused.value.message


def test_a_group_lost_while_the_server_stops_loads_nothing_here(
        pipeline: tuple[Served, LosableWorker], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    served, worker = pipeline
    monkeypatch.setattr("engine.server.pipeline.fits_here", lambda path: "")
    _health(served, 200)
    served.bridge.stop_requests()  # Ctrl-C: the server stops first
    worker.lose()  # then a rank, stopped with it, is gone
    # Before, the bridge started loading the whole model here, said the server
    # "goes on" alone, and the exit waited for that load.
    assert served.bridge._fallback is None and served.bridge.worker is worker
    assert served.bridge.machines == 3
    assert "goes on" not in caplog.text and "rank 1 (mac2.local)" in caplog.text
