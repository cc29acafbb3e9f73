"""Titles and numbers as the window writes them."""

from __future__ import annotations

import pytest

from app.format import title_from


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("What is the capital of France?", "What is the capital of France?"),
        ("  first line\nsecond line", "first line"),
        ("Write a Python function that adds two numbers. Use a code block.",
         "Write a Python function that adds two numbers. Use a code…"),
        ("x" * 80, "x" * 59 + "…"),  # one long word: cut inside it
        ("", ""),
    ],
)
def test_title_from_first_message(text: str, title: str) -> None:
    assert title_from(text) == title
    assert len(title_from(text)) <= 60


def test_panel_shows_a_title_as_text(qtbot) -> None:
    from app.memory_panel import MemoryPanel

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("<b>a < b</b>", "q6", "kept in memory")
    assert "&lt;b&gt;a &lt; b&lt;/b&gt;" in panel.session_label.text()
