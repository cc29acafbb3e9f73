"""The server's engine over a pipeline of machines, and its fallback to this one.

``PipelineBridge`` is the ``ServerBridge`` of ``serve --pipeline N`` and
``serve --hostfile FILE``: its worker is a ``RemoteWorker`` (rank 0 in a child
process group, the other ranks local or on the hostfile's machines), driven by
the same requests and events as the in-process one. When the group is lost,
the request in flight has already failed with the message naming the rank and
its machine; the bridge then goes on with the model on an in-process
``EngineWorker`` if its weights fit here (as the app does), else it answers
every request with why it cannot.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.cache.modes import KvMode
from engine.distributed.fallback import fits_here
from engine.distributed.link import RESTART_HINT, hostfile_hosts
from engine.distributed.remote import GroupLost, RemoteWorker
from engine.events import Event, Failed, PipelineLost
from engine.runtime.worker import EngineWorker
from engine.server.bridge import ServerBridge
from engine.session.batch import DEFAULT_READ_SHARE

log = logging.getLogger(__name__)

SERVER_HINT = "Restart the server to use every machine again."
RETIRE_TIMEOUT = 30.0


class PipelineBridge(ServerBridge):
    """A ``ServerBridge`` whose engine runs over ``ranks`` machines until one is lost.

    Args:
        model: a model folder mlx-lm can split.
        kv_mode: the KV mode of requests that do not ask for one.
        snapshot_dir: the server's stored-KV folder of the in-process engine it
            falls back to (the ranks keep theirs in each machine's server folder).
        ranks: local ranks with the ring backend (ignored with ``hostfile``).
        hostfile: an MLX hostfile, this machine first; its hosts are the ranks.
        split: layers per rank, rank 0 (the last layers) first (None: even).
        snapshot_budget: the stored-KV disk budget in bytes (None: the default).
        parallel: requests that decode together, over the pipeline and on this
            machine after a fall-back (None: chosen from free memory at the load).
        read_share: the share of the time a prompt being read in takes beside
            answers, over the pipeline and after a fall-back.
        **bridge_args: ``ServerBridge``'s other keyword arguments.

    Raises:
        EngineError: the hostfile cannot be read, or puts rank 0 on another machine.
    """

    def __init__(self, model: str, kv_mode: KvMode, snapshot_dir: Path | None, *,
                 ranks: int = 2, hostfile: Path | None = None,
                 split: Sequence[int] | None = None, snapshot_budget: int | None = None,
                 parallel: int | None = None, read_share: float = DEFAULT_READ_SHARE,
                 **bridge_args: Any) -> None:
        if hostfile is not None:
            ranks = len(hostfile_hosts(hostfile))
        self._ranks = ranks
        self._parallel = parallel
        self._read_share = read_share
        self._generation = 0  # the worker whose events count; the next one is +1
        self._fallback: threading.Thread | None = None
        self._closing = False
        worker = RemoteWorker(self._events_of(0), ranks=ranks, hostfile=hostfile,
                              split=split, kv_store="server", streams=parallel,
                              read_share=read_share)
        super().__init__(model, kv_mode, snapshot_dir, worker=worker,
                         snapshot_budget=snapshot_budget, parallel=parallel,
                         read_share=read_share, **bridge_args)
        if snapshot_budget is not None:  # kept for the group, applied when it starts
            worker.set_snapshot_budget(snapshot_budget)

    @property
    def machines(self) -> int:
        """The pipeline's ranks, or 1 once the server went on on this machine alone."""
        return self._ranks

    def shutdown(self) -> None:
        """Stop the worker (and a fallback still starting); sessions are stored."""
        with self._lock:
            self._closing = True
            worker, fallback = self.worker, self._fallback
        worker.shutdown(timeout=RETIRE_TIMEOUT)
        if fallback is not None:
            fallback.join(RETIRE_TIMEOUT + 5.0)
        if self.worker is not worker:  # the fallback started one before it saw the close
            self.worker.shutdown(timeout=RETIRE_TIMEOUT)
        self._renderer.shutdown(wait=True, cancel_futures=True)

    def _events_of(self, generation: int) -> Callable[[Event], None]:
        """The ``on_event`` of the worker of ``generation``: a replaced worker's late
        events are dropped (its requests were ended when it was replaced)."""
        def on_event(event: Event) -> None:
            if generation != self._generation:
                return
            if isinstance(event, PipelineLost):
                self._lost(event)
            elif isinstance(event, Failed) and event.error_type == GroupLost.__name__:
                self._on_event(dataclasses.replace(event, message=_server_message(
                    event.message)))
            else:
                self._on_event(event)
        return on_event

    def _lost(self, event: PipelineLost) -> None:
        """Stop answering on the lost group; go on here if the model fits (its thread)."""
        message = _server_message(event.message)
        problem = fits_here(self.model)
        with self._lock:
            if self._closing:
                return
            self._generation += 1
            self.ready.clear()
            self.info = None  # the next load's, on this machine
            self._loading.clear()
            # Requests sent after the loss would fail with it: end them now.
            stale = {id(ticket): ticket for ticket in self._tickets.values()}
            for ticket in stale.values():
                if ticket.chat_id in self._tickets:
                    self._in_flight -= 1
                ticket.put(Failed(ticket.chat_id, message, GroupLost.__name__))
            self._tickets.clear()
            self._sessions.clear()  # they lived on the group's ranks
            old = self.worker
            if self._stopping:  # the server stops: nothing goes on, nothing loads here
                self.load_error = message
                log.warning("%s", message)
                return
            if problem:
                self.load_error = (f"{message.removesuffix(SERVER_HINT).rstrip()} "
                                   f"{self.model_id} does not fit on this machine alone, so "
                                   f"no model is served: {problem} {SERVER_HINT}")
            else:
                self.load_error = None
            self._fallback = threading.Thread(target=self._fall_back, args=(old, problem),
                                              name="longleaf-server-fallback", daemon=True)
            self._fallback.start()
        log.warning("%s", self.load_error if problem else
                    f"{message} The server goes on with the model on this machine alone.")

    def _fall_back(self, old: RemoteWorker, problem: str) -> None:
        old.shutdown(timeout=RETIRE_TIMEOUT)  # the group is gone: its threads end
        if problem:
            return
        with self._lock:
            if self._closing or self._stopping:
                return
            self._ranks = 1
            self.worker = EngineWorker(self._events_of(self._generation),
                                       snapshots=self.snapshots, streams=self._parallel,
                                       read_share=self._read_share)
        self.load()


def _server_message(message: str) -> str:
    """The lost group's message with what a server's user can do."""
    return f"{message.removesuffix(RESTART_HINT).rstrip()} {SERVER_HINT}"
