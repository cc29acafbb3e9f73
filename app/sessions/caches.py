"""Which chat sessions' KV caches the engine holds, and their size.

At most ``MAX_OPEN_SESSIONS`` are held, the least recently used closed first;
a closed one is rebuilt from the history when its chat is next used. A chat
whose job runs is never closed to make room (closing it would cancel its
answer): while every held chat runs one, one more is held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal

from app.engine_bridge import EngineBridge
from app.settings import Settings
from app.store import SessionRecord
from engine import API_SESSION_PREFIX, Event, Failed, SessionOpened, StatsSample

MAX_OPEN_SESSIONS = 3


@dataclass(frozen=True)
class KvTotal:
    """The KV pages of every held chat together, each page shared by chats once.

    Attributes:
        used: bytes of the pages in use.
        held: bytes their storage takes in memory, the room allocated ahead for
            the next tokens included (what the memory limit counts).
    """

    used: int
    held: int


class SessionCaches(QObject):
    """Opens sessions' KV caches in the engine and closes them.

    ``opened`` maps each held session id to its KV mode, oldest use first;
    ``samples`` holds each held session's latest stats sample, so what is shown
    of a session always comes from one snapshot of that session.
    """

    changed = Signal()  # a session's KV cache was opened, or closed (any way)
    notice = Signal(str)  # the model runs on mlx-lm's own cache, and why

    def __init__(self, bridge: EngineBridge, settings: Settings,
                 parent: QObject | None = None, *,
                 in_use: Callable[[str], bool] = lambda _session_id: False) -> None:
        super().__init__(parent)
        self.bridge, self.settings = bridge, settings
        self.in_use = in_use  # whether a session's job runs now: its cache stays
        self.opened: dict[str, str] = {}  # session id -> mode, oldest first
        self.samples: dict[str, StatsSample] = {}
        self.rotations: dict[str, str | None] = {}  # session id -> its rows' rotation
        # Session id -> the conversation's tokens, while its cache holds only the
        # part a stopped read kept: the next message reads the rest first.
        self.partial: dict[str, int] = {}

    def ensure_open(self, session: SessionRecord, then: Callable[[], None],
                    failed: Callable[[Failed], None]) -> None:
        """Run ``then`` once ``session``'s cache is held (now, when it already is).

        When the engine cannot open it, ``failed`` gets the ``Failed`` instead.
        """
        if session.id in self.opened:
            self.opened[session.id] = self.opened.pop(session.id)  # most recent last
            then()
            return
        idle = [session_id for session_id in self.opened if not self.in_use(session_id)]
        for oldest in idle[:max(0, len(self.opened) - MAX_OPEN_SESSIONS + 1)]:
            self.bridge.close_session(oldest)
            del self.opened[oldest]
            self._drop(oldest)

        def handle(event: Event) -> None:
            if isinstance(event, SessionOpened):
                self._opened(event)
                then()
            elif isinstance(event, Failed):
                failed(event)

        self.bridge.open_session(session.id, session.kv_mode, self.settings.page_size,
                                 self.settings.rotate_kv, handle)

    def _opened(self, event: SessionOpened) -> None:
        self.opened[event.session_id] = event.kv_mode
        self.rotations[event.session_id] = event.rotation
        self.changed.emit()
        if event.cache_note:  # the model runs on mlx-lm's own cache: say why
            self.notice.emit(event.cache_note)

    def close(self, session_id: str) -> None:
        """Free a session's cache, if the engine holds it."""
        if session_id in self.opened:
            self.bridge.close_session(session_id)
            del self.opened[session_id]
            self.changed.emit()  # the chat is on disk now, not in memory
        self._drop(session_id)

    def forget(self, session_id: str) -> None:
        """Free a deleted session's cache without storing it, and delete its stored KV."""
        closed = session_id in self.opened
        if closed:
            self.bridge.close_session(session_id, store=False)
            del self.opened[session_id]
        self._drop(session_id)
        self.bridge.clear_stored_kv(session_id)
        if closed:
            self.changed.emit()  # its bytes leave every total shown

    def close_all(self) -> None:
        """Free every cache (a new model is loading)."""
        held = bool(self.opened)
        for session_id in list(self.opened):
            self.bridge.close_session(session_id)
        self.opened.clear()
        self.samples.clear()
        self.partial.clear()
        if held:
            self.changed.emit()

    def _drop(self, session_id: str) -> None:
        self.samples.pop(session_id, None)
        self.partial.pop(session_id, None)

    def read_ended(self, session_id: str, whole: int | None) -> None:
        """A read of ``session_id`` ended: stopped short of its ``whole`` tokens, or
        (None) with the whole conversation held."""
        if whole is None:
            self.partial.pop(session_id, None)
        else:
            self.partial[session_id] = whole

    def whole_of(self, session_id: str | None) -> int | None:
        """The conversation's tokens while its held cache keeps only part of them."""
        return self.partial.get(session_id) if session_id in self.opened else None

    def note(self, sample: StatsSample) -> None:
        """Keep a stats sample as its session's latest (the local server's are not chats')."""
        if sample.session_id and not sample.session_id.startswith(API_SESSION_PREFIX):
            self.samples[sample.session_id] = sample

    def sample_for(self, session_id: str | None) -> StatsSample | None:
        """The latest sample of ``session_id`` while its cache is held, else None."""
        if session_id is None or session_id not in self.opened:
            return None
        return self.samples.get(session_id)

    def total(self) -> KvTotal:
        """The KV pages of every held session, from their latest samples."""
        # Pages shared between chats count once: each chat reports its part of them.
        held = [sample for sid, sample in self.samples.items() if sid in self.opened]
        return KvTotal(sum(_once(sample) for sample in held),
                       sum(_held_once(sample) for sample in held))


def _once(sample: StatsSample) -> int:
    once = getattr(sample, "kv_bytes_once", None)
    return sample.kv_bytes_used if once is None else once


def _held_once(sample: StatsSample) -> int:
    return max(_once(sample), getattr(sample, "kv_bytes_held_once", 0))
