"""API sessions (``api-…``) and the app's chats never take each other's prefixes."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.events import Finished, SessionOpened
from engine.runtime.held_sessions import same_partition
from engine.runtime.worker import EngineWorker
from tests.engine.runtime.test_worker import GREEDY, EventLog, loaded_worker
from tests.engine.tinymodels import make_tiny_model_dir

DOC = "The quick brown fox jumps over the lazy dog. Longleaf pines grow in sand. " * 6


@pytest.fixture
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineWorker, EventLog]]:
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("partition-worker"), "llama")
    with loaded_worker(folder) as running:
        yield running


def test_partitions() -> None:
    assert same_partition("api-1", "api-2") and same_partition("chat-1", "chat-2")
    assert not same_partition("api-1", "chat-1")


def test_an_api_session_reuses_only_api_sessions(worker) -> None:
    engine, log = worker
    for name in ("chat", "api-a", "api-b"):
        log.result(engine.open_session(name, "q8", 16), SessionOpened)
    document = [{"role": "user", "content": DOC}]
    read = log.ending(engine.ingest("chat", document, threading.Event()))
    assert isinstance(read, Finished) and read.stats.prompt_tokens > 0
    messages = [*document, {"role": "user", "content": "Which trees?"}]
    first = log.ending(engine.chat("api-a", messages, GREEDY, threading.Event()))
    assert isinstance(first, Finished)
    assert first.stats.prefill_tokens == first.stats.prompt_tokens  # nothing from "chat"
    second = log.ending(engine.chat("api-b", messages, GREEDY, threading.Event()))
    assert second.stats.prefill_tokens < second.stats.prompt_tokens  # from "api-a"
