"""The scripted engine worker: takes requests like ``EngineWorker``, answers only when told.

Declares the ``Worker`` protocol, so the type checker holds it to the surface the
app drives (pyproject's ``[tool.mypy]`` names this file).
"""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace
from typing import Any, cast

from engine import EngineError, KvMode, SamplingParams, StatsSample, Worker
from engine.memory.fit import FitReport
from engine.runtime.commands import Message
from engine.session.prompt_ids import TurnOverhead


class ScriptedWorker(Worker):
    """Takes requests like ``EngineWorker`` and answers only when the test says."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.requests: list[tuple[int, str, tuple[Any, ...], threading.Event | None]] = []
        self._alive = False
        self.stats: StatsSample | None = None  # what latest_stats returns: a test sets it

    def _take(self, name: str, *args: Any, cancel: threading.Event | None = None) -> int:
        request_id = next(self._ids)
        self.requests.append((request_id, name, args, cancel))
        return request_id

    def last(self, name: str) -> tuple[int, tuple[Any, ...], threading.Event | None]:
        request_id, _name, args, cancel = [r for r in self.requests if r[1] == name][-1]
        return request_id, args, cancel

    def names(self) -> list[str]:
        return [r[1] for r in self.requests]

    @property
    def alive(self) -> bool:
        return self._alive

    def start(self) -> None:
        self._alive = True

    @property
    def storing_at_exit(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> bool:
        return not self._alive

    def shutdown(self, timeout: float = 2.0) -> None:
        self._alive = False

    def load_model(self, path: str) -> int:
        return self._take("load", path)

    def open_session(self, session_id: str, mode: KvMode, page_size: int = 256,
                     rotate: bool | None = None) -> int:
        return self._take("open", session_id, mode)

    def chat(self, session_id: str, messages: list[Message], sampling: SamplingParams,
             cancel: threading.Event, tools: list[dict[str, Any]] | None = None,
             template: bool = True) -> int:
        return self._take("chat", session_id, messages, cancel=cancel)

    def ingest(self, session_id: str, messages: list[Message],
               cancel: threading.Event) -> int:
        return self._take("ingest", session_id, messages, cancel=cancel)

    def check_quality(self, session_id: str, messages: list[Message],
                      cancel: threading.Event) -> int:
        return self._take("quality", session_id, messages, cancel=cancel)

    def configure(self, *, budget_bytes: int | None, chunk_size: int,
                  read_share: float) -> int:
        return self._take("configure", budget_bytes, chunk_size, read_share)

    def set_snapshot_budget(self, budget_bytes: int | None) -> int:
        return self._take("snapshot_budget", budget_bytes)

    def clear_snapshots(self, session_id: str | None = None) -> int:
        return self._take("clear_snapshots", session_id)

    def share_chats_with_api(self, share: bool) -> int:
        return self._take("share_chats", share)

    def close_session(self, session_id: str, store: bool = True) -> int:
        return self._take("close", session_id, store)

    def latest_stats(self) -> StatsSample | None:
        return self.stats

    def fit_check(self, session_id: str | None, token_count: int,
                  page_size: int | None = None) -> FitReport:
        # A stand-in holding only what these tests read of a report.
        return cast(FitReport, SimpleNamespace(max_context=8192))

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def turn_overhead(self, system_prompt: str = "") -> TurnOverhead:
        return TurnOverhead(first=3, later=2)

    def token_ends(self, text: str) -> list[int]:
        raise EngineError("No token ends in a scripted engine.")


class WindowWorker(ScriptedWorker):
    """A scripted worker the main window can sit on: no fit line, tokens by word."""

    def fit_check(self, session_id: str | None, token_count: int,
                  page_size: int | None = None) -> FitReport:
        raise EngineError("No fit check in a scripted engine.")

    def token_ends(self, text: str) -> list[int]:
        return [i + 1 for i, c in enumerate(text) if c == " "] + [len(text)]
