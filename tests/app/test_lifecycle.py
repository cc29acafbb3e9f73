"""Ingest progress and Cancel, refusals while busy, closing mid-answer."""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt

from app.settings import Settings
from app.store import HistoryStore
from engine.sampling import SamplingParams
from tests.app.conftest import ANSWER_TIMEOUT_MS, close_window, open_window
from tests.app.test_documents_drop import TEXT, drop_files


def test_long_document_shows_ingest_progress_and_can_be_cancelled(qtbot, window,
                                                                   tmp_path) -> None:
    c = window.controller
    doc = tmp_path / "long.md"
    doc.write_text(TEXT * 90)  # a few thousand tokens: several 512-token chunks
    drop_files(window, [doc])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    labels: list[str] = []
    c.ingestProgress.connect(lambda e: labels.append(window.composer.progress_label.text()))
    window.composer.set_text("Summarise it")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(labels), timeout=ANSWER_TIMEOUT_MS)
    total = next(iter(window.attachments.values()), None)
    assert total is None  # the attachment went out with the message
    first = labels[0]
    assert " / " in first and "tok/s" in first and "ETA" in first
    done, rest = first.split(" / ")
    assert 0 < int(done.replace(",", "")) < int(rest.split(" ")[0].replace(",", ""))
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS) as finished:
        next(b for b in window.composer.progress_box.findChildren(type(window.composer.send_button))
             if b.text() == "Cancel").click()
    assert finished.args == ["stopped"]
    assert not window.composer.progress_box.isVisible()
    user = c.store.messages(c.current.id)[0]
    assert [a.name for a in user.attachments] == ["long.md"]  # the document is kept


def test_switching_while_answering_is_refused_with_a_message(qtbot, window) -> None:
    c = window.controller
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=4000)
    other = c.store.create_session("Other", "q4", "demo")
    errors: list[str] = []
    c.errorRaised.connect(errors.append)
    window.composer.set_text("Tell me a long story")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: c.busy and c.active_request not in (None, -1), timeout=20_000)
    current = c.current.id
    c.select_session(other.id)
    c.load_model("demo")
    assert c.current.id == current
    assert errors[:2] == ["Stop the current answer before switching chats.",
                          "Stop the current answer before switching models."]
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        c.stop()


def test_closing_mid_answer_saves_it_and_stops_the_worker(qtbot, tiny_llama) -> None:
    window = open_window(qtbot, tiny_llama, max_tokens=4000)
    c = window.controller
    window.composer.set_text("Tell me a long story")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: c.model.rowCount() == 2 and bool(c.model.message(1).content),
                    timeout=ANSWER_TIMEOUT_MS)
    session_id = c.current.id
    close_window(window)
    assert not [t for t in threading.enumerate() if t.name == "longleaf-engine"]
    store = HistoryStore()
    answer = store.messages(session_id)[1]
    assert answer.status == "stopped" and answer.content
    assert answer.reason == "Longleaf was closed while answering"
    assert Settings().window_geometry is not None
    store.close()
