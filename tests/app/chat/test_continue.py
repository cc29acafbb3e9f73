"""An answer cut at the length limit can go on; defaults that avoid loops."""

from __future__ import annotations

from app.chat.recorder import LENGTH_LIMIT
from app.controller import CONTINUE_PROMPT
from app.settings import DEFAULT_REPETITION_PENALTY, Settings
from engine.session.sampling import build_logits_processors
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait


def test_default_sampling_penalises_repeats() -> None:
    sampling = Settings().sampling
    assert sampling.repetition_penalty == DEFAULT_REPETITION_PENALTY > 1.0
    assert len(build_logits_processors(sampling)) == 1


def test_an_answer_cut_at_the_length_limit_offers_continue(qtbot, window) -> None:
    c = window.controller
    c.new_session("q8")
    assert send_and_wait(qtbot, window, "Tell me everything") == "complete"
    cut = c.store.messages(c.current.id)[-1]
    assert cut.reason == LENGTH_LIMIT  # 24 tokens of a random tiny model never end early
    last = window.conversation.widgets[-1]
    assert last.continue_button.isVisibleTo(last)
    assert not window.conversation.widgets[0].continue_button.isVisibleTo(
        window.conversation.widgets[0])
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        last.continue_button.click()
    rows = [(m.role, m.content) for m in c.store.messages(c.current.id)]
    assert [r for r, _ in rows] == ["user", "assistant", "user", "assistant"]
    assert rows[2][1] == CONTINUE_PROMPT and rows[3][1]
    assert not window.conversation.widgets[1].continue_button.isVisibleTo(
        window.conversation.widgets[1])  # only the last answer goes on
