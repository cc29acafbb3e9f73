"""Run the server: the engine bridge, its model load, and uvicorn on one address."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from engine.server.app import KEEPALIVE_SECONDS, STOP_WAIT_S, Server
from engine.server.bridge import ServerBridge
from engine.server.connections import http_protocol

log = logging.getLogger(__name__)


class StoppingServer(uvicorn.Server):
    """A uvicorn server that, when told to stop, first ends the requests in flight
    (``ServerBridge.stop_requests``) and waits for them (at most ``wait_s``), so each
    client gets its API's error (a 503, or its stream's error event) rather than a
    cut connection."""

    def __init__(self, config: uvicorn.Config, bridge: ServerBridge,
                 wait_s: float = STOP_WAIT_S) -> None:
        super().__init__(config)
        self.bridge = bridge
        self.wait_s = wait_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.bridge.stop_requests()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while self.bridge.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def server_snapshot_dir() -> Path:
    """The server's own stored-KV folder, beside the app's and never shared with it."""
    from engine import paths

    return paths.server_snapshots_dir()


def make_app(bridge: ServerBridge, api_key: str | None = None,
             cors_origins: tuple[str, ...] = (), *, bind_host: str | None = None,
             allowed_hosts: tuple[str, ...] = (),
             keepalive: float = KEEPALIVE_SECONDS,
             loaded: Callable[[ServerBridge], None] | None = None) -> Starlette:
    """The ASGI app; its lifespan loads the model in the background and stops the worker.

    Without ``api_key`` it answers only requests addressed to this computer,
    ``bind_host`` or ``allowed_hosts`` (see ``Server``). A stream without output
    for ``keepalive`` seconds sends an event that changes nothing. ``loaded`` is
    called on the loading thread once the load ended, well or not
    (``bridge.load_error`` says which).
    """
    server = Server(bridge, api_key, cors_origins=cors_origins, bind_host=bind_host,
                    allowed_hosts=allowed_hosts, keepalive=keepalive)
    app = server.app()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        def load() -> None:
            bridge.load()
            if loaded is not None:
                loaded(bridge)

        loader = threading.Thread(target=load, name="longleaf-server-load", daemon=True)
        loader.start()  # /health answers 503 until it is done
        try:
            yield
        finally:
            loader.join()
            bridge.shutdown()

    app.router.lifespan_context = lifespan
    return app


def uvicorn_server(bridge: ServerBridge, host: str, port: int,
                   api_key: str | None = None, cors_origins: tuple[str, ...] = (),
                   allowed_hosts: tuple[str, ...] = (),
                   keepalive: float = KEEPALIVE_SECONDS,
                   head_timeout: float | None = None,
                   loaded: Callable[[ServerBridge], None] | None = None) -> uvicorn.Server:
    """A uvicorn server for ``bridge`` (not started); a connection that sends no whole
    request head within ``head_timeout`` seconds (None: ``HEAD_TIMEOUT_S``) is closed.
    ``loaded``: as ``make_app`` takes it."""
    app = make_app(bridge, api_key, cors_origins, bind_host=host, allowed_hosts=allowed_hosts,
                   keepalive=keepalive, loaded=loaded)
    config = uvicorn.Config(app, host=host, port=port, http=http_protocol(head_timeout),
                            log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    return StoppingServer(config, bridge)
