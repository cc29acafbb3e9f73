"""The engine in child processes (RemoteWorker): two local ring ranks on the CPU.

One group start costs tens of seconds on a busy CPU, so one test walks a whole
life: answer as one process does, cancel mid-prefill, lose rank 1 mid-answer,
fail fast, restart with load_model, shut down without leaving a process.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from engine.distributed.remote import RemoteWorker
from engine.errors import EngineError
from engine.events import (
    Failed,
    Finished,
    IngestProgress,
    ModelLoaded,
    PipelineLost,
    StatsSample,
    TokenChunk,
)
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams
from tests.engine.distributed.test_pipeline_cache import LAUNCH
from tests.engine.tinymodels import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
PROMPT = "Count the sheep in the meadow, one by one, slowly. " * 96
CHUNK = 16
BOUND = 10.0  # the bound for the error after a rank dies
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
WAIT = 300.0  # a group start on a loaded CPU


class Recorder:
    """Every event but stats samples, in order, and a hook run on each."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.arrived: queue.Queue[object] = queue.Queue()
        self.hook = lambda event: None

    def __call__(self, event: object) -> None:
        if isinstance(event, StatsSample):
            return
        self.hook(event)
        self.events.append(event)
        self.arrived.put(event)

    def ending(self, request_id: int, timeout: float = WAIT) -> Finished | Failed:
        deadline = time.monotonic() + timeout
        while True:
            event = self.arrived.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(event, Finished | Failed) and event.request_id == request_id:
                return event

    def tokens(self, request_id: int) -> list[int]:
        return [token for event in self.events if isinstance(event, TokenChunk)
                and event.request_id == request_id for token in event.token_ids]


def _one_process(model: Path) -> list[int]:
    recorder = Recorder()
    worker = EngineWorker(recorder, chunk_size=CHUNK)
    worker.start()
    try:
        assert isinstance(recorder.ending(worker.load_model(str(model))), Finished)
        assert isinstance(recorder.ending(worker.open_session("s", "q8", 16)), Finished)
        request = worker.chat("s", [{"role": "user", "content": PROMPT}], GREEDY,
                              threading.Event())
        assert isinstance(recorder.ending(request), Finished)
        return recorder.tokens(request)
    finally:
        worker.shutdown(timeout=30.0)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The tiny hybrid model, and its greedy answer to PROMPT in one process."""
    model = make_tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3_next", endless=True)
    return model, _one_process(model)


def _hostfile(folder: Path, hosts: list[str]) -> Path:
    path = folder / "hosts.json"
    path.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": host, "ips": [host]} for host in hosts]}), encoding="utf-8")
    return path


def _rank_pids() -> dict[int, int]:
    # The group's folder is in this process's (private) temp folder.
    pids = {}
    for path in Path(tempfile.gettempdir()).glob("pipeline-*/rank*.pid"):
        pids[int(path.stem.removeprefix("rank"))] = int(path.read_text())
    return pids


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_a_remote_pipeline_answers_cancels_loses_a_rank_and_restarts(
        qwen3_next: tuple[Path, list[int]]) -> None:
    model, expected = qwen3_next
    before = _children()
    recorder = Recorder()
    worker = RemoteWorker(recorder, chunk_size=CHUNK, ranks=2)
    worker.start()
    messages = [{"role": "user", "content": PROMPT}]
    seen: list[int] = []
    try:
        load = worker.load_model(str(model))
        assert isinstance(recorder.ending(load), Finished), recorder.events[-1]
        assert any(isinstance(e, ModelLoaded) and e.request_id == load for e in recorder.events)
        assert isinstance(recorder.ending(worker.open_session("s", "q8", 16)), Finished)

        # Cancelled from the event relay after the first chunk: rank 0 stops the read.
        cancel = threading.Event()
        recorder.hook = lambda e: isinstance(e, IngestProgress) and cancel.set()
        first = recorder.ending(worker.chat("s", messages, GREEDY, cancel))
        recorder.hook = lambda event: None
        assert isinstance(first, Finished) and first.reason == "cancelled", first
        assert 0 < first.kept_tokens < first.total_tokens
        # The next request continues from the kept chunks, as one process answers.
        second = worker.chat("s", messages, GREEDY, threading.Event())
        assert isinstance(recorder.ending(second), Finished)
        assert recorder.tokens(second) == expected
        assert worker.count_tokens("one two three") > 0
        assert worker.fit_check("s", 100).fits
        # Both machines' shares reach the app through rank 0's connection.
        assert [share.rank for share in worker.latest_stats().ranks] == [0, 1]
        assert [share.rank for share in worker.fit_check("s", 100).ranks] == [0, 1]
        # A chat not opened yet is sized as the open one is: each machine its layers,
        # every one answering (whole pages either way at a multiple of both sizes).
        opened, unopened = worker.fit_check("s", 4096), worker.fit_check(None, 4096)
        assert [share.rank for share in unopened.ranks] == [0, 1]
        assert unopened.for_mode("q8").bytes_needed == opened.for_mode("q8").bytes_needed
        assert unopened.ranks[1].tokens_in("q8") >= opened.ranks[1].tokens_in("q8") > 0
        # The page size a new chat will open with reaches rank 0's check.
        assert (worker.fit_check(None, 1100, 1024).for_mode("q8").bytes_needed
                != worker.fit_check(None, 1100).for_mode("q8").bytes_needed)

        # Rank 1 killed mid-answer: the answer and the request queued behind it fail.
        pids = _rank_pids()
        seen += pids.values()
        answering = threading.Event()
        recorder.hook = lambda e: isinstance(e, TokenChunk) and answering.set()
        long = worker.chat("s", messages, SamplingParams(temperature=0.0, max_tokens=100000),
                           threading.Event())
        queued = worker.ingest("s", messages, threading.Event())
        assert answering.wait(WAIT)
        # Rank 0's answers running reach the app after the events that changed them.
        deadline = time.monotonic() + WAIT
        while worker.streams().answering != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.streams().answering == 1, worker.streams()
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        failed = recorder.ending(long, timeout=60)
        took = time.monotonic() - killed
        assert isinstance(failed, Failed), failed
        assert took <= BOUND, f"the error came {took:.1f} s after the kill"
        assert "rank 1 (this machine)" in failed.message and "rank 0" not in failed.message
        assert recorder.ending(queued, timeout=5).message == failed.message
        lost = [e for e in recorder.events if isinstance(e, PipelineLost)]
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
            lost = [e for e in recorder.events if isinstance(e, PipelineLost)]
        assert [e.message for e in lost] == [failed.message]
        assert worker.streams().in_flight == 0  # the lost group runs nothing
        assert recorder.events.index(lost[0]) > recorder.events.index(failed)

        # Until the next load, every request fails at once with the same message.
        again = recorder.ending(worker.chat("s", messages, GREEDY, threading.Event()),
                                timeout=5)
        assert isinstance(again, Failed) and again.message == failed.message
        with pytest.raises(EngineError, match="rank 1"):
            worker.count_tokens("one")

        # load_model starts a new group.
        assert isinstance(recorder.ending(worker.load_model(str(model))), Finished)
        seen += _rank_pids().values()
        assert len([e for e in recorder.events if isinstance(e, PipelineLost)]) == 1
    finally:
        worker.shutdown(timeout=30.0)
    assert worker.join(10.0)
    assert not any(psutil.pid_exists(pid) for pid in seen)
    assert _children() <= before


def test_a_model_mlx_lm_cannot_split_fails_its_load_before_any_process_starts(
        tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path, "llama")
    before = _children()
    recorder = Recorder()
    worker = RemoteWorker(recorder, ranks=2)
    worker.start()
    try:
        # No group yet: settings are kept for it, requests fail with what to do.
        done = recorder.ending(worker.configure(budget_bytes=None, chunk_size=64, read_share=0.5))
        assert isinstance(done, Finished) and done.reason == "done"
        opened = recorder.ending(worker.open_session("s", "q8"))
        assert isinstance(opened, Failed) and "Load a model first" in opened.message
        with pytest.raises(EngineError, match="Load a model first"):
            worker.count_tokens("one")
        assert worker.latest_stats() is None
        failed = recorder.ending(worker.load_model(str(model)), timeout=60)
        assert _children() <= before
    finally:
        worker.shutdown()
    assert worker.join(5.0)
    assert isinstance(failed, Failed) and failed.error_type == "ModelLoadError"
    assert "cannot be split across machines" in failed.message and "llama" in failed.message
    assert not any(isinstance(e, PipelineLost) for e in recorder.events)


@pytest.mark.slow
def test_a_hostfile_of_this_machine_twice_runs_the_remote_pipeline(
        qwen3_next: tuple[Path, list[int]], tmp_path: Path) -> None:
    """The app's "other Macs" path: mlx.launch --hostfile, rank 0 on 127.0.0.1."""
    model, expected = qwen3_next
    before = _children()
    recorder = Recorder()
    worker = RemoteWorker(recorder, chunk_size=CHUNK,
                          hostfile=_hostfile(tmp_path, ["127.0.0.1", "127.0.0.1"]))
    worker.start()
    try:
        assert isinstance(recorder.ending(worker.load_model(str(model))), Finished)
        assert isinstance(recorder.ending(worker.open_session("s", "q8", 16)), Finished)
        answer = worker.chat("s", [{"role": "user", "content": PROMPT}], GREEDY,
                             threading.Event())
        assert isinstance(recorder.ending(answer), Finished)
        seen = _rank_pids()
    finally:
        worker.shutdown(timeout=30.0)
    assert worker.join(10.0)
    assert recorder.tokens(answer) == expected
    assert sorted(seen) == [0, 1] and not any(psutil.pid_exists(p) for p in seen.values())
    assert _children() <= before


def test_a_hostfile_whose_first_host_is_another_machine_is_refused(
        qwen3_next: tuple[Path, list[int]], tmp_path: Path) -> None:
    model, _ = qwen3_next
    failed = _load_that_fails(model, hostfile=_hostfile(tmp_path, ["mac1.local", "127.0.0.1"]))
    assert "mac1.local" in failed.message and "must be this Mac (127.0.0.1)" in failed.message


def _load_that_fails(model: Path, configure: dict[str, Any] | None = None,
                     **options: Any) -> Failed:
    """The ending of a ``RemoteWorker`` load of ``model`` that fails before any group
    runs (the worker made with ``options``, given ``configure`` first, shut down after)."""
    recorder = Recorder()
    worker = RemoteWorker(recorder, **options)
    worker.start()
    try:
        if configure is not None:
            assert isinstance(recorder.ending(worker.configure(**configure)), Finished)
        failed = recorder.ending(worker.load_model(str(model)), timeout=60)
    finally:
        worker.shutdown()
    assert worker.join(5.0)
    assert isinstance(failed, Failed), failed
    return failed


def test_the_remote_worker_has_the_in_process_workers_public_surface() -> None:
    """A front end built for EngineWorker drives RemoteWorker unchanged."""
    def public(cls: type) -> dict[str, object]:
        return {name: value for name, value in vars(cls).items() if not name.startswith("_")}

    local, remote = public(EngineWorker), public(RemoteWorker)
    assert set(local) == set(remote)
    for name, value in local.items():
        if isinstance(value, property):
            assert isinstance(remote[name], property), name
            continue
        ours, theirs = inspect.signature(value), inspect.signature(remote[name])
        assert list(ours.parameters.values()) == list(theirs.parameters.values()), name
        assert ours.return_annotation == theirs.return_annotation, name


def test_rank_zero_is_started_with_the_stream_limit_and_the_reads_share(
        qwen3_next: tuple[Path, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = qwen3_next
    started: list[list[str]] = []

    def no_group(argv: list[str], *args: object) -> None:
        started.append(argv)
        raise EngineError("no group in this test")

    monkeypatch.setattr("engine.distributed.remote.Link", no_group)
    for options, expected in (({}, []),
                              ({"streams": 3, "read_share": 0.25},
                               ["--streams", "3", "--read-share", "0.25"])):
        failed = _load_that_fails(model, **options)
        assert "no group in this test" in failed.message
        argv = started.pop()
        assert [a for a in argv if a in ("--streams", "--read-share")] == expected[::2]
        for flag, value in zip(expected[::2], expected[1::2], strict=True):
            assert argv[argv.index(flag) + 1] == value
    # A share the app's Settings give a worker that runs no group yet: the next one's.
    _load_that_fails(model, {"budget_bytes": None, "chunk_size": 512, "read_share": 0.75})
    argv = started.pop()
    assert argv[argv.index("--read-share") + 1] == "0.75"
    with pytest.raises(EngineError, match="above 0 and at most 1"):
        RemoteWorker(Recorder(), read_share=0.0)
