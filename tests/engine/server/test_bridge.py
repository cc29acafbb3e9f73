"""The server's bridge to the engine, over a stand-in worker: which session a request
runs on, and how many may wait."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from engine.events import Failed, Finished
from engine.runtime.answering import StreamCounts
from engine.server.bridge import QueueFull
from engine.server.inprocess import AttachedBridge
from engine.session.sampling import SamplingParams

PLAIN = SamplingParams(temperature=0.0, max_tokens=8)
ASKED = [{"role": "user", "content": "Hello"}]


class _Worker:
    """What the bridge asks of the engine's worker: ids, and the sessions closed."""

    def __init__(self, parallel: int) -> None:
        self.ids = itertools.count(1)
        self.closed: list[tuple[str, bool]] = []
        self.parallel = parallel

    def open_session(self, name: str, mode: str) -> int:
        return next(self.ids)

    def chat(self, name: str, messages: list, sampling: SamplingParams,
             cancel: threading.Event, **_: object) -> int:
        return next(self.ids)

    def close_session(self, name: str, store: bool) -> None:
        self.closed.append((name, store))

    def streams(self) -> StreamCounts:
        return StreamCounts(limit=self.parallel)


@pytest.fixture
def bridged() -> Iterator[SimpleNamespace]:
    worker = _Worker(parallel=2)
    bridge = AttachedBridge(worker, "q8", lambda: None, max_sessions=4, queue_limit=1)
    bridge.ready.set()
    loop = asyncio.new_event_loop()

    def submit(prompt: list[int]) -> object:
        return bridge.submit(ASKED, prompt, "q8", PLAIN, threading.Event(), loop)

    try:
        yield SimpleNamespace(bridge=bridge, worker=worker, submit=submit)
    finally:
        bridge.shutdown()
        loop.close()


def test_the_queue_limit_counts_the_requests_waiting_beyond_those_answered(
        bridged: SimpleNamespace) -> None:
    # Two answer together (parallel) and one may wait: the fourth is told to retry.
    tickets = [bridged.submit([i, 1, 2]) for i in range(3)]
    with pytest.raises(QueueFull, match="answers 2 requests at once, with 1 more waiting"):
        bridged.submit([9, 1, 2])
    bridged.bridge._on_event(Finished(tickets[0].chat_id, "stop"))
    bridged.submit([9, 1, 2])  # one ended: a place is free again


def test_a_model_answering_alone_is_told_as_one_request_at_a_time(
        bridged: SimpleNamespace) -> None:
    bridged.worker.parallel = 1
    bridged.submit([1, 1, 2])
    bridged.submit([2, 1, 2])
    with pytest.raises(QueueFull, match="answers one request at a time, with 1 more waiting"):
        bridged.submit([3, 1, 2])


@pytest.mark.parametrize("ending", ["unread", "read_in_part"])
def test_a_request_stopped_before_its_read_ends_leaves_what_its_session_held(
        bridged: SimpleNamespace, ending: str) -> None:
    # The next request is told (message_start's cache_read_input_tokens) only
    # what the session holds: not a prompt that was never read in.
    first = bridged.submit([1, 2, 3])
    opened = [rid for rid, ticket in bridged.bridge._tickets.items()
              if ticket is first and rid != first.chat_id]
    for request_id in [*opened, first.chat_id]:
        bridged.bridge._on_event(Finished(request_id, "done" if request_id in opened else "stop"))
    asked = [1, 2, 3, 4, 5, 6, 7, 8]
    second = bridged.submit(asked)
    assert second.session == first.session and second.reused == 3
    if ending == "unread":  # cancelled while it waited for a place
        stopped = Finished(second.chat_id, "cancelled")
    else:  # cancelled after two more of its tokens were read in
        stopped = Finished(second.chat_id, "cancelled", kept_tokens=5, total_tokens=8)
    bridged.bridge._on_event(stopped)
    again = bridged.submit(asked)
    assert again.session == first.session
    assert again.reused == (3 if ending == "unread" else 5)


def test_a_failed_requests_session_is_dropped_as_its_failure_arrives(
        bridged: SimpleNamespace) -> None:
    first = bridged.submit([1, 2, 3])
    # The engine's failure reaches the bridge before the handler reads it: a
    # request sent meanwhile that continues the conversation must not land on
    # the failed session (the handler would then close it under that request).
    bridged.bridge._on_event(Failed(first.chat_id, "The device went away.", "EngineError"))
    assert bridged.worker.closed == [(first.session, False)]
    again = bridged.submit([1, 2, 3, 4, 5])
    assert again.session != first.session
