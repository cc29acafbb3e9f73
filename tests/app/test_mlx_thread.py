"""Only the engine thread calls MLX or a live engine object during an app session.

Every function of ``mlx.core``, and every method and property of the live engine
objects (sessions, their caches and page pools), is wrapped to record the calling
thread, then the real app runs a whole session: start, load, a dropped document,
an answer, model discovery in the picker, a second chat, close. Any such call
from the GUI thread or a pool thread fails the test (MLX streams are
thread-local, and the engine's objects change under the worker thread).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool
from engine.session.session import Session
from tests.app.chat.test_documents_drop import TEXT, drop_files
from tests.app.conftest import close_window, open_window, send_and_wait

ENGINE_THREAD = "longleaf-engine"
LIVE_CLASSES = (Session, PagedKVCache, PagePool)


def _recording(calls: dict[str, set[str]], lock: threading.Lock, name: str, function):
    def call(*args, **kwargs):
        with lock:
            calls.setdefault(threading.current_thread().name, set()).add(name)
        return function(*args, **kwargs)

    return call


@pytest.fixture
def mlx_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, set[str]]]:
    """Thread name -> the ``mlx.core`` functions it called, while the test runs."""
    calls: dict[str, set[str]] = {}
    lock = threading.Lock()
    for name in dir(mx):
        value = getattr(mx, name)
        if callable(value) and not isinstance(value, type) and not name.startswith("_"):
            monkeypatch.setattr(mx, name, _recording(calls, lock, name, value))
    yield calls


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, set[str]]]:
    """Thread name -> the methods and properties of live engine objects it used."""
    calls: dict[str, set[str]] = {}
    lock = threading.Lock()
    for cls in LIVE_CLASSES:
        for name, value in list(vars(cls).items()):
            label = f"{cls.__name__}.{name}"
            if isinstance(value, property) and value.fget is not None:
                wrapped = property(_recording(calls, lock, label, value.fget), value.fset)
                monkeypatch.setattr(cls, name, wrapped)
            elif callable(value) and not isinstance(value, type | staticmethod | classmethod):
                monkeypatch.setattr(cls, name, _recording(calls, lock, label, value))
    yield calls


def test_only_the_engine_thread_calls_mlx_in_a_whole_session(
    qtbot, tiny_llama: Path, tmp_path: Path, mlx_calls: dict[str, set[str]],
    engine_calls: dict[str, set[str]],
) -> None:
    window = open_window(qtbot, tiny_llama)
    try:
        document = tmp_path / "notes.md"
        document.write_text(TEXT, encoding="utf-8")
        drop_files(window, [document])
        qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
        # Model discovery describes folders on a pool thread: config and headers only.
        window.model_picker.refresh([str(tiny_llama.parent)])
        assert window.model_picker.wait(30_000)
        assert send_and_wait(qtbot, window, "Summarise it") in ("complete", "stopped")
        window.controller.new_session("q6")
        assert send_and_wait(qtbot, window, "And now?") in ("complete", "stopped")
    finally:
        close_window(window)
    assert ENGINE_THREAD in mlx_calls, "the recorder saw no MLX call at all"
    others = {thread: sorted(names) for thread, names in mlx_calls.items()
              if thread != ENGINE_THREAD}
    assert not others, f"MLX called off the engine thread: {others}"
    assert ENGINE_THREAD in engine_calls, "the recorder saw no engine object used at all"
    others = {thread: sorted(names) for thread, names in engine_calls.items()
              if thread != ENGINE_THREAD}
    assert not others, f"live engine objects used off the engine thread: {others}"
