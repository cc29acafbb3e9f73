"""Ingest progress and Cancel, refusals while busy, closing mid-answer and mid-ingest."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

import pytest
from PySide6.QtCore import Qt

from app.chat.recorder import STOPPED_READING
from app.controller import CLOSED_WHILE_ANSWERING
from app.settings import Settings
from app.store import HistoryStore
from app.window.quit_box import QUIT
from engine.session.prefill import Chunk
from engine.session.sampling import SamplingParams
from engine.session.session import Session
from tests.app.chat.test_documents_drop import TEXT, drop_files
from tests.app.conftest import ANSWER_TIMEOUT_MS, close_window, open_window, send_and_wait
from tests.app.test_persistence import read_until, start_child


def test_long_document_shows_ingest_progress_and_can_be_cancelled(qtbot, window,
                                                                   tmp_path) -> None:
    c = window.controller
    doc = tmp_path / "long.md"
    doc.write_text(TEXT * 90)  # a few thousand tokens: several 512-token chunks
    drop_files(window, [doc])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    labels: list[str] = []
    c.ingestProgress.connect(lambda e: labels.append(
        window.composer.progress_label.text().replace("\u00a0", " ")))
    window.composer.set_text("Summarise it")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(labels), timeout=ANSWER_TIMEOUT_MS)
    total = next(iter(window.attachments.values()), None)
    assert total is None  # the attachment went out with the message
    first = labels[0].replace("\u2060", "")  # the word joiner that keeps "tokens/s" whole
    assert " / " in first and "tokens/s" in first and ("left" in first or "almost done" in first)
    done, rest = first.split(" / ")
    assert 0 < int(done.replace(",", "")) < int(rest.split(" ")[0].replace(",", ""))
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS) as finished:
        next(b for b in window.composer.progress_box.findChildren(type(window.composer.send_button))
             if b.text() == "Cancel").click()
    assert finished.args == ["stopped"]
    assert not window.composer.progress_box.isVisible()
    user = c.store.messages(c.current.id)[0]
    assert [a.name for a in user.attachments] == ["long.md"]  # the document is kept
    # What was read before the Cancel is kept, and the answer's row says how much.
    answer = c.store.messages(c.current.id)[1]
    assert answer.status == "stopped"
    assert answer.reason.startswith(f"{STOPPED_READING}: "), answer.reason
    kept, total = (int(n.replace(",", "")) for n in
                   answer.reason.split(": ")[1].split(" tokens")[0].split(" of "))
    assert 0 < kept < total
    assert window.conversation.widget_for(1).status.text() == (
        f"{STOPPED_READING}: {kept:,} of {total:,} tokens kept")


def test_switching_models_while_answering_is_refused_but_reading_chats_is_not(
        qtbot, window) -> None:
    c = window.controller
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=4000)
    other = c.store.create_session("Other", "q4", "demo")
    errors: list[str] = []
    c.errorRaised.connect(errors.append)
    window.composer.set_text("Tell me a long story")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: c.busy and c.active_request not in (None, -1), timeout=20_000)
    c.select_session(other.id)
    c.load_model("demo")
    assert c.current.id == other.id
    # The answer runs in the chat left: named, since the chat shown has none to stop.
    assert errors[:1] == ["Stop the answer in ‘Tell me a long story’ before switching models."]
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


def test_closing_mid_ingest_returns_at_once_and_saves_the_history(qtbot, tiny_llama, tmp_path,
                                                                  monkeypatch) -> None:
    settings = Settings()
    settings.ingest_chunk = 16
    settings.sync()
    in_chunk, release = threading.Event(), threading.Event()
    forward = Session.forward

    def stuck_forward(self: Session, chunk: Chunk, **options: Any) -> bool:
        # From the second chunk on, the engine thread is stuck inside a chunk the
        # way a big model's chunk is stuck in MLX: cancel can't reach it.
        sent_ahead = forward(self, chunk, **options)
        if self.tokens_ingested > len(chunk.ids):
            in_chunk.set()
            release.wait(60)
        return sent_ahead

    monkeypatch.setattr(Session, "forward", stuck_forward)
    window = open_window(qtbot, tiny_llama)
    c = window.controller
    doc = tmp_path / "long.md"
    doc.write_text(TEXT * 40)
    drop_files(window, [doc])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    window.composer.set_text("Summarise it")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(in_chunk.is_set, timeout=ANSWER_TIMEOUT_MS)
    session_id = c.current.id
    try:
        began = time.perf_counter()
        window.close()
        if window.quit_box is not None:  # asked mid-read: Quit
            window.quit_box.button(QUIT).click()
        print(f"close() took {(time.perf_counter() - began) * 1000:.1f} ms")  # shown with -s
        # The window is gone and the history saved while the engine is still inside
        # the chunk: closing did not wait for it.
        assert c.bridge.running and not window.isVisible()
        store = HistoryStore()
        user, answer = store.messages(session_id)
        store.close()
        assert [a.name for a in user.attachments] == ["long.md"]
        assert (answer.status, answer.reason) == ("stopped", CLOSED_WHILE_ANSWERING)
        assert not window.finish_closing(0.2)  # still in the chunk: reported, not hidden
    finally:
        release.set()
    close_window(window)  # the chunk ends, the cancel is seen, the thread ends
    assert not c.bridge.running


def _close_in_a_child(model, tmp_path, *options: str,
                                 close_on: str = "--close-on-ingest"):
    doc = tmp_path / "long.md"
    doc.write_text(TEXT * 40)
    child = start_child(model, "Summarise it", "--attach", str(doc), "--chunk", "16",
                        close_on, "--max-tokens", "4000", *options,
                        stdout=subprocess.PIPE)
    try:
        read_until(child, "closing")
        closed = time.monotonic()
        child.wait(60)
        exited_after = time.monotonic() - closed
        out = child.stdout.read().decode()
        err = child.stderr.read().decode()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
        child.stderr.close()
    store = HistoryStore()
    try:
        assert store.integrity_check() == "ok"
        (session,) = store.sessions()
        user, answer = store.messages(session.id)
    finally:
        store.close()
    assert [a.name for a in user.attachments] == ["long.md"] and user.content == "Summarise it"
    assert (answer.status, answer.reason) == ("stopped", CLOSED_WHILE_ANSWERING)
    print(f"process exited {exited_after:.2f} s after the close")  # shown with -s
    return child.returncode, exited_after, answer.content, out, err


def test_quitting_mid_ingest_exits_cleanly_once_the_chunk_ends(tiny_llama, tmp_path) -> None:
    code, _, _, out, err = _close_in_a_child(tiny_llama, tmp_path)
    assert code == 0, err[-2000:]
    assert "joined in" in out  # the engine thread ended; the normal exit path ran
    assert "did not stop" not in err and "exiting without waiting" not in err


def test_quitting_mid_answer_exits_cleanly(tiny_llama, tmp_path) -> None:
    code, _, answer, out, err = _close_in_a_child(tiny_llama, tmp_path,
                                                             close_on="--close-on-answer")
    assert code == 0, err[-2000:]
    assert answer  # the text streamed before the close is saved
    assert "joined in" in out
    assert "did not stop" not in err and "exiting without waiting" not in err


def test_quitting_inside_a_chunk_mlx_cannot_interrupt_still_exits(tiny_llama, tmp_path) -> None:
    # Every chunk after the first takes 30 s more: far longer than anyone waits.
    code, exited_after, answer, out, err = _close_in_a_child(
        tiny_llama, tmp_path, "--slow-chunk", "30")
    assert code == 0, err[-2000:]
    assert exited_after < 30  # it did not wait for the chunk
    assert answer == ""  # closed before any token; the history is saved anyway
    assert "exiting without waiting" in err and "joined in" not in out


def test_a_quit_keeps_the_open_chats_kv_even_when_storing_it_outlasts_the_exit_wait(
        qtbot, tiny_llama, monkeypatch) -> None:
    import app.window.main_window
    import engine.snapshots.snapshot_store
    from app.__main__ import finish
    from engine import snapshots_dir

    window = open_window(qtbot, tiny_llama)
    assert send_and_wait(qtbot, window, "Hello there") == "complete"
    assert not list(snapshots_dir().glob("*.json"))  # stored only on the way out
    # The store outlasts the wait for an engine stuck in MLX, as a few thousand
    # tokens of an 8B model's KV outlast the real 2 s.
    monkeypatch.setattr(app.window.main_window, "EXIT_WITHIN_S", 0.2)
    save = engine.snapshots.snapshot_store.save_snapshot

    def slow_save(*args: Any, **options: Any) -> Any:
        time.sleep(1.0)
        return save(*args, **options)

    monkeypatch.setattr(engine.snapshots.snapshot_store, "save_snapshot", slow_save)
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)  # the real one would end pytest
    window.close()
    try:
        assert finish(window, 0) == 0
        assert exits == [], "exited while the engine was storing the chat's KV"
        assert list(snapshots_dir().glob("*.json")), "the open chat's KV was not stored"
    finally:
        window.finish_closing(60)


def _terminate_a_child(model, *options: str) -> tuple[int, str]:
    """The real app in a child, sent SIGTERM at the moment ``options`` say; its exit
    code and stderr once it has ended."""
    child = start_child(model, "Hello there, tell me a story", *options)
    try:
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    return child.returncode, err.decode()


def test_sigterm_quits_like_the_quit_menu(tiny_llama) -> None:
    # A logout, a shutdown or ``kill``: before, the process died at once, with the
    # draft typed in the last moments and the chat's stored KV lost.
    code, err = _terminate_a_child(tiny_llama, "--max-tokens", "24", "--term-when-answered",
                                   "--draft", "my reply, typed just now")
    assert code == 0, err[-2000:]
    store = HistoryStore()
    try:
        (session,) = store.sessions()
        assert store.draft(session.id) == "my reply, typed just now"
    finally:
        store.close()
    from engine import snapshots_dir

    assert list(snapshots_dir().glob("*.json")), "the open chat's KV was not stored"


def test_sigterm_mid_answer_saves_it_as_stopped_not_interrupted(tiny_llama) -> None:
    # Asked nothing (no one may be there to answer "Quit while answering?"), and the
    # answer is saved as a Quit saves it, not left "streaming" for the next start to
    # call an unexpected quit.
    code, err = _terminate_a_child(tiny_llama, "--max-tokens", "4000", "--term-on-answer")
    assert code == 0, err[-2000:]
    store = HistoryStore()
    try:
        (session,) = store.sessions()
        _user, answer = store.messages(session.id)
    finally:
        store.close()
    assert (answer.status, answer.reason) == ("stopped", CLOSED_WHILE_ANSWERING)
    assert answer.content


@pytest.mark.parametrize("phase", ["answering", "ingesting"])
def test_every_engine_action_mid_request_waits_and_the_answer_stays_in_its_chat(
        qtbot, window, tmp_path, monkeypatch, phase) -> None:
    c = window.controller
    other = c.store.create_session("Other", "q4", str(c.model_id))
    c.store.add_message(other.id, "user", "other chat's question")
    in_chunk, release = threading.Event(), threading.Event()
    if phase == "ingesting":
        forward = Session.forward

        def stuck_forward(self: Session, chunk: Chunk, **options: Any) -> bool:
            sent_ahead = forward(self, chunk, **options)
            in_chunk.set()
            release.wait(60)
            return sent_ahead

        monkeypatch.setattr(Session, "forward", stuck_forward)
    else:
        c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=4000)
    errors: list[str] = []
    c.errorRaised.connect(errors.append)
    window.composer.set_text("Tell me a long story")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    if phase == "ingesting":
        qtbot.waitUntil(in_chunk.is_set, timeout=ANSWER_TIMEOUT_MS)
    else:
        qtbot.waitUntil(lambda: c.model.rowCount() == 2 and bool(c.model.message(1).content),
                        timeout=ANSWER_TIMEOUT_MS)
    session, model_before = c.current, c.model_id
    sessions_before = [s.id for s in c.store.sessions()]
    try:
        window.model_picker.activated.emit(0)  # the built-in demo, from the picker
        assert c.reopen_in("q4") is None
        c.delete_session(session.id)
        c.begin_edit()
        c.regenerate()
        window.composer.set_text("another question")
        window.send()  # this chat's own answer runs: refused, the draft stays
        assert window.composer.text() == "another question"
        c.select_session(other.id)  # reading another chat needs no engine
        assert c.current.id == other.id
        assert [m.content for m in c.model.messages()] == ["other chat's question"]
        assert window.composer.text() == ""  # the draft stays with its own chat
        window.composer.set_text("another question")
        c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=8)
        window.send()  # another chat's message starts at once, beside the answer
        assert window.composer.text() == ""
        running = "answering" if phase == "answering" else "reading"
        states = c.activity.states()
        assert states[session.id] == running and states[other.id] in ("reading", "answering")
        c.select_session(session.id)
    finally:
        release.set()
    assert errors == [
        "Stop the answer in ‘Tell me a long story’ before switching models.",
        "Stop the current answer before reopening the chat.",
        "Stop the current answer before deleting its chat.",
        "Stop the current answer before editing.",
        "Stop the current answer before sending another message.",
    ]
    assert c.current.id == session.id and c.model_id == model_before and c.busy
    assert window.model_picker.currentData() == model_before  # the picker shows what runs
    # None deleted, none made (the other chat, sent to, moved to the top).
    assert sorted(s.id for s in c.store.sessions()) == sorted(sessions_before)
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS) as finished:
        c.stop()
    assert finished.args == ["stopped"]
    user, answer = c.store.messages(session.id)
    assert user.content == "Tell me a long story" and answer.status == "stopped"
    assert answer.content == c.model.message(1).content  # streamed text went to this chat
    # The other chat's message was answered beside it, in its own chat.
    qtbot.waitUntil(lambda: not c.busy, timeout=ANSWER_TIMEOUT_MS)
    assert [(m.role, m.content) for m in c.store.messages(other.id)][:2] == [
        ("user", "other chat's question"), ("user", "another question")]
    assert c.store.messages(other.id)[-1].status == "complete"
    c.select_session(other.id)
    assert c.current.id == other.id


def test_a_refusal_banner_goes_when_the_answer_ends(qtbot, window) -> None:
    c = window.controller
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=4000)
    window.composer.set_text("Tell me a long story")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: c.busy and c.active_request not in (None, -1), timeout=20_000)
    c.load_model("demo")
    assert window.banner.isVisible()
    assert window.banner.label.text() == ("Stop the answer in ‘Tell me a long story’ before "
                                         "switching models.")
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        c.stop()
    assert not window.banner.isVisible()


def test_an_option_neither_longleaf_nor_qt_takes_is_named() -> None:
    from app.__main__ import unknown_options

    # What Qt leaves of the arguments after taking its own (-style, -reverse, …).
    assert unknown_options(["--mdoel", "notes.txt", "-psn_0_1234", "-AppleLanguages",
                            "(en)", "-NSDocumentRevisionsDebugMode", "YES", "-x"]) == [
        "--mdoel", "-x"]


def test_a_model_given_by_a_relative_path_is_kept_by_its_absolute_one(
        tmp_path, monkeypatch) -> None:
    from app.__main__ import model_argument

    # Remembered for the next launch, which may start in another folder.
    monkeypatch.chdir(tmp_path)
    assert model_argument("./models/m") == str(tmp_path / "models" / "m")
    assert model_argument("demo") == "demo" and model_argument(None) is None
