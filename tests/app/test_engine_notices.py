"""Engine notices (a stored KV cache not used, a model on mlx-lm's own cache) reach the banner."""

from __future__ import annotations

from pathlib import Path

from engine import Notice, SessionOpened
from tests.app.conftest import close_window, open_window


def test_a_snapshot_notice_and_a_cache_note_show_in_the_banner(qtbot, tiny_llama: Path) -> None:
    window = open_window(qtbot, tiny_llama)
    try:
        bridge = window.controller.bridge
        bridge._dispatch(Notice(7, "The stored KV cache of this chat is from another model; "
                                   "reading it again."))
        assert window.banner.isVisible()
        assert "another model" in window.banner.label.text()
        bridge._dispatch(SessionOpened(8, "x", "q6", 256, "mlx-lm",
                                       "mlx-lm's own KV cache is in use (KV-shared layers)."))
        assert "KV-shared layers" in window.banner.label.text()
    finally:
        close_window(window)
