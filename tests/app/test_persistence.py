"""Nothing lost: history survives a restart and a killed process."""

from __future__ import annotations

import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from app.sessions.session_list import RecordRole, StateRole, detail_text
from app.store import HistoryStore, default_path
from tests.app.chat.test_documents_drop import TEXT
from tests.app.conftest import close_window, open_window, send_and_wait

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Tell me a long story"


def test_history_round_trips_across_a_restart(qtbot, tiny_llama) -> None:
    first = open_window(qtbot, tiny_llama)
    first.controller.new_session("q6")
    send_and_wait(qtbot, first, "Remember: the password is longleaf")
    send_and_wait(qtbot, first, "What is it?")
    session = first.controller.current
    before = [(m.role, m.content, m.status, m.stats) for m in first.controller.model.messages()]
    close_window(first)

    second = open_window(qtbot, tiny_llama)
    try:
        c = second.controller
        assert c.current.id == session.id and c.current.kv_mode == "q6"
        after = [(m.role, m.content, m.status, m.stats) for m in c.model.messages()]
        assert after == before and len(after) == 4
        assert len(second.conversation.widgets) == 4
        assert second.conversation.widget_for(0).body.markdown() == before[0][1]
        # The chat is on disk, said once, with the tokens its snapshot holds, and the
        # sidebar counts the same tokens.
        on_disk = c.bridge.stored_snapshot(session.id)
        assert on_disk is not None and on_disk.tokens > 0
        assert c.cache_state(session.id).startswith(f"On disk: {on_disk.tokens:,} tokens stored")
        row = next(second.sessions.list.item(i) for i in range(second.sessions.list.count())
                   if second.sessions.list.item(i).data(RecordRole).id == session.id)
        line = detail_text(row.data(RecordRole), row.data(StateRole))
        assert line.startswith(f"On disk · {on_disk.tokens:,} tokens · ")
        assert send_and_wait(qtbot, second, "And again?") == "complete"  # cache reopened
        stats = c.model.message(c.model.rowCount() - 1).stats
        assert stats["reused_tokens"] > 0
        said = second.conversation.widgets[-1].stats.text()
        assert (f"Reused {stats['reused_tokens']:,} stored tokens, read "
                f"{stats['prefill_tokens']:,} new") in said
    finally:
        close_window(second)


def _streaming_row(db: Path) -> tuple[str, str] | None:
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute(
                "SELECT status, content FROM messages WHERE role = 'assistant' "
                "ORDER BY id DESC LIMIT 1").fetchone()
    except sqlite3.OperationalError:
        return None


def start_child(model: Path, prompt: str, *options: str,
                stdout: int = subprocess.DEVNULL) -> subprocess.Popen:
    """The real app in a subprocess, scripted by ``tests/app/crash_child.py``."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.app.crash_child", str(model), prompt, *options],
        # Unbuffered bytes: readline() then never reads past the line select() saw.
        cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE, bufsize=0)


def read_until(child: subprocess.Popen, prefix: str, timeout: float = 120) -> str:
    """The child's next stdout line starting with ``prefix`` (its own progress log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([child.stdout], [], [], 0.1)[0]:
            continue
        line = child.stdout.readline().decode()
        if not line:
            raise AssertionError(f"child ended before {prefix!r}: {child.stderr.read()[-2000:]}")
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"child never printed {prefix!r}")


def kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    for stream in (child.stdout, child.stderr):
        if stream is not None:
            stream.close()
    assert child.returncode == -signal.SIGKILL


def test_killed_mid_answer_keeps_the_partial_text(qtbot, tiny_llama) -> None:
    db = default_path()
    child = start_child(tiny_llama, PROMPT)
    try:
        deadline = time.monotonic() + 120
        seen = None
        # Wait until a second of streaming has been saved, twice over (it grows).
        while time.monotonic() < deadline:
            row = _streaming_row(db)
            if row and row[0] == "streaming" and row[1]:
                if seen is not None and len(row[1]) > len(seen):
                    break
                seen = seen or row[1]
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        else:
            raise AssertionError("the child never saved a growing answer")
        saved_before_kill = _streaming_row(db)[1]
    finally:
        kill(child)

    store = HistoryStore()
    try:
        assert store.integrity_check() == "ok"
        (session,) = store.sessions()
        user, answer = store.messages(session.id)
        assert (user.role, user.content, user.status) == ("user", PROMPT, "complete")
        assert answer.status == "streaming"  # as the crash left it
    finally:
        store.close()

    window = open_window(qtbot, tiny_llama)  # the next start marks and shows it
    try:
        c = window.controller
        assert c.recovered == 1
        rows = c.model.messages()
        assert rows[1].status == "interrupted"
        assert rows[1].content.startswith(saved_before_kill) and rows[1].content
        assert "Interrupted" in window.conversation.widget_for(1).status.text()
    finally:
        close_window(window)


def test_killed_mid_ingest_keeps_the_document_and_every_finished_message(
        qtbot, tiny_llama, tmp_path) -> None:
    doc = tmp_path / "field-notes.md"
    doc.write_text(TEXT * 60)  # ~2k tokens: over a hundred 16-token chunks
    child = start_child(tiny_llama, "Summarise the notes", "--first", "Hello there",
                        "--attach", str(doc), "--chunk", "16", "--slow-chunk", "0.05",
                        "--max-tokens", "24", stdout=subprocess.PIPE)
    try:
        assert read_until(child, "answered") == "answered complete"
        done, total = map(int, read_until(child, "ingest").split()[1:])
        assert 0 < done < total  # the document is being prefilled right now
    finally:
        kill(child)

    store = HistoryStore()
    try:
        assert store.integrity_check() == "ok"
        (session,) = store.sessions()
        messages = store.messages(session.id)
    finally:
        store.close()
    first_user, first_answer, user, answer = messages
    assert (first_user.content, first_user.status) == ("Hello there", "complete")
    assert first_answer.status == "complete" and first_answer.content
    assert (user.role, user.content, user.status) == ("user", "Summarise the notes", "complete")
    (attached,) = user.attachments
    assert (attached.name, attached.text) == ("field-notes.md", TEXT * 60)
    assert (answer.role, answer.status, answer.content) == ("assistant", "streaming", "")

    window = open_window(qtbot, tiny_llama)
    try:
        c = window.controller
        assert c.recovered == 1
        rows = c.model.messages()
        assert [r.status for r in rows] == ["complete", "complete", "complete", "interrupted"]
        assert rows[0].content == "Hello there" and rows[1].content == first_answer.content
        assert rows[2].attachments == user.attachments and rows[3].content == ""
        assert "Interrupted" in window.conversation.widget_for(3).status.text()
        # The document goes to the model again with the next message.
        engine_text = "\n".join(m["content"] for m in c.model.engine_messages(""))
        assert TEXT * 60 in engine_text
    finally:
        close_window(window)
