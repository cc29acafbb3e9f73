"""uvicorn's HTTP/1.1 protocol, with a bound on how long a request's head may take.

uvicorn closes a kept-alive connection that stays idle, but a connection that
sends part of a request head (or nothing at all after connecting) stays open
for as long as its peer likes: a few hundred of them use up the process's file
descriptors (256 by default on macOS) and no one else can connect. So each
connection gets ``head_timeout`` seconds, from when it opens or its last
response ended, to send a complete request head; past that it is closed, with
a 408 when part of a head had come. A request whose head arrived is never
timed here: a long answer, or a body that takes its time, goes on.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# Every HTTP client sends its head in one write; a person typing into a telnet
# session is the slowest legitimate sender.
HEAD_TIMEOUT_S = 10.0


class HeadTimeoutProtocol(H11Protocol):
    """``H11Protocol`` that closes a connection whose request head does not arrive in
    ``head_timeout`` seconds (set it on a subclass: ``http_protocol``)."""

    head_timeout: float = HEAD_TIMEOUT_S  # the class a server uses sets its own
    _head_timer: asyncio.TimerHandle | None = None
    _waiting_on: object = None  # the request cycle that was current when the wait began
    _head_begun = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_head()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            self._head_begun = True
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._waiting_on:
            self._stop_waiting()  # a whole head came: the request is under way

    def on_response_complete(self) -> None:
        answered = self.cycle
        super().on_response_complete()
        # A pipelined request already read has a new cycle; otherwise the next
        # head is awaited from now.
        if not self.transport.is_closing() and self.cycle is answered:
            self._wait_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _wait_for_head(self) -> None:
        self._stop_waiting()
        self._waiting_on, self._head_begun = self.cycle, False
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def _stop_waiting(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        log.info("closed the connection of %s: no complete request head within %g s",
                 self.client or "a client", self.head_timeout)
        if self._head_begun:
            # Written as is: h11 sends no response to a request it has not read.
            message = (f"The request's head did not arrive within {self.head_timeout:g} "
                       "seconds, so the server closed the connection. Send the whole "
                       "request again.\n").encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8"
                b"\r\nconnection: close\r\ncontent-length: "
                + str(len(message)).encode() + b"\r\n\r\n" + message)
        self.transport.close()


def http_protocol(head_timeout: float | None = None) -> type[HeadTimeoutProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with its bound (None:
    ``HEAD_TIMEOUT_S``)."""
    seconds = HEAD_TIMEOUT_S if head_timeout is None else head_timeout
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout": seconds})
