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
    activity.set(7, kind, "s1")
    assert activity.refuse("editing")
    assert said == [expected]
    assert Activity.is_refusal(said[0])
    activity.clear()
    assert not activity.refuse("editing")
    assert said == [expected]


def test_other_banner_text_is_not_a_refusal() -> None:
    assert not Activity.is_refusal("Longleaf ran out of memory reading the conversation in.")
