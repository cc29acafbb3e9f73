"""History store: sessions, messages, attachments, crash recovery, WAL."""

from __future__ import annotations

from app.store import AttachmentRecord, HistoryStore, default_path
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


def test_search_rename_delete_and_truncate() -> None:
    store = HistoryStore()
    a = store.create_session("Tax return", "q8", "demo")
    b = store.create_session("Holiday", "q4", "demo")
    store.add_message(a.id, "user", "deductions for 2025")
    m1 = store.add_message(b.id, "user", "Where to go in spring?")
    store.add_message(b.id, "assistant", "Kyoto.")
    assert [s.id for s in store.sessions("deduction")] == [a.id]
    assert [s.id for s in store.sessions("holi")] == [b.id]
    store.rename_session(b.id, "  Spring trip ")
    assert store.session(b.id).title == "Spring trip"
    store.delete_messages_from(b.id, m1)
    assert store.messages(b.id) == []
    store.delete_session(a.id)
    assert store.session(a.id) is None and store.messages(a.id) == []
    assert [s.id for s in store.sessions()] == [b.id]
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
