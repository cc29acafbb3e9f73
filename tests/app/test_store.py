"""History store: sessions, messages, attachments, crash recovery, WAL."""

from __future__ import annotations

from app.store import AttachmentRecord, EditRecord, HistoryStore, default_path
from engine.paths import data_dir


def test_lives_in_the_redirected_data_dir_in_wal_mode() -> None:
    store = HistoryStore()
    assert default_path().parent == data_dir()
    assert store.path.exists()
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_round_trip_across_reopen() -> None:
    store = HistoryStore()
    session = store.create_session("Pines", "q6", "demo")
    doc = AttachmentRecord("notes.md", 1234, "ab" * 32, 321, "# Notes\nLong text")
    user = store.add_message(session.id, "user", "Summarise", attachments=(doc,))
    answer = store.add_message(session.id, "assistant", "", "streaming")
    store.update_message(answer, content="Pines are", status="stopped", reason="Stopped",
                         stats={"generated_tokens": 3, "ttft": 0.1, "decode_tps": 30.0})
    store.set_tokens(session.id, 777)
    store.close()

    again = HistoryStore()
    (record,) = again.sessions()
    assert (record.title, record.kv_mode, record.model_id, record.tokens) == (
        "Pines", "q6", "demo", 777)
    first, second = again.messages(session.id)
    assert (first.id, first.role, first.content, first.attachments) == (
        user, "user", "Summarise", (doc,))
    assert (second.content, second.status, second.reason) == ("Pines are", "stopped", "Stopped")
    assert second.stats == {"generated_tokens": 3, "ttft": 0.1, "decode_tps": 30.0}
    assert again.integrity_check() == "ok"
    again.close()


def test_an_edit_is_kept_per_chat_beside_its_draft_across_reopen() -> None:
    store = HistoryStore()
    chat, other = (store.create_session(title, "q8", "demo") for title in ("A", "B"))
    doc = AttachmentRecord("notes.md", 12, "ab" * 32, 3, "# Notes")
    edit = EditRecord(7, "the question, rewritten", (doc,))
    store.set_draft(chat.id, "my own draft")
    store.set_edit(chat.id, edit)
    store.close()

    again = HistoryStore()
    assert again.edit(chat.id) == edit and again.edit(other.id) is None
    assert again.draft(chat.id) == "my own draft"
    again.set_edit(chat.id, None)
    assert again.edit(chat.id) is None
    # A chat deleted while not on screen takes its kept edit (its text) with it.
    again.set_edit(other.id, edit)
    again.delete_session(other.id)
    assert again.edit(other.id) is None
    assert again._db.execute("SELECT count(*) FROM app_state WHERE name LIKE 'edit:%'"
                             ).fetchone()[0] == 0
    again.close()


def test_search_rename_delete_and_truncate() -> None:
    store = HistoryStore()
    a = store.create_session("Tax return", "q8", "demo")
    b = store.create_session("Holiday", "q4", "demo")
    store.add_message(a.id, "user", "deductions for 2025")
    m1 = store.add_message(b.id, "user", "Where to go in spring?")
    m2 = store.add_message(b.id, "assistant", "Kyoto.")
    assert [s.id for s in store.sessions("deduction")] == [a.id]
    assert [s.id for s in store.sessions("holi")] == [b.id]
    store.rename_session(b.id, "  Spring trip ")
    assert store.session(b.id).title == "Spring trip"
    store.delete_messages((m1, m2))
    assert store.messages(b.id) == []
    store.delete_session(a.id)
    assert store.session(a.id) is None and store.messages(a.id) == []
    assert [s.id for s in store.sessions()] == [b.id]
    store.close()


def test_search_finds_the_characters_typed_not_like_wildcards() -> None:
    store = HistoryStore()
    snake = store.create_session("snake_case notes", "q8", "demo")
    store.create_session("snakeXcase", "q8", "demo")
    percent = store.create_session("Budget", "q8", "demo")
    store.add_message(percent.id, "user", "100% done")
    store.create_session("100 items", "q8", "demo")
    path = store.create_session(r"C:\temp", "q8", "demo")
    # Before, _ and % matched any character(s): every chat for "_".
    assert [s.id for s in store.sessions("snake_case")] == [snake.id]
    assert [s.id for s in store.sessions("100%")] == [percent.id]
    assert [s.id for s in store.sessions("_")] == [snake.id]
    assert [s.id for s in store.sessions("\\t")] == [path.id]
    store.close()


def test_search_matches_any_case_and_accents_and_the_files_names() -> None:
    """As a Mac's searches do: before, SQLite's LIKE folded ASCII letters only, so
    "école" missed "École" and "strasse" missed "Straße"; a chat found by the name of a
    file it was sent was not found at all."""
    store = HistoryStore()
    school = store.create_session("École d'été", "q8", "demo")
    street = store.create_session("Notes", "q8", "demo")
    store.add_message(street.id, "user", "Die Hauptstraße entlang")
    report = store.create_session("Numbers", "q8", "demo")
    store.add_message(report.id, "user", "Summarise this", "complete",
                      (AttachmentRecord("Quarterly-Report.pdf", 10, "0" * 64, 3, "text"),))
    store.create_session("Other", "q8", "demo")
    assert [s.id for s in store.sessions("école")] == [school.id]
    assert [s.id for s in store.sessions("ECOLE D'ETE")] == [school.id]
    assert [s.id for s in store.sessions("hauptstrasse")] == [street.id]
    assert [s.id for s in store.sessions("quarterly-report")] == [report.id]
    store.close()


def test_streaming_messages_become_interrupted_with_their_text() -> None:
    store = HistoryStore()
    session = store.create_session("Crash", "q8", "demo")
    done = store.add_message(session.id, "assistant", "finished", "complete")
    partial = store.add_message(session.id, "assistant", "half an ans", "streaming")
    store.close()
    again = HistoryStore()
    assert again.mark_interrupted() == 1
    by_id = {m.id: m for m in again.messages(session.id)}
    assert by_id[done].status == "complete"
    assert (by_id[partial].status, by_id[partial].content) == ("interrupted", "half an ans")
    assert "quit" in by_id[partial].reason
    again.close()


def test_rapid_streaming_writes_while_others_read_never_corrupt(qtbot, monkeypatch) -> None:
    # One writer (the GUI thread's recorder saving on every flush) and two readers
    # on their own connections, as another Longleaf window or a backup tool would be.
    import sqlite3
    import threading

    from app.chat import recorder as answer_recorder
    from app.chat.model import ChatModel
    from app.chat.recorder import AnswerRecorder

    monkeypatch.setattr(answer_recorder, "SAVE_INTERVAL_S", 0.0)  # save on every flush
    store = HistoryStore()
    session = store.create_session("stream", "q8", "demo")
    other = store.create_session("other", "q4", "demo")
    model = ChatModel()
    recorder = AnswerRecorder(store, model)
    message_id = recorder.start(session.id)
    pieces = [f"token{i} " for i in range(1500)]
    stop = threading.Event()
    seen: list[list[str]] = [[], []]
    errors: list[BaseException] = []

    def read(into: list[str]) -> None:
        try:
            db = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True, timeout=5.0)
            while not stop.is_set():
                row = db.execute("SELECT content FROM messages WHERE id = ?",
                                 (message_id,)).fetchone()
                into.append(row[0])
                if len(into) % 50 == 0:
                    assert db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            db.close()
        except BaseException as error:  # reported on the test's thread
            errors.append(error)

    readers = [threading.Thread(target=read, args=(s,), name=f"reader-{i}")
               for i, s in enumerate(seen)]
    for reader in readers:
        reader.start()
    try:
        for i, piece in enumerate(pieces):
            recorder.append(piece)
            model.flush()  # the 30 ms flush of the streaming path, at once
            if i % 100 == 0:  # the other writes the GUI thread makes meanwhile
                store.add_message(other.id, "user", f"note {i}")
                store.set_tokens(session.id, i)
        recorder.finish("complete", None, {"generated_tokens": len(pieces)})
    finally:
        stop.set()
        for reader in readers:
            reader.join(30)
    assert not errors, errors
    print(f"reads: {[len(s) for s in seen]}, distinct texts read: "
          f"{[len(set(s)) for s in seen]}")  # shown with -s
    full = "".join(pieces)
    for observed in seen:
        assert len(observed) > 10, "a reader never got a turn"
        assert all(full.startswith(text) for text in observed)  # only whole saves
        assert [len(t) for t in observed] == sorted(len(t) for t in observed)
    assert store.integrity_check() == "ok"
    store.close()
    again = HistoryStore()
    (answer,) = again.messages(session.id)
    assert (answer.content, answer.status) == (full, "complete")
    assert len(again.messages(other.id)) == 15
    assert again.integrity_check() == "ok"
    again.close()


def test_an_answer_ending_and_a_quality_check_count_as_the_chats_activity(
        monkeypatch) -> None:
    import app.store as store_module
    from engine.events import QualityReceipt

    now = [1_000.0]
    monkeypatch.setattr(store_module.time, "time", lambda: now[0])
    store = HistoryStore()
    chat = store.create_session("Pines", "q8", "demo")
    store.add_message(chat.id, "user", "Where do they grow?", "complete")
    now[0] = 2_000.0
    answer = store.add_message(chat.id, "assistant", "", "streaming")
    now[0] = 2_500.0
    store.update_message(answer, content="In the south")  # still streaming: no activity yet
    assert store.session(chat.id).updated == 2_000.0
    now[0] = 3_000.0
    store.update_message(answer, content="In the south.", status="complete")
    assert store.session(chat.id).updated == 3_000.0
    now[0] = 4_000.0
    store.save_receipt(chat.id, QualityReceipt("q8", True, 1024, 5_007, 1_023, 0.996, 0.004,
                                               0.05, "m", now[0]), "")
    assert store.session(chat.id).updated == 4_000.0
    store.close()


def _flip_a_byte_in(path, *marks: bytes) -> None:
    """Put a byte that is not UTF-8 at the start of each mark (SQLite checks no text)."""
    data = bytearray(path.read_bytes())
    for mark in marks:
        data[data.index(mark)] = 0xFF
    path.write_bytes(bytes(data))


def test_a_byte_that_is_not_utf8_reads_as_a_replacement_character() -> None:
    from app.store import open_history

    store = HistoryStore()
    chat = store.create_session("Trip ZZTITLE", "q8", "demo")
    store.add_message(chat.id, "user", "hello ZZTEXT world")
    store.set_last_session(chat.id)
    store.close()
    _flip_a_byte_in(default_path(), b"ZZTEXT", b"ZZTITLE")

    again, opened = open_history()  # before, the window's first read raised
    assert opened == type(opened)()
    assert [s.title for s in again.sessions()] == ["Trip \ufffdZTITLE"]
    assert again.last_session().title == "Trip \ufffdZTITLE"
    assert [m.content for m in again.messages(chat.id)] == ["hello \ufffdZTEXT world"]
    again.close()


def test_a_column_this_version_does_not_know_is_left_alone() -> None:
    import sqlite3

    store = HistoryStore()
    chat = store.create_session("Pines", "q8", "demo")
    store.close()
    db = sqlite3.connect(default_path())
    # As a later version may add one: after the others, with a default.
    db.execute("ALTER TABLE sessions ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
    db.commit()
    db.close()

    again = HistoryStore()  # before, the rows did not fit SessionRecord, nor the insert
    assert [s.title for s in again.sessions()] == ["Pines"]
    assert again.session(chat.id).title == "Pines"
    other = again.create_session("Oaks", "q4", "demo")
    assert {s.id for s in again.sessions("s")} == {chat.id, other.id}
    again.close()
    db = sqlite3.connect(default_path())
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1  # stamped at the open
    db.close()


def test_text_with_a_lone_surrogate_is_saved_with_a_replacement_character() -> None:
    # As os.fsdecode gives a file name's byte that is not UTF-8; UTF-8 cannot hold it.
    store = HistoryStore()
    chat = store.create_session("notes \udcff", "q8", "demo")
    doc = AttachmentRecord("caf\udce9.txt", 5, "ab" * 32, 2, "text \ud800")
    store.add_message(chat.id, "user", "bad \udcff, a pair \ud83d\ude00",
                      attachments=(doc,))  # before, each save raised
    answer = store.add_message(chat.id, "assistant", "", "streaming")
    store.update_message(answer, content="streamed \udcff", status="complete")
    store.set_draft(chat.id, "draft \ud83d")
    store.set_draft(None, "no chat \ud83d")
    store.close()

    again = HistoryStore()
    assert again.session(chat.id).title == "notes \ufffd"
    question, answered = again.messages(chat.id)
    assert question.content == "bad \ufffd, a pair \U0001F600"
    assert (question.attachments[0].name, question.attachments[0].text) == (
        "caf\ufffd.txt", "text \ufffd")
    assert answered.content == "streamed \ufffd"
    assert (again.draft(chat.id), again.draft(None)) == ("draft \ufffd", "no chat \ufffd")
    again.close()


def test_a_write_of_several_statements_is_all_or_nothing(tmp_path) -> None:
    """A message whose file cannot be stored is not stored without it; an edit whose
    new turn cannot be stored keeps the turns it was to replace."""
    import sqlite3

    import pytest

    store = HistoryStore(tmp_path / "history.sqlite3")
    chat = store.create_session("t", "q8", "demo")
    first = store.add_message(chat.id, "user", "the first question", "complete")
    answer = store.add_message(chat.id, "assistant", "its answer", "complete")
    unstorable = AttachmentRecord("f.txt", 1, "0" * 64, 1, None)  # type: ignore[arg-type]
    with pytest.raises(sqlite3.IntegrityError):
        store.add_message(chat.id, "user", "a question with a file", "complete", (unstorable,))
    with pytest.raises(sqlite3.IntegrityError), store.writing():
        store.delete_messages((first, answer))
        store.add_message(chat.id, "user", "the edit", "complete", (unstorable,))
    reopened = HistoryStore(tmp_path / "history.sqlite3")
    assert [m.content for m in reopened.messages(chat.id)] == ["the first question", "its answer"]


def test_a_history_another_program_is_writing_to_is_said_in_words(tmp_path) -> None:
    """DB Browser (or sqlite3 in a terminal) holding the write lock: a fault the app
    says and retries, as for a full disk, not a raw "database is locked"."""
    import sqlite3

    import pytest

    from engine import disk
    from engine.errors import DiskFault

    path = tmp_path / "history.sqlite3"
    store = HistoryStore(path)
    chat = store.create_session("t", "q8", "demo")
    other = sqlite3.connect(str(path), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(DiskFault, match="another program is writing to") as held:
            store.add_message(chat.id, "user", "a question", "complete")
        assert held.value.cause == disk.IN_USE and str(path) in str(held.value)
    finally:
        other.execute("ROLLBACK")
        other.close()
    store.add_message(chat.id, "user", "a question", "complete")  # once it lets go
    assert [m.content for m in store.messages(chat.id)] == ["a question"]


def test_a_history_damaged_twice_in_one_second_keeps_both_copies(tmp_path, monkeypatch) -> None:
    import time

    from app import store as store_module

    monkeypatch.setattr(time, "strftime", lambda _format: "20261207-154500")
    path = tmp_path / "history.sqlite3"
    kept = []
    for copy in (b"first damaged bytes", b"second damaged bytes"):
        path.write_bytes(copy)
        kept.append(store_module._move_aside(path))
    # Was one name for both: the second rename replaced the first copy, never to return.
    assert kept[0] != kept[1]
    assert [p.read_bytes() for p in kept] == [b"first damaged bytes", b"second damaged bytes"]
