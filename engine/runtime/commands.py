"""A request as it waits in the engine worker's queue and runs on its thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Command:
    """One request: which handler runs it, its arguments, and how to stop it.

    Attributes:
        request_id: the id its events carry.
        name: the handler that runs it ("chat", "open_session", ...).
        args: the handler's arguments, copied when the request was made.
        cancel: set by the caller (or by shutdown) to stop it.
    """

    request_id: int
    name: str
    args: tuple[Any, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
