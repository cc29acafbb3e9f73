"""EngineWorker.check_quality: progress, the receipt, cancel, and the session left alone."""

from __future__ import annotations

import threading

import engine.session.quality_check as quality_check
from engine import Failed, Finished, ModelLoaded, QualityChecked, QualityProgress, SessionOpened
from engine.runtime.worker import THREAD_NAME
from tests.engine.runtime import test_worker
from tests.engine.runtime.test_worker import MESSAGES

# The worker tests' fixtures: a started worker, the tiny model folders.
start_worker = test_worker.start_worker
model_dirs = test_worker.model_dirs
LONG = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 12}]


def _opened(start_worker, model_dir, mode: str, rotate: bool | None = None):
    worker, log = start_worker(chunk_size=16)
    log.result(worker.load_model(str(model_dir)), ModelLoaded)
    opened = log.result(worker.open_session("s", mode, 16, rotate), SessionOpened)
    return worker, log, opened


def test_check_reports_progress_then_the_receipt(start_worker, model_dirs,
                                                 monkeypatch) -> None:
    monkeypatch.setattr(quality_check, "CHUNK_TOKENS", 32)
    monkeypatch.setattr(quality_check, "WINDOW_TOKENS", 80)
    worker, log, opened = _opened(start_worker, model_dirs["llama"], "q4", rotate=True)
    ingested = log.ending(worker.ingest("s", LONG, threading.Event()))
    held = worker._held.get("s").tokens[:]
    rid = worker.check_quality("s", LONG, threading.Event())
    checked = log.result(rid, QualityChecked)
    receipt = checked.receipt
    assert checked.session_id == "s" and receipt.mode == "q4"
    # The session's rows are rotated, so the check's are too.
    assert opened.rotation is not None and receipt.rotated
    total = ingested.stats.prompt_tokens
    assert receipt.context_tokens == total and receipt.window_tokens == min(80, total)
    assert receipt.kl_mean > 0.0 and 0.0 <= receipt.top1 <= 1.0
    progress = [e for e in log.for_request(rid) if isinstance(e, QualityProgress)]
    # One token first (its logits show the vocabulary), then steps of 32.
    assert [e.tokens_done for e in progress] == [1, 33, 65, 80][: len(progress)]
    assert progress[-1].tokens_done == progress[-1].tokens_total == receipt.window_tokens
    events = log.for_request(rid)
    assert events.index(checked) == len(events) - 2  # then Finished("done")
    # Its own caches: the session still holds exactly what it held.
    assert worker._held.get("s").tokens == held
    assert all(src == THREAD_NAME for e, src in zip(log.events, log.sources, strict=True)
               if isinstance(e, QualityProgress | QualityChecked))


def test_unrotated_session_gets_an_unrotated_check(start_worker, model_dirs,
                                                   monkeypatch) -> None:
    monkeypatch.setattr(quality_check, "WINDOW_TOKENS", 24)
    worker, log, opened = _opened(start_worker, model_dirs["llama"], "q6", rotate=False)
    receipt = log.result(worker.check_quality("s", MESSAGES, threading.Event()),
                         QualityChecked).receipt
    assert opened.rotation is None and not receipt.rotated and receipt.mode == "q6"


def test_cancel_ends_the_check_without_a_receipt(start_worker, model_dirs,
                                                 monkeypatch) -> None:
    monkeypatch.setattr(quality_check, "CHUNK_TOKENS", 8)
    worker, log, _ = _opened(start_worker, model_dirs["llama"], "q8")
    cancel = threading.Event()
    original = quality_check.divergence

    def cancel_after_first_chunk(reference, variant):
        cancel.set()
        return original(reference, variant)

    monkeypatch.setattr(quality_check, "divergence", cancel_after_first_chunk)
    rid = worker.check_quality("s", LONG, cancel)
    ending = log.ending(rid)
    assert isinstance(ending, Finished) and ending.reason == "cancelled"
    assert not [e for e in log.for_request(rid) if isinstance(e, QualityChecked)]
    assert len([e for e in log.for_request(rid) if isinstance(e, QualityProgress)]) == 1


def test_unknown_session_and_empty_chat_fail_with_a_reason(start_worker,
                                                            model_dirs) -> None:
    worker, log, _ = _opened(start_worker, model_dirs["llama"], "q8")
    unknown = log.ending(worker.check_quality("nope", MESSAGES, threading.Event()))
    assert isinstance(unknown, Failed) and "open it first" in unknown.message
    empty = log.ending(worker.check_quality("s", [], threading.Event()))
    assert isinstance(empty, Failed) and empty.error_type == "EngineError"
