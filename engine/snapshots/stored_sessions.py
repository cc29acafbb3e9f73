"""What the worker does with snapshots: store a cache that leaves memory, restore it on return.

HeldSessions are the sessions in memory; these are the ones stored on disk.

Every call runs on the engine worker thread, between requests: a save never
races a send because the worker runs one command at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from engine import disk
from engine.cache.modes import FP16, KvMode
from engine.errors import EngineError
from engine.events import Event, Notice, StoredKv
from engine.format import human_bytes
from engine.snapshots.fingerprint import session_fingerprint
from engine.snapshots.snapshot import SnapshotRejected
from engine.snapshots.snapshot_store import SnapshotStore

if TYPE_CHECKING:
    from engine.session.session import Session

log = logging.getLogger(__name__)

# Other chats' snapshots offered to a new chat, the most shared first: one it
# cannot use is refused from its manifest before any page is read.
MAX_OFFERS = 4


class StoredSessions:
    """Saves sessions as they close and reopens them from the longest stored prefix.

    Args:
        snapshots: the snapshot folder and its disk budget; None stores nothing on disk.
        emit: where notices go (a refused snapshot says why in one line).
        mirror: called with the names on disk after every change, so a pipeline's
            other ranks drop their parts of any snapshot rank 0 no longer has.
    """

    def __init__(self, snapshots: SnapshotStore | None, emit: Callable[[Event], None],
                 mirror: Callable[[list[str]], None] | None = None,
                 loaded_digest: Callable[[], str] = lambda: "") -> None:
        self.snapshots = snapshots
        self._emit = emit
        self._mirror = mirror
        self._loaded_digest = loaded_digest  # the loaded weights' fingerprint ("": none)
        self._told: set[str] = set()  # why saves failed, each said once per run

    def store(self, session: Session, spare: Collection[str] = ()) -> bool:
        """Store the session's cache under its id (nothing held: nothing stored);
        whether it is on disk now.

        Args:
            session: the session to store.
            spare: the open chats whose snapshot is the only copy of their KV (their
                pages are gone): evicted under the disk budget only when nothing else
                is left to go, and then the user is told they are read again.
        """
        if self.snapshots is None or not session.tokens:
            return False
        followers = getattr(session, "followers", None)
        if followers is not None and not followers.save(session.session_id):
            # A pipeline's KV is whole only with every rank's layers: all or none.
            log.warning("KV snapshot of %s not saved: another rank could not store its "
                        "layers", session.session_id)
            return False
        stored = False
        try:
            saved = self.snapshots.save(session, session.session_id, spare=spare)
            stored = True
            self._tell_lost([name for name in saved.evicted if name in spare])
        except EngineError as error:
            # Losing a snapshot costs a re-read later, never the conversation.
            log.warning("KV snapshot of %s not saved: %s", session.session_id, error)
            self._tell_not_stored(str(error))
        except OSError as error:  # making room (evicting) on a disk that takes no write
            log.warning("KV snapshot of %s not saved: %s", session.session_id, error)
            fault = disk.fault_of(error)
            detail = str(fault) if fault is not None else f"({error.strerror or error})."
            self._tell_not_stored(f"This conversation's KV was not stored. {detail}")
        except Exception as error:  # nor may it stop a session from closing
            log.exception("KV snapshot of %s failed", session.session_id)
            self._tell_not_stored(f"This conversation's KV was not stored ({error}).")
        self.announce()
        return stored

    def _tell_lost(self, names: list[str]) -> None:
        """Say that open chats' stored KV went to make room under the disk budget."""
        if not names or self.snapshots is None:
            return
        log.info("stored KV of open chats %s evicted under the disk budget", names)
        chats, they = (("another open chat", "it is") if len(names) == 1
                       else (f"{len(names)} other open chats", "they are"))
        self._emit(Notice(0, (
            f"The stored KV of {chats} was removed to stay within the stored-KV disk "
            f"budget ({human_bytes(self.snapshots.budget_bytes)}); {they} read again when "
            "next used. A larger stored-KV budget keeps more.")))

    def _tell_not_stored(self, why: str) -> None:
        """Say once per run, per reason, that a chat will be read again next time."""
        if why in self._told:
            return
        self._told.add(why)
        self._emit(Notice(0, f"{why} Reopened later, the conversation is read again "
                             "(this is said once)."))

    def set_budget(self, budget_bytes: int | None) -> None:
        """Apply a disk budget (None: the default), evicting down to it, then announce."""
        if self.snapshots is not None:
            self.snapshots.set_budget(budget_bytes)
        self.announce()

    def clear(self, name: str | None = None) -> None:
        """Delete snapshot ``name`` (None: every snapshot), then announce."""
        if self.snapshots is not None:
            if name is None:
                self.snapshots.clear()
            else:
                self.snapshots.delete(name)
        self.announce()

    def announce(self) -> None:
        """Emit a ``StoredKv`` listing of what is on disk now."""
        if self.snapshots is None:
            self._emit(StoredKv(0, 0))
            return
        try:
            total = self.snapshots.total_bytes()
            listing = StoredKv(self.snapshots.budget_bytes, total,
                               tuple(self.snapshots.per_snapshot()),
                               self.snapshots.counted_bytes() - total, self._loaded_digest())
        except OSError as error:  # the folder went away: say nothing rather than fail a close
            log.warning("cannot list stored KV: %s", error)
            return
        self._emit(listing)
        if self._mirror is not None:
            self._mirror([info.name for info in listing.snapshots])

    def restore(
        self, session: Session, prompt: Sequence[int], request_id: int, *, keep_last: bool,
        allow: Callable[[str], bool] | None = None,
    ) -> int:
        """Fill an empty session from the stored chat of its model that starts with
        the most of ``prompt``: its own snapshot, or another chat's (one document
        stored once serves every chat about it; only those ``allow`` accepts by name,
        when given); returns the tokens reused."""
        store = self.snapshots
        if store is None or session.tokens:
            return 0
        own = session.session_id
        offers = self._others(store, session, prompt, allow)
        own_shares = offers.pop(own, 0)
        # Another chat sharing more goes before the chat's own snapshot (its own
        # conversation may have changed near the start); the rest stand behind it.
        ahead = [name for name, shared in offers.items() if shared > own_shares]
        behind = [name for name in offers if name not in ahead]
        reused = self._from_another(store, session, prompt, ahead, request_id, keep_last)
        if not reused:
            reused = self._own(store, session, prompt, request_id, keep_last)
        if not reused:
            tried = min(len(ahead), MAX_OFFERS)
            reused = self._from_another(store, session, prompt, behind[:MAX_OFFERS - tried],
                                        request_id, keep_last)
        if reused:
            self.announce()  # its "last used" moved
        return reused

    def _own(self, store: SnapshotStore, session: Session, prompt: Sequence[int],
             request_id: int, keep_last: bool) -> int:
        """The session's own snapshot loaded into it: the tokens it holds of ``prompt``;
        one that cannot be used says why."""
        try:
            return self._load(store, session, session.session_id, prompt, keep_last)
        except SnapshotRejected as rejected:
            self._emit(Notice(request_id, str(rejected)))
            if rejected.removed or rejected.set_aside:
                self.announce()
        except OSError as error:  # the disk fails a read: a cache miss, never a failed send
            session.reset()
            self._emit(Notice(request_id, f"Stored KV for this chat could not be read "
                                          f"({error.strerror or error}); the conversation "
                                          "is read again."))
        return 0

    def kept_rotation(self, name: str, mode: KvMode, rotate: bool | None) -> bool | None:
        """Whether chat ``name``, reopened in ``mode``, rotates its rows: as its stored
        pages do when they are in that mode, else ``rotate``.

        The rotation setting is for new chats: an existing chat reopened in another
        rotation would have its pages decoded and quantized again at the same width,
        a second rounding on the first, compounding at every change of the setting.
        """
        info = self.snapshots.info(name) if self.snapshots is not None else None
        if info is None or info.mode != mode or mode == FP16:
            return rotate
        return info.rotation is not None

    def _load(self, store: SnapshotStore, session: Session, name: str, prompt: Sequence[int],
              keep_last: bool) -> int:
        """Snapshot ``name`` into ``session``; on a pipeline, into every rank's layers."""
        reused = store.load(session, name, prompt, keep_last=keep_last)
        followers = getattr(session, "followers", None)
        if reused and followers is not None and not followers.restore(
                name, session.tokens[:reused]):
            session.reset()
            raise SnapshotRejected(
                f"Stored KV for {name!r} is incomplete on another machine of the pipeline; "
                "the conversation is read again.", reason="pipeline")
        return reused

    def _offered(self, store: SnapshotStore, session: Session, name: str,
                 prompt: Sequence[int], keep_last: bool) -> int:
        """Another chat's snapshot ``name`` loaded into ``session``: the tokens it
        holds of ``prompt`` (0: it cannot serve this chat; the session is empty)."""
        try:
            return self._load(store, session, name, prompt, keep_last)
        except SnapshotRejected as rejected:
            # Another chat's snapshot this one cannot use (a higher mode, layers that
            # cannot rewind there): nothing to tell, the prompt is read as usual.
            log.info("snapshot %s not reused for %s: %s", name, session.session_id, rejected)
            if rejected.removed or rejected.set_aside:
                self.announce()
        except OSError as error:  # its disk fails a read: the prompt is read as usual
            session.reset()
            log.warning("snapshot %s not reused for %s: %s", name, session.session_id, error)
        return 0

    def _others(self, store: SnapshotStore, session: Session, prompt: Sequence[int],
                allow: Callable[[str], bool] | None) -> dict[str, int]:
        """The stored chats of this session's model sharing at least a page of
        ``prompt`` (its own among them; others only where ``allow`` says so), each
        with the tokens it shares, the most first."""
        try:
            digest = session_fingerprint(session)["digest"]
        except EngineError:
            return {}
        own = session.session_id
        found = store.by_shared_prefix(
            prompt, model_digest=digest, at_least=session.page_size,
            allow=lambda name: name == own or allow is None or allow(name))
        return dict(found)

    def _from_another(
        self, store: SnapshotStore, session: Session, prompt: Sequence[int],
        names: Sequence[str], request_id: int, keep_last: bool,
    ) -> int:
        """The first of other chats' snapshots ``names`` this session can use, loaded
        into it (at most ``MAX_OFFERS`` tried): the tokens it holds of ``prompt``."""
        # One this chat cannot use (stored in a lower mode, layers that cannot rewind
        # to where the prompts part) gives way to the next.
        reused = 0
        for name in names[:MAX_OFFERS]:
            reused = self._offered(store, session, name, prompt, keep_last)
            if reused:
                break
        if reused:
            self._emit(Notice(request_id, f"Reused {reused:,} tokens stored for another chat; "
                                          "reading only the rest."))
        return reused
