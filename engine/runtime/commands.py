"""A request as it waits in the engine worker's queue and runs on its thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Command:
    """One request: which handler runs it, its arguments, and how it was stopped.

    Attributes:
        request_id: the id its events carry.
        name: the handler that runs it ("chat", "open_session", ...).
        args: the handler's arguments, copied when the request was made.
        cancel: set by the caller (or by shutdown) to stop it.
        prefill_stop: (kept, total) tokens when its prefill stopped short, for
            the event that ends it.
    """

    request_id: int
    name: str
    args: tuple[Any, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
    prefill_stop: tuple[int, int] | None = None

    def kept(self) -> tuple[int | None, int | None]:
        """(kept, total) tokens of a prefill that stopped short, else Nones (for events)."""
        return self.prefill_stop or (None, None)
