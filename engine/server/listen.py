"""The server's listening socket, bound before anything else starts, so that a port
in use (or one that cannot exist) is a message, not a traceback after a model load."""

from __future__ import annotations

import errno
import socket

from engine.errors import EngineError

MAX_PORT = 65535
ANSWER_TIMEOUT_S = 0.25  # a local program that listens answers a connect at once
# Where a client of a wildcard address connects: a program listening on this
# computer's loopback (or on the wildcard) answers there.
LOOPBACK_OF = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


class ServerUnavailable(EngineError):
    """The server cannot listen (the port is taken, or the address is not ours)."""


def bind(host: str, port: int, *, name: str, change: str) -> socket.socket:
    """A socket bound to ``host:port``, ready for uvicorn to listen on.

    Args:
        host: the address to bind (an IPv6 one has a colon).
        port: the port, 0 (any free one) to 65535.
        name: what listens, for the messages ("the local server").
        change: how the user picks another port, for the messages ("in
            Settings → Local server", "with --port").

    Raises:
        ServerUnavailable: the port is out of range or in use, or the address
            cannot be bound; nothing stays open.
    """
    if not 0 <= port <= MAX_PORT:
        raise ServerUnavailable(f"Port {port} does not exist: ports go from 0 to {MAX_PORT}. "
                                f"Choose another {change}.")
    if port and answers(host, port):
        raise _in_use(port, name, change)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    # As uvicorn's own sockets: a port just freed (TIME_WAIT) binds again at once. A
    # port another program listens on was refused above (``answers``): macOS's bind
    # would share it between two addresses.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise _in_use(port, name, change) from error
        raise ServerUnavailable(f"{name[0].upper()}{name[1:]} cannot listen on {host}:{port}: "
                                f"{error.strerror or error}.") from error
    return sock


def answers(host: str, port: int) -> bool:
    """Whether a program already accepts connections at ``host:port`` (at the
    loopback for a wildcard ``host``).

    The bind alone does not tell: with SO_REUSEADDR, macOS (BSD) lets a socket bind
    127.0.0.1:N while another program listens on 0.0.0.0:N, and the reverse, and
    clients then reach whichever the kernel picks: another app's server under
    Longleaf's address.
    """
    try:
        with socket.create_connection((LOOPBACK_OF.get(host, host), port),
                                      timeout=ANSWER_TIMEOUT_S):
            return True
    except OSError:  # refused, unreachable or silent: nothing listens for clients there
        return False


def _in_use(port: int, name: str, change: str) -> ServerUnavailable:
    return ServerUnavailable(f"Port {port} is already in use by another program, so {name} "
                             f"is off. Choose another port {change}.")
