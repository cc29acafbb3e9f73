"""The conversation model batches streamed text and repaints the last row only."""

from __future__ import annotations

from app.chat_model import ChatMessage, ChatModel, StatusRole, engine_content
from app.store import AttachmentRecord


def test_streamed_text_is_batched_into_one_last_row_update(qtbot) -> None:
    model = ChatModel()
    model.set_messages([ChatMessage("user", "hi"), ChatMessage("assistant", "", "streaming")])
    changes: list[tuple[int, int]] = []
    model.dataChanged.connect(lambda top, bottom, _roles: changes.append((top.row(),
                                                                          bottom.row())))
    with qtbot.waitSignal(model.streamFlushed, timeout=2000) as flushed:
        for piece in ("The ", "capital ", "is ", "Paris."):
            model.append_text(piece)
        assert changes == []  # nothing repainted until the timer fires
    assert flushed.args == ["The capital is Paris."]
    assert changes == [(1, 1)]
    assert model.data(model.index(1)) == "The capital is Paris."
    assert model.data(model.index(0)) == "hi"


def test_update_truncate_and_engine_messages() -> None:
    model = ChatModel()
    doc = AttachmentRecord("a.txt", 5, "0" * 64, 2, "hello")
    model.set_messages([
        ChatMessage("user", "Summarise", attachments=(doc,)),
        ChatMessage("assistant", "partial", "streaming"),
    ])
    model.update_last(status="failed", reason="boom")
    assert model.data(model.index(1), StatusRole) == "failed"
    assert model.engine_messages("sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "<document name=\"a.txt\">\nhello\n</document>\n\nSummarise"},
    ]
    assert engine_content(model.message(0)).startswith("<document")
    model.truncate(1)
    assert model.rowCount() == 1
