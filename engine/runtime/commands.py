"""The requests a worker runs, one frozen value per kind, and how one waits in its queue.

Each request is a plain value (picklable, so a pipeline's front end sends the
same value to rank 0), made by the worker's public methods and dispatched by
its type on the worker thread: a reader (or a static tool) follows a request
from the method that makes it to the handler that runs it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from engine.cache.modes import KvMode
from engine.session.sampling import SamplingParams

Message = dict[str, Any]
"""One chat message: role and content, and a tool turn's plain JSON keys."""


@dataclass(frozen=True)
class LoadModel:
    """Load "demo" or a model folder."""

    path: str


@dataclass(frozen=True)
class OpenSession:
    """Open (or replace) a session with a fixed KV mode."""

    session_id: str
    mode: KvMode
    page_size: int
    rotate: bool | None


@dataclass(frozen=True)
class Chat:
    """Answer the conversation's last user turn."""

    session_id: str
    messages: list[Message]
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None = None
    template: bool = True


@dataclass(frozen=True)
class Ingest:
    """Read the conversation into the session's cache without answering."""

    session_id: str
    messages: list[Message]


@dataclass(frozen=True)
class CheckQuality:
    """Measure the session's KV mode against fp16 on the conversation's last tokens."""

    session_id: str
    messages: list[Message]


@dataclass(frozen=True)
class Configure:
    """Change the KV budget of all sessions, the prefill chunk, and the reads' share
    of the time beside answers."""

    budget_bytes: int | None
    chunk_size: int
    read_share: float


@dataclass(frozen=True)
class SetSnapshotBudget:
    """Set the stored-KV disk budget (None: the default)."""

    budget_bytes: int | None


@dataclass(frozen=True)
class ClearSnapshots:
    """Delete one chat's stored KV (None: all of it)."""

    session_id: str | None


@dataclass(frozen=True)
class ShareChats:
    """Let API sessions and the app's chats reuse each other's KV, or keep them apart."""

    share: bool


@dataclass(frozen=True)
class CloseSession:
    """Free a session's pages, storing its KV first unless ``store`` is False."""

    session_id: str
    store: bool = True


Request = (LoadModel | OpenSession | Chat | Ingest | CheckQuality | Configure
           | SetSnapshotBudget | ClearSnapshots | ShareChats | CloseSession)
"""Every request a worker runs."""

REQUESTS = (LoadModel, OpenSession, Chat, Ingest, CheckQuality, Configure,
            SetSnapshotBudget, ClearSnapshots, ShareChats, CloseSession)
"""``Request``'s kinds, for a check of a value that came from elsewhere."""

CANCELLABLE = (Chat, Ingest, CheckQuality)
"""The requests a cancel stops; one cancelled while it waits ends before it starts."""

ALONE = (LoadModel, Ingest, CheckQuality, Configure)
"""The requests that run with no answer beside them: a model load replaces the
model the answers run on, a read or a quality check runs whole (not a chunk a
step), and a new chunk size would change how reads under way are cut (a
``Configure`` that keeps the chunk size runs between two steps)."""

SETTINGS = (Configure, SetSnapshotBudget, ShareChats)
"""The requests that set how the engine runs rather than what it holds."""


@dataclass
class Command:
    """One request as it waits in the worker's queue: its id, what it asks, how to stop it.

    Attributes:
        request_id: the id its events carry.
        request: what to run, copied when the request was made.
        cancel: set by the caller (or by shutdown) to stop it.
    """

    request_id: int
    request: Request
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        """The request's kind, for logs."""
        return type(self.request).__name__
