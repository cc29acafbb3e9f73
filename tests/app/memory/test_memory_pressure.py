"""How the window shows the engine's memory guard: stops, refusals, and recovery.

The worker gets a memory guard whose probe the test steers (as in
tests/engine/memory/test_guard.py); nothing here uses real memory pressure.
"""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.chat.answers import MEMORY_STOP
from engine.format import GB
from engine.memory.guard import MemoryGuard
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams
from tests.app.conftest import ANSWER_TIMEOUT_MS, close_window, open_window, send_and_wait
from tests.engine.memory.test_guard import FakeMemory
from tests.engine.tinymodels import make_tiny_model_dir


def _window_with_memory(qtbot, model, memory: FakeMemory, max_tokens: int = 24, **guard_args):
    def worker_factory(on_event, budget_bytes, chunk_size, read_share):
        guard = MemoryGuard(probe=memory, check_interval=0.0, **guard_args)
        return EngineWorker(on_event, chunk_size=chunk_size, memory_guard=guard)

    return open_window(qtbot, model, max_tokens, worker_factory=worker_factory)


def test_memory_turning_critical_mid_answer_is_saved_explained_and_recovers(
        qtbot, tiny_llama) -> None:
    memory = FakeMemory()
    window = _window_with_memory(qtbot, tiny_llama, memory, max_tokens=4000,
                                 headroom_bytes=0, floor_bytes=GB)
    c = window.controller
    try:
        window.composer.set_text("Tell me a long story")
        with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS) as finished:
            qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
            qtbot.waitUntil(lambda: c.model.rowCount() == 2 and bool(c.model.message(1).content),
                            timeout=ANSWER_TIMEOUT_MS)
            memory.available = GB // 2  # below the 1 GiB floor: critical
        assert finished.args == ["stopped"]
        assert window.banner.isVisible() and window.banner.label.text() == MEMORY_STOP
        _, answer = c.store.messages(c.current.id)
        assert (answer.status, answer.reason) == ("stopped", MEMORY_STOP) and answer.content
        assert answer.content == c.model.message(1).content
        status = window.conversation.widget_for(1).status
        assert (status.text(), status.toolTip()) == ("Stopped", MEMORY_STOP)

        # Still critical: the next answer is refused before it starts, with the numbers.
        assert send_and_wait(qtbot, window, "Go on") == "failed"
        text = window.banner.label.text()
        assert text.startswith("Longleaf did not start the answer: system memory is critically "
                               "low (512.0 MB available")
        assert c.store.messages(c.current.id)[-1].reason == text

        memory.available = 16 * GB  # other apps closed
        c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=24)
        assert send_and_wait(qtbot, window, "Go on") == "complete"
    finally:
        close_window(window)


def test_a_model_too_big_for_free_memory_is_refused_and_the_loaded_one_kept(
        qtbot, tiny_llama, tmp_path) -> None:
    big = make_tiny_model_dir(tmp_path, "llama", intermediate_size=4096)  # ~6.6 MB of weights
    memory = FakeMemory()
    window = _window_with_memory(qtbot, tiny_llama, memory, headroom_bytes=0, floor_bytes=0)
    c = window.controller
    try:
        send_and_wait(qtbot, window, "Hello")
        memory.available = 2 * 2**20  # 2 MiB free: the tiny model (0.5 MB) fits, big does not
        with qtbot.waitSignal(c.modelStateChanged, timeout=ANSWER_TIMEOUT_MS,
                              check_params_cb=lambda _text, ready: ready):
            c.load_model(str(big))
        text = window.banner.label.text()
        assert text.startswith(f"Loading {big.name} needs about ")
        assert text.endswith(f" Still using {tiny_llama.name}.")
        assert c.model_ready and c.model_id == str(tiny_llama)
        memory.available = 16 * GB
        assert send_and_wait(qtbot, window, "Still there?") == "complete"
    finally:
        close_window(window)
