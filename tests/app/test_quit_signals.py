"""SIGTERM, SIGHUP and SIGINT reach the Qt event loop as a quit."""

from __future__ import annotations

import os
import signal

import pytest

from app.quit_signals import quit_signals


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_a_quit_signal_calls_quit_inside_the_event_loop(qtbot, number: int) -> None:
    # Ctrl-C in the terminal that started Longleaf did nothing before: Python's own
    # handler never ran while Qt's loop held the main thread.
    before = signal.getsignal(number)
    quits: list[int] = []
    with quit_signals(lambda: quits.append(1)):
        os.kill(os.getpid(), number)
        qtbot.waitUntil(lambda: bool(quits), timeout=5_000)
    assert quits == [1]
    assert signal.getsignal(number) is before  # the test run's own handlers are back


def test_another_signal_with_a_python_handler_does_not_quit(qtbot) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, _frame: seen.append(number))
    quits: list[int] = []
    try:
        with quit_signals(lambda: quits.append(1)):
            os.kill(os.getpid(), signal.SIGUSR1)
            qtbot.waitUntil(lambda: bool(seen), timeout=5_000)
            qtbot.wait(100)  # the wakeup, had it quit, came with the handler
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert quits == []
