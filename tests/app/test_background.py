"""The app's background jobs: outcomes come back on the GUI thread; bugs are logged."""

from __future__ import annotations

import logging
import threading

from app.background import Background
from engine import EngineError


def test_outcomes_come_back_on_the_gui_thread_and_bugs_are_logged(qtbot, caplog) -> None:
    jobs = Background()
    got: list[tuple[object, bool]] = []

    def on_gui(outcome: object) -> None:
        got.append((outcome, threading.current_thread() is threading.main_thread()))

    ran_on: list[bool] = []

    def work() -> int:
        ran_on.append(threading.current_thread() is threading.main_thread())
        return 7

    def refused() -> None:
        raise EngineError("That file is not a document.")

    def bug() -> None:
        raise KeyError("oops")

    with caplog.at_level(logging.ERROR, logger="app.background"):
        for job in (work, refused, bug):
            jobs.run(job, on_gui)
        assert jobs.wait(10_000)
        qtbot.waitUntil(lambda: len(got) == 3, timeout=10_000)
    assert ran_on == [False]  # the work ran off the GUI thread
    assert got[0] == (7, True) and all(on_main for _outcome, on_main in got)
    assert isinstance(got[1][0], EngineError) and isinstance(got[2][0], KeyError)
    logged = [r for r in caplog.records if r.name == "app.background"]
    assert len(logged) == 1 and logged[0].exc_info[0] is KeyError  # the bug, not the refusal
