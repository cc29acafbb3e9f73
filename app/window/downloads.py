"""One model download from the Hub, run off the GUI thread, reported as Qt signals.

``engine.download_model`` does the work (resumable, cancellable, disk checked);
this runs it as a background job (``app.background``), which makes no MLX call,
and hands progress and the outcome back to the GUI thread.
"""

from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, Signal

from app.background import Background
from engine import Cancelled, DiskFault, EngineError, HubUnreachable, download_model

log = logging.getLogger(__name__)


def unreachable_text(host: str) -> str:
    """What a download says when the Hub can't be reached at all."""
    return f"Can't reach {host} — check the network, then Retry."


class ModelDownload(QObject):
    """Download ``repo_id`` into Longleaf's models folder.

    Signals:
        progressed(DownloadProgress): now and then while bytes arrive (queued to
            receivers on the GUI thread).
        finished(str): the model folder, complete and verified.
        failed(str, bool): the message to show, and True when the user cancelled.
    """

    progressed = Signal(object)
    finished = Signal(str)
    failed = Signal(str, bool)

    def __init__(self, repo_id: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.repo_id = repo_id
        self._cancel = threading.Event()
        self._job = Background(threads=1, parent=self)
        self._started = self._reported = False

    @property
    def running(self) -> bool:
        """True from ``start`` until the download has reported how it ended."""
        return self._started and not self._reported

    def start(self) -> None:
        """Start downloading in the background."""
        self._started = True
        self._job.run(lambda: str(download_model(self.repo_id, on_progress=self.progressed.emit,
                                                 cancel=self._cancel)), self._report)

    def cancel(self) -> None:
        """Stop soon; the bytes so far are kept and the next download resumes."""
        self._cancel.set()

    def wait(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for the download's thread to end; True when it has."""
        return self._job.wait(int(seconds * 1000))

    def _report(self, outcome: object) -> None:
        self._reported = True
        if isinstance(outcome, str):
            self.finished.emit(outcome)
        elif isinstance(outcome, Cancelled):
            self.failed.emit(f"Download of {self.repo_id} paused; download it again to "
                             "resume where it stopped.", True)
        elif isinstance(outcome, HubUnreachable):
            # The engine's message carries the socket error for a terminal; here words do.
            log.info("download of %s: %s", self.repo_id, outcome)
            self.failed.emit(unreachable_text(outcome.host), False)
        elif isinstance(outcome, DiskFault):  # names the download and what to do itself
            self.failed.emit(str(outcome), False)
        elif isinstance(outcome, EngineError):
            self.failed.emit(f"Could not download {self.repo_id}: {outcome}", False)
        else:  # a bug (logged by the job): still said, so the dialog does not wait forever
            self.failed.emit(f"Could not download {self.repo_id}: {type(outcome).__name__}: "
                             f"{outcome}", False)


class Downloads(QObject):
    """The model downloads running now, at most one per repo.

    Signals:
        progressed(DownloadProgress): progress of any of them.
        ended(str, object, str, bool): repo id, the folder (None unless it
            finished), the message to show otherwise, and whether it was cancelled.
    """

    progressed = Signal(object)
    ended = Signal(str, object, str, bool)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._running: dict[str, ModelDownload] = {}

    @property
    def running(self) -> set[str]:
        """Repo ids being downloaded."""
        return set(self._running)

    def start(self, repo_id: str) -> None:
        """Start downloading ``repo_id`` unless it already is."""
        if repo_id in self._running:
            return
        download = ModelDownload(repo_id, self)
        download.progressed.connect(self.progressed)
        download.finished.connect(lambda folder: self._end(repo_id, folder, "", False))
        download.failed.connect(lambda text, cancelled: self._end(repo_id, None, text, cancelled))
        self._running[repo_id] = download
        download.start()

    def cancel(self, repo_id: str) -> None:
        """Stop ``repo_id``'s download; it resumes from there next time."""
        if repo_id in self._running:
            self._running[repo_id].cancel()

    def wait_all(self, seconds: float) -> bool:
        """Cancel every download and join their threads; True when all have ended."""
        for download in self._running.values():
            download.cancel()
        return all([download.wait(seconds) for download in self._running.values()])

    def _end(self, repo_id: str, folder: str | None, message: str, cancelled: bool) -> None:
        self._running.pop(repo_id).wait(5.0)  # it has reported: the thread is ending
        self.ended.emit(repo_id, folder, message, cancelled)
