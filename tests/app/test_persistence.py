"""Nothing lost: history survives a restart and a killed process."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from app.store import HistoryStore, default_path
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
        assert second.conversation.widgets[0].body.markdown() == before[0][1]
        assert c.cache_state(session.id) == "rebuilt on next send"
        assert send_and_wait(qtbot, second, "And again?") == "complete"  # cache rebuilt
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


def test_killed_mid_answer_keeps_the_partial_text(qtbot, tiny_llama) -> None:
    db = default_path()
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.app.crash_child", str(tiny_llama), PROMPT],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL

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
        assert "Interrupted" in window.conversation.widgets[1].status.text()
    finally:
        close_window(window)
