"""Reading dropped files off the GUI thread.

Each file is parsed (``engine.documents``) and its tokens counted on a pool
thread; the result comes back to the GUI thread through a queued signal.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from PySide6.QtCore import QObject, QRunnable, Qt, QThreadPool, Signal, Slot

from app.store import AttachmentRecord
from engine import EngineError, read_document

CHARS_PER_TOKEN_BOUND = 8  # no tokenizer packs more characters into one token


class _Relay(QObject):
    done = Signal(int, object, object)  # job id, AttachmentRecord | None, notes or error


class _ReadJob(QRunnable):
    def __init__(self, job_id: int, path: str, max_chars: int,
                 count_tokens: Callable[[str], int], relay: _Relay) -> None:
        super().__init__()
        self.job_id, self.path, self.max_chars = job_id, path, max_chars
        self.count_tokens, self.relay = count_tokens, relay
        self.setAutoDelete(True)

    def run(self) -> None:
        try:
            doc = read_document(self.path, max_chars=self.max_chars)
            tokens = self.count_tokens(doc.text)
            record = AttachmentRecord(doc.name, doc.size_bytes, doc.sha256, tokens, doc.text)
            self.relay.done.emit(self.job_id, record, doc.notes)
        except EngineError as exc:
            self.relay.done.emit(self.job_id, None, str(exc))
        except Exception as exc:  # never let a worker thread die silently
            self.relay.done.emit(self.job_id, None, f"Couldn't read the file: {exc}")


class DocumentLoader(QObject):
    """Reads files on a private thread pool and reports on the GUI thread.

    Args:
        count_tokens: thread-safe token counter (the engine bridge's).
    """

    loaded = Signal(int, object, object)  # job id, AttachmentRecord, notes tuple
    failed = Signal(int, str)  # job id, message for the user
    started = Signal(int, str)  # job id, file name

    def __init__(self, count_tokens: Callable[[str], int], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.count_tokens = count_tokens
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(1)
        self._relay = _Relay()
        self._relay.done.connect(self._finish, Qt.ConnectionType.QueuedConnection)
        self._ids = itertools.count(1)
        self.pending: set[int] = set()

    def load(self, path: str, max_tokens: int) -> int:
        """Start reading ``path``; returns the job id used in the signals."""
        from pathlib import Path

        job_id = next(self._ids)
        self.pending.add(job_id)
        self.started.emit(job_id, Path(path).name)
        max_chars = max(1, max_tokens) * CHARS_PER_TOKEN_BOUND
        self.pool.start(_ReadJob(job_id, path, max_chars, self.count_tokens, self._relay))
        return job_id

    @Slot(int, object, object)
    def _finish(self, job_id: int, record: AttachmentRecord | None, detail) -> None:
        self.pending.discard(job_id)
        if record is None:
            self.failed.emit(job_id, str(detail))
        else:
            self.loaded.emit(job_id, record, tuple(detail or ()))

    def wait(self, msecs: int = 5000) -> bool:
        """Block until every job has finished (shutdown and tests)."""
        return self.pool.waitForDone(msecs)
