"""Per-session KV modes, the live memory panel, reopening in another mode."""

from __future__ import annotations

import threading

import pytest
from mlx_lm.models import llama
from PySide6.QtCore import Qt, QTimer

from app.format import human_bytes
from app.memory.fit_check import DEBOUNCE_MS
from app.sessions.session_list import RecordRole
from app.window.dialogs import NewChatDialog
from engine.session.sampling import SamplingParams
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait


@pytest.mark.parametrize("mode", ["q8", "q6", "q4", "fp16"])
def test_a_new_session_per_mode(qtbot, window, mode) -> None:
    c = window.controller
    record = c.new_session(mode)
    assert send_and_wait(qtbot, window, "hello there") == "complete"
    assert c.caches.opened == {record.id: mode}
    sample = c.bridge.latest_stats()
    assert sample.session_id == record.id and sample.kv_mode == mode
    assert sample.tokens_in_context > 0
    listed = [window.sessions.list.item(i).data(RecordRole)
              for i in range(window.sessions.list.count())]
    assert [r.kv_mode for r in listed if r.id == record.id] == [mode]
    assert f"— {mode}" in window.windowTitle()
    assert mode in window.panel.session_label.text()
    assert c.store.session(record.id).tokens == sample.tokens_in_context


def test_new_chat_dialog_shows_each_modes_projection(qtbot, window) -> None:
    full = window.fit.full_context_report()
    dialog = NewChatDialog("q6", full, window)
    qtbot.addWidget(dialog)
    assert dialog.mode() == "q6"
    for mode, button in dialog.buttons.items():
        entry = full.for_mode(mode)
        assert human_bytes(entry.bytes_needed) in button.text()
        assert f"{full.max_context:,} tokens" in button.text()


def test_panel_updates_live_while_the_engine_generates(qtbot, window) -> None:
    c = window.controller
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=160)
    shown_before = window.panel.samples_shown
    seen: list[tuple[int, int]] = []
    c.statsUpdated.connect(lambda s: seen.append((s.tokens_in_context, s.kv_bytes_used)))
    send_and_wait(qtbot, window, "Count slowly")
    assert window.panel.samples_shown > shown_before + 1
    tokens = [t for t, _ in seen]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0]  # grows as it generates
    final = c.bridge.latest_stats()
    assert f"{final.tokens_in_context:,} tokens" in window.panel.kv_label.text()
    assert human_bytes(final.kv_bytes_used) in window.panel.kv_label.text()
    assert window.panel.pool.in_use == final.pages_in_use > 0
    assert len(window.panel.chart.kv) >= 2
    mode_row = ("fp16", "q8", "q6", "q4").index(c.current.kv_mode)
    assert window.panel.table.item(mode_row, 0).font().bold()


def test_the_window_stays_live_while_the_engine_is_held_mid_answer(qtbot, window,
                                                                   monkeypatch) -> None:
    """The GUI thread never waits for the engine: with the engine thread held inside a
    forward pass mid-answer (as a big model's step holds it), timers tick, typing goes
    into the box and the streamed part of the answer shows; released, the answer ends."""
    c = window.controller
    send_and_wait(qtbot, window, "Warm up")  # opens the session and its cache first
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=40)
    held, release = threading.Event(), threading.Event()
    calls = 0
    forward = llama.Model.__call__

    def held_forward(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 4:  # past the prompt's pass, tokens into the answer
            held.set()
            release.wait(30)  # a window that waits for the engine fails, not hangs
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(llama.Model, "__call__", held_forward)
    ticks: list[int] = []
    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(lambda: ticks.append(1))
    timer.start()
    try:
        window.composer.set_text("Write a long answer")
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        qtbot.waitUntil(held.is_set, timeout=ANSWER_TIMEOUT_MS)
        before = len(ticks)
        qtbot.waitUntil(lambda: len(ticks) >= before + 5, timeout=10_000)
        window.fit.last_prompt_tokens = 0
        qtbot.keyClicks(window.composer.edit, "next question")
        assert window.composer.text() == "next question"
        typed = len(ticks)  # the fit line's count of the typed text runs, and ticks go on
        qtbot.waitUntil(lambda: len(ticks) >= typed + 2 * DEBOUNCE_MS // 10, timeout=10_000)
        assert window.fit.last_prompt_tokens == window.fit.prompt_tokens()[0] > 0
        answer = c.model.message(c.model.rowCount() - 1)
        assert (answer.role, answer.status) == ("assistant", "streaming")
        assert c.busy and held.is_set() and not release.is_set()
    finally:
        release.set()
        timer.stop()
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        pass
    assert c.model.message(c.model.rowCount() - 1).stats["generated_tokens"] > 8


def test_reopen_in_another_mode_reingests_the_conversation(qtbot, window) -> None:
    c = window.controller
    c.new_session("q8")
    send_and_wait(qtbot, window, "Remember the pines")
    source = c.current
    with qtbot.waitSignal(c.bridge.ended, timeout=ANSWER_TIMEOUT_MS,
                          check_params_cb=lambda e: getattr(e, "reason", "") == "done"):
        reopened = c.reopen_in("q4")
    assert reopened.kv_mode == "q4" and c.current.id == reopened.id
    qtbot.waitUntil(lambda: not c.busy, timeout=ANSWER_TIMEOUT_MS)
    old = [(m.role, m.content) for m in c.store.messages(source.id)]
    new = [(m.role, m.content) for m in c.store.messages(reopened.id)]
    assert new == old
    assert c.bridge.latest_stats().kv_mode == "q4"
    assert c.bridge.latest_stats().tokens_in_context > 0
    held = c.bridge.latest_stats().tokens_in_context
    assert c.cache_state(reopened.id) == f"In memory: {held:,} tokens, ready to answer at once."
