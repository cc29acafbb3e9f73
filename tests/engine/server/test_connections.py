"""Connections that never finish their request head are closed, and only those.

The server here gets a bound of a fraction of a second (``HEAD_TIMEOUT``); the
tests wait for the server to close a connection (a read that ends), never for a
time to pass, except to let a request's body come later than the bound.
"""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.engine.server.conftest import Served, start_server
from tests.engine.tinymodels import make_tiny_model_dir

HEAD_TIMEOUT = 0.3
# How long a test waits for the server to act at most: long past the bound, so
# only a connection the server never closes runs into it.
PATIENCE = 60.0


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("connections")
    folder = make_tiny_model_dir(root, "llama")
    running, stop = start_server(folder, root / "kv", api_key=None, head_timeout=HEAD_TIMEOUT)
    yield running
    stop()


def connect(served: Served) -> socket.socket:
    port = int(served.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_connection_that_sends_nothing_is_closed(strict: Served) -> None:
    with connect(strict) as sock:
        assert read_until_closed(sock) == b""


def test_a_head_cut_short_gets_a_408_and_is_closed(strict: Served) -> None:
    with connect(strict) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within 0.3 seconds" in reply and b"Send the whole request" in reply


def test_many_half_open_connections_are_all_closed_and_the_server_answers(
        strict: Served) -> None:
    # Both ends are in this process: two descriptors each (macOS allows 256 by default).
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = max(10, min(200, (soft - 128) // 2))
    socks = [connect(strict) for _ in range(count)]
    try:
        for sock in socks:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for sock in socks:
            assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(strict.url + "/health", timeout=PATIENCE).status_code == 200


def test_a_kept_alive_connection_gets_the_bound_for_its_next_head(strict: Served) -> None:
    with connect(strict) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")


def test_a_request_whose_head_arrived_may_take_its_time(strict: Served) -> None:
    body = b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}'
    with connect(strict) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n")
        time.sleep(HEAD_TIMEOUT * 3)  # the body comes well after the head's bound
        sock.sendall(body)
        reply = read_response(sock)
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        assert b'"finish_reason"' in reply
        # The connection stays open for the next request, as kept-alive ones do.
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")



def test_a_client_that_leaves_mid_body_is_its_doing_not_a_server_error() -> None:
    """A body cut short by its client's leaving ends the request as the client's
    doing (a 400, which no one reads), not a server error with its traceback."""
    import asyncio

    from starlette.requests import Request

    from engine.server.app import ApiError, Server

    async def left() -> dict:
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "headers": [(b"content-type", b"application/json")]}, left)
    with pytest.raises(ApiError) as ended:
        asyncio.run(Server(None)._body(request))  # type: ignore[arg-type]
    assert ended.value.status == 400 and "left before its request body" in ended.value.message
