"""The server's listening socket: a port another program serves is refused, whatever
the address each side binds (`engine/server/listen.py`)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from engine.server import listen
from engine.server.listen import ServerUnavailable, answers, bind

WILDCARD, LOOPBACK = "0.0.0.0", "127.0.0.1"


class SharingSocket(socket.socket):
    """A socket that lets another such socket bind its port (SO_REUSEPORT on both, as
    macOS's SO_REUSEADDR allows between 127.0.0.1 and 0.0.0.0): the bind cannot
    tell that another program listens."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)


def _listener(host: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen()
    return sock


@pytest.fixture
def sharing_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(listen.socket, "socket", SharingSocket)
    yield


@pytest.mark.parametrize(("theirs", "ours"), [(WILDCARD, LOOPBACK), (LOOPBACK, WILDCARD)])
def test_a_port_another_program_listens_on_at_another_address_is_in_use(
        sharing_kernel: None, theirs: str, ours: str) -> None:
    with _listener(theirs) as other:
        port = other.getsockname()[1]
        with pytest.raises(ServerUnavailable) as refused:
            bind(ours, port, name="the local server", change="in Settings → Local server")
    assert str(refused.value) == (
        f"Port {port} is already in use by another program, so the local server is off. "
        "Choose another port in Settings → Local server.")


def test_answers_finds_a_listener_through_the_wildcard_and_the_loopback() -> None:
    with _listener(WILDCARD) as other:
        port = other.getsockname()[1]
        assert answers(LOOPBACK, port) and answers(WILDCARD, port)
    assert not answers(LOOPBACK, port) and not answers(WILDCARD, port)


def test_a_port_our_server_just_freed_binds_again() -> None:
    """A guard, not a fix: the probe must not take a closed connection for a listener."""
    with bind(LOOPBACK, 0, name="the local server", change="in Settings → Local server") as first:
        first.listen()
        port = first.getsockname()[1]
        with socket.create_connection((LOOPBACK, port)):
            first.accept()[0].close()  # the server closes first: its port is in TIME_WAIT
    bind(LOOPBACK, port, name="the local server", change="in Settings → Local server").close()
