"""An answer cut at the length limit can go on; defaults that avoid loops."""

from __future__ import annotations

from app.chat.recorder import LENGTH_LIMIT
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
    assert not window.conversation.widget_for(0).continue_button.isVisibleTo(
        window.conversation.widget_for(0))
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        last.continue_button.click()
    # The same answer grew: no "Continue." turn, no second bubble.
    rows = [(m.role, m.content, m.status) for m in c.store.messages(c.current.id)]
    assert [r for r, _, _ in rows] == ["user", "assistant"]
    assert rows[1][1].startswith(cut.content) and len(rows[1][1]) > len(cut.content)
    assert rows[1][2] == "complete"
    assert len(window.conversation.widgets) == 2
    assert c.model.message(1).content == rows[1][1]
    assert window.conversation.widget_for(1).continue_button.isVisibleTo(
        window.conversation.widget_for(1))  # cut at the limit again: it can go on again
