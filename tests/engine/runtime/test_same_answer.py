"""Same input, same answer: a chat read on a slow machine with little free RAM gives the
tokens it gives on a fast one with plenty, in every quantized mode.

In a quantized mode the model's own matmuls round by chunk length, so a chunk plan
that followed timing or free RAM would change the answer with the machine's load.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.events import AnswerWaiting, Finished, IngestProgress, TokenChunk
from engine.format import GB
from engine.memory.guard import MemoryGuard, MemoryReading
from engine.runtime.worker import EngineWorker
from engine.session.prefill import Chunk
from engine.session.sampling import SamplingParams
from engine.session.session import Session
from tests.engine.runtime.test_worker import EventLog
from tests.engine.tinymodels import make_tiny_model_dir

DOCUMENT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30))
CHUNK = 96  # above the old pacer's 64-token floor, so timing could have moved it
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("same-answer-models")
    return {arch: make_tiny_model_dir(root, arch) for arch in ("llama", "qwen3_next")}


class ShortOfMemory:
    """A memory probe: plenty, except for the few reads after each squeeze, which
    find room for half a chunk (``low`` bytes free)."""

    def __init__(self, squeezed_reads: int) -> None:
        self.squeezed_reads = squeezed_reads
        self.low_left = 0
        self.squeezes = 0
        self.low = 0

    def squeeze(self) -> None:
        self.low_left = self.squeezed_reads
        self.squeezes += 1

    def __call__(self) -> MemoryReading:
        if self.low_left > 0:
            self.low_left -= 1
            return MemoryReading(32 * GB, self.low)
        return MemoryReading(32 * GB, 16 * GB)


def _two_turns(model_dir: Path, mode: str, probe: Any, on_progress=None) -> dict[str, Any]:
    """Answer a question about a document, then a follow-up; the ids and the chunks."""
    log = EventLog()

    def on_event(event: object) -> None:
        log(event)
        if on_progress is not None and isinstance(event, IngestProgress):
            on_progress(event)

    guard = MemoryGuard(probe=probe, headroom_bytes=0, floor_bytes=0, check_interval=0.0)
    # A short stats interval: the old pacer shrank chunks that took over two of them.
    worker = EngineWorker(on_event, chunk_size=CHUNK, memory_guard=guard, stats_interval=0.02)
    worker.start()
    try:
        assert isinstance(log.ending(worker.load_model(str(model_dir))), Finished)
        assert isinstance(log.ending(worker.open_session("s", mode, 16)), Finished)
        # Arithmetic only (no MLX): what half a chunk needs, for the squeezed readings.
        probe.low = worker._held.get("s").chunk_bytes(CHUNK // 2)
        messages = [{"role": "user", "content": DOCUMENT + "\n\nWhat jumps?"}]
        answers, chunks = [], []
        for follow_up in ("Over what?", None):
            rid = worker.chat("s", messages, GREEDY, threading.Event())
            ending = log.ending(rid)
            assert isinstance(ending, Finished) and ending.reason in ("stop", "length"), ending
            events = log.for_request(rid)
            ids = [t for e in events if isinstance(e, TokenChunk) for t in e.token_ids]
            answers.append(ids)
            chunks.append([e.tokens_done for e in events if isinstance(e, IngestProgress)])
            text = "".join(e.text for e in events if isinstance(e, TokenChunk))
            if follow_up is not None:
                messages = [*messages, {"role": "assistant", "content": text},
                            {"role": "user", "content": follow_up}]
        waits = [e for e in log.events if isinstance(e, AnswerWaiting)]
        return {"answers": answers, "chunks": chunks, "waits": waits}
    finally:
        worker.shutdown(timeout=10.0)


@pytest.mark.parametrize("mode", ["q6", "q4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_slow_machine_short_of_memory_gives_the_same_tokens(model_dirs, arch, mode,
                                                              monkeypatch) -> None:
    fast = _two_turns(model_dirs[arch], mode, ShortOfMemory(0))
    assert all(fast["answers"]) and len(fast["chunks"][0]) > 2

    forward = Session.forward

    def slow_forward(self: Session, chunk: Chunk, **options: Any) -> bool:
        sent_ahead = forward(self, chunk, **options)
        time.sleep(0.1)  # five stats intervals a chunk: a slow, busy machine
        return sent_ahead

    monkeypatch.setattr(Session, "forward", slow_forward)
    memory = ShortOfMemory(squeezed_reads=3)

    def squeeze(event: IngestProgress) -> None:
        if event.tokens_done < event.tokens_total:  # before a chunk, not before decoding
            memory.squeeze()

    slow = _two_turns(model_dirs[arch], mode, memory, squeeze)
    assert memory.squeezes > 2 and slow["waits"]  # the reads did wait for memory
    assert slow["chunks"] == fast["chunks"]
    assert slow["answers"] == fast["answers"]
