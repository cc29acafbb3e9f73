"""Fixtures for app tests: the real engine worker on a tiny model, offscreen Qt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.controller import ChatController
from app.engine_bridge import EngineBridge
from app.sessions.session_list import RecordRole, StateRole, detail_text
from app.settings import Settings
from app.store import HistoryStore
from app.window.main_window import MainWindow
from app.window.quit_box import QUIT
from engine.session.sampling import SamplingParams
from tests.engine.tinymodels import make_tiny_model_dir

MODEL_LOAD_TIMEOUT_MS = 120_000
ANSWER_TIMEOUT_MS = 120_000


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight llama folder shared by the app tests (read-only)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("app-models"), "llama")


def configure(settings: Settings, max_tokens: int = 24) -> None:
    """Deterministic, short answers."""
    settings.sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    settings.system_prompt = "You are terse."


def open_window(qtbot, model: Path, max_tokens: int = 24,
                load_timeout_ms: int = MODEL_LOAD_TIMEOUT_MS, **bridge_args) -> MainWindow:
    """Build the whole app on the real worker and wait until the model is loaded.

    ``bridge_args`` go to ``EngineBridge`` (e.g. a ``worker_factory`` whose worker
    has a memory guard with a fake probe).
    """
    settings = Settings()
    configure(settings, max_tokens)
    store = HistoryStore()
    bridge = EngineBridge(settings.memory_budget_bytes, settings.ingest_chunk, **bridge_args)
    controller = ChatController(settings, store, bridge)
    window = MainWindow(controller)
    qtbot.addWidget(window)
    with qtbot.waitSignal(controller.modelStateChanged, timeout=load_timeout_ms,
                          check_params_cb=lambda _text, ready: ready):
        controller.start(str(model))
    window.show()
    return window


def close_window(window: MainWindow, within: float = 60.0) -> None:
    """Close like a user does, join the worker as the app's exit does, close the database.

    Mid-answer the window asks first; the user answers Quit.
    """
    window.close()
    if window.isVisible() and window.quit_box is not None:
        window.quit_box.button(QUIT).click()
    assert window.finish_closing(within), "the engine thread did not stop"
    window.controller.store.close()


@pytest.fixture
def window(qtbot, tiny_llama: Path) -> Iterator[MainWindow]:
    """The app with the tiny llama loaded; always shut down afterwards."""
    win = open_window(qtbot, tiny_llama)
    try:
        yield win
    finally:
        close_window(win)


def send_and_wait(qtbot, window: MainWindow, text: str) -> str:
    """Type ``text``, press Enter and wait for the answer to end; returns its status."""
    window.composer.set_text(text)
    with qtbot.waitSignal(window.controller.answerFinished, timeout=ANSWER_TIMEOUT_MS) as done:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    return done.args[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The offscreen platform plugin warns whenever a window's size limits change;
    # that is a limitation of the test platform, not something the app did wrong.
    for item in items:
        if "tests/app/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.qt_log_ignore("does not support propagateSizeHints"))


def sidebar_line(window: MainWindow, session_id: str) -> str:
    """The second line of chat ``session_id``'s row in the sidebar ("Answering…", …)."""
    for row in range(window.sessions.list.count()):
        item = window.sessions.list.item(row)
        if item.data(RecordRole).id == session_id:
            return detail_text(item.data(RecordRole), item.data(StateRole))
    raise AssertionError(f"{session_id} is not in the sidebar")
