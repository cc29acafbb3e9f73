"""The local server inside another front end (the app), on that front end's worker.

The app owns the one ``EngineWorker``: its chats and the server's requests go
to the same queue and answer together in its batch (a re-ingest or a quality
check in the app still runs alone, and API requests wait for it). The server
here never starts, stops or loads a model on that worker; it serves the model
the app has loaded (``model_loaded``), and gets its requests' events from the
app's event fan-out (``claim``, called on the worker thread). uvicorn runs on a
thread of its own, on a socket bound before it starts, so a port in use is a
message, not a dead thread. Nothing here imports Qt.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.cache.modes import KvMode
from engine.errors import EngineStopped
from engine.events import AnswerWaiting, Event, Failed, Finished, request_id_of
from engine.runtime.interface import Worker
from engine.server.bridge import ServerBridge, Ticket
from engine.server.listen import ServerUnavailable, bind

if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette

    from engine.models.info import ModelInfo

log = logging.getLogger(__name__)

THREAD_NAME = "longleaf-server"
START_TIMEOUT = 30.0
# Open streams get this long to finish when the server is turned off or the app quits,
# after the requests cancelled first got this long to end (the window waits for both).
GRACEFUL_SHUTDOWN_S = 1
STOP_WAIT_S = 3.0


@dataclass(frozen=True)
class ServerStatus:
    """What the local server is doing, for the front end to show.

    Attributes:
        state: "off", "loading" (listening, no model ready yet), "ready",
            "waiting" (its requests wait for the engine, or have not sent their
            first event yet), "answering" (one of them has begun) or "failed".
        url: the base URL on this computer, e.g. "http://127.0.0.1:1234".
        in_flight: requests waiting for or running on the engine.
        message: why it failed, or why no model is ready.
    """

    state: str
    url: str = ""
    in_flight: int = 0
    message: str = ""


@dataclass(frozen=True)
class ApiSession:
    """One session the server holds on the engine: its name, KV mode, last prompt
    length, and whether a request of it is being read in or answered now."""

    name: str
    mode: KvMode
    tokens: int
    answering: bool = False


class AttachedBridge(ServerBridge):
    """A ``ServerBridge`` on a worker someone else owns and loads models on.

    Args:
        worker: the front end's running worker.
        kv_mode: the KV mode of requests that do not ask for one.
        on_change: called (from any thread) whenever requests start or end or the
            model changes.
        max_sessions: server sessions held in memory at once.
        queue_limit: requests that may wait for the engine at once, beside those
            it answers together; more get 429.
    """

    def __init__(self, worker: Worker, kv_mode: KvMode, on_change: Callable[[], None], *,
                 max_sessions: int, queue_limit: int) -> None:
        super().__init__("", kv_mode, None, max_sessions=max_sessions, queue_limit=queue_limit,
                         worker=worker)
        self._on_change = on_change
        # Each model the front end loaded, with the count of changes it came after.
        self._models: queue.Queue[tuple[int, str, ModelInfo] | None] = queue.Queue()
        self._changes = 0  # model changes so far: a model queued before the last is stale
        self._running: set[int] = set()  # chat requests the engine has begun on

    def load(self) -> None:
        """Serve each model the front end loads, in turn, until ``stop_loading`` (blocks).

        A model that another change followed before it was served is skipped: its
        ``ready`` would say a model is served while the next one loads.
        """
        while (item := self._models.get()) is not None:
            change, path, info = item
            if change != self._changes:
                continue
            self.model = path
            self.use_model(info)
            if change != self._changes:  # another change came while it was read
                self.ready.clear()
            self._on_change()

    def stop_loading(self) -> None:
        """End ``load``."""
        self._models.put(None)

    def model_loaded(self, path: str, info: ModelInfo) -> None:
        """The front end has ``path`` ("demo" or a folder) loaded: serve it."""
        self.model_changing()
        self._models.put((self._changes, path, info))

    def model_changing(self, message: str | None = None) -> None:
        """Refuse requests until the next ``model_loaded`` (with ``message`` when no
        model is coming: why); the sessions of the old model are stored and closed
        ahead of the load in the worker's queue."""
        with self._lock:
            self._changes += 1
        self.ready.clear()
        self.load_error = message
        self.close_sessions()
        self._on_change()

    def close_sessions(self) -> None:
        """Store and close the server's sessions (queued on the worker)."""
        with self._lock:
            names = list(self._sessions)
            self._sessions.clear()
        for name in names:
            try:
                self.worker.close_session(name, store=True)
            except EngineStopped:  # the engine went first: it let go of every session
                return

    def shutdown(self) -> None:
        """The server is going: its sessions are stored and closed; the worker goes on."""
        self.close_sessions()
        self._renderer.shutdown(wait=True, cancel_futures=True)

    def claim(self, event: Event) -> bool:
        """Take ``event`` when it belongs to one of the server's requests (worker thread)."""
        request_id = request_id_of(event)
        if request_id is None:
            return False  # news of no one request (stats, stored KV) goes on to the app
        ending = isinstance(event, Finished | Failed)
        with self._lock:
            ticket = self._tickets.get(request_id)
            # Told it waits (for memory, or its turn behind one that does) is not
            # begun: it still waits for the engine.
            began = (ticket is not None and ticket.chat_id == request_id and not ending
                     and not isinstance(event, AnswerWaiting)
                     and request_id not in self._running)
            if began:
                self._running.add(request_id)
            elif ending:
                self._running.discard(request_id)
        if ticket is not None:
            self._on_event(event)
            if began or ending:
                self._on_change()
        return ticket is not None

    def submit(self, *args: Any, **kwargs: Any) -> Ticket:
        """``ServerBridge.submit``, announced."""
        ticket = super().submit(*args, **kwargs)
        self._on_change()
        return ticket

    @property
    def machines(self) -> int:
        """The machines the front end's worker runs on: a pipeline's ranks, as its last
        stats sample names them (1 on this machine alone)."""
        sample = self.worker.latest_stats()
        return max(1, len(sample.ranks)) if sample is not None else 1

    @property
    def idle(self) -> bool:
        """Whether no request of the server's waits for an event any more."""
        with self._lock:
            return not self._tickets

    @property
    def answering(self) -> bool:
        """Whether the engine is on one of the server's requests now."""
        with self._lock:
            return bool(self._running)

    def sessions(self) -> tuple[ApiSession, ...]:
        """The sessions the server holds, least recently used first."""
        with self._lock:
            running = {self._tickets[r].session for r in self._running if r in self._tickets}
            return tuple(ApiSession(name, mode, len(prompt), name in running)
                         for name, (mode, prompt) in self._sessions.items())


class LocalServer:
    """The OpenAI/Anthropic server on a front end's worker, on its own thread.

    Args:
        worker: the front end's running worker (the app's one engine thread).
        host: "127.0.0.1" (this computer only) or "0.0.0.0" (every interface).
        port: the TCP port.
        api_key: the key clients must send, or None.
        kv_mode: the KV mode of requests that do not ask for one.
        on_status: called with a ``ServerStatus`` whenever it changes, from any thread.
        max_sessions: API sessions held in memory besides the front end's own.
        queue_limit: requests that may wait for the engine at once, beside those
            it answers together (more get 429).
        allowed_hosts: names besides this computer's that requests may be
            addressed to while there is no API key (see ``engine.server.app.Server``).
    """

    def __init__(self, worker: Worker, *, host: str, port: int, api_key: str | None,
                 kv_mode: KvMode, on_status: Callable[[ServerStatus], None],
                 max_sessions: int = 2, queue_limit: int = 16,
                 allowed_hosts: tuple[str, ...] = ()) -> None:
        self.host, self.port, self.api_key = host, port, api_key or None
        self.allowed_hosts = allowed_hosts
        self._on_status = on_status
        self.bridge = AttachedBridge(worker, kv_mode, self._announce,
                                     max_sessions=max_sessions, queue_limit=queue_limit)
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._failure = ""

    @property
    def url(self) -> str:
        """The base URL on this computer (Anthropic clients; OpenAI clients add /v1)."""
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> ServerStatus:
        """What the server does now."""
        if self._failure:
            return ServerStatus("failed", self.url, 0, self._failure)
        if not self.running:
            return ServerStatus("off", self.url)
        busy = self.bridge.in_flight
        if busy:
            return ServerStatus("answering" if self.bridge.answering else "waiting",
                                self.url, busy)
        if not self.bridge.ready.is_set():
            return ServerStatus("loading", self.url, 0, self.bridge.load_error or "")
        return ServerStatus("ready", self.url)

    @property
    def running(self) -> bool:
        """Whether the server thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _announce(self) -> None:
        self._on_status(self.status())

    def start(self) -> None:
        """Listen and serve; returns once the server accepts connections.

        Raises:
            ServerUnavailable: the port is in use or the address cannot be bound;
                nothing keeps running.
        """
        # Here, not at import: the app imports this module at launch, server on or off.
        import uvicorn

        from engine.server.connections import http_protocol
        from engine.server.serve import StoppingServer, make_app

        self._socket = bind(self.host, self.port, name="the local server",
                            change="in Settings → Local server")
        app = make_app(self.bridge, self.api_key, bind_host=self.host,
                       allowed_hosts=self.allowed_hosts)
        app.router.lifespan_context = self._lifespan
        config = uvicorn.Config(app, log_level="warning", lifespan="on", http=http_protocol(),
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self._server = StoppingServer(config, self.bridge, STOP_WAIT_S)
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started and self._thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            self.stop()
            raise ServerUnavailable(self._failure or "The local server did not start.")
        self._announce()

    def _serve(self) -> None:
        assert self._server is not None and self._socket is not None
        try:
            self._server.run(sockets=[self._socket])
        except (Exception, SystemExit) as error:  # uvicorn exits on a failed startup
            log.exception("the local server stopped")
            self._failure = f"The local server stopped: {error}"
        finally:
            self._socket.close()
        if self._failure:
            self._announce()  # the front end learns it is down without asking

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        loader = threading.Thread(target=self.bridge.load, name=f"{THREAD_NAME}-models",
                                  daemon=True)
        loader.start()
        try:
            yield
        finally:
            self.bridge.stop_loading()
            loader.join()
            self.bridge.shutdown()

    def model_loaded(self, path: str, info: ModelInfo) -> None:
        """The front end loaded ``path``: serve it from now on."""
        self.bridge.model_loaded(path, info)

    def set_default_mode(self, mode: KvMode) -> None:
        """The KV mode of requests that ask for none, from the next request on: a plain
        value each request reads once, so the server goes on without a restart (a
        restart cuts the answers running and closes its sessions)."""
        self.bridge.kv_mode = mode

    def model_changing(self, message: str | None = None) -> None:
        """The front end is loading another model (or, with ``message``, has none and
        says why): refuse requests until one is loaded."""
        self.bridge.model_changing(message)

    def claim(self, event: Event) -> bool:
        """Route a worker event to the server's request it belongs to; True when it did."""
        return self.bridge.claim(event)

    def request_stop(self) -> None:
        """Ask the server to close its connections and end (returns at once)."""
        if self._server is not None:
            self._server.should_exit = True

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the server thread to end; True once it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        done = not self.running
        if done:
            self._announce()
        return done

    def stop(self, timeout: float | None = 10.0) -> bool:
        """``request_stop`` and ``join``."""
        self.request_stop()
        return self.join(timeout)
