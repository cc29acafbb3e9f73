"""The local server on a worker another front end owns (no Qt): claims, model, start, stop."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.events import ModelLoaded
from engine.runtime.worker import EngineWorker
from engine.server import connections
from engine.server.inprocess import AttachedBridge, LocalServer
from engine.server.listen import ServerUnavailable
from tests.engine.runtime.test_worker import EventLog
from tests.engine.tinymodels import make_tiny_model_dir


def test_serves_the_front_ends_model_and_leaves_its_worker_running(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama")
    front_end = EventLog()  # what the owning front end gets: never the server's events
    statuses: list[str] = []
    server: LocalServer | None = None

    def on_event(event: object) -> None:
        if server is None or not server.claim(event):
            front_end(event)

    worker = EngineWorker(on_event)
    worker.start()
    try:
        loaded = front_end.result(worker.load_model(str(folder)), ModelLoaded)
        server = LocalServer(worker, host="127.0.0.1", port=_free_port(), api_key=None,
                             kv_mode="q8",
                             on_status=lambda status: statuses.append(status.state))
        server.start()
        url = f"http://127.0.0.1:{server.port}"
        assert httpx.get(url + "/health", timeout=10).status_code == 503  # no model given yet
        server.model_loaded(str(folder), loaded.info)
        assert server.bridge.ready.wait(60)
        seen = len(front_end.events)
        reply = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat \
            .completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens > 0 and reply.model == folder.name
        # Its requests' events were the server's; stats samples (no request) still reach
        # the front end, nothing else did.
        assert all(getattr(e, "request_id", None) is None for e in front_end.events[seen:])
        assert {"ready", "waiting", "answering"} <= set(statuses)
        assert server.stop()
        assert worker.alive  # the front end's worker goes on
    finally:
        if server is not None:
            server.stop()
        worker.shutdown(timeout=10.0)
    assert not [t for t in threading.enumerate() if t.name.startswith("longleaf-server")]


def test_a_port_in_use_raises_and_leaves_nothing_running() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = EngineWorker(lambda _event: None)
        server = LocalServer(worker, host="127.0.0.1", port=port, api_key=None, kv_mode="q8",
                             on_status=lambda _status: None)
        with pytest.raises(ServerUnavailable, match=f"Port {port} is already in use"):
            server.start()
        assert not server.running


def test_the_local_server_closes_a_connection_that_sends_no_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections, "HEAD_TIMEOUT_S", 0.3)
    worker = EngineWorker(lambda _event: None)
    server = LocalServer(worker, host="127.0.0.1", port=_free_port(), api_key=None,
                         kv_mode="q8", on_status=lambda _status: None)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            reply = b""
            while chunk := sock.recv(4096):  # until the server closes it
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408 ")
        assert httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=60).status_code \
            == 503  # no model given: it still answers
    finally:
        assert server.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_local_server_counts_the_machines_its_front_ends_worker_runs_on() -> None:
    """The app's worker may be a pipeline's: its stats name the ranks (an explicit
    speculative request is then refused, and /health says so)."""
    sample = None
    worker = SimpleNamespace(latest_stats=lambda: sample)
    bridge = AttachedBridge(worker, "q8", lambda: None, max_sessions=1, queue_limit=1)
    try:
        assert bridge.machines == 1  # nothing sampled yet
        sample = SimpleNamespace(ranks=())
        assert bridge.machines == 1
        sample = SimpleNamespace(ranks=("rank 0", "rank 1", "rank 2"))
        assert bridge.machines == 3
    finally:
        bridge.shutdown()


def test_a_model_change_after_a_load_was_queued_keeps_the_server_not_ready(
        tmp_path: Path) -> None:
    """The front end reloads (another machine joined, a model switch): the model it
    had queued to serve is stale once the change comes, and the server says it is
    not ready until the next model is loaded, instead of ready while it loads."""
    from engine.models.info import inspect_model_dir

    folder = make_tiny_model_dir(tmp_path, "llama")
    info = inspect_model_dir(folder)
    bridge = AttachedBridge(EngineWorker(lambda event: None), "fp16", lambda: None,
                            max_sessions=2, queue_limit=2)

    def serve_queued() -> None:
        loader = threading.Thread(target=bridge.load)
        loader.start()
        bridge.stop_loading()
        loader.join(60)

    bridge.model_loaded(str(folder), info)
    bridge.model_changing("Loading the next model.")
    serve_queued()
    assert not bridge.ready.is_set() and bridge.load_error == "Loading the next model."
    bridge.model_loaded(str(folder), info)
    serve_queued()
    assert bridge.ready.is_set() and bridge.load_error is None
    bridge.shutdown()


def test_a_request_told_it_waits_for_memory_is_not_answering_yet() -> None:
    """The app's status line and "Answering together" read this: a request the
    engine holds for memory is still waiting, until it reads or answers."""
    import asyncio

    from engine.events import AnswerWaiting, Finished, TokenChunk
    from engine.server.bridge import Ticket

    changes: list[bool] = []
    worker = SimpleNamespace(latest_stats=lambda: None, close_session=lambda *a, **k: 0)
    bridge = AttachedBridge(worker, "q8", lambda: changes.append(bridge.answering),
                            max_sessions=2, queue_limit=2)
    loop = asyncio.new_event_loop()
    try:
        bridge._sessions["api-1"] = ("q8", [1, 2, 3])
        bridge._tickets[7] = Ticket(loop, chat_id=7, session="api-1")
        bridge.claim(AnswerWaiting(7, "Waiting for memory: …", 4096))
        assert not bridge.answering and not bridge.sessions()[0].answering
        bridge.claim(TokenChunk(7, "Pines", (5,)))
        assert bridge.answering and bridge.sessions()[0].answering
        bridge.claim(Finished(7, "stop"))
        assert not bridge.answering and changes == [True, False]
    finally:
        loop.close()
        bridge.shutdown()
