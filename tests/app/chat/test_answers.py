"""Answers end whatever the history can still save: a disk that fills up or turns
read-only mid-answer never leaves the chat busy, and nothing written is lost."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import pytest

from app.controller import QUIT_UNSAVED, ChatController
from app.engine_bridge import EngineBridge
from app.settings import Settings
from app.store import HistoryStore
from engine import Failed, Finished, ModelLoaded, SamplingParams, TokenChunk
from tests.app.scripted import ScriptedWorker, open_session

# What the worker says when the disk under MLX's kernel folder filled up mid-answer.
DISK_FULL = ("Longleaf could not prepare the model's compute kernels: the disk holding "
             "/data/cache/tmp is full. Free some space on it, then send the message again.")


@pytest.fixture
def chat(qtbot):
    worker = ScriptedWorker()
    bridge = EngineBridge(worker_factory=lambda *_args: worker)
    settings = Settings()
    settings.sampling = SamplingParams(temperature=0.0, max_tokens=8, seed=0)
    store = HistoryStore()  # a file in the test's data folder
    controller = ChatController(settings, store, bridge)
    controller.start("tiny")
    rid, _args, _cancel = worker.last("load")
    bridge._dispatch(ModelLoaded(rid, SimpleNamespace(name="tiny")))
    bridge._dispatch(Finished(rid, "done"))
    bridge._dispatch(Finished(worker.last("snapshot_budget")[0], "done"))
    said: dict[str, list[str]] = {"errors": [], "notices": []}
    controller.errorRaised.connect(said["errors"].append)
    controller.notice.connect(said["notices"].append)
    yield SimpleNamespace(c=controller, bridge=bridge, worker=worker, store=store, said=said)
    controller.shutdown(0)
    store.close()


def _full(store: HistoryStore) -> None:
    """The database may not grow by a page and its tables' pages hold no more rows:
    SQLite's own "database or disk is full"."""
    filler = store.create_session("filler", "q8", "tiny")
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    for size in (4096, 256, 16, 1):  # what room is left in the pages, filled
        for sql, args in (("INSERT INTO app_state VALUES (hex(randomblob(8)), ?)", ()),
                          ("INSERT INTO messages (session_id, role, content, status, created, "
                           "updated) VALUES (?, 'user', ?, 'complete', 0, 0)", (filler.id,))):
            try:
                while True:
                    store._db.execute(sql, (*args, "x" * size))
            except sqlite3.OperationalError:
                continue


def _read_only(store: HistoryStore) -> None:
    """Every write refused: SQLite's own "attempt to write a readonly database"."""
    store._db.execute("PRAGMA query_only = 1")


def _space_back(store: HistoryStore) -> None:
    store._db.execute("PRAGMA query_only = 0")
    store._db.execute("PRAGMA max_page_count = 1073741823")
    store._db.execute("DELETE FROM app_state WHERE value LIKE 'x%'")
    store._db.execute("DELETE FROM sessions WHERE title = 'filler'")


@pytest.mark.parametrize(("fault", "words"), [(_full, "is full"),
                                              (_read_only, "read-only disk")])
def test_a_disk_that_fails_mid_answer_ends_the_answer_and_keeps_it(chat, fault, words):
    c, bridge, worker, store = chat.c, chat.bridge, chat.worker, chat.store
    session = c.new_session("q8")
    assert c.send("What grows in sand?")
    open_session(chat, session.id)
    rid, _args, _cancel = worker.last("chat")
    answer = "Pines grow in sand. " * 2000  # more than the database's free pages hold
    bridge._dispatch(TokenChunk(rid, answer, (1,)))
    fault(store)
    bridge._dispatch(Failed(rid, DISK_FULL, "DiskFault"))

    # The job ended: Stop has nothing to stop and the chat is not busy.
    assert not c.activity.busy and c.activity.job_of(session.id) is None
    banner = chat.said["errors"][-1]
    assert banner.startswith(DISK_FULL) and "kept in this window" in banner and words in banner
    row = c.model.message(c.model.rowCount() - 1)
    assert (row.content, row.status) == (answer, "failed")
    # Sending while the disk still refuses: the message stays in the box, said why.
    assert not c.send("And in clay?")
    assert "still in the box" in chat.said["errors"][-1]
    assert "Stop the current answer" not in " ".join(chat.said["errors"])

    # Quitting now would lose the answer: the quit question says so.
    assert c.quit_question() == QUIT_UNSAVED
    _space_back(store)
    assert c.answers.flush()  # what its recorder's retry timer does every few seconds
    assert c.quit_question() == ""
    saved = [m for m in store.messages(session.id) if m.role == "assistant"][-1]
    assert (saved.content, saved.status, saved.reason) == (answer, "failed", DISK_FULL)
    assert chat.said["notices"][-1].startswith("The answers Longleaf could not save")
    assert c.send("And in clay?")
    assert worker.last("chat")[0] != rid


def test_an_answer_that_cannot_get_its_row_does_not_start(chat):
    c, bridge, worker, store = chat.c, chat.bridge, chat.worker, chat.store
    first = c.new_session("q8")
    assert c.send("What grows in sand?")
    open_session(chat, first.id)
    bridge._dispatch(Finished(worker.last("chat")[0], "stop"))
    c.answers.start_ingest(first)  # runs alone: an answer sent now waits for it
    second = c.new_session("q8")
    assert c.send("What grows in clay?")  # saved; its answer waits for the re-ingest
    _read_only(store)
    bridge._dispatch(Finished(worker.last("ingest")[0], "done"))
    # The second chat's turn came, but its answer could not get a row: not started.
    assert worker.names().count("chat") == 1 and not c.activity.busy
    assert chat.said["errors"][-1].startswith("The answer was not started.")
    _space_back(store)
    assert c.send("What grows in clay?")
    open_session(chat, second.id)
    assert worker.names().count("chat") == 2


def _answered(chat, question: str, answer: str):
    """A chat with one turn answered; the chat."""
    c, bridge, worker = chat.c, chat.bridge, chat.worker
    session = c.new_session("q8")
    assert c.send(question)
    open_session(chat, session.id)
    rid = worker.last("chat")[0]
    bridge._dispatch(TokenChunk(rid, answer, (1,)))
    bridge._dispatch(Finished(rid, "stop"))
    return session


def _turns(store: HistoryStore, session_id: str) -> list[tuple[str, str, str]]:
    return [(m.role, m.content, m.status) for m in store.messages(session_id)]


def _shown(c: ChatController) -> list[tuple[str, str, str]]:
    c.model.flush()
    return [(m.role, m.content, m.status) for m in c.model.messages()]


@pytest.mark.parametrize("ending", ["failed", "refused", "stopped", "dropped"])
def test_an_answer_made_again_that_ends_before_any_text_keeps_the_earlier_one(chat, ending):
    """Regenerate refused (memory, a context the model cannot hold), failed, or
    stopped before its first word: the earlier answer is still there, as it was."""
    c, bridge, worker, store = chat.c, chat.bridge, chat.worker, chat.store
    session = _answered(chat, "What grows in sand?", "Pines.")
    before = _turns(store, session.id)
    earlier = c.model.message(1).message_id
    ended: list[str] = []
    c.answerFinished.connect(ended.append)
    if ending == "dropped":  # Stop while it waits in line behind another chat's re-ingest
        c.answers.start_ingest(c.store.create_session("other", "q8", "tiny"))
    c.regenerate()
    assert c.activity.job_of(session.id) is not None
    if ending == "dropped":
        assert worker.names().count("chat") == 1  # in line: the engine has not seen it
        c.stop()
    else:
        rid = worker.last("chat")[0]
        bridge._dispatch({
            "failed": Failed(rid, "The engine failed: out of kernels.", "EngineError"),
            "refused": Failed(rid, "Too long for the model's context.", "ContextTooLong"),
            "stopped": Finished(rid, "cancelled"),
        }[ending])
    assert _turns(store, session.id) == before
    assert _shown(c) == before and c.model.message(1).message_id == earlier
    said = chat.said["errors"] if ending in ("failed", "refused") else chat.said["notices"]
    assert said[-1].endswith("The earlier answer is kept."), said
    assert c.activity.job_of(session.id) is None and c.can_regenerate()
    assert ended == ["failed" if ending in ("failed", "refused") else "stopped"]


def test_an_answer_made_again_replaces_the_earlier_one_once_it_has_text(chat):
    c, bridge, worker, store = chat.c, chat.bridge, chat.worker, chat.store
    session = _answered(chat, "What grows in sand?", "Pines.")
    c.regenerate()
    rid = worker.last("chat")[0]
    # Until its first word the earlier answer is the history's (a crash keeps it).
    assert _turns(store, session.id)[:2] == [("user", "What grows in sand?", "complete"),
                                             ("assistant", "Pines.", "complete")]
    bridge._dispatch(TokenChunk(rid, "Grasses", (2,)))
    assert [t[1] for t in _turns(store, session.id)] == ["What grows in sand?", ""]
    bridge._dispatch(TokenChunk(rid, ".", (3,)))
    bridge._dispatch(Finished(rid, "stop"))
    assert _turns(store, session.id) == _shown(c) == [
        ("user", "What grows in sand?", "complete"), ("assistant", "Grasses.", "complete")]


def test_an_answer_made_again_in_a_chat_shown_again_meanwhile_shows_only_the_new(chat):
    """Left and shown again before the new answer's first word, the chat showed the
    history's rows, the earlier answer among them: gone once the new one has text."""
    c, bridge, worker, store = chat.c, chat.bridge, chat.worker, chat.store
    session = _answered(chat, "What grows in sand?", "Pines.")
    c.regenerate()
    rid = worker.last("chat")[0]
    other = c.new_session("q8")
    c.select_session(session.id)
    assert [t[1] for t in _shown(c)][:2] == ["What grows in sand?", "Pines."]
    bridge._dispatch(TokenChunk(rid, "Grasses.", (2,)))
    bridge._dispatch(Finished(rid, "stop"))
    assert _shown(c) == _turns(store, session.id) == [
        ("user", "What grows in sand?", "complete"), ("assistant", "Grasses.", "complete")]
    assert other.id != session.id


@pytest.mark.parametrize("shown", [True, False])
def test_an_edit_whose_answer_ends_before_any_text_comes_back_to_the_box(chat, shown):
    """An edit too long for the context (or refused, or failed) leaves the chat as it
    was, and the rewritten message is back in the composer, in edit mode: in the
    chat shown at once, in another when it is shown (kept in the history)."""
    c, bridge, worker, store = chat.c, chat.bridge, chat.worker, chat.store
    session = _answered(chat, "What grows in sand?", "Pines.")
    before = _turns(store, session.id)
    edits: list[tuple[str, object]] = []
    c.editRequested.connect(lambda text, files: edits.append((text, files)))
    c.begin_edit()
    edits.clear()
    assert c.send("What grows in sand by the sea? " * 3)
    rid = worker.last("chat")[0]
    if not shown:
        c.new_session("q8")
    bridge._dispatch(Failed(rid, "Too long for the model's context.", "ContextTooLong"))
    assert _turns(store, session.id) == before
    kept = store.edit(session.id)
    assert kept is not None and kept.text == "What grows in sand by the sea? " * 3
    assert kept.message_id == store.messages(session.id)[0].id
    assert chat.said["errors"][-1].endswith("your edit is back in the box.")
    if shown:
        assert _shown(c) == before
        assert edits == [(kept.text, ())] and c.editing
        assert c.edited_message_id == kept.message_id
    else:
        assert edits == [] and not c.editing
    assert not c.activity.busy


@pytest.mark.parametrize(("kind", "set_aside"), [("ContextTooLong", True),
                                                 ("MemoryShort", False)])
def test_only_a_turn_past_the_models_context_is_set_aside_for_good(chat, kind, set_aside):
    """Short of memory now (other chats hold it, the budget is low) the turn stays
    one the model reads: sent again, or its answer made again, once memory is freed."""
    c, bridge, worker, store = chat.c, chat.bridge, chat.worker, chat.store
    session = c.new_session("q8")
    assert c.send("A long question")
    open_session(chat, session.id)
    bridge._dispatch(Failed(worker.last("chat")[0], "This conversation needs …", kind))
    turn, answer = store.messages(session.id)
    assert (turn.status == "failed") is set_aside and answer.status == "failed"
    assert c.can_regenerate() is not set_aside
