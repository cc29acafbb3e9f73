"""Reading dropped files off the GUI thread.

Each file is parsed (``engine.documents.reader``) and its tokens counted on a pool
thread (``app.background``); the result comes back on the GUI thread. A
file longer than the room in the context is measured in tokens and offered
cut to the part that fits (``tooLong``); the user takes it or not. A file whose
chip is removed while it is read, or waits to be, is cancelled (``cancel``):
the pool reads one file at a time, and the files dropped after it wait for it.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections.abc import Callable, Iterable, KeysView, Sequence
from typing import cast

from PySide6.QtCore import QObject, Signal

from app.background import Background
from app.format import counted, human_bytes, visible_text
from app.store import AttachmentRecord
from engine import DocumentTooLong, EngineError, file_patterns, read_document

CHARS_PER_TOKEN_BOUND = 8  # no tokenizer packs more characters into one token
# Text read to count a file that is too long, so the refusal says its tokens and
# the part that fits can be offered; longer files are refused by their size.
READ_CAP_CHARS = 4 * 1024 * 1024
# Files one message holds. A drop of a whole folder's files would otherwise make
# a chip, a read and a draft entry for each (thousands), and no model's context
# holds that many documents worth reading anyway.
MAX_FILES = 20


def attach_filter() -> str:
    """The attach dialog's name filter: every file the reader reads, then all files."""
    return f"Documents ({' '.join(file_patterns())});;All files (*)"


def copy_of(record: AttachmentRecord,
            attached: Iterable[AttachmentRecord]) -> AttachmentRecord | None:
    """The one of ``attached`` holding ``record``'s text, if any: attaching it again
    would only put that text in the prompt twice."""
    return next((kept for kept in attached
                 if kept.sha256 == record.sha256 and kept.text == record.text), None)


def already_attached(name: str, attached: str) -> str:
    """What is said when file ``name`` holds the same text as ``attached``, attached."""
    if name == attached:
        return f"“{name}” is already attached to this message."
    return f"“{name}” holds the same text as “{attached}”, already attached to this message."


def awaiting_model(paths: Sequence[str]) -> str:
    """What is said of files given before a model is ready to count their tokens."""
    name = os.path.basename(paths[0]) if len(paths) == 1 else ""
    which = f"“{visible_text(name)}”" if name else counted(len(paths), "file")
    return f"{which} will be attached once the model has loaded."


def files_left_out(given: int, taken: int) -> str:
    """What is said when ``given`` files came and only ``taken`` fit under ``MAX_FILES``."""
    left = given - taken
    if not taken:
        return (f"This message already has {MAX_FILES} attached files, the most one "
                f"message takes, so {left:,} more {'file was' if left == 1 else 'files were'} "
                "not attached. Send it or remove some files, then attach the others.")
    return (f"{counted(given, 'file')} were given, more than the {MAX_FILES} one message "
            f"takes: the first {counted(taken, 'file')} {'is' if taken == 1 else 'are'} "
            "attached and the other "
            f"{left:,} {'is' if left == 1 else 'are'} not. Send these, then attach the rest to "
            "a later message, or combine them into fewer files.")


def restored_left_out(held: int) -> str:
    """What is said when a stored draft held more files than ``MAX_FILES``."""
    return (f"This chat's draft held {held:,} attached files, more than the {MAX_FILES} one "
            f"message takes; the first {MAX_FILES} are kept. Attach the others to a later "
            "message.")


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
            "tokens left in this model's context (after the chat so far and room for the "
            "answer).")


def read_attachment(path: str, max_tokens: int, token_ends: Callable[[str], Sequence[int]],
                    cancel: threading.Event | None = None
                    ) -> tuple[AttachmentRecord | TooLong | None, str | tuple[str, ...]]:
    """Read and count one file (on a pool thread): the record or what is too long, and notes.

    A file too long even to count comes back as (None, the refusal).

    Raises:
        EngineError: the file cannot be read (``engine.documents.reader``), or
            ``cancel`` was set while it was read (``Cancelled``).
    """
    max_chars = max(1, max_tokens) * CHARS_PER_TOKEN_BOUND
    try:
        doc = read_document(path, max_chars=max(max_chars, READ_CAP_CHARS), cancel=cancel)
    except DocumentTooLong:
        name = os.path.basename(path)
        size = os.stat(path).st_size
        return None, (too_long_message(name, size, None, max_tokens)
                      + " Split it into smaller files.")
    ends = token_ends(doc.text)  # the one tokenization of this file
    record = AttachmentRecord(doc.name, doc.size_bytes, doc.sha256, len(ends), doc.text)
    if len(ends) > max_tokens:
        return _too_long(record, max_tokens, ends), doc.notes
    return record, doc.notes


def _too_long(whole: AttachmentRecord, max_tokens: int, ends: Sequence[int]) -> TooLong:
    text, tokens = fitting_prefix(whole.text, max_tokens, ends)
    message = too_long_message(whole.name, whole.size, whole.tokens, max_tokens)
    if not text:
        return TooLong(message, None)
    if tokens < max_tokens:  # the offer's count is lower than the room: say why
        message += (f" The part offered, {tokens:,} tokens, ends at the last whole line "
                    "that fits.")
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
        self.jobs = Background(threads=1, parent=self)
        self._ids = itertools.count(1)
        self._cancels: dict[int, threading.Event] = {}  # job id -> its cancel, while read
        self.offered: dict[int, AttachmentRecord] = {}  # job id -> part offered

    @property
    def pending(self) -> KeysView[int]:
        """The jobs still being read, or waiting to be (a cancelled one is not)."""
        return self._cancels.keys()

    def load(self, path: str, max_tokens: int) -> int:
        """Start reading ``path``; returns the job id used in the signals."""
        from pathlib import Path

        job_id = next(self._ids)
        cancel = self._cancels[job_id] = threading.Event()
        self.started.emit(job_id, Path(path).name)
        self.jobs.run(lambda: read_attachment(path, max_tokens, self.token_ends, cancel),
                      lambda outcome: self._finish(job_id, outcome))
        return job_id

    def cancel(self, job_id: int) -> None:
        """Stop reading a file (its chip was removed): a read under way ends at its next
        page, one still waiting ends as it starts, and no signal comes for it."""
        cancel = self._cancels.pop(job_id, None)
        if cancel is not None:
            cancel.set()

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

    def _finish(self, job_id: int, outcome: object) -> None:
        if self._cancels.pop(job_id, None) is None:  # cancelled: no one waits for it
            return
        detail: str | tuple[str, ...]
        if isinstance(outcome, EngineError):
            record, detail = None, str(outcome)
        elif isinstance(outcome, BaseException):  # a bug, logged: the user still hears of it
            record, detail = None, f"Couldn't read the file: {outcome}"
        else:  # what read_attachment returned
            record, detail = cast("tuple[AttachmentRecord | TooLong | None, str | tuple[str, ...]]",
                                  outcome)
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
        return self.jobs.wait(msecs)
