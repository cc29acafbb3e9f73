"""Copy what SQLite can still read out of a damaged history into a sound one.

SQLite's own ``.recover`` lives in its command-line shell and its
``sqlite3_recover`` C API, neither of which Python's ``sqlite3`` module exposes
nor every Mac has in a usable version; ``Connection.iterdump`` stops at the
first unreadable page. So the rows are read table by table in rowid order, and
a read that hits a damaged page steps over it: a seek by rowid goes down the
table's b-tree from its root, so the first rowid whose seek reads again is
found by doubling, then bisecting. Only the damaged pages' rows are lost.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from numbers import Real

from engine import DEFAULT_MODE

MAX_ROWID = 2**63 - 1
RECOVERED_TITLE = "Recovered chat"
ROLES = ("system", "user", "assistant")

# Column order of each table, as SCHEMA in app/store.py creates them.
COLUMNS = {
    "sessions": ("id", "title", "kv_mode", "model_id", "tokens", "created", "updated"),
    "messages": ("id", "session_id", "role", "content", "status", "reason", "stats",
                 "created", "updated"),
    "attachments": ("id", "message_id", "name", "size", "sha256", "tokens", "text"),
    "measurements": ("name", "value", "updated"),
    "quality_receipts": ("session_id", "mode", "receipt", "updated"),
    "drafts": ("session_id", "text", "updated"),
    "draft_attachments": ("session_id", "records"),
    "app_state": ("name", "value"),
}


def decoded(raw: bytes) -> str:
    """A text value as ``text_factory`` reads it: a byte that is not UTF-8 reads as
    U+FFFD, so one damaged byte costs one character rather than its whole row."""
    return raw.decode("utf-8", "replace")


@dataclass(frozen=True)
class Recovered:
    """What a recovery copied into the new history."""

    chats: int
    messages: int
    attachments: int


def readable_rows(db: sqlite3.Connection, table: str) -> Iterator[tuple]:
    """Every row of ``table`` SQLite can still read, in rowid order."""
    query = (f"SELECT rowid, {', '.join(COLUMNS[table])} FROM {table} "
             "WHERE rowid >= ? ORDER BY rowid")
    start: int | None = -MAX_ROWID - 1
    while start is not None:
        try:
            for rowid, *row in db.execute(query, (start,)):
                start = rowid + 1 if rowid < MAX_ROWID else None
                yield tuple(row)
                if start is None:
                    return
            return
        except sqlite3.DatabaseError:
            if start is None:  # the last rowid was read
                return
            start = _next_readable(db, query, start)


def _next_readable(db: sqlite3.Connection, query: str, bad: int) -> int | None:
    """The smallest rowid after ``bad`` from which a read works again, or None."""
    def readable(rowid: int) -> bool:
        try:
            db.execute(query + " LIMIT 1", (rowid,)).fetchall()
            return True
        except sqlite3.DatabaseError:
            return False

    low, step = bad, 1
    while True:
        high = min(bad + step, MAX_ROWID)
        if readable(high):
            break
        if high == MAX_ROWID:
            return None
        low, step = high, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        if readable(middle):
            high = middle
        else:
            low = middle
    return high


def recover(source: sqlite3.Connection, target: sqlite3.Connection,
            statuses: tuple[str, ...]) -> Recovered:
    """Copy every readable, well-typed row of ``source`` into ``target``'s empty tables.

    Messages whose chat row was lost get a chat titled "Recovered chat";
    attachments whose message was lost are left out (they stay in the damaged file).
    """
    source.text_factory = decoded
    sessions = {row[0]: row for row in readable_rows(source, "sessions") if _session_ok(row)}
    messages = [row for row in readable_rows(source, "messages") if _message_ok(row)]
    for row in messages:
        if row[1] not in sessions:
            sessions[row[1]] = (row[1], RECOVERED_TITLE, DEFAULT_MODE, "", 0, row[7], row[8])
    kept_ids = {row[0] for row in messages}
    attachments = [row for row in readable_rows(source, "attachments")
                   if _attachment_ok(row) and row[1] in kept_ids]
    target.execute("BEGIN")
    try:
        _insert(target, "sessions", sessions.values())
        _insert(target, "messages", [_message_row(row, statuses) for row in messages])
        _insert(target, "attachments", attachments)
        _insert(target, "measurements", [row for row in readable_rows(source, "measurements")
                                         if isinstance(row[0], str) and _numbers(row[1:])])
        _insert(target, "quality_receipts", [
            row for row in readable_rows(source, "quality_receipts")
            if row[0] in sessions and _texts(row[1:3]) and _numbers(row[3:])])
        _insert(target, "drafts", [row for row in readable_rows(source, "drafts")
                                   if row[0] in sessions and _texts(row[1:2])
                                   and _numbers(row[2:])])
        _insert(target, "draft_attachments", [
            row for row in readable_rows(source, "draft_attachments")
            if row[0] in sessions and _texts(row[1:2])])
        # What was typed with no chat open is kept nowhere else; the chat on screen
        # is only shown again if its row came back.
        _insert(target, "app_state", [row for row in readable_rows(source, "app_state")
                                      if _texts(row)])
    except BaseException:
        target.execute("ROLLBACK")
        raise
    target.execute("COMMIT")
    return Recovered(len(sessions), len(messages), len(attachments))


def _insert(db: sqlite3.Connection, table: str, rows: Iterable[tuple]) -> None:
    marks = ", ".join("?" * len(COLUMNS[table]))
    db.executemany(f"INSERT OR IGNORE INTO {table} ({', '.join(COLUMNS[table])}) "
                   f"VALUES ({marks})", list(rows))


def _texts(values: Iterable[object]) -> bool:
    return all(isinstance(v, str) for v in values)


def _numbers(values: Iterable[object]) -> bool:
    return all(isinstance(v, Real) and not isinstance(v, bool) for v in values)


def _session_ok(row: tuple) -> bool:
    return _texts(row[:4]) and _numbers(row[4:])


def _message_ok(row: tuple) -> bool:
    _, session_id, role, content, status, reason, _stats, *times = row
    if not (isinstance(row[0], int) and _texts((session_id, content, status))
            and role in ROLES and _numbers(times)):
        return False
    return reason is None or isinstance(reason, str)


def _message_row(row: tuple, statuses: tuple[str, ...]) -> tuple:
    """A message row to insert: an unknown status reads "interrupted", broken stats none."""
    status = row[4] if row[4] in statuses else "interrupted"
    stats = row[6]
    try:
        json.loads(stats) if stats is not None else None
    except (TypeError, ValueError):
        stats = None
    return (*row[:4], status, row[5], stats, *row[7:])


def _attachment_ok(row: tuple) -> bool:
    _, message_id, name, size, sha256, tokens, text = row
    return (isinstance(message_id, int) and _texts((name, sha256, text))
            and _numbers((size, tokens)))
