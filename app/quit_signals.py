"""SIGTERM, SIGHUP and SIGINT quit Longleaf as its Quit menu does.

A logout, a shutdown or ``kill`` sends SIGTERM (a closed terminal SIGHUP, Ctrl-C in
it SIGINT). Python runs a signal handler only between bytecodes of the main thread,
which sits in Qt's C++ event loop, so the handler itself does nothing: the signal
number that ``signal.set_wakeup_fd`` writes to a socket wakes a ``QSocketNotifier``
inside the loop, and the quit runs there, between events, as a menu's would.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from types import FrameType

from PySide6.QtCore import QSocketNotifier

log = logging.getLogger(__name__)
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _noted(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler: the wakeup byte carries the signal into the loop."""


@contextlib.contextmanager
def quit_signals(quit_now: Callable[[], None]) -> Iterator[None]:
    """While inside, each of ``QUIT_SIGNALS`` calls ``quit_now`` in the Qt event loop.

    On leaving, the handlers are put back as they were. Call from the main thread.
    """
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    notifier = QSocketNotifier(reader.fileno(), QSocketNotifier.Type.Read)
    notifier.activated.connect(lambda *_: _on_wakeup(reader, quit_now))
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = {number: signal.signal(number, _noted) for number in QUIT_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        signal.set_wakeup_fd(previous_fd)
        notifier.setEnabled(False)
        reader.close()
        writer.close()


def _on_wakeup(reader: socket.socket, quit_now: Callable[[], None]) -> None:
    try:
        numbers = reader.recv(64)
    except BlockingIOError:  # woken with nothing to read: no signal came
        return
    # Another handler's signal wakes this too; only these quit.
    quitting = [number for number in numbers if number in QUIT_SIGNALS]
    if quitting:
        log.info("%s received: quitting", signal.Signals(quitting[0]).name)
        quit_now()


def end_at_once_on_signals() -> None:
    """From here on each of ``QUIT_SIGNALS`` ends the process at once (the default):
    a second one while the quit stores the chats' KV means stop now, and the
    history is saved by then."""
    for number in QUIT_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
