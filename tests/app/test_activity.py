"""The chats' jobs: which run together, which wait, and what refusals say."""

from __future__ import annotations

import pytest

from app.activity import Activity, Job
from engine import IngestProgress


@pytest.mark.parametrize(("kind", "expected", "anywhere"), [
    ("chat", "Stop the current answer before editing.",
     "Stop the answer in ‘One’ before switching models."),
    ("ingest", "Stop reading the conversation in before editing.",
     "Stop reading ‘One’ in before switching models."),
    ("quality", "Stop the quality check before editing.",
     "Stop the quality check of ‘One’ before switching models."),
])
def test_refusal_names_what_runs(qtbot, kind: str, expected: str, anywhere: str) -> None:
    activity = Activity()
    said: list[str] = []
    activity.refused.connect(said.append)
    job = activity.add("s1", kind, "One", lambda _job: None, lambda _job: None)
    assert activity.refuse_in("s1", "editing")
    assert not activity.refuse_in("s2", "editing")  # another chat waits for nothing
    # The engine's work waits for every chat's, which may not be the one shown: named.
    assert activity.refuse("switching models")
    # So does a chat's own, asked of it from elsewhere (deleting it from the sidebar).
    assert activity.refuse_in("s1", "switching models", named=True)
    assert said == [expected, anywhere, anywhere]
    assert activity.is_refusal(said[0]) and activity.is_refusal(said[1])
    activity.end(job)
    assert not activity.refuse_in("s1", "editing") and not activity.refuse("switching models")
    assert len(said) == 3


class _Line:
    """An ``Activity`` and what its jobs' callbacks saw."""

    def __init__(self) -> None:
        self.activity = Activity()
        self.started: list[str] = []
        self.dropped: list[str] = []

    def add(self, session_id: str, kind: str = "chat") -> Job:
        return self.activity.add(session_id, kind, session_id.upper(),
                                 lambda job: self.started.append(job.session_id),
                                 lambda job: self.dropped.append(job.session_id))


def test_answers_of_two_chats_start_together_and_stop_each_alone(qtbot) -> None:
    line = _Line()
    activity = line.activity
    with qtbot.waitSignal(activity.busyChanged, check_params_cb=lambda busy: busy):
        a = line.add("a")
    b = line.add("b")
    assert line.started == ["a", "b"] and activity.running == [a, b]
    assert activity.states() == {"a": "reading", "b": "reading"}
    assert activity.ahead_of(a) is None and activity.ahead_of(b) is None
    activity.submitted(a, 41)
    activity.submitted(b, 42)
    activity.note(b, answering=True)
    cancelled: list[int] = []
    activity.stop(a, cancelled.append)
    assert cancelled == [41] and a.stopping and not b.stopping
    activity.end(a)
    assert activity.running == [b] and activity.states() == {"b": "answering"}
    assert activity.busy and activity.refuse("switching models")  # b still runs
    activity.stop(b, cancelled.append)
    assert cancelled == [41, 42]
    with qtbot.waitSignal(activity.busyChanged, check_params_cb=lambda busy: not busy):
        activity.end(b)
    assert not activity.busy and not activity.refuse("switching models")


def test_a_stop_before_the_request_exists_cancels_it_once_it_does(qtbot) -> None:
    line = _Line()
    a = line.add("a")
    cancelled: list[int] = []
    line.activity.stop(a, cancelled.append)  # its cache still opens: no request yet
    assert cancelled == [] and line.activity.submitted(a, 41)


@pytest.mark.parametrize("kind", ["ingest", "quality"])
def test_a_job_that_runs_alone_waits_for_the_answers_and_those_after_it_wait_too(
        qtbot, kind: str) -> None:
    line = _Line()
    activity = line.activity
    a = line.add("a")
    alone = line.add("r", kind)
    c = line.add("c")  # sent after the lone job: waits behind it, never overtakes it
    assert line.started == ["a"] and activity.running == [a]
    assert activity.states() == {"a": "reading", "r": "waiting", "c": "waiting"}
    assert activity.ahead_of(alone) is a and activity.ahead_of(c) is alone
    activity.end(a)
    assert line.started == ["a", "r"] and activity.running == [alone]
    assert activity.ahead_of(c) is alone
    activity.end(alone)
    assert line.started == ["a", "r", "c"] and activity.running == [c]


def test_dropping_the_lone_job_in_line_lets_the_answers_behind_it_start(qtbot) -> None:
    line = _Line()
    activity = line.activity
    a = line.add("a")
    ingest = line.add("r", "ingest")
    line.add("c")
    cancelled: list[int] = []
    activity.stop(ingest, cancelled.append)  # waiting: out of the line, the engine never saw it
    assert line.dropped == ["r"] and cancelled == [] and activity.job_of("r") is None
    assert line.started == ["a", "c"] and len(activity.running) == 2
    activity.end(a)
    assert activity.states() == {"c": "reading"}


def test_an_answer_the_engine_holds_waits_until_it_reads_or_answers(qtbot) -> None:
    line = _Line()
    activity = line.activity
    line.add("a")
    b = line.add("b")
    with qtbot.waitSignal(activity.changed):
        activity.hold(b, "Waiting for memory: 1.0 GB more is needed.")
    assert b.state == "waiting" and activity.ahead_of(b) is None  # started: in no line
    with qtbot.assertNotEmitted(activity.changed):
        activity.hold(b, "Waiting for memory: 1.0 GB more is needed.")  # said already
    activity.note(b, progress=IngestProgress(7, 128, 512, 100.0, 3.0))
    assert b.held == "" and b.state == "reading"
    activity.hold(b, "Waiting for memory again.")
    activity.note(b, answering=True)
    assert b.held == "" and b.state == "answering"


def test_other_banner_text_is_not_a_refusal(qtbot) -> None:
    assert not Activity().is_refusal("Longleaf ran out of memory reading the conversation in.")
