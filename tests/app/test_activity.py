"""The one running request and what its refusals say."""

from __future__ import annotations

import pytest

from app.activity import Activity


@pytest.mark.parametrize(("kind", "expected"), [
    ("chat", "Stop the current answer before editing."),
    ("ingest", "Stop reading the conversation in before editing."),
    ("quality", "Stop the quality check before editing."),
])
def test_refusal_names_what_runs(qtbot, kind: str, expected: str) -> None:
    activity = Activity()
    said: list[str] = []
    activity.refused.connect(said.append)
    job = activity.add("s1", kind, "One", lambda _job: None, lambda _job: None)
    assert activity.refuse_in("s1", "editing")
    assert not activity.refuse_in("s2", "editing")  # another chat waits for nothing
    assert activity.refuse("switching models")  # the engine's work: every chat's
    assert said[0] == expected
    assert Activity.is_refusal(said[0])
    activity.end(job)
    assert not activity.refuse_in("s1", "editing") and not activity.refuse("switching models")
    assert len(said) == 2


def test_jobs_wait_in_line_start_by_themselves_and_leave_it_when_dropped(qtbot) -> None:
    activity = Activity()
    started: list[str] = []
    dropped: list[str] = []

    def add(session_id: str):
        return activity.add(session_id, "chat", session_id.upper(),
                            lambda job: started.append(job.session_id),
                            lambda job: dropped.append(job.session_id))

    a, b, c = add("a"), add("b"), add("c")
    assert started == ["a"] and activity.running is a
    assert activity.states() == {"a": "reading", "b": "waiting", "c": "waiting"}
    assert activity.ahead_of(b) is a and activity.ahead_of(a) is None
    cancelled: list[int] = []
    activity.stop(b, cancelled.append)  # waiting: out of the line, the engine never sees it
    assert dropped == ["b"] and cancelled == [] and activity.job_of("b") is None
    activity.stop(a, cancelled.append)  # running, no request yet: cancelled once it has one
    assert cancelled == [] and activity.submitted(a, 41)
    activity.note(c, answering=True)
    activity.end(a)
    assert started == ["a", "c"] and activity.running is c
    assert activity.states() == {"c": "answering"}
    activity.submitted(c, 42)
    activity.stop(c, cancelled.append)
    assert cancelled == [42]
    with qtbot.waitSignal(activity.busyChanged, check_params_cb=lambda busy: not busy):
        activity.end(c)
    assert not activity.busy


def test_other_banner_text_is_not_a_refusal() -> None:
    assert not Activity.is_refusal("Longleaf ran out of memory reading the conversation in.")
