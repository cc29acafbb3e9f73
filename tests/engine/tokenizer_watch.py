"""Whether a tokenizer lets the process's other threads run while it encodes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest


class WatchedBackend:
    """A tokenizer's Rust backend that notes, as each encoding returns, whether another
    thread of the process got to run several times while it encoded.

    The other thread waits for an encoding to begin, then sleeps a few short times,
    each a wait for the interpreter's lock, and only then sets ``other_ran``. An
    encoding that holds the lock throughout lets it run once, as it returns: too
    late for the rest. ``finished`` is set as the first encoding returns.
    """

    ROUNDS = 3

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.started = threading.Event()
        self.other_ran = threading.Event()
        self.finished = threading.Event()
        self.seen: list[bool] = []  # per encoding: whether the other thread ran meanwhile
        threading.Thread(target=self._other, daemon=True).start()

    def _other(self) -> None:
        if self.started.wait(120):
            for _ in range(self.ROUNDS):
                time.sleep(0.001)
            self.other_ran.set()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._backend, name)
        if not name.startswith("encode"):
            return found

        def encode(*args, **kwargs):
            self.started.set()
            result = found(*args, **kwargs)
            self.seen.append(self.other_ran.is_set())
            self.finished.set()
            return result
        return encode


def watch_encodings(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> WatchedBackend:
    """Put a ``WatchedBackend`` under an mlx-lm tokenizer."""
    inner = tokenizer._tokenizer
    watched = WatchedBackend(inner._tokenizer)
    monkeypatch.setattr(inner, "_tokenizer", watched)
    return watched
