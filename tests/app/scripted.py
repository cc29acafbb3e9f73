"""A scripted engine behind the real bridge, for tests of the app's routing and widgets.

``ScriptedWorker`` takes requests like ``EngineWorker`` and answers only when
the test plays an event back (``EngineBridge._dispatch``): no model, no thread.
``scripted_app`` builds the controller on it, with a model loaded; with
``window=True`` the main window too.
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

from app.controller import ChatController
from app.engine_bridge import EngineBridge
from app.settings import Settings
from app.store import HistoryStore
from app.window.quit_box import QUIT
from engine import Finished, ModelLoaded, SamplingParams, SessionOpened
from engine.memory.stats import MemoryUsage, stats_sample
from tests.app.scripted_worker import ScriptedWorker, WindowWorker


def scripted_app(qtbot, window: bool = False) -> SimpleNamespace:
    """The controller (and the main window) on a scripted worker, its model loaded.

    Returns a namespace of ``c`` (the controller), ``bridge``, ``worker``,
    ``store`` and ``window`` (None unless asked for); ``close_scripted`` ends it.
    """
    worker = WindowWorker() if window else ScriptedWorker()
    bridge = EngineBridge(worker_factory=lambda *_args: worker)
    settings = Settings()
    settings.sampling = SamplingParams(temperature=0.0, max_tokens=8, seed=0)
    store = HistoryStore()
    controller = ChatController(settings, store, bridge)
    shown = None
    if window:
        from app.window.main_window import MainWindow

        shown = MainWindow(controller)
        qtbot.addWidget(shown)
    controller.start("tiny")
    rid, _args, _cancel = worker.last("load")
    bridge._dispatch(ModelLoaded(rid, SimpleNamespace(name="tiny")))
    bridge._dispatch(Finished(rid, "done"))
    bridge._dispatch(Finished(worker.last("snapshot_budget")[0], "done"))
    assert controller.model_ready and bridge.pending == 0
    if shown is not None:
        shown.show()
    return SimpleNamespace(c=controller, bridge=bridge, worker=worker, store=store,
                           window=shown)


def sample(session_id: str, tokens: int, kv_bytes: int = 0, mode: str = "q8"):
    """A stats sample of ``session_id`` holding ``tokens`` tokens in ``kv_bytes``."""
    memory = MemoryUsage(1 << 30, 1 << 30, 0, 2 << 30, 16 << 30, 8 << 30, 50.0, 0, None)
    plain = stats_sample(session_id, None, memory)
    return replace(plain, kv_mode=mode, tokens_in_context=tokens, kv_bytes_used=kv_bytes,
                   kv_bytes_allocated=kv_bytes, timestamp=time.time())


def close_scripted(app: SimpleNamespace) -> None:
    """Shut the controller down and close the history."""
    if app.window is not None:
        app.window.close()
        if app.window.isVisible() and app.window.quit_box is not None:
            app.window.quit_box.button(QUIT).click()  # asked mid-answer or mid-read
    app.c.shutdown(0)
    app.store.close()


def open_session(app: SimpleNamespace, session_id: str) -> None:
    """The engine opened ``session_id``'s cache, as asked last."""
    rid, args, _cancel = app.worker.last("open")
    assert args[0] == session_id
    app.bridge._dispatch(SessionOpened(rid, session_id, args[1], 256))
    app.bridge._dispatch(Finished(rid, "done"))
