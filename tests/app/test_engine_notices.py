"""Engine notices (a stored KV cache not used, a model on mlx-lm's own cache) reach the banner."""

from __future__ import annotations

from pathlib import Path

from engine import Finished, Notice, SessionOpened
from tests.app.conftest import close_window, open_window


def test_a_snapshot_notice_and_a_cache_note_show_in_the_banner(qtbot, tiny_llama: Path,
                                                              monkeypatch) -> None:
    window = open_window(qtbot, tiny_llama)
    try:
        bridge = window.controller.bridge
        bridge._dispatch(Notice(7, "The stored KV cache of this chat is from another model; "
                                   "reading it again."))
        assert window.banner.isVisible()
        assert "another model" in window.banner.label.text()
        # The note comes with the opening of a chat's cache, to that open's own handler:
        # the engine's answer is played here, to the request the app registered.
        monkeypatch.setattr(bridge._worker, "open_session", lambda *_args: 999)
        record = window.controller.new_session("q6")
        window.controller.caches.ensure_open(record, lambda: None, lambda _event: None)
        bridge._dispatch(SessionOpened(999, record.id, "q6", 256, "mlx-lm",
                                       "mlx-lm's own KV cache is in use (KV-shared layers)."))
        assert "KV-shared layers" in window.banner.label.text()
        bridge._dispatch(Finished(999, "done"))
        assert 999 not in bridge._handlers  # the ending unregistered it
    finally:
        close_window(window)
