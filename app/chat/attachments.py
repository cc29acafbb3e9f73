"""Reading dropped files off the GUI thread.

Each file is parsed (``engine.documents.reader``) and its tokens counted on a pool
thread; the result comes back to the GUI thread through a queued signal. A
file longer than the room in the context is measured in tokens and offered
cut to the part that fits (``tooLong``); the user takes it or not.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Callable, Sequence

from PySide6.QtCore import QObject, QRunnable, Qt, QThreadPool, Signal, Slot

from app.format import human_bytes
from app.store import AttachmentRecord
from engine import DocumentTooLong, EngineError, read_document

CHARS_PER_TOKEN_BOUND = 8  # no tokenizer packs more characters into one token
# Text read to count a file that is too long, so the refusal says its tokens and
# the part that fits can be offered; longer files are refused by their size.
READ_CAP_CHARS = 4 * 1024 * 1024


class TooLong:
    """A file longer than the room in the context, and the part of it that fits."""

    def __init__(self, message: str, part: AttachmentRecord | None) -> None:
        self.message, self.part = message, part


def fitting_prefix(text: str, max_tokens: int, ends: Sequence[int]) -> tuple[str, int]:
    """The longest prefix of ``text`` (cut at a line end when one is near) within
    ``max_tokens``, and its tokens.

    ``ends`` says where each of ``text``'s tokens ends (one tokenization of the
    whole text): the cut is found on those offsets, never by tokenizing again.
    """
    if len(ends) <= max_tokens:
        return text, len(ends)
    if max_tokens < 1:
        return "", 0
    cut = ends[max_tokens - 1]
    line_end = text.rfind("\n", 0, cut)
    if line_end > cut * 0.9:
        cut = line_end + 1  # a whole last line reads better than half of one
    return text[:cut], bisect.bisect_right(ends, cut)


def too_long_message(name: str, size: int, tokens: int | None, max_tokens: int) -> str:
    """The refusal, in tokens and the file's real size."""
    amount = f", about {tokens:,} tokens — more" if tokens is not None else " — far more"
    return (f"“{name}” is {human_bytes(size)}{amount} than the {max_tokens:,} "
            "tokens left in this model's context.")


class _Relay(QObject):
    done = Signal(int, object, object)  # job id, AttachmentRecord | TooLong | None, detail


class _ReadJob(QRunnable):
    def __init__(self, job_id: int, path: str, max_tokens: int,
                 token_ends: Callable[[str], Sequence[int]], relay: _Relay) -> None:
        super().__init__()
        self.job_id, self.path, self.max_tokens = job_id, path, max_tokens
        self.token_ends, self.relay = token_ends, relay
        self.setAutoDelete(True)

    def run(self) -> None:
        max_chars = max(1, self.max_tokens) * CHARS_PER_TOKEN_BOUND
        try:
            doc = read_document(self.path, max_chars=max(max_chars, READ_CAP_CHARS))
            ends = self.token_ends(doc.text)  # the one tokenization of this file
            record = AttachmentRecord(doc.name, doc.size_bytes, doc.sha256, len(ends), doc.text)
            if len(ends) > self.max_tokens:
                self.relay.done.emit(self.job_id, self._too_long(record, ends), doc.notes)
            else:
                self.relay.done.emit(self.job_id, record, doc.notes)
        except DocumentTooLong:
            name = os.path.basename(self.path)
            size = os.stat(self.path).st_size
            self.relay.done.emit(self.job_id, None,
                                 too_long_message(name, size, None, self.max_tokens)
                                 + " Split it into smaller files.")
        except EngineError as exc:
            self.relay.done.emit(self.job_id, None, str(exc))
        except Exception as exc:  # never let a worker thread die silently
            self.relay.done.emit(self.job_id, None, f"Couldn't read the file: {exc}")


    def _too_long(self, whole: AttachmentRecord, ends: Sequence[int]) -> TooLong:
        text, tokens = fitting_prefix(whole.text, self.max_tokens, ends)
        message = too_long_message(whole.name, whole.size, whole.tokens, self.max_tokens)
        if not text:
            return TooLong(message, None)
        part = AttachmentRecord(whole.name, whole.size, whole.sha256, tokens, text)
        return TooLong(message, part)


class DocumentLoader(QObject):
    """Reads files on a private thread pool and reports on the GUI thread.

    Args:
        token_ends: where each token of a text ends, thread-safe (the engine bridge's).
    """

    loaded = Signal(int, object, object)  # job id, AttachmentRecord, notes tuple
    failed = Signal(int, str)  # job id, message for the user
    tooLong = Signal(int, str, object)  # job id, message, the part that fits (or None)
    started = Signal(int, str)  # job id, file name

    def __init__(self, token_ends: Callable[[str], Sequence[int]],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.token_ends = token_ends
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(1)
        self._relay = _Relay()
        self._relay.done.connect(self._finish, Qt.ConnectionType.QueuedConnection)
        self._ids = itertools.count(1)
        self.pending: set[int] = set()
        self.offered: dict[int, AttachmentRecord] = {}  # job id -> part offered

    def load(self, path: str, max_tokens: int) -> int:
        """Start reading ``path``; returns the job id used in the signals."""
        from pathlib import Path

        job_id = next(self._ids)
        self.pending.add(job_id)
        self.started.emit(job_id, Path(path).name)
        self.pool.start(_ReadJob(job_id, path, max_tokens, self.token_ends, self._relay))
        return job_id

    def accept_part(self, job_id: int) -> None:
        """Attach the part of a too-long file that was offered."""
        part = self.offered.pop(job_id, None)
        if part is not None:
            self.loaded.emit(job_id, part, (f"Attached the first {part.tokens:,} tokens of "
                                            f"“{part.name}”.",))

    def decline_part(self, job_id: int, message: str) -> None:
        """The offer was declined: the file is not attached."""
        if self.offered.pop(job_id, None) is not None:
            self.failed.emit(job_id, message)

    @Slot(int, object, object)
    def _finish(self, job_id: int, record: AttachmentRecord | None, detail) -> None:
        self.pending.discard(job_id)
        if record is None:
            self.failed.emit(job_id, str(detail))
        elif isinstance(record, TooLong):
            if record.part is None:
                self.failed.emit(job_id, record.message)
            else:
                self.offered[job_id] = record.part
                self.tooLong.emit(job_id, record.message, record.part)
        else:
            self.loaded.emit(job_id, record, tuple(detail or ()))

    def wait(self, msecs: int = 5000) -> bool:
        """Block until every job has finished (shutdown and tests)."""
        return self.pool.waitForDone(msecs)
