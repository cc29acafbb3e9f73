"""Chat history in SQLite (WAL): sessions, messages and attachments.

One ``HistoryStore`` per process is the single writer, used from the GUI
thread. WAL plus ``synchronous=NORMAL`` keeps every committed write across an
application crash (SIGKILL); a streaming answer is committed as it grows so a
crash loses at most the last second of it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import sqlite3
import time
import unicodedata
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from app.history_recovery import Recovered, decoded, recover
from engine import DiskFault, KvMode, QualityReceipt, data_dir, disk, private_file

log = logging.getLogger(__name__)

STATUSES = ("complete", "streaming", "stopped", "failed", "interrupted")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    kv_mode TEXT NOT NULL,
    model_id TEXT NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT,
    stats TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages(session_id, id);
CREATE TABLE IF NOT EXISTS attachments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS attachments_by_message ON attachments(message_id);
CREATE TABLE IF NOT EXISTS measurements (
    name TEXT PRIMARY KEY,
    value REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS quality_receipts (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    mode TEXT NOT NULL,
    receipt TEXT NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (session_id, mode)
);
CREATE TABLE IF NOT EXISTS drafts (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
    text TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS draft_attachments (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
    records TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS app_state (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""
# The schema this build reads and writes, kept in the file's ``PRAGMA user_version``
# (0: a history from before it was kept, which is this schema). A later version that
# changes the tables in a way this build would misread or break sets a higher one.
SCHEMA_VERSION = 1
# Every column of sessions, as SessionRecord takes them: named, never ``*``, so a
# column a later version adds does not shift them.
SESSION_COLUMNS = "id, title, kv_mode, model_id, tokens, created, updated"


# The combining diacritical marks (and their supplement and extended blocks, and
# those for symbols and half marks) that decomposing a letter splits off its base.
_MARKS = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")


def folded(text: str | None) -> str:
    """``text`` as a search compares it: case folded, accents left out, compatibility
    forms unified ("ﬁ" is "fi"). Called on every message a search reads: plain ASCII,
    most of them, takes the quick way."""
    if not text:
        return ""
    if text.isascii():
        return text.lower()
    return _MARKS.sub("", unicodedata.normalize("NFKD", text)).casefold()
# The key a stored quality receipt keeps the digest of the text it measured under:
# the text the engine read (system prompt first, failed turns left out). Receipts
# stored before kept the digest of every stored message under the older key.
MEASURED_TEXT = "measured_read"
MEASURED_ROWS = "measured_text"
# app_state names: the chat on screen, and what was typed while no chat was.
LAST_SESSION = "last_session"
NO_CHAT_DRAFT = "draft"
NO_CHAT_DRAFT_ATTACHMENTS = "draft_attachments"
# The app_state names of a chat's message being rewritten (its id and text) and of
# its files (written only when they change), after these prefixes.
EDIT_OF = "edit:"
EDIT_FILES_OF = "edit-files:"


@dataclass(frozen=True)
class SessionRecord:
    """A conversation as listed in the sidebar."""

    id: str
    title: str
    kv_mode: KvMode
    model_id: str
    tokens: int
    created: float
    updated: float


@dataclass(frozen=True)
class AttachmentRecord:
    """A document attached to a user message."""

    name: str
    size: int
    sha256: str
    tokens: int
    text: str


@dataclass(frozen=True)
class EditRecord:
    """An earlier message being rewritten in the composer: its id and the text now."""

    message_id: int
    text: str
    attachments: tuple[AttachmentRecord, ...] = ()


@dataclass(frozen=True)
class MessageRecord:
    """One chat message and how it ended."""

    id: int
    session_id: str
    role: str
    content: str
    status: str
    reason: str | None
    stats: dict | None
    attachments: tuple[AttachmentRecord, ...] = field(default_factory=tuple)


def default_path() -> Path:
    """Where the history lives: ``history.sqlite3`` in the user data dir."""
    return data_dir() / "history.sqlite3"


# SQLite's primary result codes (the low byte of an extended code).
_CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
# SQLITE_PERM, SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL,
# SQLITE_CANTOPEN: the file may be sound, but it cannot be written here now.
_UNWRITABLE_CODES = (3, 5, 6, 8, 10, 13, 14)


# Why a write failed, by SQLite's primary result code (None: ask the folder).
_WRITE_FAULTS = {13: disk.FULL, 8: disk.READ_ONLY, 3: disk.UNWRITABLE, 10: None, 14: None,
                 5: disk.IN_USE, 6: disk.IN_USE}
# Seconds a write waits for another program's write lock before it is said: the
# window waits with it, and only another program ever holds it.
LOCK_WAIT = 1.0


class DamagedHistory(sqlite3.DatabaseError):
    """SQLite's structure check found a damaged page."""


class NewerHistory(Exception):
    """The history was written by a newer Longleaf, with a schema this one does not know.

    Attributes:
        version: the file's schema version.
    """

    def __init__(self, version: int) -> None:
        super().__init__(f"the history's schema version {version} is newer than "
                         f"{SCHEMA_VERSION}, the newest this Longleaf knows")
        self.version = version


@dataclass(frozen=True)
class HistoryOpened:
    """How the history opened, for the window to tell the user.

    Attributes:
        damaged: where a damaged history was moved (kept, never deleted), or None.
        chats: chats recovered from it (or copied for a read-only history).
        messages: messages recovered from it.
        unsaved: why nothing of this run will be saved ("" when it will be).
    """

    damaged: Path | None = None
    chats: int = 0
    messages: int = 0
    unsaved: str = ""


def open_history(path: Path | None = None,
                 writable: bool = True) -> tuple[HistoryStore, HistoryOpened]:
    """Open the history whatever state its file and folder are in; never raises.

    A damaged database is moved aside and what SQLite can still read of it is
    copied into a fresh one. A folder that cannot be written (read-only, full,
    missing) gives a history in memory holding what could be read: it works for
    this run, and ``HistoryOpened.unsaved`` says nothing of it will be kept.
    ``writable=False`` (the data folder's lock could not be taken) does the same.
    """
    try:
        path = path or default_path()
    except OSError as error:  # the data folder itself cannot be made or fixed
        return _in_memory(None, _unwritable(None, error))
    if not writable and not os.access(path.parent, os.W_OK):
        return _in_memory(path, _unwritable(path, OSError(errno.EROFS, "it is read-only")))
    if not writable:
        return _in_memory(path, (
            f"Longleaf could not lock its data folder {path.parent}, so it cannot rule out "
            "another Longleaf writing the same history: your chats are shown, but nothing "
            "of this session will be saved."))
    try:
        return HistoryStore(path), HistoryOpened()
    except NewerHistory as error:
        return _in_memory(path, _newer(path, error))
    except sqlite3.DatabaseError as error:
        if not isinstance(error, DamagedHistory) and _code(error) not in _CORRUPT_CODES:
            if isinstance(error, sqlite3.OperationalError) or _code(error) in _UNWRITABLE_CODES:
                return _in_memory(path, _unwritable(path, error))
            raise
        log.warning("the history %s is damaged (%s); recovering what can be read", path, error)
    except OSError as error:
        return _in_memory(path, _unwritable(path, error))
    try:
        damaged = _move_aside(path)
    except OSError as error:
        return _in_memory(path, _unwritable(path, error), damaged=path)
    store = HistoryStore(path)
    recovered = store.recover_from(damaged)
    return store, HistoryOpened(damaged, recovered.chats, recovered.messages)


def _code(error: sqlite3.Error) -> int:
    return (getattr(error, "sqlite_errorcode", 0) or 0) & 0xFF


def _unwritable(path: Path | None, error: Exception) -> str:
    where = path.parent if path is not None else "its data folder"
    detail = getattr(error, "strerror", None) or str(error)
    return (f"Longleaf cannot write to {where} ({detail}), so nothing you do in this "
            "session will be saved. Free some space or fix the folder's permissions, "
            "then restart Longleaf.")


def _newer(path: Path, error: NewerHistory) -> str:
    return (f"Your chat history {path} was written by a newer version of Longleaf "
            f"(history version {error.version}; this one knows up to {SCHEMA_VERSION}), so "
            "this one only shows it: nothing you do in this session will be saved. Update "
            "Longleaf to go on with your chats.")


def _move_aside(path: Path) -> Path:
    """Rename the damaged database (and its WAL files) to a dated name beside it,
    never one a damaged copy of the same second already has (it would be lost)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    damaged = path.with_name(f"{path.stem}.damaged-{stamp}{path.suffix}")
    again = 1
    while damaged.exists():
        again += 1
        damaged = path.with_name(f"{path.stem}.damaged-{stamp}-{again}{path.suffix}")
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.replace(damaged.with_name(damaged.name + suffix))
    path.replace(damaged)
    return damaged


def _in_memory(path: Path | None, unsaved: str,
               damaged: Path | None = None) -> tuple[HistoryStore, HistoryOpened]:
    log.warning("%s", unsaved)
    store = HistoryStore.in_memory(path)
    recovered = store.recover_from(path) if path is not None and path.is_file() else None
    if recovered is None:
        return store, HistoryOpened(damaged, unsaved=unsaved)
    return store, HistoryOpened(damaged, recovered.chats, recovered.messages, unsaved)


class HistoryStore:
    """The history database; the app's only writer to it.

    Args:
        path: database file; defaults to :func:`default_path`.

    Raises:
        NewerHistory: the file's schema is newer than this build's (nothing was
            written to it; :func:`open_history` reads it into memory instead).
    """

    def __init__(self, path: Path | None = None, *, memory: bool = False) -> None:
        if memory:
            self.path = path or Path(":memory:")
            self._db = sqlite3.connect(":memory:", isolation_level=None)
        else:
            # Created user-only first: SQLite gives its -wal and -shm files the same mode.
            self.path = private_file(path or default_path())
            self._db = sqlite3.connect(str(self.path), isolation_level=None,
                                       timeout=LOCK_WAIT)
        # A byte that is not UTF-8 (a disk's or another tool's) passes SQLite's checks
        # but fails the default decoding of every read of its row, and so every start.
        self._db.text_factory = decoded
        self._db.create_function("folded", 1, folded, deterministic=True)
        try:
            # Read before anything is written: a newer schema is left as it is.
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise NewerHistory(version)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
            if version < SCHEMA_VERSION:
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            # Every page's structure, read once: a damaged page is found here, at
            # start-up, rather than on the send that first reads it.
            verdict = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if verdict != "ok":
                raise DamagedHistory(f"database disk image is malformed: {verdict}")
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def in_memory(cls, shown_path: Path | None = None) -> HistoryStore:
        """An empty history held in memory only (``shown_path`` is the file it stands for)."""
        return cls(shown_path, memory=True)

    def recover_from(self, source: Path) -> Recovered:
        """Copy what can be read of the database ``source`` into this (empty) history."""
        try:
            db = _read_only(source)
        except sqlite3.Error as error:
            log.warning("nothing could be read from %s: %s", source, error)
            return Recovered(0, 0, 0)
        try:
            return recover(db, self._db, STATUSES)
        except sqlite3.DatabaseError as error:  # not even the table list can be read
            log.warning("nothing could be read from %s: %s", source, error)
            return Recovered(0, 0, 0)
        finally:
            db.close()

    def close(self) -> None:
        """Checkpoint and close the database."""
        self._db.close()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """One write of all the statements in the block, or none of them; a disk that
        is full or read-only raises ``DiskFault``, in words. Inside another block it
        is part of that one.

        Raises:
            DiskFault: the history's folder cannot take the write now (nothing of
                it was written; the caller keeps what it could not save).
        """
        if self._db.in_transaction:  # part of the write around it
            yield
            return
        try:
            # The connection commits each statement by itself (isolation_level=None):
            # a block of several is made one here, or a message could be saved
            # without its files, or an edit's old turns deleted without its new one.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as error:
            code = _code(error)
            if code not in _WRITE_FAULTS:
                raise
            folder = self.path.parent
            cause = _WRITE_FAULTS[code] or disk.probe(folder) or disk.UNWRITABLE
            where = self.path if cause == disk.IN_USE else folder
            raise disk.fault(cause, where, "Longleaf could not save your chat history",
                             "try again") from error

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self.writing():
            return self._put(sql, args)

    def _put(self, sql: str, args: tuple) -> sqlite3.Cursor:
        """Run one statement of a write, its text made storable (see ``_storable``)."""
        return self._db.execute(sql, tuple(_storable(a) if isinstance(a, str) else a
                                           for a in args))

    # Sessions -------------------------------------------------------------

    def create_session(self, title: str, kv_mode: KvMode, model_id: str) -> SessionRecord:
        """Create and return a new, empty session."""
        now = time.time()
        record = SessionRecord(uuid.uuid4().hex, title, kv_mode, model_id, 0, now, now)
        self._write(
            f"INSERT INTO sessions ({SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (record.id, title, kv_mode, model_id, 0, now, now),
        )
        return record

    def session(self, session_id: str) -> SessionRecord | None:
        """Return one session, or None when it does not exist."""
        row = self._db.execute(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?",
                               (session_id,)).fetchone()
        return SessionRecord(*row) if row else None

    def sessions(self, search: str = "") -> list[SessionRecord]:
        """Sessions, most recent first, whose title or messages contain ``search``."""
        if not search.strip():
            rows = self._db.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions ORDER BY updated DESC").fetchall()
        else:
            # The characters typed (instr has no wildcards), in any case and with or
            # without accents, as a Mac's searches match: "ecole" finds "École".
            typed = folded(search.strip())
            rows = self._db.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions WHERE instr(folded(title), ?) OR id IN "
                "(SELECT session_id FROM messages WHERE instr(folded(content), ?)) OR id IN "
                "(SELECT m.session_id FROM attachments a JOIN messages m ON m.id = a.message_id"
                " WHERE instr(folded(a.name), ?)) ORDER BY updated DESC",
                (typed, typed, typed),
            ).fetchall()
        return [SessionRecord(*row) for row in rows]

    def rename_session(self, session_id: str, title: str) -> None:
        """Give a session a new title."""
        self._write("UPDATE sessions SET title = ? WHERE id = ?", (title.strip(), session_id))

    def set_mode(self, session_id: str, kv_mode: KvMode) -> None:
        """Give a chat with nothing in it yet another KV mode."""
        self._write("UPDATE sessions SET kv_mode = ? WHERE id = ?", (kv_mode, session_id))

    def delete_session(self, session_id: str) -> None:
        """Delete a session with its messages and attachments, and an edit of it kept."""
        with self.writing():
            self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            self._db.execute("DELETE FROM app_state WHERE name IN (?, ?)",
                             (EDIT_OF + session_id, EDIT_FILES_OF + session_id))

    def set_tokens(self, session_id: str, tokens: int) -> None:
        """Record how many tokens the session's context holds (a count the engine
        gives again: a disk that cannot take it now is logged, not raised)."""
        try:
            self._write("UPDATE sessions SET tokens = ? WHERE id = ?",
                        (int(tokens), session_id))
        except DiskFault as fault:
            log.warning("token count of %s not saved: %s", session_id, fault)

    def _touch(self, session_id: str) -> None:
        self._db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))

    # Drafts and the chat on screen ----------------------------------------

    def set_draft(self, session_id: str | None, text: str,
                  attachments: tuple[AttachmentRecord, ...] | None = ()) -> None:
        """Keep what is in a chat's composer (None: while no chat is shown).

        The attachments are kept whole (their text too): an attachment not yet
        sent is stored nowhere else. Empty text deletes the text, no attachments
        the attachments, None leaves them as stored (a pause in typing need not
        write megabytes of documents again); a chat deleted meanwhile keeps none.
        """
        records = None if attachments is None else json.dumps(
            [dataclasses.asdict(a) for a in attachments], ensure_ascii=False) \
            if attachments else ""
        if session_id is None:
            self._set_state(NO_CHAT_DRAFT, text)
            if records is not None:
                self._set_state(NO_CHAT_DRAFT_ATTACHMENTS, records)
            return
        with self.writing():
            if text:
                self._put("INSERT OR REPLACE INTO drafts (session_id, text, updated) "
                          "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?)",
                          (session_id, text, time.time(), session_id))
            else:
                self._db.execute("DELETE FROM drafts WHERE session_id = ?", (session_id,))
            if records is None:
                return
            if records:
                self._put("INSERT OR REPLACE INTO draft_attachments (session_id, records) "
                          "SELECT ?, ? WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?)",
                          (session_id, records, session_id))
            else:
                self._db.execute("DELETE FROM draft_attachments WHERE session_id = ?",
                                 (session_id,))

    def draft(self, session_id: str | None) -> str:
        """The text left typed in a chat's composer ("" when none)."""
        if session_id is None:
            return self._state(NO_CHAT_DRAFT) or ""
        row = self._db.execute("SELECT text FROM drafts WHERE session_id = ?",
                               (session_id,)).fetchone()
        return str(row[0]) if row else ""

    def draft_attachments(self, session_id: str | None) -> tuple[AttachmentRecord, ...]:
        """The attachments left unsent in a chat's composer, in their order."""
        if session_id is None:
            text = self._state(NO_CHAT_DRAFT_ATTACHMENTS)
        else:
            row = self._db.execute("SELECT records FROM draft_attachments WHERE session_id = ?",
                                   (session_id,)).fetchone()
            text = row[0] if row else None
        if not text:
            return ()
        try:
            return tuple(AttachmentRecord(**item) for item in json.loads(text))
        except (ValueError, TypeError, AttributeError) as error:
            # Damaged: the draft's text still comes back.
            log.warning("draft attachments unreadable: %s", error)
            return ()

    def set_edit(self, session_id: str, edit: EditRecord | None, *, files: bool = True) -> None:
        """Keep the message a chat's composer rewrites (None: no edit under way).

        Kept apart from the chat's draft, which the edit set aside: both come back.
        ``files`` False leaves the edit's files as stored (a pause in typing need not
        write its documents again).
        """
        if edit is None:
            self._set_state(EDIT_OF + session_id, "")
            self._set_state(EDIT_FILES_OF + session_id, "")
            return
        self._set_state(EDIT_OF + session_id, json.dumps(
            {"message_id": edit.message_id, "text": edit.text}, ensure_ascii=False))
        if files:
            self._set_state(EDIT_FILES_OF + session_id, json.dumps(
                [dataclasses.asdict(a) for a in edit.attachments], ensure_ascii=False))

    def edit(self, session_id: str) -> EditRecord | None:
        """The edit kept for a chat (:meth:`set_edit`), or None."""
        text = self._state(EDIT_OF + session_id)
        if not text:
            return None
        try:
            item = json.loads(text)
            records = json.loads(self._state(EDIT_FILES_OF + session_id) or "[]")
            files = tuple(AttachmentRecord(**record) for record in records)
            return EditRecord(int(item["message_id"]), str(item["text"]), files)
        except (ValueError, TypeError, AttributeError, KeyError) as error:
            log.warning("kept edit unreadable: %s", error)
            return None

    def set_last_session(self, session_id: str | None) -> None:
        """Remember the chat on screen, to show it again at the next start (a
        convenience: a disk that cannot take it now is logged, not raised)."""
        try:
            self._set_state(LAST_SESSION, session_id or "")
        except DiskFault as fault:
            log.warning("the chat on screen was not saved: %s", fault)

    def last_session(self) -> SessionRecord | None:
        """The chat that was on screen last, if it still exists."""
        session_id = self._state(LAST_SESSION)
        return self.session(session_id) if session_id else None

    def _set_state(self, name: str, value: str) -> None:
        if value:
            self._write("INSERT OR REPLACE INTO app_state (name, value) VALUES (?, ?)",
                        (name, value))
        else:
            self._write("DELETE FROM app_state WHERE name = ?", (name,))

    def _state(self, name: str) -> str | None:
        row = self._db.execute("SELECT value FROM app_state WHERE name = ?",
                               (name,)).fetchone()
        return str(row[0]) if row else None

    # Quality receipts -----------------------------------------------------

    def save_receipt(self, session_id: str, receipt: QualityReceipt, system_prompt: str) -> None:
        """Keep a chat's quality receipt, with a digest of the text it measured (the
        chat's now under ``system_prompt``: a check runs as its chat's job, nothing is
        sent meanwhile); it replaces the one of the same mode."""
        kept = {**dataclasses.asdict(receipt),
                MEASURED_TEXT: self._read_digest(session_id, system_prompt)}
        self._write("INSERT OR REPLACE INTO quality_receipts (session_id, mode, receipt, updated) "
                    "VALUES (?, ?, ?, ?)",
                    (session_id, receipt.mode, json.dumps(kept), time.time()))
        self._write("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))

    def outdated_receipts(self, session_id: str, system_prompt: str) -> set[str]:
        """The modes whose receipt measured other text than the engine reads for the
        chat now under ``system_prompt`` (a message sent, edited, regenerated or
        deleted since, or another system prompt)."""
        rows = self._db.execute(
            "SELECT mode, receipt FROM quality_receipts WHERE session_id = ?",
            (session_id,)).fetchall()
        if not rows:
            return set()  # nothing to compare: the chat's text is not read
        now = {MEASURED_TEXT: self._read_digest(session_id, system_prompt),
               MEASURED_ROWS: self._rows_digest(session_id)}
        outdated = set()
        for mode, text in rows:
            try:
                kept = json.loads(text)
                key = next((k for k in now if kept.get(k) is not None), None)
            except (ValueError, AttributeError):
                continue  # unreadable: ``receipts`` leaves it out
            if key is not None and kept[key] != now[key]:  # the oldest receipts carry none
                outdated.add(mode)
        return outdated

    def _read_digest(self, session_id: str, system_prompt: str) -> str:
        """sha256 of a chat as the engine reads it: the system prompt, then each turn
        ``read_by_engine`` keeps with its role, text and attached files' hashes."""
        digest = hashlib.sha256(json.dumps(["system", system_prompt]).encode())
        for role, content, status, files in self._digest_rows(session_id):
            if read_by_engine(role, content, status):
                digest.update(json.dumps([role, content, files]).encode())
        return digest.hexdigest()

    def _rows_digest(self, session_id: str) -> str:
        """sha256 of every stored message (what receipts stored before kept)."""
        digest = hashlib.sha256()
        for role, content, _status, files in self._digest_rows(session_id):
            digest.update(json.dumps([role, content, files]).encode())
        return digest.hexdigest()

    def _digest_rows(self, session_id: str) -> Iterator[tuple[str, str, str, list[str]]]:
        """A chat's messages in order: role, text, status and attached files' hashes
        (their text is in the attachment rows)."""
        files: dict[int, list[str]] = {}
        for message_id, sha in self._db.execute(
            "SELECT a.message_id, a.sha256 FROM attachments a JOIN messages m "
            "ON m.id = a.message_id WHERE m.session_id = ? ORDER BY a.id", (session_id,)):
            files.setdefault(message_id, []).append(sha)
        for message_id, role, content, status in self._db.execute(
            "SELECT id, role, content, status FROM messages WHERE session_id = ? ORDER BY id",
                (session_id,)).fetchall():
            yield role, content, status, files.get(message_id, [])

    def receipts(self, session_id: str) -> dict[str, QualityReceipt]:
        """A chat's quality receipts by mode (none for a history older than receipts)."""
        found: dict[str, QualityReceipt] = {}
        for mode, text in self._db.execute(
            "SELECT mode, receipt FROM quality_receipts WHERE session_id = ?", (session_id,)
        ):
            receipt = _receipt(text)
            if receipt is not None:
                found[mode] = receipt
        return found

    def copy_receipts(self, source_id: str, target_id: str) -> None:
        """Give a copy of a chat (reopened in another mode) the receipts of its text."""
        self._write(
            "INSERT OR REPLACE INTO quality_receipts (session_id, mode, receipt, updated) "
            "SELECT ?, mode, receipt, updated "
            "FROM quality_receipts WHERE session_id = ?", (target_id, source_id))

    # Messages -------------------------------------------------------------

    def add_message(
        self,
        session_id: str,
        role: str,
        content: str,
        status: str = "complete",
        attachments: tuple[AttachmentRecord, ...] = (),
    ) -> int:
        """Save a message (and its attachments) at once; returns its id."""
        _check_status(status)
        now = time.time()
        with self.writing():
            cursor = self._put(
                "INSERT INTO messages (session_id, role, content, status, created, updated) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, role, content, status, now, now),
            )
            message_id = int(cursor.lastrowid or 0)
            for item in attachments:
                self._put(
                    "INSERT INTO attachments (message_id, name, size, sha256, tokens, text) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (message_id, item.name, item.size, item.sha256, item.tokens, item.text),
                )
            self._touch(session_id)
        return message_id

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        status: str | None = None,
        reason: str | None = None,
        stats: dict | None = None,
    ) -> None:
        """Change a message's text and/or how it ended."""
        sets: list[str] = ["updated = ?"]
        args: list[object] = [time.time()]
        if content is not None:
            sets.append("content = ?")
            args.append(content)
        if status is not None:
            _check_status(status)
            sets.append("status = ?")
            args.append(status)
        if reason is not None:
            sets.append("reason = ?")
            args.append(reason)
        if stats is not None:
            sets.append("stats = ?")
            args.append(json.dumps(stats))
        self._write(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))
        if status is not None and status != "streaming":
            # An answer that ended is the chat's latest activity, as a question is.
            self._write("UPDATE sessions SET updated = ? WHERE id = "
                        "(SELECT session_id FROM messages WHERE id = ?)",
                        (time.time(), message_id))

    def messages(self, session_id: str) -> list[MessageRecord]:
        """A session's messages in order, with their attachments."""
        rows = self._db.execute(
            "SELECT id, session_id, role, content, status, reason, stats FROM messages "
            "WHERE session_id = ? ORDER BY id",
            (session_id,),
        ).fetchall()
        files: dict[int, list[AttachmentRecord]] = {}
        for row in self._db.execute(
            "SELECT a.message_id, a.name, a.size, a.sha256, a.tokens, a.text FROM attachments a "
            "JOIN messages m ON m.id = a.message_id WHERE m.session_id = ? ORDER BY a.id",
            (session_id,),
        ):
            files.setdefault(row[0], []).append(AttachmentRecord(*row[1:]))
        return [
            MessageRecord(
                mid, sid, role, content, status, reason,
                json.loads(stats) if stats else None, tuple(files.get(mid, ())),
            )
            for mid, sid, role, content, status, reason, stats in rows
        ]

    def delete_messages(self, message_ids: Sequence[int]) -> None:
        """Delete the messages ``message_ids`` (a turn replaced by its new answer)."""
        with self.writing():
            for message_id in message_ids:
                self._write("DELETE FROM messages WHERE id = ?", (message_id,))

    def mark_interrupted(self) -> int:
        """Mark answers left streaming by a crash as interrupted; returns how many."""
        cursor = self._write(
            "UPDATE messages SET status = 'interrupted', "
            "reason = 'Longleaf quit before this answer finished' WHERE status = 'streaming'"
        )
        return cursor.rowcount

    def integrity_check(self) -> str:
        """SQLite's own integrity check ("ok" when the file is sound)."""
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])


def _read_only(source: Path) -> sqlite3.Connection:
    """A read-only connection to ``source``, also in a folder that cannot be written.

    A WAL database opened read-only needs its -shm file, which SQLite cannot create
    in a read-only folder; ``immutable`` reads the file as it is instead (a
    cleanly closed history has nothing in a WAL file to miss).
    """
    uri = source.resolve().as_uri()
    db = sqlite3.connect(f"{uri}?mode=ro", uri=True)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.DatabaseError as error:
        db.close()
        if _code(error) in _CORRUPT_CODES:
            return sqlite3.connect(f"{uri}?mode=ro", uri=True)  # recovery reads around it
    return sqlite3.connect(f"{uri}?immutable=1", uri=True)


def _receipt(text: str) -> QualityReceipt | None:
    """A stored receipt; fields a newer version added are ignored, a broken one skipped."""
    try:
        values = json.loads(text)
        known = {f.name for f in dataclasses.fields(QualityReceipt)}
        return QualityReceipt(**{k: v for k, v in values.items() if k in known})
    except (TypeError, ValueError, AttributeError):
        log.warning("a stored quality receipt could not be read; it is left out")
        return None


def _storable(text: str) -> str:
    """``text`` as SQLite's UTF-8 can hold it: a lone surrogate (UTF-8 has no form for
    one; a file name's undecodable byte reads as one) is kept as U+FFFD, a pair as its
    character, so a save never fails on what it saves."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def read_by_engine(role: str, content: str, status: str) -> bool:
    """Whether a turn is part of the conversation the engine reads: failed turns
    (and user turns set aside as too long) and empty answers never are."""
    return status != "failed" and not (role == "assistant" and not content)


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"unknown message status {status!r}; expected one of {STATUSES}")
