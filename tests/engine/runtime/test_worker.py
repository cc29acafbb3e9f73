"""EngineWorker: one thread, ordered events, exactly one ending per request."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.errors import EngineError, EngineStopped
from engine.events import (
    AnswerWaiting,
    Failed,
    Finished,
    IngestProgress,
    ModelLoaded,
    SessionOpened,
    StatsSample,
    TokenChunk,
)
from engine.runtime.heartbeat import THREAD_NAME as HEARTBEAT_THREAD
from engine.runtime.worker import THREAD_NAME, EngineWorker
from engine.session.prefill import Chunk
from engine.session.sampling import SamplingParams
from engine.session.session import Session
from tests.engine.tinymodels import make_tiny_model_dir

QUESTION = "What is the capital of France? The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
WAIT = 60.0


class EventLog:
    """Thread-safe event recorder that can wait for a request's ending."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.sources: list[str] = []  # the thread each event came from
        self.threads: set[str] = set()
        self.changed = threading.Condition()
        self.raise_on: type | None = None

    def __call__(self, event: object) -> None:
        with self.changed:
            self.events.append(event)
            self.sources.append(threading.current_thread().name)
            self.threads.add(self.sources[-1])
            self.changed.notify_all()
        if self.raise_on is not None and isinstance(event, self.raise_on):
            raise RuntimeError("a broken GUI callback")

    def for_request(self, request_id: int) -> list[Any]:
        with self.changed:
            return [e for e in self.events if getattr(e, "request_id", None) == request_id]

    def wait_for(self, predicate, timeout: float = WAIT) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.events), timeout)

    def ending(self, request_id: int) -> Finished | Failed:
        self.wait_for(lambda events: any(
            isinstance(e, Finished | Failed) and e.request_id == request_id for e in events))
        endings = [e for e in self.for_request(request_id) if isinstance(e, Finished | Failed)]
        assert len(endings) == 1, endings
        return endings[0]

    def result(self, request_id: int, kind: type) -> Any:
        """The request's one ``kind`` event, once it ended with ``Finished("done")``."""
        ending = self.ending(request_id)
        assert isinstance(ending, Finished) and ending.reason == "done", ending
        (event,) = [e for e in self.for_request(request_id) if isinstance(e, kind)]
        return event


@contextlib.contextmanager
def loaded_worker(folder: Path, **kwargs: Any) -> Iterator[tuple[EngineWorker, EventLog]]:
    """A started worker with ``folder``'s model loaded, shut down on the way out."""
    log = EventLog()
    engine = EngineWorker(log, **kwargs)
    engine.start()
    try:
        log.result(engine.load_model(str(folder)), ModelLoaded)
        yield engine, log
    finally:
        engine.shutdown(timeout=10.0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker-models")
    return {arch: make_tiny_model_dir(root, arch) for arch in ("llama", "qwen3")}


@pytest.fixture
def start_worker() -> Iterator[Any]:
    workers: list[EngineWorker] = []

    def start(**kwargs: Any) -> tuple[EngineWorker, EventLog]:
        log = EventLog()
        worker = EngineWorker(log, **kwargs)
        worker.start()
        workers.append(worker)
        return worker, log

    yield start
    for worker in workers:
        worker.shutdown(timeout=10.0)


def _ready(start_worker, model_dir: Path, mode: str = "q8", **kwargs: Any):
    worker, log = start_worker(**kwargs)
    log.result(worker.load_model(str(model_dir)), ModelLoaded)
    log.result(worker.open_session("s", mode, 16), SessionOpened)
    return worker, log


def test_chat_streams_events_in_order_on_the_engine_thread(start_worker, model_dirs) -> None:
    worker, log = start_worker(chunk_size=16)
    loaded = log.result(worker.load_model(str(model_dirs["qwen3"])), ModelLoaded)
    assert loaded.info.architecture == "qwen3"
    opened = log.result(worker.open_session("s", "q8", 16), SessionOpened)
    assert (opened.session_id, opened.kv_mode, opened.page_size) == ("s", "q8", 16)
    rid = worker.chat("s", MESSAGES, GREEDY, threading.Event())
    ending = log.ending(rid)
    assert isinstance(ending, Finished) and ending.reason in ("length", "stop")
    events = log.for_request(rid)
    assert events[-1] is ending
    kinds = [type(e) for e in events]
    assert kinds.index(TokenChunk) > max(i for i, k in enumerate(kinds) if k is IngestProgress)
    assert sum(len(e.token_ids) for e in events if isinstance(e, TokenChunk)) == \
        ending.stats.generated_tokens
    # Only stats samples may come from the heartbeat thread (a slow step on a busy machine).
    assert log.threads <= {THREAD_NAME, HEARTBEAT_THREAD}
    assert all(source == THREAD_NAME for e, source in zip(log.events, log.sources, strict=True)
               if not isinstance(e, StatsSample))
    samples = [e for e in log.events if isinstance(e, StatsSample)]
    assert samples and samples[-1].session_id == "s" and samples[-1].kv_mode == "q8"
    latest = worker.latest_stats()
    assert latest is not None and latest.tokens_in_context > 0 and latest.pages_in_use > 0
    # The predicted prefill peak: the weights and the held pages plus one chunk's needs.
    weights = worker._held.prefill.weights_bytes
    assert latest.prefill_peak_bytes > weights + latest.kv_bytes_allocated


def test_matches_a_direct_session(start_worker, model_dirs) -> None:
    from engine.models.loader import load_model

    worker, log = _ready(start_worker, model_dirs["qwen3"], "fp16")
    rid = worker.chat("s", MESSAGES, GREEDY, threading.Event())
    log.ending(rid)
    ids = [i for e in log.for_request(rid) if isinstance(e, TokenChunk) for i in e.token_ids]
    session = Session("direct", load_model(model_dirs["qwen3"]), "fp16", 16)
    direct: list[TokenChunk] = []
    session.chat(MESSAGES, GREEDY, request_id=0, cancel=threading.Event(),
                 emit=direct.append, tick=lambda: None)
    assert ids == [i for e in direct if isinstance(e, TokenChunk) for i in e.token_ids]


def test_stats_follow_the_interval(start_worker, model_dirs) -> None:
    # Interval 0: every chunk and token is "due", so the time-based path is exercised.
    worker, log = _ready(start_worker, model_dirs["qwen3"], stats_interval=0.0, chunk_size=8)
    before = len([e for e in log.events if isinstance(e, StatsSample)])
    rid = worker.chat("s", MESSAGES, GREEDY, threading.Event())
    ending = log.ending(rid)
    samples = [e for e in log.events if isinstance(e, StatsSample)][before:]
    chunks = [e for e in log.for_request(rid) if isinstance(e, IngestProgress)]
    assert len(samples) >= len(chunks) + ending.stats.generated_tokens
    tokens = [s.tokens_in_context for s in samples]
    assert tokens == sorted(tokens)  # context only grows within one request


def test_samples_keep_coming_while_a_chunk_runs_long(start_worker, model_dirs,
                                                     monkeypatch) -> None:
    forward = Session.forward

    def slow_forward(self: Session, chunk: Chunk, **options: Any) -> bool:
        sent_ahead = forward(self, chunk, **options)
        time.sleep(0.4)  # one chunk of a big model on a slow machine
        return sent_ahead

    monkeypatch.setattr(Session, "forward", slow_forward)
    worker, log = _ready(start_worker, model_dirs["llama"], stats_interval=0.05,
                         chunk_size=16)
    rid = worker.ingest("s", [{"role": "user", "content": QUESTION * 3}], threading.Event())
    ending = log.ending(rid)
    with log.changed:
        events = list(log.events)
    chunks = [e for e in events if isinstance(e, IngestProgress) and e.request_id == rid]
    window = events[events.index(chunks[0]):events.index(ending)]
    samples = [e for e in window if isinstance(e, StatsSample)]
    # The worker alone sends one sample per 0.4 s chunk; the heartbeat thread the rest.
    assert len(chunks) >= 4 and len(samples) >= 2 * len(chunks)
    assert HEARTBEAT_THREAD in log.threads
    stamps = [s.timestamp for s in samples]
    assert stamps == sorted(stamps)


def test_ingest_then_chat(start_worker, model_dirs) -> None:
    worker, log = _ready(start_worker, model_dirs["llama"], "q4", chunk_size=8)
    ending = log.ending(worker.ingest("s", MESSAGES, threading.Event()))
    assert isinstance(ending, Finished) and ending.reason == "done"
    assert ending.stats.prompt_tokens == worker.latest_stats().tokens_in_context
    assert isinstance(log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event())),
                      Finished)


@pytest.mark.parametrize(
    ("request_kind", "message", "error_type"),
    [("chat_unknown", "open it first", "EngineError"),
     ("open_bad_mode", "q6_k", "UnsupportedModeError"),
     ("load_missing", "missing", "ModelLoadError")],
)
def test_errors_become_failed_with_the_engine_message(
    start_worker, model_dirs, tmp_path, request_kind: str, message: str, error_type: str
) -> None:
    worker, log = _ready(start_worker, model_dirs["llama"])
    if request_kind == "chat_unknown":
        rid = worker.chat("nope", MESSAGES, GREEDY, threading.Event())
    elif request_kind == "open_bad_mode":
        rid = worker.open_session("t", "q6_k", 256)
    else:
        rid = worker.load_model(str(tmp_path / "missing"))
    ending = log.ending(rid)
    assert isinstance(ending, Failed) and message in ending.message
    assert ending.error_type == error_type
    # The worker carries on.
    assert isinstance(log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event())),
                      Finished)


def test_open_before_load_fails(start_worker) -> None:
    worker, log = start_worker()
    ending = log.ending(worker.open_session("s", "q8"))
    assert isinstance(ending, Failed) and "Load a model" in ending.message


def test_a_prompt_memory_cannot_hold_is_failed_as_short_of_memory(start_worker,
                                                                   model_dirs) -> None:
    """Within the model's context but past the KV budget: ``MemoryShort``, which the
    app does not take for a turn too long for good (``ContextTooLong``)."""
    worker, log = _ready(start_worker, model_dirs["llama"], "fp16", budget_bytes=8192)
    ending = log.ending(worker.chat("s", [{"role": "user", "content": QUESTION * 3}],
                                    GREEDY, threading.Event()))
    assert isinstance(ending, Failed) and ending.error_type == "MemoryShort"
    assert "tokens" in ending.message and "free memory" in ending.message


def test_unexpected_errors_are_failed_generically_and_logged(
    start_worker, model_dirs, monkeypatch, caplog
) -> None:
    worker, log = _ready(start_worker, model_dirs["llama"])

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Session, "run_answer", broken)
    with caplog.at_level(logging.ERROR, logger="engine.runtime.worker"):
        ending = log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event()))
    assert isinstance(ending, Failed) and ending.error_type == "RuntimeError"
    assert "boom" in ending.message and "reload the model" in ending.message
    assert any(record.exc_info for record in caplog.records)
    assert isinstance(log.ending(worker.close_session("s")), Finished)


def test_a_raising_callback_does_not_stop_the_worker(start_worker, model_dirs) -> None:
    worker, log = _ready(start_worker, model_dirs["qwen3"])
    log.raise_on = TokenChunk
    ending = log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event()))
    assert isinstance(ending, Finished)


def test_cancel_event_stops_generation(start_worker, model_dirs) -> None:
    worker, log = _ready(start_worker, model_dirs["qwen3"])
    cancel = threading.Event()
    rid = worker.chat("s", MESSAGES, SamplingParams(temperature=0.0, max_tokens=3000), cancel)
    log.wait_for(lambda events: any(isinstance(e, TokenChunk) for e in events))
    cancel.set()
    ending = log.ending(rid)
    assert isinstance(ending, Finished) and ending.reason == "cancelled"
    assert ending.stats.generated_tokens < 3000


def test_shutdown_cancels_running_and_queued_requests(model_dirs) -> None:
    log = EventLog()
    worker = EngineWorker(log)
    worker.start()
    try:
        log.ending(worker.load_model(str(model_dirs["qwen3"])))
        log.ending(worker.open_session("s", "q8"))
        long = SamplingParams(temperature=0.0, max_tokens=3000)
        running = worker.chat("s", MESSAGES, long, threading.Event())
        queued = worker.chat("s", MESSAGES, long, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) for e in events))
    finally:
        worker.shutdown(timeout=10.0)
    assert not any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())
    assert log.ending(running).reason == "cancelled"
    assert log.ending(queued).reason == "cancelled"
    # After shutdown: refused at once, rather than queued where no thread takes it.
    for late in (lambda: worker.close_session("s"), lambda: worker.open_session("t", "q8"),
                 lambda: worker.chat("s", MESSAGES, long, threading.Event())):
        with pytest.raises(EngineStopped, match="has shut down"):
            late()


def test_a_fault_while_shutting_down_ends_no_request_twice(model_dirs) -> None:
    log = EventLog()
    worker = EngineWorker(log)
    worker.start()
    long = SamplingParams(temperature=0.0, max_tokens=3000)
    try:
        log.ending(worker.load_model(str(model_dirs["qwen3"])))
        log.ending(worker.open_session("s", "q8"))
        running = worker.chat("s", MESSAGES, long, threading.Event())
        queued = worker.chat("s", MESSAGES, long, threading.Event())  # waits for "s"
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) for e in events))

        def failing_release() -> None:
            raise RuntimeError("a disk gone while the sessions are stored")

        worker._held.release = failing_release  # type: ignore[method-assign]
    finally:
        worker.shutdown(timeout=10.0)
    assert worker.join(10.0)
    # Each ends once (EventLog.ending checks there is one): cancelled by the stop,
    # not again by the fault after it.
    assert log.ending(running).reason == "cancelled"
    assert log.ending(queued).reason == "cancelled"


def test_close_session_and_reload_forget_sessions(start_worker, model_dirs) -> None:
    worker, log = _ready(start_worker, model_dirs["llama"])
    assert log.ending(worker.close_session("s")).reason == "done"
    assert isinstance(log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event())), Failed)
    log.ending(worker.open_session("s", "q4"))
    log.ending(worker.load_model(str(model_dirs["qwen3"])))
    assert isinstance(log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event())), Failed)


def test_fit_check_and_count_tokens(start_worker, model_dirs) -> None:
    worker, log = start_worker()
    with pytest.raises(EngineError):
        worker.fit_check(None, 100)
    with pytest.raises(EngineError):
        worker.count_tokens("hello")
    with pytest.raises(EngineError):
        worker.turn_overhead("")
    log.ending(worker.load_model(str(model_dirs["llama"])))
    overhead = worker.turn_overhead("Be brief.")
    assert worker.turn_overhead("Be brief.") is overhead  # computed once per system prompt
    assert worker.turn_overhead("") is not overhead
    report = worker.fit_check(None, 100)
    assert report.fits and report.session_mode is None and report.max_context == 4096
    assert not worker.fit_check(None, 5000).fits
    log.ending(worker.open_session("s", "q6", 16))
    assert worker.fit_check("s", 100).session_mode == "q6"
    with pytest.raises(EngineError, match="open it first"):
        worker.fit_check("other", 100)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json"))
    assert worker.count_tokens(QUESTION) == len(tokenizer.encode(QUESTION).ids)


def test_shutdown_without_start_and_twice_is_safe() -> None:
    worker = EngineWorker(lambda event: None)
    worker.shutdown(timeout=0.1)
    worker = EngineWorker(lambda event: None)
    worker.start()
    worker.shutdown()
    worker.shutdown()


def test_cancelled_ingest_says_what_it_kept_and_the_next_one_continues(model_dirs) -> None:
    log = EventLog()
    cancel = threading.Event()

    def on_event(event: object) -> None:
        log(event)
        if isinstance(event, IngestProgress) and event.tokens_done >= 16:
            cancel.set()  # on the engine thread, between two chunks

    worker = EngineWorker(on_event, chunk_size=8)
    worker.start()
    try:
        log.result(worker.load_model(str(model_dirs["llama"])), ModelLoaded)
        log.result(worker.open_session("s", "q8", 16), SessionOpened)
        messages = [{"role": "user", "content": QUESTION * 4}]
        ending = log.ending(worker.ingest("s", messages, cancel))
        assert isinstance(ending, Finished) and ending.reason == "cancelled"
        total = ending.total_tokens
        assert ending.kept_tokens == 16 and total > 32
        rid = worker.ingest("s", messages, threading.Event())
        done = log.ending(rid)
        assert isinstance(done, Finished) and done.reason == "done"
        assert done.kept_tokens is None and done.stats.prompt_tokens == total
        progress = [e for e in log.for_request(rid) if isinstance(e, IngestProgress)]
        assert progress[-1].tokens_total == total - 16  # only what was not held
    finally:
        worker.shutdown(timeout=10.0)


def test_fit_check_before_a_chat_is_opened_counts_the_prefill_peak(start_worker, model_dirs):
    worker, _ = _ready(start_worker, model_dirs["llama"], chunk_size=128)
    report = worker.fit_check(None, 1000)
    session = worker.fit_check("s", 1000)
    # Same model, same smallest chunk: the same transient, opened or not, but for
    # the attention's block, whole pages of the chat's size (16 here, 256 before).
    assert session.transient_bytes > 0
    assert report.transient_bytes == pytest.approx(session.transient_bytes, rel=0.05)
    # The peak: weights, the pages and one chunk's scratch and activations at this
    # context (the attention's block is no longer than the 1,000 tokens).
    facts, needed = report.prefill, report.for_mode("fp16").bytes_needed
    assert report.prefill_peak_bytes == (
        facts.weights_bytes + needed + facts.transient_bytes(report.chunk_tokens, 1000))
    assert facts.transient_bytes(report.chunk_tokens, 1000) < report.transient_bytes


def test_a_closed_chat_comes_back_from_its_snapshot(start_worker, model_dirs, tmp_path) -> None:
    from engine import Notice, SnapshotStore

    store = SnapshotStore(tmp_path / "kv")
    worker, log = _ready(start_worker, model_dirs["llama"], snapshots=store)
    first = log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event()))
    assert first.stats.reused_tokens == 0
    assert log.ending(worker.close_session("s")).reason == "done"
    assert [info.name for info in store.per_snapshot()] == ["s"]
    log.result(worker.open_session("s", "q8", 16), SessionOpened)
    again = log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event()))
    assert again.stats.reused_tokens == again.stats.prompt_tokens - 1
    assert again.stats.prefill_tokens == 1
    texts = [e.text for e in log.events if isinstance(e, TokenChunk)]
    first_text = "".join(e.text for e in log.for_request(first.request_id)
                         if isinstance(e, TokenChunk))
    assert "".join(e.text for e in log.for_request(again.request_id)
                   if isinstance(e, TokenChunk)) == first_text and texts
    # A snapshot of another model is refused with a notice, and the chat is read again.
    log.ending(worker.close_session("s"))
    log.ending(worker.load_model(str(model_dirs["qwen3"])))
    log.result(worker.open_session("s", "q8", 16), SessionOpened)
    other = log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event()))
    assert other.stats.reused_tokens == 0
    notices = [e for e in log.for_request(other.request_id) if isinstance(e, Notice)]
    assert len(notices) == 1 and "model" in notices[0].message.lower()


def test_open_session_can_rotate_the_rows_and_says_so(start_worker, model_dirs) -> None:
    worker, log = start_worker()
    log.result(worker.load_model(str(model_dirs["llama"])), ModelLoaded)
    rotated = log.result(worker.open_session("r", "q6", 16, rotate=True), SessionOpened)
    plain = log.result(worker.open_session("p", "q6", 16, rotate=False), SessionOpened)
    assert rotated.rotation is not None and rotated.rotation.startswith("hadamard")
    assert plain.rotation is None
    for session_id in ("r", "p"):
        ending = log.ending(worker.chat(session_id, MESSAGES, GREEDY, threading.Event()))
        assert isinstance(ending, Finished) and ending.stats.generated_tokens > 0


def test_closing_a_chat_mid_answer_cancels_the_answer(model_dirs, tmp_path,
                                                      monkeypatch) -> None:
    from engine import SnapshotStore
    from engine.session.sampling import AnswerStream

    log = EventLog()
    closes: list[int] = []
    chats: list[int] = []
    answer = SamplingParams(temperature=0.0, max_tokens=400)
    streamed = AnswerStream.stream

    def stream(self: AnswerStream, token: int) -> None:
        streamed(self, token)
        # The window closes the chat while its answer streams: here, on the engine
        # thread after the first token, so the answer cannot have ended before.
        if self.request_id in chats and not closes:
            closes.append(worker.close_session("s"))

    monkeypatch.setattr(AnswerStream, "stream", stream)
    worker = EngineWorker(log, snapshots=SnapshotStore(tmp_path / "kv"))
    worker.start()
    try:
        log.result(worker.load_model(str(model_dirs["llama"])), ModelLoaded)
        log.result(worker.open_session("full", "q8", 16), SessionOpened)
        full = log.ending(worker.chat("full", MESSAGES, answer, threading.Event()))
        assert full.stats.generated_tokens > 8  # long enough for a cut to show
        log.result(worker.open_session("s", "q8", 16), SessionOpened)
        chats.append(worker.chat("s", MESSAGES, answer, threading.Event()))
        ending = log.ending(chats[0])
        assert isinstance(ending, Finished) and ending.reason == "cancelled", ending
        assert 0 < ending.stats.generated_tokens < full.stats.generated_tokens
        assert log.ending(closes[0]).reason == "done"
        # The partial answer went to the stored KV, as a close after an answer does.
        assert "s" in [info.name for info in worker._stored.snapshots.per_snapshot()]
    finally:
        worker.shutdown(timeout=10.0)


# What MLX's CPU backend raised when the disk holding its kernel folder filled up
# mid-answer (captured on a full tmpfs), and when that folder turned read-only.
COMPILE_FAILED = (
    "[Compile::eval_cpu] Failed to compile function Df4IExpAEf4_contiguous: Failed to "
    'execute command with return code 1: "g++ -std=c++17 -O3 -Wall -fPIC -shared -I '
    '"/venv/mlx/include" "{tmp}/mlx/0.32.4/cpu/tmp_21f4257c.cpp" -o '
    '"{tmp}/mlx/0.32.4/cpu/tmp_21f4257c.so" 2>&1", the output is: {output}')
NO_SPACE = "{tmp}/mlx/0.32.4/cpu/tmp_21f4257c.cpp:1: fatal error: error closing x.s: " \
    "No space left on device\ncompilation terminated."
NOT_WRITTEN = "cc1plus: fatal error: {tmp}/mlx/0.32.4/cpu/tmp_1a3735dc.cpp: No such file " \
    "or directory\ncompilation terminated."


@pytest.mark.parametrize(("output", "said"), [(NO_SPACE, "is full"),
                                              (NOT_WRITTEN, "read-only disk")])
def test_a_kernel_compile_into_a_full_or_read_only_folder_is_said_in_words(
    start_worker, model_dirs, monkeypatch, caplog, output: str, said: str
) -> None:
    from engine import disk

    tmp = str(disk.kernel_folder())
    worker, log = _ready(start_worker, model_dirs["llama"])

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(COMPILE_FAILED.format(tmp=tmp, output=output.format(tmp=tmp)))

    monkeypatch.setattr(Session, "run_answer", broken)
    # The read-only case names no cause: the folder itself is asked (here: read-only).
    monkeypatch.setattr(disk, "probe", lambda folder: disk.READ_ONLY)
    with caplog.at_level(logging.WARNING, logger="engine.runtime.worker"):
        ending = log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event()))
    assert isinstance(ending, Failed) and ending.error_type == "DiskFault"
    assert said in ending.message and tmp in ending.message
    assert "g++" not in ending.message and "send the message again" in ending.message
    assert not any(record.exc_info for record in caplog.records)  # one line, no traceback
    monkeypatch.undo()
    assert isinstance(log.ending(worker.chat("s", MESSAGES, GREEDY, threading.Event())),
                      Finished)


@pytest.mark.parametrize("close_via", ["method", "submit"])
def test_a_close_cancels_the_request_running_in_its_session_only(close_via: str) -> None:
    # A pipeline's rank 0 submits the front end's CloseSession as a value: it must
    # stop the running answer as the method does, or the close waits for it.
    from engine.runtime.commands import Chat, CloseSession, Command

    engine = EngineWorker(lambda event: None)  # never started: no MLX, no thread
    running = Command(1, Chat("s", [], SamplingParams()), threading.Event())
    engine._current = running
    close = (engine.close_session if close_via == "method"
             else lambda session_id: engine.submit(CloseSession(session_id)))
    close("other")
    assert not running.cancel.is_set()
    close("s")
    assert running.cancel.is_set()


def test_a_chat_not_opened_yet_keeps_its_layers_outside_the_pages(start_worker,
                                                                 tmp_path) -> None:
    """The fit line of a new chat on a hybrid model leaves the KV budget its
    linear-attention state and their checkpoints take, as the opened chat does."""
    budget = 8 << 20
    worker, log = start_worker(budget_bytes=budget, chunk_size=32)
    log.result(worker.load_model(str(make_tiny_model_dir(tmp_path, "qwen3_next"))),
               ModelLoaded)
    unopened = worker.fit_check(None, 100).budget_bytes
    assert unopened is not None and unopened < budget
    log.result(worker.open_session("s", "q8", 16), SessionOpened)
    assert worker.fit_check("s", 100).budget_bytes == unopened


def test_a_new_chats_fit_counts_the_page_size_it_will_open_with(start_worker,
                                                               model_dirs) -> None:
    """Pages come whole: a chat to open at 1,024-token pages needs what that chat,
    opened, is told it needs, not what the engine's default pages would take."""
    worker, log = start_worker()
    log.result(worker.load_model(str(model_dirs["llama"])), ModelLoaded)
    planned = worker.fit_check(None, 1100, page_size=1024).for_mode("q8").bytes_needed
    assert planned != worker.fit_check(None, 1100).for_mode("q8").bytes_needed
    log.result(worker.open_session("s", "q8", 1024), SessionOpened)
    assert worker.fit_check("s", 1100).for_mode("q8").bytes_needed == planned
    with pytest.raises(EngineError):
        worker.fit_check(None, 1100, page_size=0)


def test_a_chat_waiting_for_its_own_session_holds_no_other_chat_back(tmp_path) -> None:
    """A second message in a chat that answers waits for that answer; a chat after
    it, with places free in the batch, starts at once, and is told of no wait."""
    folder = make_tiny_model_dir(tmp_path, "llama", endless=True, seed=1)
    log = EventLog()
    worker = EngineWorker(log, chunk_size=16, streams=4)
    worker.start()
    try:
        log.result(worker.load_model(str(folder)), ModelLoaded)
        for name in ("x", "y", "z"):
            log.result(worker.open_session(name, "q8", 16), SessionOpened)
        long = SamplingParams(temperature=0.0, max_tokens=600)
        short = SamplingParams(temperature=0.0, max_tokens=5)
        first = worker.chat("x", [{"role": "user", "content": "Tell me about the fox."}],
                            long, threading.Event())
        other = worker.chat("z", [{"role": "user", "content": "And the dog?"}], long,
                            threading.Event())
        log.wait_for(lambda seen: any(isinstance(e, TokenChunk) and e.request_id == other
                                      for e in seen))
        worker.chat("x", [{"role": "user", "content": "Tell me about the fox. More."}], short,
                    threading.Event())
        later = worker.chat("y", [{"role": "user", "content": "What is the capital?"}], short,
                            threading.Event())
        assert isinstance(log.ending(later), Finished)
        assert not any(isinstance(e, AnswerWaiting) for e in log.for_request(later))
        with log.changed:
            assert not any(isinstance(e, Finished) and e.request_id == first
                           for e in log.events)  # it ended while the first still answered
    finally:
        worker.shutdown(timeout=10.0)


def test_a_load_pins_the_code_its_sessions_kv_is_stored_as(start_worker, model_dirs) -> None:
    """The code a session's KV is stored as is the code imported as its model
    loaded: an mlx-lm updated on disk later does not vouch for it."""
    from engine.snapshots import fingerprint

    worker, _log = _ready(start_worker, model_dirs["llama"])
    loaded = worker._held.loaded
    assert loaded is not None
    assert loaded.code == fingerprint.code_fingerprint(model_dirs["llama"])
    assert fingerprint.session_code(worker._held.get("s")) == loaded.code
