"""A scripted engine behind the real bridge, for tests of the app's routing and widgets.

``ScriptedWorker`` takes requests like ``EngineWorker`` and answers only when
the test plays an event back (``EngineBridge._dispatch``): no model, no thread.
``scripted_app`` builds the controller on it, with a model loaded; with
``window=True`` the main window too.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

from app.controller import ChatController
from app.engine_bridge import EngineBridge
from app.settings import Settings
from app.store import HistoryStore
from engine import EngineError, Finished, ModelLoaded, SamplingParams, SessionOpened
from engine.memory.stats import MemoryUsage, stats_sample
from engine.session.prompt_ids import TurnOverhead


class ScriptedWorker:
    """Takes requests like ``EngineWorker`` and answers only when the test says."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.requests: list[tuple[int, str, tuple, threading.Event | None]] = []
        self.alive = False
        self.stats = None  # what latest_stats returns: a test sets it

    def _take(self, name: str, *args, cancel: threading.Event | None = None) -> int:
        request_id = next(self._ids)
        self.requests.append((request_id, name, args, cancel))
        return request_id

    def last(self, name: str) -> tuple[int, tuple, threading.Event | None]:
        request_id, _name, args, cancel = [r for r in self.requests if r[1] == name][-1]
        return request_id, args, cancel

    def names(self) -> list[str]:
        return [r[1] for r in self.requests]

    def start(self) -> None:
        self.alive = True

    def join(self, _timeout: float | None = None) -> bool:
        return not self.alive

    def shutdown(self, _timeout: float = 2.0) -> None:
        self.alive = False

    def load_model(self, path):
        return self._take("load", path)

    def open_session(self, session_id, mode, page_size, rotate):
        return self._take("open", session_id, mode)

    def chat(self, session_id, messages, sampling, cancel):
        return self._take("chat", session_id, messages, cancel=cancel)

    def ingest(self, session_id, messages, cancel):
        return self._take("ingest", session_id, messages, cancel=cancel)

    def check_quality(self, session_id, messages, cancel):
        return self._take("quality", session_id, messages, cancel=cancel)

    def configure(self, *, budget_bytes, chunk_size):
        return self._take("configure", budget_bytes, chunk_size)

    def set_snapshot_budget(self, budget_bytes):
        return self._take("snapshot_budget", budget_bytes)

    def clear_snapshots(self, session_id):
        return self._take("clear_snapshots", session_id)

    def close_session(self, session_id, store):
        return self._take("close", session_id, store)

    def latest_stats(self):
        return self.stats

    def fit_check(self, session_id, token_count):
        return SimpleNamespace(max_context=8192)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def turn_overhead(self, system_prompt: str):
        return TurnOverhead(first=3, later=2)


class WindowWorker(ScriptedWorker):
    """A scripted worker the main window can sit on: no fit line, tokens by word."""

    def fit_check(self, session_id, token_count):
        raise EngineError("No fit check in a scripted engine.")

    def token_ends(self, text: str) -> list[int]:
        return [i + 1 for i, c in enumerate(text) if c == " "] + [len(text)]


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
    app.c.shutdown(0)
    app.store.close()


def open_session(app: SimpleNamespace, session_id: str) -> None:
    """The engine opened ``session_id``'s cache, as asked last."""
    rid, args, _cancel = app.worker.last("open")
    assert args[0] == session_id
    app.bridge._dispatch(SessionOpened(rid, session_id, args[1], 256))
    app.bridge._dispatch(Finished(rid, "done"))
