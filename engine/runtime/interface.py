"""The worker as a front end sees it, and the pipeline as the worker sees it.

``Worker`` is the surface the app, the server and the CLI drive: the engine
in this process (``EngineWorker``) and a pipeline group in child processes
(``engine.distributed.remote.RemoteWorker``) both declare it, and the test
fakes do too, so the checker holds all of them to it. ``Pipeline`` and
``Conductor`` are what this layer needs of rank 0's command channel, which
``engine.distributed`` (a front end above this layer) provides.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx

from engine.cache.modes import KvMode
from engine.events import Event, RankShare, StatsSample
from engine.memory import fit
from engine.models.loader import LoadedModel
from engine.runtime.answering import StreamCounts
from engine.runtime.commands import Message
from engine.session.followers import FollowerLink
from engine.session.prompt_ids import TurnOverhead
from engine.session.sampling import SamplingParams

OnEvent = Callable[[Event], None]
"""Where a worker sends its events (on its own threads: it must be thread-safe)."""


class Worker(Protocol):
    """An engine front ends drive: requests answered by events, and quick reads.

    Each request method returns the request's id, which its events carry; the
    request ends with exactly one ``Finished`` or ``Failed``. Reads answer at
    once and never wait for a request.
    """

    def start(self) -> None:
        """Start the worker's threads."""
        ...

    def load_model(self, path: str) -> int:
        """Load "demo" or a model folder."""
        ...

    def open_session(self, session_id: str, mode: KvMode, page_size: int = ...,
                     rotate: bool | None = None) -> int:
        """Open (or replace) a session with a fixed KV mode."""
        ...

    def chat(self, session_id: str, messages: list[Message], sampling: SamplingParams,
             cancel: threading.Event, tools: list[dict[str, Any]] | None = None,
             template: bool = True) -> int:
        """Answer the conversation's last user turn, streaming ``TokenChunk`` events."""
        ...

    def ingest(self, session_id: str, messages: list[Message],
               cancel: threading.Event) -> int:
        """Read the conversation in without answering."""
        ...

    def check_quality(self, session_id: str, messages: list[Message],
                      cancel: threading.Event) -> int:
        """Measure the session's KV mode against fp16 on its last tokens."""
        ...

    def configure(self, *, budget_bytes: int | None, chunk_size: int,
                  read_share: float) -> int:
        """Change the KV budget, the prefill chunk and the reads' share beside answers."""
        ...

    def set_snapshot_budget(self, budget_bytes: int | None) -> int:
        """Set the stored-KV disk budget."""
        ...

    def clear_snapshots(self, session_id: str | None = None) -> int:
        """Delete one chat's stored KV (None: all of it)."""
        ...

    def share_chats_with_api(self, share: bool) -> int:
        """Let API sessions and the app's chats reuse each other's KV, or not."""
        ...

    def close_session(self, session_id: str, store: bool = True) -> int:
        """Free a session's pages, storing its KV first unless told not to."""
        ...

    def latest_stats(self) -> StatsSample | None:
        """The last stats sample; never waits."""
        ...

    def streams(self) -> StreamCounts:
        """The answers running together now; never waits."""
        ...

    def fit_check(self, session_id: str | None, token_count: int,
                  page_size: int | None = None) -> fit.FitReport:
        """Whether ``token_count`` tokens fit, per mode (a new chat's at ``page_size``)."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` encodes to with the loaded model's tokenizer."""
        ...

    def turn_overhead(self, system_prompt: str = "") -> TurnOverhead:
        """Tokens the chat template adds to a user message's text."""
        ...

    def token_ends(self, text: str) -> list[int]:
        """Where each of ``text``'s tokens ends, in characters."""
        ...

    @property
    def alive(self) -> bool:
        """True from ``start`` until the worker's threads have ended."""
        ...

    @property
    def storing_at_exit(self) -> bool:
        """True from when the worker, asked to stop, begins storing its open sessions'
        KV until its threads have ended: a wait then is for the disk, not for MLX."""
        ...

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for the threads to end; True once they have."""
        ...

    def shutdown(self, timeout: float = 2.0) -> None:
        """Cancel running and queued work and stop."""
        ...


class Conductor(Protocol):
    """Rank 0's command channel to a pipeline's other ranks, for one model."""

    fingerprint: dict[str, Any]

    def open(self, mode: KvMode, page_size: int, rotate: bool | None,
             chunk_size: int) -> FollowerLink:
        """Open the session on the other ranks; the link rank 0's session drives."""
        ...

    def unopened_machines(self, chunk_size: int) -> tuple[RankShare, ...]:
        """Every machine's share of a chat not opened yet."""
        ...

    def prune(self, names: Sequence[str]) -> None:
        """Keep the other ranks' stored parts of these snapshots only."""
        ...

    def stop(self) -> None:
        """Tell the other ranks to end."""
        ...


class Pipeline(Protocol):
    """Rank 0's pipeline as its engine holds it: the group, and a channel per model."""

    group: mx.distributed.Group
    split: Sequence[int] | None

    def conduct(self, loaded: LoadedModel) -> Conductor:
        """The command channel for ``loaded``, this rank's stage."""
        ...
