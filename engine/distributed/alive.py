"""Signs of life from a pipeline's ranks, so a stalled rank ends its group in bounded time.

MLX collectives have no timeout, and a rank whose process is gone is noticed by
its pid or its exit (``engine.distributed.group``); a rank that is still there
but no longer runs (stopped, swapped out, a Mac asleep, an ssh connection that
hangs) would leave its peers blocked in a receive for as long as TCP takes. So
each rank beats: a daemon thread writes one short line to stderr every
``BEAT_SECONDS``. It touches no MLX and no engine object, and MLX drops the GIL
while it evaluates, so a rank deep in a long chunk still beats. mlx.launch
relays the line (over ssh for another machine, where the tty merges it into
stdout) and the group's watcher reads it; a rank silent for ``STALL_SECONDS``
is lost.

A link between two ranks that drops while both processes run (a cable pulled,
a Mac gone from the network) beats on: the ranks' own TCP sockets get keepalive
probes instead, so the receive of the rank waiting on the dead link fails and it
ends with the ring's error. (No bound on unacknowledged data: a sender blocked
by a peer that is busy and not reading yet must not count as a dead link.)
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import sys
import threading
from typing import TextIO

BEAT_SECONDS = 1.0
# Long enough for a rank that is merely busy (a Python step between evaluations
# still lets the beat thread run within milliseconds), short enough that a
# stalled rank's error comes within ten seconds of the stall.
STALL_SECONDS = 7.0
_BEAT = "longleaf:alive"
BEAT_LINE = re.compile(rf"{_BEAT} (\d+)")
# TCP keepalive on the ranks' sockets: first probe after this many idle seconds,
# then one a second; the link is dead after this many unanswered probes.
KEEPALIVE_IDLE = 2
KEEPALIVE_INTERVAL = 1
KEEPALIVE_PROBES = 4


def start_beating(rank: int, stream: TextIO | None = None,
                  stop: threading.Event | None = None) -> threading.Thread:
    """Write this rank's sign of life to ``stream`` (stderr) every ``BEAT_SECONDS``
    until ``stop`` is set or the process ends."""
    out = stream if stream is not None else sys.stderr
    thread = threading.Thread(target=_beat, args=(rank, out, stop or threading.Event()),
                              name="longleaf-alive", daemon=True)
    thread.start()
    return thread


def _beat(rank: int, out: TextIO, stop: threading.Event) -> None:
    line = f"{_BEAT} {rank}\n"
    while not stop.is_set():
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):  # the launcher is gone: nobody to tell
            return
        stop.wait(BEAT_SECONDS)


def beating_rank(line: str) -> int | None:
    """The rank a relayed output line is a sign of life from, or None."""
    match = BEAT_LINE.search(line)
    return int(match.group(1)) if match else None


def guard_links() -> int:
    """Give every TCP socket this process holds keepalive probes (call once the group
    is up: its sockets are open then). Returns how many."""
    guarded = 0
    for fd in _open_fds():
        with contextlib.suppress(OSError):
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))
            try:
                if probe.type == socket.SOCK_STREAM and probe.family in (socket.AF_INET,
                                                                          socket.AF_INET6):
                    keep_alive(probe)
                    guarded += 1
            finally:
                probe.close()
    return guarded


def keep_alive(sock: socket.socket) -> None:
    """Keepalive probes on one TCP socket (see the constants)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)
    if idle is not None:
        sock.setsockopt(socket.IPPROTO_TCP, idle, KEEPALIVE_IDLE)
    for option, value in (("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _open_fds() -> list[int]:
    # /dev/fd lists this process's descriptors on macOS and Linux alike (one of
    # them the listing's own, closed again by the time fstat asks).
    return [int(name) for name in os.listdir("/dev/fd") if name.isdigit()]
