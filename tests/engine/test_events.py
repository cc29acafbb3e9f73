"""Events renumbered for a replaced worker keep pointing at their own requests."""

from __future__ import annotations

from engine.events import AnswerWaiting, Finished, renumbered


def test_a_waiting_answer_names_the_request_before_it_by_the_new_numbers() -> None:
    moved = renumbered(AnswerWaiting(7, "waits", 0, behind=6), 7 + 1000)
    assert (moved.request_id, moved.behind) == (1007, 1006)
    alone = renumbered(AnswerWaiting(7, "waits", 512), 1007)
    assert (alone.request_id, alone.behind) == (1007, None)
    assert renumbered(Finished(7, "stop"), 1007) == Finished(1007, "stop")
