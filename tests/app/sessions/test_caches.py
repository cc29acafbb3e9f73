"""SessionCaches on its own, with a stand-in bridge: which KV caches are held."""

from __future__ import annotations

from types import SimpleNamespace

from app.sessions.caches import MAX_OPEN_SESSIONS, KvTotal, SessionCaches
from engine import Failed, SessionOpened


class FakeBridge:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.last_request = 0
        self.handlers: dict[int, object] = {}

    def open_session(self, session_id: str, mode: str, page_size: int,
                     rotate: bool | None, handler) -> int:
        self.calls.append(("open", session_id))
        self.last_request += 1
        self.handlers[self.last_request] = handler
        return self.last_request

    def deliver(self, event) -> None:
        self.handlers[event.request_id](event)

    def close_session(self, session_id: str, store: bool = True) -> None:
        self.calls.append(("close" if store else "close unsaved", session_id))

    def clear_stored_kv(self, session_id: str | None = None) -> int:
        self.calls.append(("clear stored", session_id or ""))
        return 0


def _session(name: str) -> SimpleNamespace:
    return SimpleNamespace(id=name, kv_mode="q8")


def _open(caches: SessionCaches, bridge: FakeBridge, name: str, ran: list[str]) -> None:
    caches.ensure_open(_session(name), lambda: ran.append(name), _never)
    bridge.deliver(SessionOpened(bridge.last_request, name, "q8", 256))


def _never(event) -> None:
    raise AssertionError(f"the open failed: {event}")


def test_the_least_recently_used_cache_is_closed_first(qtbot) -> None:
    bridge = FakeBridge()
    caches = SessionCaches(bridge, SimpleNamespace(page_size=256, rotate_kv=None))
    ran: list[str] = []
    names = [f"s{i}" for i in range(MAX_OPEN_SESSIONS)]
    for name in names:
        _open(caches, bridge, name, ran)
    assert ran == names and list(caches.opened) == names
    caches.ensure_open(_session("s0"), lambda: ran.append("s0 again"), _never)  # held: now
    assert ran[-1] == "s0 again" and bridge.calls[-1] == ("open", names[-1])
    with qtbot.waitSignal(caches.changed):
        _open(caches, bridge, "new", ran)
    assert ("close", "s1") in bridge.calls and "s1" not in caches.opened
    assert list(caches.opened) == [*names[2:], "s0", "new"]


def test_a_failed_open_drops_what_waited_and_bytes_count_held_caches_only(qtbot) -> None:
    bridge = FakeBridge()
    caches = SessionCaches(bridge, SimpleNamespace(page_size=256, rotate_kv=None))
    ran: list[str] = []
    failed: list[Failed] = []
    caches.ensure_open(_session("a"), lambda: ran.append("a"), failed.append)
    refusal = Failed(bridge.last_request, "No memory for it.", "OutOfMemory")
    bridge.deliver(refusal)
    assert failed == [refusal] and ran == [] and caches.opened == {}
    _open(caches, bridge, "b", ran)
    caches.note(SimpleNamespace(session_id="b", kv_bytes_used=1000))
    caches.note(SimpleNamespace(session_id="a", kv_bytes_used=5))  # not held
    assert caches.total() == KvTotal(1000, 1000)
    caches.close_all()
    assert caches.opened == {} and caches.total() == KvTotal(0, 0)
    assert ("close", "b") in bridge.calls


def test_pages_two_chats_share_count_once_in_the_total(qtbot) -> None:
    bridge = FakeBridge()
    caches = SessionCaches(bridge, SimpleNamespace(page_size=256, rotate_kv=None))
    ran: list[str] = []
    for name in ("a", "b"):
        _open(caches, bridge, name, ran)
    # 800 bytes of pages both hold, 200 of each one's own; their storage holds 400
    # bytes of room ahead besides, 200 counted in each one's share.
    for name in ("a", "b"):
        caches.note(SimpleNamespace(session_id=name, kv_bytes_used=1000, kv_bytes_once=600,
                                    kv_bytes_held_once=800))
    assert caches.total() == KvTotal(1200, 1600)


def test_a_cache_note_is_said_when_the_cache_opens(qtbot) -> None:
    bridge = FakeBridge()
    caches = SessionCaches(bridge, SimpleNamespace(page_size=256, rotate_kv=None))
    said: list[str] = []
    caches.notice.connect(said.append)
    caches.ensure_open(_session("x"), lambda: None, _never)
    bridge.deliver(SessionOpened(bridge.last_request, "x", "q6", 256, "mlx-lm",
                                 "mlx-lm's own KV cache is in use (KV-shared layers)."))
    assert said == ["mlx-lm's own KV cache is in use (KV-shared layers)."]


def test_a_deleted_chat_is_freed_unsaved_and_its_stored_kv_cleared(qtbot) -> None:
    bridge = FakeBridge()
    caches = SessionCaches(bridge, SimpleNamespace(page_size=256, rotate_kv=None))
    _open(caches, bridge, "a", [])
    caches.forget("a")
    caches.forget("never opened")  # may still have KV on disk from an earlier run
    assert bridge.calls[1:] == [("close unsaved", "a"), ("clear stored", "a"),
                                ("clear stored", "never opened")]
    assert "a" not in caches.opened
