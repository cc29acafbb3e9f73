"""The app's background jobs: a function run on a pool thread, its outcome on the GUI thread.

Reading attached files, scanning for models and downloading one all run here.
None of them calls MLX (only the engine thread does). A job's outcome, its
return value or the exception it raised, comes back through a queued signal to
the thread that owns the ``Background`` (the GUI thread). An ``EngineError`` is
an outcome the user can act on; any other exception is a bug, logged with its
traceback before it is handed back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QRunnable, Qt, QThreadPool, Signal, SignalInstance, Slot

from engine import EngineError

log = logging.getLogger(__name__)
Done = Callable[[Any], None]  # gets the job's return value, or the exception it raised


class _Job(QRunnable):
    def __init__(self, work: Callable[[], Any], done: Done, report: SignalInstance) -> None:
        super().__init__()
        self.work, self.done, self.report = work, done, report
        self.setAutoDelete(True)

    def run(self) -> None:
        try:
            outcome = self.work()
        except EngineError as error:
            outcome = error
        except Exception as error:  # a bug: logged, and still reported, never lost
            log.exception("background job %r failed", getattr(self.work, "__name__", "job"))
            outcome = error
        with contextlib.suppress(RuntimeError):  # the app is gone (shutdown): no one to tell
            self.report.emit(self.done, outcome)


class Background(QObject):
    """A private thread pool whose jobs report back on this object's thread.

    Args:
        threads: jobs that may run at once; more wait in order.
    """

    _report = Signal(object, object)  # done callback, outcome

    def __init__(self, threads: int = 1, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(threads)
        self._report.connect(self._deliver, Qt.ConnectionType.QueuedConnection)

    def run(self, work: Callable[[], Any], done: Done) -> None:
        """Run ``work()`` on a pool thread; ``done(outcome)`` then runs on this object's thread."""
        self.pool.start(_Job(work, done, self._report))

    def wait(self, msecs: int = 5000) -> bool:
        """Block until every job has ended (shutdown and tests); True when all have."""
        return self.pool.waitForDone(msecs)

    @Slot(object, object)
    def _deliver(self, done: Done, outcome: object) -> None:
        done(outcome)
