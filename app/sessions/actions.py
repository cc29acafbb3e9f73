"""Chat sessions: create, show, rename, delete, reopen in another KV mode.

``SessionActions`` holds the session shown in the window (``current``) and
is the only code that changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeGuard

from PySide6.QtCore import QObject, Signal

from app.activity import Activity
from app.chat.model import ChatMessage, ChatModel
from app.format import reopened_title, short_title, title_from
from app.sessions.caches import SessionCaches
from app.settings import Settings
from app.store import HistoryStore, SessionRecord
from engine import KvMode, StatsSample

NEW_TITLE = "New chat"


class SessionActions(QObject):
    """Creates, shows, renames, deletes and reopens sessions.

    Args:
        store: the history; sessions and their messages are read from and written to it.
        model: the open conversation, refilled when another session is shown.
        caches: the sessions' KV caches, freed when a session is deleted.
        activity: the chats' jobs; deleting a chat and reopening it wait for its own
            job, reading other chats does not.
        before_switch: called before another session is shown.
    """

    sessionsChanged = Signal()
    currentSessionChanged = Signal(object)  # SessionRecord | None

    def __init__(self, store: HistoryStore, settings: Settings, model: ChatModel,
                 caches: SessionCaches, activity: Activity, before_switch: Callable[[], None],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.settings, self.model = store, settings, model
        self.caches, self.activity = caches, activity
        self._before_switch = before_switch
        self.current: SessionRecord | None = None

    def new_session(self, mode: KvMode | None = None, model_id: str = "",
                    keep_blank: bool = False) -> SessionRecord | None:
        """Start an empty chat in ``mode`` (default from settings) and show it.

        ``keep_blank``: an empty chat on screen (nothing typed in it either) is
        that chat already: it is kept, in ``mode``, so pressing New Chat again
        piles up no empty chats.
        """
        mode = mode or self.settings.default_mode
        if keep_blank and self._blank(self.current):
            return self._set_mode(self.current, mode)
        record = self.store.create_session(NEW_TITLE, mode,
                                           model_id or self.settings.last_model)
        self.sessionsChanged.emit()
        self.select_session(record.id)
        return record

    def _blank(self, record: SessionRecord | None) -> TypeGuard[SessionRecord]:
        """Whether ``record`` is an untitled chat with no message and no job."""
        return (record is not None and record.title == NEW_TITLE and not self.model.rowCount()
                and self.activity.job_of(record.id) is None
                and not self.store.messages(record.id))

    def _set_mode(self, record: SessionRecord, mode: KvMode) -> SessionRecord | None:
        if record.kv_mode == mode:
            return record
        self.store.set_mode(record.id, mode)
        self.caches.forget(record.id)  # nothing of it is held or stored in the old mode
        self.current = self.store.session(record.id)
        self.currentSessionChanged.emit(self.current)
        self.sessionsChanged.emit()
        return self.current

    def shown(self, session_id: str) -> bool:
        """Whether chat ``session_id`` is the one on screen."""
        return self.current is not None and self.current.id == session_id

    def about(self, session_id: str, message: str) -> str:
        """``message`` as the banner says it: naming its chat when another is shown
        (chats answer together; the banner is over the one on screen)."""
        record = self.store.session(session_id)
        if self.shown(session_id) or record is None:
            return message
        return f"In ‘{short_title(record.title)}’: {message}"

    def reload(self, session_id: str) -> None:
        """Show chat ``session_id``'s messages as the history holds them now, when it
        is the chat shown (its turns changed behind the model's back)."""
        if self.shown(session_id):
            self.model.set_messages([ChatMessage.from_record(m)
                                     for m in self.store.messages(session_id)])

    def select_session(self, session_id: str) -> None:
        """Show a stored session; its KV cache is rebuilt on the next send if dropped."""
        if self.current and self.current.id == session_id:
            return
        self._before_switch()
        self.current = self.store.session(session_id)
        self.reload(session_id)
        self.currentSessionChanged.emit(self.current)

    def rename_session(self, session_id: str, title: str) -> None:
        """Rename a session: one line (a pasted name's line breaks become spaces),
        as long as a title made from a first message at most; a blank name is no
        new name."""
        title = title_from(" ".join(title.split()))
        if title:
            self.store.rename_session(session_id, title)
            if self.current and self.current.id == session_id:
                self.current = self.store.session(session_id)
                self.currentSessionChanged.emit(self.current)
            self.sessionsChanged.emit()

    def delete_session(self, session_id: str, listed: Sequence[str] | None = None) -> None:
        """Delete a session and free its cache.

        Args:
            session_id: the chat to delete.
            listed: the chats the list shows, top to bottom (a search may show
                some only); None: every chat, newest first. Deleting the chat on
                screen shows the one listed after it, else the one before (as a
                Mac list does), else none.
        """
        shown = self.current is not None and self.current.id == session_id
        if self.activity.refuse_in(session_id, "deleting its chat", named=not shown):
            return
        order = list(listed) if listed is not None else [s.id for s in self.store.sessions()]
        self.store.delete_session(session_id)  # first: a history that takes no write keeps all
        self.caches.forget(session_id)
        if self.current and self.current.id == session_id:
            self._before_switch()  # an edit of it goes with it, also with no chat after
            self.current = None
            self.model.set_messages([])
            after = _neighbour(order, session_id)
            if after is not None and self.store.session(after) is not None:
                self.select_session(after)
            else:
                self.currentSessionChanged.emit(None)
        self.sessionsChanged.emit()

    def reopen_in(self, mode: KvMode, model_id: str) -> SessionRecord | None:
        """Copy the shown conversation into a new session in ``mode`` and show it.

        The caller re-ingests it (``Answers.start_ingest``).
        """
        if self.current is None or self.current.kv_mode == mode:
            return None  # the chat is in that mode already
        if self.activity.refuse_in(self.current.id, "reopening the chat"):
            return None
        source = self.current
        with self.store.writing():  # the whole copy, or no half-copied chat
            record = self.store.create_session(reopened_title(source.title, mode), mode,
                                               model_id)
            for message in self.store.messages(source.id):
                if message.status in ("complete", "stopped", "interrupted") and (
                    message.content or message.attachments
                ):
                    # An answer cut short stays marked so, with why, in its copy.
                    copied = self.store.add_message(record.id, message.role, message.content,
                                                    message.status, message.attachments)
                    if message.reason or message.stats:  # how the answer was made stays too
                        self.store.update_message(copied, reason=message.reason,
                                                  stats=message.stats)
            # Receipts measured the same text: the copy's per-mode table keeps them.
            self.store.copy_receipts(source.id, record.id)
        self.sessionsChanged.emit()
        self.select_session(record.id)
        return record

    def record_tokens(self, session_id: str | None, sample: StatsSample | None,
                      whole: int | None = None) -> None:
        """Save how many tokens ``session_id`` has, from the engine's latest sample of it.

        ``whole``: the conversation's tokens when its read stopped short, which
        the history keeps rather than the part read.
        """
        if session_id is None or sample is None or sample.session_id != session_id:
            return
        self.store.set_tokens(session_id, max(sample.tokens_in_context, whole or 0))
        if self.current and self.current.id == session_id:
            self.current = self.store.session(session_id)
        self.sessionsChanged.emit()


def _neighbour(order: list[str], session_id: str) -> str | None:
    """The chat listed after ``session_id`` in ``order``, else the one before it."""
    if session_id not in order:
        return order[0] if order else None
    at = order.index(session_id)
    if at + 1 < len(order):
        return order[at + 1]
    return order[at - 1] if at > 0 else None
