"""The memory guard: one KV budget for every session, RAM headroom, pressure stops and
model-load refusals, all driven by a fake memory probe (no real memory pressure)."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest

from engine.cache import adapter
from engine.cache.pages import PagePool
from engine.errors import (
    Cancelled,
    ContextTooLong,
    InsufficientMemory,
    KvBudgetExceeded,
    MemoryPressure,
    ModelLoadError,
)
from engine.events import (
    AnswerWaiting,
    Failed,
    Finished,
    IngestProgress,
    ModelLoaded,
    Notice,
    SessionOpened,
    StatsSample,
    TokenChunk,
    WaitEnded,
)
from engine.format import GB, human_bytes
from engine.memory.guard import (
    MIB,
    MemoryGuard,
    MemoryReading,
    default_floor,
    default_headroom,
    system_memory,
)
from engine.models.loader import estimate_load_bytes
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams
from engine.session.session import Session
from tests.engine.tinymodels import load_tiny_model, make_tiny_model_dir

QUESTION = "What is the capital of France? The quick brown fox jumps over the lazy dog."
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
# Tiny llama: 2 layers x 2 KV heads x head_dim 32; an fp16 16-token page of both
# layers takes 2 * 16 * 2 * 128 = 8 KiB.
PAGE = 8192


class FakeMemory:
    """A memory probe tests steer: total, available and macOS pressure level."""

    def __init__(self, available: int = 16 * GB, total: int = 32 * GB) -> None:
        self.total = total
        self.available = available
        self.pressure: str | None = None
        self.reads = 0

    def __call__(self) -> MemoryReading:
        self.reads += 1
        return MemoryReading(self.total, self.available, self.pressure)


class HeldByMlx(FakeMemory):
    """A probe whose available memory is ``base`` less what MLX holds: unloading a
    model gives back what its arrays really took, no more."""

    def __init__(self, base: int) -> None:
        super().__init__(base)
        self.base = base

    def __call__(self) -> MemoryReading:
        self.available = self.base - mx.get_active_memory() - mx.get_cache_memory()
        return super().__call__()


def _guard(memory: FakeMemory, **kwargs: Any) -> MemoryGuard:
    args = {"headroom_bytes": 0, "floor_bytes": 0, "check_interval": 0.0, **kwargs}
    return MemoryGuard(probe=memory, **args)


def _pool() -> PagePool:
    pool = PagePool("fp16", 16)
    for _ in range(2):
        pool.add_store(2, 32)  # the tiny llama's layers: PAGE bytes per page
    return pool


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return load_tiny_model(make_tiny_model_dir(tmp_path_factory.mktemp("guard-models"),
                                               "llama"))


class Recorder:
    """Collects events and runs ``on_event(event, count)`` hooks to change memory."""

    def __init__(self, hook=None) -> None:
        self.events: list[Any] = []
        self.cancel = threading.Event()
        self.hook = hook

    def __call__(self, event: object) -> None:
        self.events.append(event)
        if self.hook:
            self.hook(event, self)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _chat(session: Session, messages, recorder: Recorder, sampling=GREEDY, tick=None):
    return session.chat(messages, sampling, request_id=1, cancel=recorder.cancel,
                        emit=recorder, tick=tick or (lambda: None))


def _ingest(session: Session, messages, recorder: Recorder):
    return session.ingest(messages, request_id=1, cancel=recorder.cancel, emit=recorder,
                          tick=lambda: None)


# -- the arithmetic ------------------------------------------------------------


def test_default_headroom_and_floor() -> None:
    assert default_headroom(8 * GB) == 2 * GB  # small machines keep 2 GiB
    assert default_headroom(64 * GB) == int(64 * GB * 0.15)
    assert default_floor(8 * GB) == 512 * MIB
    assert default_floor(64 * GB) == int(64 * GB * 0.05)
    memory = FakeMemory(available=3 * GB, total=8 * GB)
    guard = MemoryGuard(probe=memory)
    assert guard.free_bytes() == 1 * GB
    assert guard.floor(memory()) < guard.headroom(memory())
    memory.available = GB
    assert guard.free_bytes() == 0


def test_system_probe_reads_this_machine() -> None:
    reading = system_memory()
    assert 0 < reading.available_bytes <= reading.total_bytes
    assert reading.pressure_level in (None, "normal", "warning", "critical")
    guard = MemoryGuard()  # the defaults every worker gets
    assert guard.headroom(reading) == default_headroom(reading.total_bytes) >= 2 * GB
    assert guard.free_bytes(reading) == max(0, reading.available_bytes - guard.headroom(reading))


def test_critical_pressure_from_floor_or_macos_level() -> None:
    memory = FakeMemory(available=600 * MIB, total=8 * GB)
    guard = MemoryGuard(probe=memory)
    assert guard.critical() is None
    memory.pressure = "warning"
    assert guard.critical() is None  # warning is normal life on macOS
    memory.pressure = "critical"
    assert guard.critical() == "macOS reports critical memory pressure (600.0 MB available)"
    memory.pressure = None
    memory.available = 400 * MIB
    assert guard.critical() == ("system memory is critically low (400.0 MB available of "
                                "8.0 GB, below the 512.0 MB safety floor)")
    with pytest.raises(MemoryPressure, match=r"did not start the answer: system memory is "
                                             r"critically low .*Close other apps"):
        guard.check_pressure("the answer")


def test_poll_probes_at_most_once_per_interval() -> None:
    memory = FakeMemory()
    now = [0.0]
    guard = MemoryGuard(probe=memory, check_interval=0.5, clock=lambda: now[0])
    assert guard.poll(None) is None and memory.reads == 1
    now[0] = 0.4
    guard.poll(None)
    assert memory.reads == 1
    now[0] = 0.9
    guard.poll(None)
    assert memory.reads == 2
    # And by default at most ten probes a second (what reliability.md says).
    default = MemoryGuard(probe=memory, clock=lambda: now[0])
    default.poll(None)
    now[0] += 0.09
    default.poll(None)
    assert memory.reads == 3
    now[0] += 0.02
    default.poll(None)
    assert memory.reads == 4


# -- one budget for every session's pages ---------------------------------------


def test_all_pools_together_stay_within_one_budget() -> None:
    guard = _guard(FakeMemory(), budget_bytes=10 * PAGE)
    first, second = _pool(), _pool()
    guard.attach("a", first)
    guard.attach("b", second)
    first.ensure(16 * 6)  # six pages
    assert first.bytes_allocated == 6 * PAGE
    guard.refresh("b")
    assert guard.kv_share("b") == 4 * PAGE and second.budget_bytes == 4 * PAGE
    with pytest.raises(KvBudgetExceeded, match="holds 64 tokens"):
        second.ensure(16 * 5)
    second.ensure(16 * 4)
    assert first.bytes_allocated + second.bytes_allocated <= 10 * PAGE
    assert guard.held_bytes() == 10 * PAGE and not guard.ram_bound("b")
    # Closing a session gives its share back to the others.
    guard.detach("a", first)
    guard.refresh("b")
    assert second.budget_bytes == 10 * PAGE
    second.ensure(16 * 10)


def test_a_ceiling_holds_a_pools_growth_to_what_was_counted_for_it() -> None:
    guard = _guard(FakeMemory(), budget_bytes=20 * PAGE)
    pool = _pool()
    guard.attach("a", pool)
    pool.ensure(16)
    assert pool.bytes_allocated == 4 * PAGE  # grown ahead of its one page
    guard.set_ceiling("a", 16 * 6)  # the tokens it was counted for: six pages
    assert pool.budget_bytes == 6 * PAGE
    pool.ensure(16 * 5)  # its growth stops at the ceiling, not at twice its pages
    assert pool.bytes_allocated == 6 * PAGE
    with pytest.raises(KvBudgetExceeded):
        pool.ensure(16 * 7)
    guard.set_ceiling("a", 16 * 2)  # never below what it holds already
    assert pool.budget_bytes == 6 * PAGE
    guard.set_ceiling("a", None)  # left the batch: as alone again
    assert pool.budget_bytes == 20 * PAGE
    # A session that closes takes its ceiling with it.
    guard.set_ceiling("a", 16 * 6)
    guard.detach("a", pool)
    fresh = _pool()
    guard.attach("a", fresh)
    assert fresh.budget_bytes == 20 * PAGE


def test_detach_ignores_a_replaced_pool() -> None:
    guard = _guard(FakeMemory(), budget_bytes=10 * PAGE)
    old, new = _pool(), _pool()
    guard.attach("s", old)
    guard.attach("s", new)  # the session was reopened under the same id
    guard.detach("s", old)
    new.ensure(16)
    assert guard.held_bytes() == new.bytes_allocated > 0


def test_free_ram_bounds_pools_without_a_budget() -> None:
    memory = FakeMemory(available=3 * PAGE)
    guard = _guard(memory)
    pool = _pool()
    guard.attach("s", pool)
    assert pool.budget_bytes == 3 * PAGE and guard.ram_bound("s")
    pool.ensure(16 * 3)
    memory.available = 0  # the pages took what was free
    guard.refresh("s")
    assert pool.budget_bytes == 3 * PAGE  # what it holds stays usable
    with pytest.raises(KvBudgetExceeded):
        pool.ensure(16 * 4)



def test_pages_leave_free_ram_for_the_prefill_transient() -> None:
    memory = FakeMemory(available=8 * PAGE)
    guard = _guard(memory)
    pool = _pool()
    guard.attach("s", pool, transient_bytes=5 * PAGE)
    assert pool.budget_bytes == 3 * PAGE
    memory.available = 4 * PAGE  # less than the transient: no new page, none taken back
    guard.refresh("s")
    assert pool.budget_bytes == pool.bytes_allocated == 0


def test_a_chunk_free_ram_cannot_hold_waits_and_goes_on_at_its_planned_size(llama) -> None:
    memory = FakeMemory()
    guard = _guard(memory)
    session = Session("s", llama, "fp16", page_size=16, guard=guard, chunk_size=64,
                      scratch_bytes=MIB)
    plenty = memory.available

    def squeeze(event: object, recorder: Recorder) -> None:
        if isinstance(event, IngestProgress) and event.tokens_done == 64:
            # Free RAM for the scratch and 32 tokens of activations and pages: half a chunk.
            memory.available = session.chunk_bytes(32) + guard.headroom(memory())

    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            memory.available = plenty  # another app quit

    session.sleep = sleep
    recorder = Recorder(squeeze)
    _ingest(session, _user(QUESTION * 8), recorder)
    assert len(waits) == 3
    said = [e for e in recorder.events if isinstance(e, AnswerWaiting)]
    assert len(said) == 1 and said[0].reason.startswith("Waiting for ")
    assert said[0].short_bytes > 0  # what free RAM lacked for the chunk then
    # Told it goes on as soon as memory came free, before the chunk is read.
    after = recorder.events[recorder.events.index(said[0]) + 1:]
    assert isinstance(after[0], WaitEnded) and isinstance(after[1], IngestProgress)
    done = [e.tokens_done for e in recorder.of(IngestProgress)]
    steps = [b - a for a, b in zip([0, *done], done, strict=False)]
    assert steps[:-1] == [64] * (len(steps) - 1) and 0 < steps[-1] <= 64
    assert done[-1] == len(session.tokens) > 128


# -- model loads ---------------------------------------------------------------


def test_model_load_refusal_names_needed_free_and_a_fitting_size() -> None:
    memory = FakeMemory(available=5 * GB, total=16 * GB)
    guard = MemoryGuard(probe=memory)  # default headroom: 2.4 GiB on 16 GiB
    assert guard.check_load(2 * GB, name="small") is False
    assert guard.check_load(3 * GB, name="swap", releasable_bytes=GB) is True
    with pytest.raises(InsufficientMemory) as error:
        guard.check_load(8 * GB, name="Big-8B", quantized=False)
    message = str(error.value)
    assert message.startswith("Loading Big-8B needs about 8.0 GB of memory, but only "
                              "2.6 GB is free for it (5.0 GB available, 2.4 GB kept free")
    assert "A 4-bit version of this model (about 2.5 GB) would fit" in message
    assert error.value.needed_bytes == 8 * GB
    assert error.value.free_bytes == 5 * GB - int(16 * GB * 0.15)
    with pytest.raises(InsufficientMemory, match="choose a smaller model"):
        guard.check_load(30 * GB, name="Huge", quantized=False)


def test_load_estimate_comes_from_safetensors_headers(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama", dtype="float16")
    needed, quantized = estimate_load_bytes(folder)
    data = (folder / "model.safetensors").stat().st_size
    header = int.from_bytes((folder / "model.safetensors").read_bytes()[:8], "little")
    # CPU backend: float16 weights are computed in float32, twice their file size,
    # plus the load-time probe's working set (tests/engine/models/test_load_estimate.py).
    assert needed > 2 * (data - 8 - header) and not quantized


# -- sessions ------------------------------------------------------------------


def test_second_session_gets_what_the_first_leaves_of_the_budget(llama) -> None:
    guard = _guard(FakeMemory(), budget_bytes=12 * PAGE)
    first = Session("a", llama, "fp16", page_size=16, guard=guard, chunk_size=512)
    _ingest(first, _user(QUESTION * 4), Recorder())
    held = guard.held_bytes()
    assert held >= 4 * PAGE
    second = Session("b", llama, "fp16", page_size=16, guard=guard)
    report = second.fit_report(len(first.tokens))
    assert report.budget_bytes == 12 * PAGE - held and report.other_sessions_bytes == held
    with pytest.raises(ContextTooLong) as error:
        _ingest(second, _user(QUESTION * 4), Recorder())
    message = str(error.value)
    assert f"needs {len(first.tokens):,} tokens" in message
    assert "of the budget held by other open conversations" in message
    assert "Reopen this conversation in q" in message
    assert second.tokens == []
    first.close()
    _ingest(second, _user(QUESTION * 4), Recorder())
    assert adapter.cache_tokens(second.cache) == len(second.tokens) > 0


def test_ingest_past_free_ram_is_refused_up_front_with_numbers(llama) -> None:
    memory = FakeMemory()
    guard = _guard(memory)
    session = Session("s", llama, "fp16", page_size=16, guard=guard, scratch_bytes=MIB)
    # Free RAM holds one prefill chunk's scratch and activations plus three pages.
    transient = session.prefill_facts.transient_bytes(session.chunk_size)
    assert transient > MIB
    memory.available = 3 * PAGE + transient
    with pytest.raises(ContextTooLong) as error:
        _ingest(session, _user(QUESTION * 4), Recorder())
    message = str(error.value)
    assert (f"free RAM (24.0 KB after the safety headroom and {human_bytes(transient)} for "
            "reading it in) holds about 48 tokens in fp16") in message
    assert re.search(r"Reopen this conversation in q[864] to fit it\.$", message)
    assert session.tokens == [] and session.tokens_ingested == 0


def test_generation_stops_with_reason_memory_when_pressure_turns_critical(llama) -> None:
    memory = FakeMemory()
    guard = _guard(memory, floor_bytes=GB)

    ticks = []

    def squeeze() -> None:  # called after every generated token
        ticks.append(1)
        if len(ticks) == 3:
            memory.available = GB // 2  # another app grabbed memory

    session = Session("s", llama, "q8", page_size=16, guard=guard)
    recorder = Recorder()
    reason, stats = _chat(session, _user(QUESTION), recorder, tick=squeeze)
    assert reason == "memory" and session.memory_stop.startswith("system memory is critically")
    # Three ticks: one after the prefill chunk, one per token: stopped after token 2.
    assert stats.generated_tokens == 2
    assert adapter.cache_tokens(session.cache) == len(session.tokens)
    # Memory recovers: the same conversation continues in the same cache.
    memory.available = 16 * GB
    answer = "".join(c.text for c in recorder.of(TokenChunk))
    follow = [*_user(QUESTION), {"role": "assistant", "content": answer}, *_user("And?")]
    reason, _ = _chat(session, follow, Recorder(), SamplingParams(temperature=0.0, max_tokens=3))
    assert reason in ("length", "stop")


def test_answer_that_outgrows_free_ram_ends_as_memory_not_length(llama) -> None:
    memory = FakeMemory()
    guard = _guard(memory)

    def fill() -> None:
        memory.available = 0  # nothing more is free: the pages held are all

    session = Session("s", llama, "fp16", page_size=16, guard=guard)
    reason, stats = _chat(session, _user("Hi"), Recorder(),
                          SamplingParams(temperature=0.0, max_tokens=2000), tick=fill)
    assert reason == "memory" and 0 < stats.generated_tokens < 2000
    held = session.stats()
    assert held.tokens == len(session.tokens) <= held.pages_allocated // 2 * 16


def test_ingest_stops_cleanly_between_chunks_under_pressure(llama) -> None:
    memory = FakeMemory()
    guard = _guard(memory, floor_bytes=GB)

    def squeeze(event: object, recorder: Recorder) -> None:
        if isinstance(event, IngestProgress) and event.tokens_done >= 64:
            memory.pressure = "critical"

    session = Session("s", llama, "q4", page_size=16, guard=guard, chunk_size=32)
    first = _user(QUESTION)
    _ingest(session, first, Recorder())
    messages = [*first, {"role": "assistant", "content": "ok"}, *_user(QUESTION * 8)]
    prompt = session.render(messages, add_generation_prompt=False)
    start = len(session.tokens)
    recorder = Recorder(squeeze)
    with pytest.raises(MemoryPressure) as error:
        _ingest(session, messages, recorder)
    # Every chunk read stays held, not just whole messages.
    held = prompt[: start + recorder.of(IngestProgress)[-1].tokens_done]
    assert str(error.value) == (
        "Longleaf stopped reading the conversation in: macOS reports critical memory "
        f"pressure (16.0 GB available). It kept {len(held):,} of {len(prompt):,} tokens; "
        "close other apps or conversations to free memory, then send again to continue "
        "from there.")
    assert session.tokens == held and adapter.cache_tokens(session.cache) == len(held)
    assert (error.value.kept_tokens, error.value.total_tokens) == (len(held), len(prompt))
    assert len(recorder.of(IngestProgress)) >= 2
    # A request that starts under pressure changes nothing.
    with pytest.raises(MemoryPressure, match="did not start the answer"):
        _chat(session, messages, Recorder())
    assert session.tokens == held


def test_user_cancel_is_still_cancelled_not_memory(llama) -> None:
    guard = _guard(FakeMemory())
    session = Session("s", llama, "fp16", page_size=16, guard=guard)

    recorder = Recorder()
    reason, _ = _chat(session, _user(QUESTION), recorder, tick=recorder.cancel.set)
    assert reason == "cancelled" and session.memory_stop is None
    reading = Session("r", llama, "fp16", page_size=16, guard=guard, chunk_size=16)
    recorder = Recorder()  # stopped after the first of several chunks: while reading in
    with pytest.raises(Cancelled):
        _chat(reading, _user(QUESTION * 4), recorder, tick=recorder.cancel.set)
    assert reading.memory_stop is None and len(reading.tokens) == 16


# -- worker ----------------------------------------------------------------------


class Events:
    def __init__(self, hook=None) -> None:
        self.events: list[Any] = []
        self.changed = threading.Condition()
        self.hook = hook

    def __call__(self, event: object) -> None:
        if self.hook:
            self.hook(event, self)
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def ending(self, request_id: int) -> Finished | Failed:
        def done(events: list[Any]) -> bool:
            return any(isinstance(e, Finished | Failed) and e.request_id == request_id
                       for e in events)
        with self.changed:
            assert self.changed.wait_for(lambda: done(self.events), 60.0)
            return next(e for e in self.events if isinstance(e, Finished | Failed)
                        and e.request_id == request_id)


@pytest.fixture
def worker_with():
    workers: list[EngineWorker] = []

    def start(
        memory: FakeMemory, hook=None, stats_interval: float = 0.25, **kwargs: Any
    ) -> tuple[EngineWorker, Events]:
        events = Events(hook)
        worker = EngineWorker(events, memory_guard=_guard(memory, **kwargs),
                              stats_interval=stats_interval)
        worker.start()
        workers.append(worker)
        return worker, events

    yield start
    for worker in workers:
        worker.shutdown(timeout=10.0)


def test_worker_refuses_a_model_that_does_not_fit_and_keeps_the_loaded_one(
    llama, worker_with, tmp_path: Path
) -> None:
    big = make_tiny_model_dir(tmp_path, "llama", intermediate_size=4096)
    memory = FakeMemory()
    worker, events = worker_with(memory)
    assert isinstance(events.ending(worker.load_model(str(llama.folder))), Finished)
    assert isinstance(events.ending(worker.open_session("s", "q8", 16)), Finished)
    small, _ = estimate_load_bytes(llama.folder)
    needed, _ = estimate_load_bytes(big)
    assert needed > 4 * small
    memory.available = needed // 4  # less than the weights, even after unloading
    failed = events.ending(worker.load_model(str(big)))
    assert isinstance(failed, Failed) and failed.error_type == "InsufficientMemory"
    assert failed.message.startswith(f"Loading {big.name} needs about ")
    assert f"is free for it ({needed / 4 / 2**20:.1f} MB available" in failed.message
    # The refusal changed nothing: the open session still answers.
    memory.available = 16 * GB
    ending = events.ending(worker.chat("s", _user(QUESTION), GREEDY, threading.Event()))
    assert isinstance(ending, Finished) and ending.reason in ("stop", "length")


def test_worker_unloads_first_when_only_that_makes_room(llama, worker_with) -> None:
    memory = HeldByMlx(64 * GB)
    worker, events = worker_with(memory)
    events.ending(worker.load_model(str(llama.folder)))
    events.ending(worker.open_session("s", "fp16", 16))
    needed, _ = estimate_load_bytes(llama.folder)
    memory()
    memory.base -= memory.available - needed + 1  # fits only once the model is released
    ending = events.ending(worker.load_model(str(llama.folder)))
    assert isinstance(ending, Finished) and ending.reason == "done"
    assert any(isinstance(e, ModelLoaded) for e in events.events)
    failed = events.ending(worker.chat("s", _user(QUESTION), GREEDY, threading.Event()))
    assert isinstance(failed, Failed) and "No open session named 's'" in failed.message


def test_a_load_that_fits_only_by_counting_reserves_is_refused(llama, worker_with) -> None:
    """The chats' reserves (and the load's own peak) are never all given back:
    once the current model is gone, the load is checked against what was."""
    memory = HeldByMlx(64 * GB)
    worker, events = worker_with(memory)
    events.ending(worker.load_model(str(llama.folder)))
    events.ending(worker.open_session("s", "fp16", 16))
    asked = worker.chat("s", _user(QUESTION), GREEDY, threading.Event())
    assert isinstance(events.ending(asked), Finished)
    needed, _ = estimate_load_bytes(llama.folder)
    memory()
    held = mx.get_active_memory() + mx.get_cache_memory()
    # Short by more than all MLX holds: unloading cannot make room.
    memory.base -= memory.available - needed + held + 1
    loads = sum(isinstance(e, ModelLoaded) for e in events.events)
    failed = events.ending(worker.load_model(str(llama.folder)))
    assert isinstance(failed, Failed) and failed.error_type == "InsufficientMemory"
    assert sum(isinstance(e, ModelLoaded) for e in events.events) == loads


def test_a_model_unloaded_first_is_gone_before_the_next_loads_after_a_batch(
        llama, worker_with, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chats that answered together leave the worker's batch behind: it must not keep
    the model the load unloads, neither while the next loads nor after a failed load."""
    import gc
    import weakref

    from engine.models import loader

    memory = HeldByMlx(64 * GB)
    worker, events = worker_with(memory)
    events.ending(worker.load_model(str(llama.folder)))
    for name in ("a", "b"):
        events.ending(worker.open_session(name, "q8", 16))
    long = SamplingParams(temperature=0.0, max_tokens=24, speculative="off")
    asked = [worker.chat(name, _user(QUESTION), long, threading.Event()) for name in "ab"]
    assert all(isinstance(events.ending(i), Finished) for i in asked)
    assert worker._answering._batch is not None  # they answered together
    old = weakref.ref(worker._held.loaded.model)
    needed, _ = estimate_load_bytes(llama.folder)
    memory()
    memory.base -= memory.available - needed + 1  # fits only once the model is released
    alive_at_load: list[bool] = []

    def failing_load(*args: Any, **kwargs: Any) -> None:
        # No collection here: the unload itself must have let go of the weights.
        alive_at_load.append(old() is not None)
        raise ModelLoadError("the weights are corrupt")

    monkeypatch.setattr(loader, "load_model", failing_load)
    assert isinstance(events.ending(worker.load_model(str(llama.folder))), Failed)
    gc.collect()
    assert alive_at_load == [False] and old() is None


def test_worker_chat_ends_with_reason_memory(llama, worker_with) -> None:
    memory = FakeMemory()

    def squeeze(event: object, events: Events) -> None:
        # Stats come after every token (interval 0): squeeze once tokens are held.
        if isinstance(event, StatsSample) and event.tokens_in_context > 0:
            memory.available = GB // 2

    worker, events = worker_with(memory, squeeze, floor_bytes=GB, stats_interval=0.0)
    events.ending(worker.load_model(str(llama.folder)))
    opened = events.ending(worker.open_session("s", "q6", 16))
    assert isinstance(opened, Finished)
    assert any(isinstance(e, SessionOpened) for e in events.events)
    ending = events.ending(worker.chat("s", _user(QUESTION), GREEDY, threading.Event()))
    assert isinstance(ending, Finished) and ending.reason == "memory"
    assert ending.stats.generated_tokens >= 1
    # Starting again while memory is still critical is refused with the numbers.
    failed = events.ending(worker.chat("s", _user(QUESTION), GREEDY, threading.Event()))
    assert isinstance(failed, Failed) and failed.error_type == "MemoryPressure"
    assert "512.0 MB available" in failed.message


def test_worker_sessions_share_one_budget(llama, worker_with) -> None:
    worker, events = worker_with(FakeMemory(), budget_bytes=12 * PAGE)
    events.ending(worker.load_model(str(llama.folder)))
    for name in ("a", "b"):
        events.ending(worker.open_session(name, "fp16", 16))
    ending = events.ending(worker.ingest("a", _user(QUESTION * 4), threading.Event()))
    assert isinstance(ending, Finished) and ending.reason == "done"
    held = worker.guard.held_bytes()
    report = worker.fit_check("b", ending.stats.prompt_tokens)
    assert report.budget_bytes == 12 * PAGE - held and not report.fits
    assert worker.fit_check(None, 16).budget_bytes == 12 * PAGE - held
    # Another document (nothing of what "a" holds can be shared) fits only once
    # "a", idle, sets its pages aside; one that would not fit anyway leaves it be.
    failed = events.ending(worker.ingest("b", _user("Zebras! " + QUESTION * 16),
                                         threading.Event()))
    assert isinstance(failed, Failed) and failed.error_type == "MemoryShort"
    assert worker.guard.held_bytes() == held
    rid = worker.ingest("b", _user("Zebras! " + QUESTION * 4), threading.Event())
    ending = events.ending(rid)
    assert isinstance(ending, Finished) and ending.reason == "done"
    assert [e for e in events.events if isinstance(e, Notice) and e.request_id == rid
            and e.message.startswith("Made room")]
    events.ending(worker.close_session("b"))
    assert worker.guard.held_bytes() == 0  # "a" holds nothing now


def test_worker_configure_changes_the_budget_between_requests(llama, worker_with) -> None:
    worker, events = worker_with(FakeMemory(), budget_bytes=12 * PAGE)
    events.ending(worker.load_model(str(llama.folder)))
    for name in ("a", "b"):
        events.ending(worker.open_session(name, "fp16", 16))
    events.ending(worker.ingest("a", _user(QUESTION * 4), threading.Event()))
    held = worker.guard.held_bytes()
    applied = events.ending(worker.configure(budget_bytes=held + PAGE, chunk_size=32,
                                             read_share=0.5))
    assert isinstance(applied, Finished) and applied.reason == "done"
    assert worker.fit_check(None, 16).budget_bytes == PAGE
    assert worker.guard.held_bytes() == held  # what "a" holds stays
    # Nothing in common with what "a" holds, and more than the whole budget holds
    # (so setting "a" aside would not make room for it either).
    other = _user("Zebras! " + QUESTION * 16)
    failed = events.ending(worker.ingest("b", other, threading.Event()))
    assert isinstance(failed, Failed) and failed.error_type == "MemoryShort"
    events.ending(worker.configure(budget_bytes=None, chunk_size=32, read_share=0.5))
    assert worker.fit_check(None, 16).budget_bytes is None
    rid = worker.ingest("b", other, threading.Event())
    ending = events.ending(rid)
    assert isinstance(ending, Finished) and ending.reason == "done"
    done = [e.tokens_done for e in events.events
            if isinstance(e, IngestProgress) and e.request_id == rid]
    steps = [b - a for a, b in zip([0, *done], done, strict=False)]
    assert len(steps) > 1 and max(steps) <= 32  # the new chunk size applies too
    bad = events.ending(worker.configure(budget_bytes=-1, chunk_size=32, read_share=0.5))
    assert isinstance(bad, Failed) and "cannot be negative" in bad.message
    # The reads' share beside answers is one of these settings too (read here once
    # the worker has said the request ended).
    assert worker._answering.read_share == 0.5
    events.ending(worker.configure(budget_bytes=None, chunk_size=32, read_share=0.25))
    assert worker._answering.read_share == 0.25
    bad = events.ending(worker.configure(budget_bytes=None, chunk_size=32, read_share=0))
    assert isinstance(bad, Failed) and "above 0 and at most 1" in bad.message
    assert worker._answering.read_share == 0.25


def test_ingest_that_runs_out_of_free_ram_midway_is_refused_with_numbers(llama) -> None:
    memory = FakeMemory()
    guard = _guard(memory)

    def fill(event: object, recorder: Recorder) -> None:
        if isinstance(event, IngestProgress):
            memory.available = 0  # the pages already taken are all there is

    session = Session("s", llama, "fp16", page_size=16, guard=guard, chunk_size=16)
    session.sleep = lambda seconds: None  # RAM never comes back: no need to wait for it
    transient = human_bytes(session.prefill_facts.transient_bytes(session.chunk_size))
    messages = _user(QUESTION * 8)
    with pytest.raises(ContextTooLong) as error:
        _ingest(session, messages, Recorder(fill))
    held = session.stats().bytes_allocated
    prompt = session.render(messages, add_generation_prompt=False)
    assert str(error.value).startswith(f"This conversation needs {len(prompt):,} tokens")
    assert (f"free RAM ({held / 1024:.1f} KB after the safety headroom and {transient} for "
            f"reading it in) holds about {held // PAGE * 16} tokens in fp16") in str(error.value)
    # The chunks read before RAM ran out stay held, and the message says how many.
    kept = len(session.tokens)
    assert "Longleaf waited 30 s for the " in str(error.value)
    assert str(error.value).endswith(f"Longleaf kept {kept:,} of {len(prompt):,} tokens.")
    assert 0 < kept < len(prompt) and session.tokens == prompt[:kept]
    assert adapter.cache_tokens(session.cache) == kept
    assert 0 < held < len(prompt) // 16 * PAGE


def test_worker_ingest_stopped_by_pressure_fails_with_what_it_kept(llama, worker_with) -> None:
    memory = FakeMemory()

    def squeeze(event: object, events: Events) -> None:
        if isinstance(event, IngestProgress) and event.tokens_done >= 32:
            memory.pressure = "critical"

    worker, events = worker_with(memory, squeeze)
    worker.chunk_size = 16
    events.ending(worker.load_model(str(llama.folder)))
    events.ending(worker.open_session("s", "q8", 16))
    failed = events.ending(worker.ingest("s", _user(QUESTION * 4), threading.Event()))
    assert isinstance(failed, Failed) and failed.error_type == "MemoryPressure"
    assert failed.kept_tokens == 32 and failed.total_tokens > 32
    assert f"kept 32 of {failed.total_tokens:,} tokens" in failed.message
