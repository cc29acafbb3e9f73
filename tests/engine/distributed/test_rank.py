"""Rank 0's end of the app's connection (engine.distributed.rank.LeadRank), without MLX.

A fake worker stands in for EngineWorker: the LeadRank must give its events the app's
request ids, pass cancels and reads through, refuse what it does not serve, and
send the answers running together whenever an event changed them.
"""

from __future__ import annotations

import itertools
import threading
from multiprocessing import Pipe
from typing import Any

from engine.distributed.rank import LeadRank
from engine.errors import ContextTooLong
from engine.events import Failed, Finished, TokenChunk
from engine.runtime.answering import StreamCounts
from engine.runtime.commands import Chat, Request
from engine.session.sampling import SamplingParams


class FakeWorker:
    """Answers a chat with one chunk, from its own thread once cancelled."""

    def __init__(self, on_event: Any) -> None:
        self.on_event = on_event
        self.ids = itertools.count(1)
        self.cancels: dict[int, threading.Event] = {}
        self.threads: list[threading.Thread] = []
        self.stopped: float | None = None
        self.answering = 0

    def streams(self) -> StreamCounts:
        return StreamCounts(answering=self.answering)

    def start(self) -> None:
        pass

    def submit(self, request: Request, cancel: threading.Event | None = None) -> int:
        assert isinstance(request, Chat) and cancel is not None
        request_id = next(self.ids)
        self.cancels[request_id] = cancel

        def answer() -> None:
            self.answering += 1
            self.on_event(TokenChunk(request_id, "hi", (5,)))
            cancel.wait(10)
            self.answering -= 1
            self.on_event(Finished(request_id, "cancelled"))

        thread = threading.Thread(target=answer)
        self.threads.append(thread)
        thread.start()
        return request_id

    def count_tokens(self, text: str) -> int:
        if not text:
            raise ContextTooLong("nothing to count")
        return len(text)

    def shutdown(self, timeout: float) -> None:
        self.stopped = timeout
        for thread in self.threads:
            thread.join(10)


def test_the_host_serves_calls_cancels_and_reads_under_the_apps_ids() -> None:
    app, rank0 = Pipe()
    host = LeadRank(rank0, FakeWorker)
    serving = threading.Thread(target=host.serve)
    serving.start()
    try:
        app.send(("call", 41, Chat("s", [], SamplingParams())))
        assert app.recv() == ("event", TokenChunk(41, "hi", (5,)))
        # The answers running together follow an event that changed them.
        assert app.recv() == ("streams", StreamCounts(answering=1))
        app.send(("read", 1, "count_tokens", ("abc",)))
        assert app.recv() == ("reply", 1, True, 3)
        app.send(("read", 2, "count_tokens", ("",)))
        assert app.recv() == ("reply", 2, False, ("ContextTooLong", "nothing to count"))
        app.send(("read", 3, "guard", ()))
        _, _, ok, (_, message) = app.recv()
        assert not ok and "Unknown engine read 'guard'" in message
        app.send(("call", 42, "_execute"))
        refused = app.recv()[1]
        assert isinstance(refused, Failed) and refused.request_id == 42
        app.send(("cancel", 41))  # rank 0's own Event, so its worker ends the answer
        assert app.recv() == ("event", Finished(41, "cancelled"))
        assert app.recv() == ("streams", StreamCounts(answering=0))
        app.send(("shutdown", 4.0))
        serving.join(10)
    finally:
        app.close()
        serving.join(10)
    assert not serving.is_alive() and host.worker.stopped == 4.0
