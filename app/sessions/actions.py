"""The chat sessions side of ``ChatController``: create, show, rename, delete, reopen.

Also which sessions' KV caches the engine holds: at most ``MAX_OPEN_SESSIONS``,
the least recently used closed first, and what to run once one has opened.
"""

from __future__ import annotations

from collections.abc import Callable

from app.chat.model import ChatMessage
from app.store import SessionRecord
from engine import SessionOpened

MAX_OPEN_SESSIONS = 3
NEW_TITLE = "New chat"


class SessionActions:
    """Session management, mixed into ``ChatController``.

    The controller's ``__init__`` owns the state used here (``store``,
    ``bridge``, ``current``, ``opened``, ``session_bytes``, ...) and its signals.
    """

    def new_session(self, mode: str | None = None) -> SessionRecord | None:
        """Start an empty chat in ``mode`` (default from settings)."""
        if self._refuse_if_busy("starting a new chat"):
            return None
        record = self.store.create_session(NEW_TITLE, mode or self.settings.default_mode,
                                           self.model_id or self.settings.last_model)
        self.sessionsChanged.emit()
        self.select_session(record.id)
        return record

    def select_session(self, session_id: str) -> None:
        """Show a stored session; its KV cache is rebuilt on the next send if dropped."""
        if self.current and self.current.id == session_id:
            return
        if self._refuse_if_busy("switching chats"):
            return
        self._editing = None
        self.current = self.store.session(session_id)
        rows = [ChatMessage.from_record(m) for m in self.store.messages(session_id)]
        self.model.set_messages(rows)
        self.currentSessionChanged.emit(self.current)

    def rename_session(self, session_id: str, title: str) -> None:
        """Rename a session."""
        if title.strip():
            self.store.rename_session(session_id, title)
            if self.current and self.current.id == session_id:
                self.current = self.store.session(session_id)
                self.currentSessionChanged.emit(self.current)
            self.sessionsChanged.emit()

    def delete_session(self, session_id: str) -> None:
        """Delete a session and free its cache."""
        if self.current and self.current.id == session_id and self._refuse_if_busy("deleting it"):
            return
        if session_id in self.opened:
            self.bridge.close_session(session_id)
            del self.opened[session_id]
        self.store.delete_session(session_id)
        if self.current and self.current.id == session_id:
            self.current = None
            self.model.set_messages([])
            remaining = self.store.sessions()
            if remaining:
                self.select_session(remaining[0].id)
            else:
                self.currentSessionChanged.emit(None)
        self.sessionsChanged.emit()

    def cache_state(self, session_id: str | None) -> str:
        """Whether a session's KV cache is held now or rebuilt when it is next used."""
        if session_id is None:
            return ""
        return "kept in memory" if session_id in self.opened else "rebuilt on next send"

    def _ensure_open(self, session: SessionRecord, then: Callable[[], None]) -> None:
        if session.id in self.opened:
            self.opened[session.id] = self.opened.pop(session.id)  # most recent last
            then()
            return
        while len(self.opened) >= MAX_OPEN_SESSIONS:
            oldest = next(iter(self.opened))
            self.bridge.close_session(oldest)
            del self.opened[oldest]
        rid = self.bridge.open_session(session.id, session.kv_mode, self.settings.page_size)
        self._kinds[rid] = "open"
        self._after_open[rid] = then

    def _on_session_opened(self, event: SessionOpened) -> None:
        if self.closed:
            return
        self.opened[event.session_id] = event.kv_mode
        self.cacheChanged.emit()
        then = self._after_open.pop(event.request_id, None)
        if then is not None:
            then()

    def reopen_in(self, mode: str) -> SessionRecord | None:
        """Copy the conversation into a new session in ``mode`` and re-ingest it."""
        if self.current is None or self._refuse_if_busy("reopening the chat"):
            return None
        source = self.current
        record = self.store.create_session(f"{source.title} · {mode}", mode, self.model_id)
        for message in self.store.messages(source.id):
            if message.status in ("complete", "stopped", "interrupted") and (
                message.content or message.attachments
            ):
                self.store.add_message(record.id, message.role, message.content,
                                       "complete", message.attachments)
        self.sessionsChanged.emit()
        self.select_session(record.id)
        if self.model_ready and self.model.rowCount():
            self._set_active(-1, "ingest")  # reserved until the real id is known
            self._ensure_open(record, self._start_reingest)
        return record

    def _start_reingest(self) -> None:
        if self.current is None:
            return
        messages = self.model.engine_messages(self.settings.system_prompt)
        rid = self.bridge.ingest(self.current.id, messages)
        self._kinds[rid] = "ingest"
        self._set_active(rid, "ingest")

    def total_kv_bytes(self) -> int:
        """KV bytes held by every open session, from their latest samples."""
        return sum(self.session_bytes.get(sid, 0) for sid in self.opened)
