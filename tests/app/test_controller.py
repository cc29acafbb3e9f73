"""The controller driven through the request registry by a scripted engine.

A fake worker stands behind the real ``EngineBridge``: it records each request
and the test plays the engine's events back, so every step of the routing is
checked (which handler gets an event, what runs together and what waits,
what Stop stops)
without a model or a thread.
"""

from __future__ import annotations

import pytest

from app.chat.recorder import CONTEXT_END, LENGTH_LIMIT
from engine import (
    AnswerWaiting,
    Failed,
    Finished,
    GenerationStats,
    IngestProgress,
    Notice,
    TokenChunk,
    WaitEnded,
)
from tests.app.scripted import close_scripted, open_session, sample, scripted_app


@pytest.fixture
def app(qtbot):
    scripted = scripted_app(qtbot)
    yield scripted
    close_scripted(scripted)


_open = open_session


def _answer(app, session_id: str) -> str:
    return [m for m in app.store.messages(session_id) if m.role == "assistant"][-1].content


def test_each_event_reaches_the_request_it_belongs_to(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    assert c.send("first question")
    _open(app, a.id)
    chat_a, _args, cancel_a = worker.last("chat")
    bridge._dispatch(IngestProgress(chat_a, 3, 10, 100.0, 0.1))
    assert c.activity.states() == {a.id: "reading"}
    bridge._dispatch(TokenChunk(chat_a, "Pines ", (1,)))
    assert c.activity.states() == {a.id: "answering"}

    b = c.new_session("q4")  # shown now; A answers on
    assert c.send("second question")  # starts at once beside A: its own cache first
    _open(app, b.id)
    assert worker.names().count("chat") == 2, "B answers beside A, not after it"
    chat_b, args, cancel_b = worker.last("chat")
    assert args[0] == b.id and args[1][-1]["content"] == "second question"
    assert c.activity.states() == {a.id: "answering", b.id: "reading"}
    assert c.active_request == chat_b and not c.can_regenerate()
    bridge._dispatch(TokenChunk(chat_a, "grow.", (2,)))
    bridge._dispatch(TokenChunk(chat_b, "Yes.", (4,)))
    bridge._dispatch(TokenChunk(999, "stray", (3,)))  # no request 999: reaches no one
    c.model.flush()  # streamed text reaches the rows in batches
    assert c.model.message(c.model.rowCount() - 1).content == "Yes."  # B is shown, not A
    c.stop()  # Stop in B stops B's own answer, never A
    assert cancel_b.is_set() and not cancel_a.is_set()
    bridge._dispatch(Finished(chat_b, "cancelled"))
    assert c.activity.states() == {a.id: "answering"}
    bridge._dispatch(Finished(chat_a, "stop"))
    assert _answer(app, a.id) == "Pines grow." and _answer(app, b.id) == "Yes."
    assert [m.status for m in app.store.messages(a.id)] == ["complete", "complete"]
    assert [m.status for m in app.store.messages(b.id)] == ["complete", "stopped"]
    bridge._dispatch(TokenChunk(chat_a, "late", (5,)))  # A's request has ended
    assert _answer(app, a.id) == "Pines grow."
    assert not c.busy and bridge.pending == 0


def test_a_message_sent_while_a_chat_is_read_in_waits_behind_it(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    assert c.send("first question")
    _open(app, a.id)
    bridge._dispatch(Finished(worker.last("chat")[0], "stop"))
    c.answers.start_ingest(c.current)  # a re-ingest runs alone in the engine
    ingest, _args, _cancel = worker.last("ingest")
    b = c.new_session("q4")
    assert c.send("second question")
    assert worker.names().count("chat") == 1, "B waits for the re-ingest, not in the engine"
    assert c.activity.states() == {a.id: "reading", b.id: "waiting"}
    assert c.cache_state(b.id) == f"Waiting for ‘{c.store.session(a.id).title}’ to finish…"
    c.rename_session(a.id, "Pine notes")  # what B waits for is said by its new name
    assert c.cache_state(b.id) == "Waiting for ‘Pine notes’ to finish…"
    bridge._dispatch(Finished(ingest, "done"))
    _open(app, b.id)  # B started by itself
    assert worker.names().count("chat") == 2 and c.activity.states() == {b.id: "reading"}


def test_an_answer_the_engine_holds_says_the_engines_reason_until_it_reads(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    assert c.send("first question")
    _open(app, a.id)
    b = c.new_session("q4")
    assert c.send("second question")
    _open(app, b.id)
    chat_b, _args, _cancel = worker.last("chat")
    reason = "Waiting for memory to answer beside ‘first question’: 1.2 GB more is needed."
    bridge._dispatch(AnswerWaiting(chat_b, reason, 1_200_000_000))
    assert c.activity.states()[b.id] == "waiting"
    assert c.cache_state(b.id) == reason
    assert c.all_chat_facts([c.store.session(b.id)])[b.id].held == reason
    assert c.answering_together() == [("first question", None)]  # B is not in it yet
    bridge._dispatch(WaitEnded(chat_b))  # it joined: its first chunk is under way
    assert c.activity.states()[b.id] == "reading" and c.cache_state(b.id) != reason
    bridge._dispatch(IngestProgress(chat_b, 3, 10, 100.0, 0.1))
    assert c.activity.states()[b.id] == "reading" and c.cache_state(b.id) != reason
    bridge._dispatch(sample(b.id, 12, 4096))
    assert c.answering_together() == [("first question", None), ("second question", 4096)]


def test_a_chat_waiting_its_turn_names_the_chat_before_it(app) -> None:
    """The engine knows the chat a waiting one is behind as a request: the app says
    its title (as the engine words it for the server, with no chats to name)."""
    from engine.session.batch import _Short

    c, bridge, worker = app.c, app.bridge, app.worker
    chats = []
    for title in ("first question", "second question", "third question"):
        chats.append(c.new_session("q8"))
        assert c.send(title)
        _open(app, chats[-1].id)
    chat_b, chat_c = [r[0] for r in worker.requests if r[1] == "chat"][1:]
    short = _Short(19_968)
    bridge._dispatch(AnswerWaiting(chat_b, short.reason(), 19_968))
    bridge._dispatch(AnswerWaiting(chat_c, short.behind(), 0, behind=chat_b))
    assert c.cache_state(chats[2].id) == ("Waiting for memory: ‘second question’ needs "
                                          "19.5 KB more than is free; it starts after "
                                          "that one.")


def test_an_answer_the_engine_holds_for_its_next_page_says_so_until_its_next_word(
        app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    assert c.send("first question")
    _open(app, a.id)
    chat_a, _args, cancel_a = worker.last("chat")
    bridge._dispatch(TokenChunk(chat_a, "Pines ", (1,)))
    reason = ("Waiting for memory: this answer's next page (4.5 KB) does not fit in what "
              "is free; it goes on when another answer ends.")
    bridge._dispatch(AnswerWaiting(chat_a, reason, 4608))
    assert c.activity.states() == {a.id: "waiting"} and c.cache_state(a.id) == reason
    assert c.busy and not cancel_a.is_set()  # still its answer: Stop stops it
    bridge._dispatch(TokenChunk(chat_a, "grow.", (2,)))
    assert c.activity.states() == {a.id: "answering"} and c.cache_state(a.id) != reason
    bridge._dispatch(Finished(chat_a, "stop"))
    assert _answer(app, a.id) == "Pines grow."  # nothing it said before the wait is lost


def test_a_fourth_chat_never_closes_the_cache_of_a_chat_that_answers(app) -> None:
    c, worker = app.c, app.worker
    chats = []
    for question in ("one", "two", "three", "four"):
        chats.append(c.new_session("q8"))
        assert c.send(question)
        _open(app, chats[-1].id)
    assert worker.names().count("chat") == 4 and "close" not in worker.names()
    assert set(c.opened) == {chat.id for chat in chats}


def test_stop_during_the_open_cancels_once_the_request_exists(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    c.send("hello")
    c.stop()  # its cache is still opening: no request to cancel yet
    _open(app, a.id)
    chat_a, _args, cancel = worker.last("chat")
    assert cancel.is_set()
    bridge._dispatch(Finished(chat_a, "cancelled"))
    assert [m.status for m in app.store.messages(a.id)] == ["complete", "stopped"]
    assert not c.busy


def test_failures_go_to_their_request_and_those_of_none_to_the_banner(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    said: list[str] = []
    c.errorRaised.connect(said.append)
    a = c.new_session("q8")
    c.send("hello")
    rid, _args, _cancel = worker.last("open")
    bridge._dispatch(Failed(rid, "Not enough memory to open this chat.", "OutOfMemory"))
    assert said == ["Not enough memory to open this chat."]
    assert [m.status for m in app.store.messages(a.id)] == ["complete", "failed"]
    assert not c.busy
    configure = bridge.configure(-1, 512, 0.5)
    bridge._dispatch(Failed(configure, "The KV memory budget cannot be negative.", "E"))
    assert said[-1] == "The KV memory budget cannot be negative."
    notices: list[str] = []
    c.notice.connect(notices.append)
    bridge._dispatch(Notice(0, "The stored KV cache is from another model."))
    assert notices == ["The stored KV cache is from another model."]


def test_after_close_no_event_touches_the_history(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    c.send("hello")
    _open(app, a.id)
    chat_a, _args, cancel = worker.last("chat")
    bridge._dispatch(TokenChunk(chat_a, "Hi", (1,)))
    c.close()
    assert cancel.is_set()
    answer = app.store.messages(a.id)[-1]
    bridge._dispatch(TokenChunk(chat_a, " there", (2,)))
    bridge._dispatch(Finished(chat_a, "stop"))
    bridge._dispatch(Notice(chat_a, "late"))
    assert app.store.messages(a.id)[-1] == answer and answer.status == "stopped"
    assert bridge.pending == 0


def test_a_stop_while_answering_says_stopped_not_stopped_while_reading(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    c.send("hello")
    _open(app, a.id)
    chat_a, _args, _cancel = worker.last("chat")
    # The whole prompt but its last token was read; the answer's first step reads that one.
    bridge._dispatch(IngestProgress(chat_a, 35, 35, 100.0, 0.0))
    bridge._dispatch(TokenChunk(chat_a, "Pines", (1,)))
    c.stop()
    bridge._dispatch(Finished(chat_a, "cancelled"))
    answer = app.store.messages(a.id)[-1]
    assert (answer.content, answer.status, answer.reason) == ("Pines", "stopped", "Stopped")


def test_a_stop_while_reading_says_how_much_was_kept(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    c.send("hello")
    _open(app, a.id)
    chat_a, _args, _cancel = worker.last("chat")
    bridge._dispatch(IngestProgress(chat_a, 512, 2000, 100.0, 15.0))
    c.stop()
    bridge._dispatch(Finished(chat_a, "cancelled", None, 512, 2001))
    answer = app.store.messages(a.id)[-1]
    assert answer.status == "stopped"
    assert answer.reason.startswith("Stopped while reading: 512 of 2,001 tokens kept")


def test_a_stop_after_the_whole_read_before_any_word_says_stopped(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    c.send("hello")
    _open(app, a.id)
    chat_a, _args, _cancel = worker.last("chat")
    bridge._dispatch(IngestProgress(chat_a, 10, 10, 100.0, 0.0))  # all but the last token
    c.stop()
    bridge._dispatch(Finished(chat_a, "cancelled"))  # the first step made no text yet
    assert app.store.messages(a.id)[-1].reason == "Stopped"


def test_a_chat_whose_read_was_stopped_says_what_the_next_message_reads_first(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    c.send("Summarise the report")
    _open(app, a.id)
    chat_a, _args, _cancel = worker.last("chat")
    bridge._dispatch(IngestProgress(chat_a, 1536, 7756, 30.0, 200.0, 512, 1024, 17.0))
    c.stop()
    worker.stats = sample(a.id, 1536)
    c.caches.note(worker.stats)
    bridge._dispatch(Finished(chat_a, "cancelled", None, 1536, 7757))
    assert c.cache_state(a.id) == ("In memory: 1,536 of its 7,757 tokens; the next message "
                                   "reads the other 6,221 first.")
    assert app.store.session(a.id).tokens == 7757  # the history keeps the whole count
    # The next read takes it all in: in memory, whole.
    assert c.send("And the conclusions?")
    chat_b, _args, _cancel = worker.last("chat")
    worker.stats = sample(a.id, 7790)
    c.caches.note(worker.stats)
    bridge._dispatch(TokenChunk(chat_b, "Yes.", (1,)))
    bridge._dispatch(Finished(chat_b, "stop"))
    assert c.cache_state(a.id) == "In memory: 7,790 tokens, ready to answer at once."



def test_a_continued_answers_stats_count_every_piece(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    c.send("Tell me everything")
    _open(app, a.id)
    first, _args, _cancel = worker.last("chat")
    bridge._dispatch(TokenChunk(first, "Pines grow", (1, 2)))
    bridge._dispatch(Finished(first, "length", GenerationStats(20, 8, 0.5, 40.0, 4.0, 20)))
    assert c.continue_answer()
    second, _args, _cancel = worker.last("chat")
    bridge._dispatch(TokenChunk(second, " tall", (3,)))
    bridge._dispatch(Finished(second, "stop", GenerationStats(30, 12, 0.3, 40.0, 2.0, 3)))
    stats = app.store.messages(a.id)[-1].stats
    assert stats["generated_tokens"] == 20 and stats["ttft"] == 0.5
    assert stats["decode_tps"] == pytest.approx(20 / (8 / 4.0 + 12 / 2.0))
    assert stats["prefill_tokens"] == 23


def test_an_answer_that_fills_the_context_says_so_and_offers_no_continue(app) -> None:
    # The engine ends it as it ends one at its length limit; Continue then always
    # failed, turning a whole answer into "Stopped" with a memory message.
    c, bridge, worker = app.c, app.bridge, app.worker
    c.answers.max_context = lambda: 28
    a = c.new_session("q8")
    c.send("Tell me everything")
    _open(app, a.id)
    rid, _args, _cancel = worker.last("chat")
    bridge._dispatch(TokenChunk(rid, "Pines grow", (1, 2)))
    bridge._dispatch(Finished(rid, "length", GenerationStats(20, 8, 0.5, 40.0, 4.0, 8)))
    assert app.store.messages(a.id)[-1].reason == CONTEXT_END
    asked = worker.names().count("chat")
    assert not c.continue_answer() and worker.names().count("chat") == asked
    # Short of the context, it is the length limit, and it goes on.
    c.answers.max_context = lambda: 4096
    b = c.new_session("q8")
    c.send("Tell me more")
    _open(app, b.id)
    rid, _args, _cancel = worker.last("chat")
    bridge._dispatch(TokenChunk(rid, "Pines", (1,)))
    bridge._dispatch(Finished(rid, "length", GenerationStats(20, 8, 0.5, 40.0, 4.0, 8)))
    assert app.store.messages(b.id)[-1].reason == LENGTH_LIMIT
    assert c.continue_answer()


def test_check_quality_while_the_model_loads_says_it_loads(app) -> None:
    c = app.c
    c.new_session("q8")
    c.load_model("other")
    assert c.quality_unavailable() == "The model is loading: check once it is ready."


def test_whoever_hears_a_load_start_sees_the_model_loading(app) -> None:
    c = app.c
    c.new_session("q8")
    heard: list[str] = []
    c.modelStateChanged.connect(lambda _text, _ready: heard.append(c.quality_unavailable()))
    c.load_model("other")
    assert heard == ["The model is loading: check once it is ready."]


def _two_answering(app) -> dict[str, int]:
    """Two chats sent one after the other, both answering: each one's chat request."""
    chats = {}
    for text in ("first question", "second question"):
        session = app.c.new_session("q8")
        assert app.c.send(text)
        _open(app, session.id)
        chats[session.id] = app.worker.last("chat")[0]
        app.bridge._dispatch(TokenChunk(chats[session.id], "Pines ", (1,)))
    return chats


def test_a_chats_stats_are_kept_though_another_chats_newer_sample_came_first(app) -> None:
    import time
    from dataclasses import replace

    c, bridge, worker = app.c, app.bridge, app.worker
    chats = _two_answering(app)
    a, b = chats
    now = time.time()
    # After a step the engine publishes one sample per answering chat, A's then B's;
    # the window's poll may read the newest (B's) before A's queued one arrives.
    a_sample = replace(sample(a, 40, 8192), timestamp=now)
    b_sample = replace(sample(b, 30, 4096), timestamp=now + 0.001)
    worker.stats = b_sample
    c._poll_stats()
    bridge._dispatch(a_sample)
    bridge._dispatch(b_sample)
    assert c.caches.sample_for(a) == a_sample
    bridge._dispatch(Finished(chats[a], "stop"))
    assert app.store.session(a).tokens == 40  # what its history records at its end


def test_a_chat_answering_in_the_background_names_itself_in_the_banner(app) -> None:
    c, bridge = app.c, app.bridge
    chats = _two_answering(app)
    a, b = chats
    c.rename_session(b, "Pine notes")
    said: list[str] = []
    c.errorRaised.connect(said.append)
    c.select_session(a)  # the user reads A while B answers
    bridge._dispatch(Finished(chats[b], "memory"))
    bridge._dispatch(Failed(chats[a], "The device went away.", "EngineError"))
    assert said[0].startswith("In ‘Pine notes’: ")  # not "this chat": the one on screen
    assert said[1] == "The device went away."  # the shown chat's own, as before


def test_the_answering_together_line_has_every_answer_in_the_batch_by_its_title_now(
        app) -> None:
    c, bridge = app.c, app.bridge
    chats = _two_answering(app)
    a, b = chats
    c.rename_session(a, "Renamed chat")
    for session_id in chats:
        bridge._dispatch(sample(session_id, 40, 8192))
    # A waits for its next page: its row and pages are still the batch's.
    bridge._dispatch(AnswerWaiting(chats[a], "Waiting for memory: this answer's next "
                                             "page (4 KB) does not fit …", 4096))
    assert [title for title, _ in c.answering_together()] == [
        "Renamed chat", app.store.session(b).title]


def test_a_notice_about_a_chat_not_shown_names_it(app) -> None:
    c, bridge, worker = app.c, app.bridge, app.worker
    a = c.new_session("q8")
    assert c.send("first question")
    _open(app, a.id)
    chat_a, _args, _cancel = worker.last("chat")
    said: list[str] = []
    c.notice.connect(said.append)
    bridge._dispatch(Notice(chat_a, "Reused 512 tokens stored for another chat."))
    c.new_session("q4")  # the user reads another chat meanwhile
    bridge._dispatch(Notice(chat_a, "Reused 512 tokens stored for another chat."))
    assert said == ["Reused 512 tokens stored for another chat.",
                    "In ‘first question’: Reused 512 tokens stored for another chat."]


@pytest.mark.parametrize("gone", [True, False])
def test_a_last_model_whose_folder_is_gone_opens_the_demo_and_says_so(
        qtbot, tmp_path, gone: bool) -> None:
    from app.controller import ChatController
    from app.engine_bridge import EngineBridge
    from app.settings import Settings
    from app.store import HistoryStore
    from tests.app.scripted_worker import ScriptedWorker

    folder = tmp_path / "on-a-drive" / "model"
    if not gone:
        folder.mkdir(parents=True)
    worker = ScriptedWorker()
    settings = Settings()
    settings.last_model = str(folder)
    controller = ChatController(settings, HistoryStore(),
                                EngineBridge(worker_factory=lambda *_args: worker))
    notices: list[str] = []
    controller.notice.connect(notices.append)
    controller.start()
    try:
        # Before, the drive's model was asked for, and the app stayed with no model.
        assert worker.last("load")[1] == (("demo",) if gone else (str(folder),))
        assert notices == ([f"The model used last, {folder}, is not there any more: "
                            "moved, deleted, or on a drive not connected now. Longleaf "
                            "opened the demo model; choose another in the toolbar's "
                            "model list."] if gone else [])
    finally:
        controller.shutdown(0)


def test_a_name_pasted_into_rename_is_one_line_of_a_titles_length(app) -> None:
    record = app.store.create_session("Old", "q8", "demo")
    # Before, the line break was kept (the window's title showed ⟨U+000A⟩), and a
    # 100,000-character name was taken whole.
    app.c.rename_session(record.id, "line one\nline two\t ")
    assert app.store.session(record.id).title == "line one line two"
    app.c.rename_session(record.id, "word " * 20_000)
    assert len(app.store.session(record.id).title) <= 200
    app.c.rename_session(record.id, " \n ")
    assert app.store.session(record.id).title.startswith("word word")


def test_deleting_the_chat_shown_from_a_searched_list_shows_one_the_list_holds(qtbot) -> None:
    scripted = scripted_app(qtbot, window=True)
    try:
        c, window = scripted.c, scripted.window
        ids = {title: c.store.create_session(title, "q8", "demo").id
               for title in ("alpha two", "beta plan", "alpha notes")}
        c.select_session(ids["alpha notes"])
        window.sessions.search.setText("alpha")
        qtbot.waitUntil(lambda: len(window.sessions.records()) == 2)  # once typing pauses
        assert [r.title for r in window.sessions.records()] == ["alpha notes", "alpha two"]
        window.sessions.deleteRequested.emit(ids["alpha notes"])
        # Before: the newest chat of all, "beta plan", which the list did not show.
        assert c.current is not None and c.current.id == ids["alpha two"]
        assert [r.title for r in window.sessions.records()] == ["alpha two"]
        window.sessions.search.setText("")
        c.select_session(ids["alpha two"])
        # Unsearched, as a Mac list: the chat below the one deleted, else the one
        # above ("alpha two" is the oldest, at the bottom).
        window.sessions.deleteRequested.emit(ids["alpha two"])
        assert c.current is not None and c.current.id == ids["beta plan"]
    finally:
        close_scripted(scripted)


def test_a_history_that_takes_no_write_refuses_each_action_in_words(app) -> None:
    """Rename, delete, a new chat, Reopen in… and regenerate on a read-only disk:
    each says it did not happen and why, and nothing of it is half done."""
    c, bridge, worker = app.c, app.bridge, app.worker
    said: list[str] = []
    c.errorRaised.connect(said.append)
    chat = c.new_session("q8")
    assert c.send("a question")
    _open(app, chat.id)
    request, _args, _cancel = worker.last("chat")
    bridge._dispatch(TokenChunk(request, "An answer.", (1,)))
    bridge._dispatch(Finished(request, "stop"))
    app.store._db.execute("PRAGMA query_only = 1")  # every write refused: a read-only disk
    sessions = [s.id for s in app.store.sessions()]
    c.rename_session(chat.id, "Pines")
    c.delete_session(chat.id)
    assert c.new_session("q4") is None
    assert c.reopen_in("q4") is None
    c.regenerate()
    assert [line.split(".")[0] for line in said] == [
        "The chat was not renamed", "The chat was not deleted", "No new chat was made",
        "The chat was not reopened in q4", "The answer was not started"]
    assert all("read-only disk" in line for line in said), said
    assert said[-1].endswith("The earlier answer is kept.")
    assert [s.id for s in app.store.sessions()] == sessions and c.current.id == chat.id
    assert [m.content for m in app.store.messages(chat.id)] == ["a question", "An answer."]
    assert c.model.rowCount() == 2


def test_a_chat_stored_with_another_models_weights_is_not_called_reopenable(app) -> None:
    """Reopening it would set its snapshot aside and read the chat again: it is "on
    disk as text" to the model loaded now, whatever the listing holds of it."""
    from engine import SnapshotInfo, StoredKv

    c = app.c
    chat = c.new_session("q8")
    app.store.set_tokens(chat.id, 900)

    def listed(digest: str) -> None:
        info = SnapshotInfo(chat.id, 1_200, "q8", 256, 10**6, 10**6, 0.0, 0.0, "other",
                            model_digest=digest)
        app.bridge._dispatch(StoredKv(2**30, 10**6, (info,), model_digest="loaded now"))

    listed("another model")
    assert c.cache_state(chat.id) == "On disk as text: the next message reads its 900 " \
                                     "tokens in again."
    listed("loaded now")
    assert c.cache_state(chat.id).startswith("On disk: 1,200 tokens stored")
