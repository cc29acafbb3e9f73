"""The worker hands a new chat the prefix another open chat already read."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.events import Finished, ModelLoaded, Notice, SessionOpened, StatsSample
from engine.runtime.worker import EngineWorker
from tests.engine.runtime.test_worker import GREEDY, EventLog, loaded_worker
from tests.engine.tinymodels import make_tiny_model_dir

DOC = "The quick brown fox jumps over the lazy dog. Longleaf pines grow in sand. " * 6


@pytest.fixture
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineWorker, EventLog]]:
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("reuse-worker"), "llama")
    with loaded_worker(folder) as running:
        yield running


def test_a_second_chat_on_the_same_document_reads_only_its_question(worker):
    engine, log = worker
    for chat in ("a", "b"):
        log.result(engine.open_session(chat, "q8", 16), SessionOpened)
    document = [{"role": "user", "content": DOC}]
    first = log.ending(engine.ingest("a", document, threading.Event()))
    assert isinstance(first, Finished) and first.stats.reused_tokens == 0
    messages = [*document, {"role": "user", "content": "What is the capital of France?"}]
    second = log.ending(engine.chat("b", messages, GREEDY, threading.Event()))
    assert isinstance(second, Finished) and second.stats.generated_tokens > 0
    held = first.stats.prompt_tokens
    assert second.stats.reused_tokens == held
    assert second.stats.prefill_tokens == second.stats.prompt_tokens - held
    notices = [e for e in log.for_request(second.request_id) if isinstance(e, Notice)]
    assert len(notices) == 1 and f"{held:,} tokens" in notices[0].message
    sample = [e for e in log.events if isinstance(e, StatsSample) and e.session_id == "b"][-1]
    assert sample.kv_shared_bytes > 0 and sample.kv_shared_with == 1
    assert sample.kv_bytes_once < sample.kv_bytes_used
    # Closing the first leaves the second its pages, no longer shared.
    assert log.ending(engine.close_session("a")).reason == "done"
    sample = [e for e in log.events if isinstance(e, StatsSample) and e.session_id == "b"][-1]
    assert sample.kv_shared_bytes == 0 and sample.kv_bytes_once == sample.kv_bytes_used
    log.result(engine.open_session("a", "q8", 16), SessionOpened)
    # Another mode holds other bytes: nothing to share.
    log.result(engine.open_session("c", "q4", 16), SessionOpened)
    third = log.ending(engine.ingest("c", document, threading.Event()))
    assert third.stats.reused_tokens == 0 and third.stats.prefill_tokens == held


def test_a_new_chat_starts_from_another_chats_stored_document(tmp_path) -> None:
    from engine.snapshots import SnapshotStore

    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    log = EventLog()
    engine = EngineWorker(log, snapshots=SnapshotStore(tmp_path / "kv"))
    engine.start()
    try:
        log.result(engine.load_model(str(folder)), ModelLoaded)
        document = [{"role": "user", "content": DOC}]
        log.result(engine.open_session("a", "q8", 16), SessionOpened)
        first = log.ending(engine.ingest("a", document, threading.Event()))
        assert log.ending(engine.close_session("a")).reason == "done"  # stored on disk
        log.result(engine.open_session("b", "q4", 16), SessionOpened)  # a lower mode converts
        messages = [*document, {"role": "user", "content": "Who wrote it?"}]
        second = log.ending(engine.ingest("b", messages, threading.Event()))
        assert isinstance(second, Finished)
        assert second.stats.reused_tokens == first.stats.prompt_tokens
        assert second.stats.prefill_tokens == second.stats.prompt_tokens - first.stats.prompt_tokens
        notices = [e.message for e in log.for_request(second.request_id) if isinstance(e, Notice)]
        assert notices == [f"Reused {first.stats.prompt_tokens:,} tokens stored for another "
                           "chat; reading only the rest."]
        # A snapshot of a document that differs from the first token serves no one.
        log.result(engine.open_session("c", "q8", 16), SessionOpened)
        other = [{"role": "user", "content": "Zebras! " + DOC}]
        third = log.ending(engine.ingest("c", other, threading.Event()))
        assert third.stats.reused_tokens == 0
    finally:
        engine.shutdown(timeout=10.0)


def test_a_deleted_chat_is_closed_without_storing_and_its_stored_kv_goes(tmp_path) -> None:
    from engine.snapshots import SnapshotStore

    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    store = SnapshotStore(tmp_path / "kv")
    log = EventLog()
    engine = EngineWorker(log, snapshots=store)
    engine.start()
    try:
        log.result(engine.load_model(str(folder)), ModelLoaded)
        document = [{"role": "user", "content": DOC}]
        for name in ("kept", "deleted"):
            log.result(engine.open_session(name, "q8", 16), SessionOpened)
            log.ending(engine.ingest(name, document, threading.Event()))
        log.ending(engine.close_session("kept"))
        stored = {info.name for info in store.per_snapshot()}
        assert len(stored) == 1
        log.ending(engine.close_session("deleted", store=False))
        assert {info.name for info in store.per_snapshot()} == stored  # nothing written
        log.ending(engine.clear_snapshots("kept"))
        assert store.per_snapshot() == []
    finally:
        engine.shutdown(timeout=10.0)
