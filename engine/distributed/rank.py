"""One rank of the app's pipeline engine, started by ``engine.distributed.remote``.

``python -m engine.distributed.rank --model PATH [--chunk N] [--budget BYTES]
[--split 10,14] [--kv-store app|server] [--streams N] [--read-share S]`` runs on
every rank under mlx.launch. Rank 0 runs an ``EngineWorker`` on the pipeline group
(with the stored KV of this machine's data folder: the app's, or the API server's
own; up to ``--streams`` answers together) and serves its front end's connection:
each call it reads becomes a worker call, each event the worker sends goes back
with the front end's request id, and the answers it runs together follow whenever
they changed. The other ranks follow rank 0 (``engine.distributed.follower``),
each with its own ``rank<N>`` folder of stored KV in the same store of its own
machine's data folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.distributed.launch import (
    REPORT_DIR,
    join_group,
    rank_report_dir,
    write_rank_report,
)
from engine.distributed.link import ADDRESS_ENV, KEY_ENV
from engine.errors import EngineError
from engine.events import Event, Failed, Finished, renumbered, request_id_of
from engine.runtime.answering import StreamCounts
from engine.runtime.commands import CANCELLABLE, REQUESTS, Request
from engine.runtime.interface import OnEvent
from engine.runtime.worker import UNEXPECTED, EngineWorker
from engine.session.batch import DEFAULT_READ_SHARE

if TYPE_CHECKING:
    import mlx.core as mx

log = logging.getLogger(__name__)

READS = frozenset({"latest_stats", "fit_check", "count_tokens", "turn_overhead",
                   "token_ends"})


class LeadRank:
    """Rank 0's end of the app's connection, in front of its ``EngineWorker``.

    Args:
        conn: the connection to the app.
        make_worker: builds the worker from its ``on_event``.
    """

    def __init__(self, conn: Connection,
                 make_worker: Callable[[OnEvent], EngineWorker]) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        # Held while a call is submitted, so the worker's first event of it
        # (on its own thread) finds the app's id already recorded.
        self._ids_lock = threading.Lock()
        self._ids: dict[int, int] = {}  # the worker's request id -> the app's
        self._cancels: dict[int, threading.Event] = {}  # by the app's request id
        self._streams: StreamCounts | None = None  # as last sent to the app
        # Held from reading the counts to sending them: the stats heartbeat sends
        # events from its own thread, and an older count must not follow a newer.
        self._streams_lock = threading.Lock()
        self.worker = make_worker(self._on_event)

    def serve(self) -> None:
        """Run the worker and its calls until the app says stop or goes away."""
        self.worker.start()
        timeout = 10.0
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    log.warning("the app's connection closed; stopping the pipeline")
                    break
                kind = message[0]
                if kind == "shutdown":
                    timeout = float(message[1])
                    break
                if kind == "call":
                    self._call(*message[1:])
                elif kind == "cancel":
                    with self._ids_lock:
                        cancel = self._cancels.get(message[1])
                    if cancel is not None:
                        cancel.set()
                elif kind == "read":
                    self._read(*message[1:])
        finally:
            # Stores the open sessions and tells the other ranks to end.
            self.worker.shutdown(timeout)
            self.conn.close()

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError) as error:  # the app is gone; serve() ends
            log.warning("cannot reach the app: %s", error)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            # Events are plain values by design; one that is not still ends its request.
            log.exception("cannot send %r to the app", type(message[-1]).__name__)
            event = message[-1]
            if message[0] == "event" and isinstance(event, Finished | Failed):
                self._send(("event", Failed(event.request_id, UNEXPECTED.format(
                    detail=f"{type(error).__name__}: {error}"), type(error).__name__)))

    def _on_event(self, event: Event) -> None:
        request_id = request_id_of(event)
        if request_id is not None:
            with self._ids_lock:
                app_id = self._ids.get(request_id)
                if app_id is not None and isinstance(event, Finished | Failed):
                    self._ids.pop(request_id, None)
                    self._cancels.pop(app_id, None)
            if app_id is None:
                return
            event = renumbered(event, app_id)
        self._send(("event", event))
        self._send_streams()

    def _send_streams(self) -> None:
        """Send the worker's answers running together when they changed: they change
        at its steps, which send events, so the app's copy follows them (its
        ``streams`` must never wait on rank 0)."""
        with self._streams_lock:
            streams = self.worker.streams()
            if streams != self._streams:
                self._streams = streams
                self._send(("streams", streams))

    def _call(self, app_id: int, request: Request) -> None:
        if not isinstance(request, REQUESTS):
            self._send(("event", Failed(app_id, f"Unknown engine request {request!r}.",
                                        EngineError.__name__)))
            return
        with self._ids_lock:
            cancel = (self._cancels.setdefault(app_id, threading.Event())
                      if isinstance(request, CANCELLABLE) else None)
            request_id = self.worker.submit(request, cancel)
            self._ids[request_id] = app_id

    def _read(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        if name not in READS:
            self._send(("reply", call_id, False, (EngineError.__name__,
                                                  f"Unknown engine read {name!r}.")))
            return
        try:
            value = getattr(self.worker, name)(*args)
        except EngineError as error:
            self._send(("reply", call_id, False, (type(error).__name__, str(error))))
            return
        self._send(("reply", call_id, True, value))


KV_STORES = ("app", "server")


def _snapshot_dir(store: str) -> Path | None:
    """This machine's folder of ``store`` ("app": the app's chats, "server": the API
    server's own, so API requests never reuse a chat's KV)."""
    from engine import paths

    try:
        return paths.server_snapshots_dir() if store == "server" else paths.snapshots_dir()
    except OSError as error:  # an unwritable data folder: chats are read again instead
        log.warning("stored KV is off: its folder cannot be used (%s)", error)
        return None


def _lead(group: mx.distributed.Group, args: argparse.Namespace) -> None:
    from engine.distributed.rank_commands import Pipeline
    from engine.runtime.worker import EngineWorker
    from engine.snapshots.snapshot_store import SnapshotStore

    host, port = os.environ[ADDRESS_ENV].rsplit(":", 1)
    key = bytes.fromhex(os.environ.pop(KEY_ENV))
    try:
        conn = Client((host, int(port)), authkey=key)
    except (OSError, AuthenticationError) as error:
        raise EngineError(f"Rank 0 cannot reach the app ({error}).") from error
    folder = _snapshot_dir(args.kv_store)
    # The app's stored KV counts against the server's budget: one user, one disk.
    counted = (_snapshot_dir("app"),) if args.kv_store == "server" else ()
    snapshots = None if folder is None else SnapshotStore(
        folder, counted_with=[path for path in counted if path is not None])

    def make_worker(on_event: OnEvent) -> EngineWorker:
        return EngineWorker(on_event, budget_bytes=args.budget, chunk_size=args.chunk,
                            snapshots=snapshots, pipeline=Pipeline(group, args.split),
                            streams=args.streams, read_share=args.read_share)

    LeadRank(conn, make_worker).serve()


def main(argv: list[str] | None = None) -> int:
    """Run this rank; 0 when it ended as asked."""
    parser = argparse.ArgumentParser(prog="python -m engine.distributed.rank")
    parser.add_argument("--model", required=True)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--split", type=lambda text: [int(n) for n in text.split(",")],
                        default=None)
    parser.add_argument("--kv-store", choices=KV_STORES, default="app")
    parser.add_argument("--streams", type=int, default=None)
    parser.add_argument("--read-share", type=float, default=DEFAULT_READ_SHARE)
    args = parser.parse_args(argv)
    if os.environ.get(REPORT_DIR) is None:
        print("error: this is one rank of the app's pipeline; mlx.launch starts it.",
              file=sys.stderr)
        return 2
    try:
        folder = rank_report_dir()
        assert folder is not None  # the launcher set REPORT_DIR
        group = join_group(folder)
        rank = group.rank()
        if rank != 0:
            from engine.distributed.follower import follow

            report = follow(args.model, group, _snapshot_dir(args.kv_store), args.split)
            write_rank_report(folder, rank, {"rank_stats": report})
        else:
            _lead(group, args)
            write_rank_report(folder, rank, {})
    except EngineError as error:
        # The watcher quotes the last "error:" line in the message naming this rank.
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
