"""One worker for the app and its local server: API sessions and chats share KV only when told.

In the app both kinds of session live on one worker and one stored-KV folder, so
the partition must hold for the snapshots on disk as well as the open sessions.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.events import Finished, SessionOpened
from engine.runtime.held_sessions import may_reuse
from engine.runtime.worker import EngineWorker
from engine.snapshots.snapshot_store import SnapshotStore
from tests.engine.runtime.test_worker import GREEDY, EventLog, loaded_worker
from tests.engine.tinymodels import make_tiny_model_dir

DOC = "The quick brown fox jumps over the lazy dog. Longleaf pines grow in sand. " * 6
DOCUMENT = [{"role": "user", "content": DOC}]
QUESTION = [*DOCUMENT, {"role": "user", "content": "Which trees?"}]


@pytest.fixture
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineWorker, EventLog]]:
    root = tmp_path_factory.mktemp("api-sharing")
    with loaded_worker(make_tiny_model_dir(root, "llama"),
                       snapshots=SnapshotStore(Path(root) / "kv")) as running:
        yield running


def _answer(engine: EngineWorker, log: EventLog, name: str) -> Finished:
    log.result(engine.open_session(name, "q8", 16), SessionOpened)
    ending = log.ending(engine.chat(name, QUESTION, GREEDY, threading.Event()))
    assert isinstance(ending, Finished)
    return ending


def _read_chat(engine: EngineWorker, log: EventLog) -> None:
    log.result(engine.open_session("chat", "q8", 16), SessionOpened)
    read = log.ending(engine.ingest("chat", DOCUMENT, threading.Event()))
    assert isinstance(read, Finished) and read.stats.prompt_tokens > 0


def test_the_rule() -> None:
    assert not may_reuse("api-1", "chat-1", share_chats=False)
    assert not may_reuse("chat-1", "api-1", share_chats=False)
    assert may_reuse("api-1", "api-2", share_chats=False)
    assert may_reuse("api-1", "chat-1", share_chats=True)


def test_a_stored_chat_serves_api_requests_only_once_shared(worker) -> None:
    engine, log = worker
    _read_chat(engine, log)
    log.ending(engine.close_session("chat", store=True))  # on disk now, nothing in memory
    apart = _answer(engine, log, "api-a")
    assert apart.stats.prefill_tokens == apart.stats.prompt_tokens
    log.ending(engine.close_session("api-a", store=False))
    log.ending(engine.share_chats_with_api(True))
    shared = _answer(engine, log, "api-b")
    assert shared.stats.prefill_tokens < shared.stats.prompt_tokens


def test_an_open_chat_serves_api_requests_only_once_shared(worker) -> None:
    engine, log = worker
    _read_chat(engine, log)
    apart = _answer(engine, log, "api-a")
    assert apart.stats.prefill_tokens == apart.stats.prompt_tokens
    log.ending(engine.close_session("api-a", store=False))
    log.ending(engine.share_chats_with_api(True))
    shared = _answer(engine, log, "api-b")
    assert shared.stats.prefill_tokens < shared.stats.prompt_tokens
    log.ending(engine.share_chats_with_api(False))
    log.ending(engine.close_session("api-b", store=False))
    again = _answer(engine, log, "api-c")
    assert again.stats.prefill_tokens == again.stats.prompt_tokens


def test_a_stored_api_session_serves_no_chat(worker) -> None:
    engine, log = worker
    _answer(engine, log, "api-a")
    log.ending(engine.close_session("api-a", store=True))
    chat = _answer(engine, log, "chat")
    assert chat.stats.prefill_tokens == chat.stats.prompt_tokens
