"""A real uvicorn server on 127.0.0.1 (ephemeral port) over a tiny model, per module."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.server.bridge import ServerBridge
from engine.server.serve import uvicorn_server
from tests.engine.tinymodels import make_tiny_model_dir

API_KEY = "test-key-123"


@dataclass
class Served:
    """A running server: its base URL, key and bridge."""

    url: str
    key: str
    bridge: ServerBridge


def start_server(folder: Path, snapshots: Path, bridge_type: type = ServerBridge, *,
                 api_key: str | None = API_KEY, allowed_hosts: tuple[str, ...] = (),
                 keepalive: float | None = None, head_timeout: float | None = None,
                 **bridge_args) -> tuple[Served, callable]:
    """Start a server in a thread; returns it and the function that stops it."""
    bridge = bridge_type(str(folder), "fp16", snapshots, **bridge_args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    extra = {} if keepalive is None else {"keepalive": keepalive}
    if head_timeout is not None:
        extra["head_timeout"] = head_timeout
    server = uvicorn_server(bridge, "127.0.0.1", port, api_key, allowed_hosts=allowed_hosts,
                            **extra)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="test-uvicorn")
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        raise AssertionError(f"server did not become healthy: {bridge.load_error}")

    def stop() -> None:
        server.should_exit = True
        thread.join(60)
        sock.close()
    return Served(url, api_key or "", bridge), stop


def health_of(served: Served, **kwargs) -> httpx.Response:
    """``/health`` asked with the server's key: its model, machines and streams."""
    return httpx.get(served.url + "/health", headers={"x-api-key": served.key}, **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A llama-type tiny model behind the server."""
    root = tmp_path_factory.mktemp("server")
    folder = make_tiny_model_dir(root, "llama")
    running, stop = start_server(folder, root / "kv", queue_limit=3, max_sessions=2)
    yield running
    stop()
