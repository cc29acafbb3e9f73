"""The one request the chat runs at a time, an answer or a re-ingest.

What needs the engine (sending, regenerating, switching models, reopening,
deleting the answering chat) waits for it; ``refuse`` says so in the banner.
Reading other chats does not: the answer stays bound to ``session_id``.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

REFUSAL = "Stop {running} before {what}."
# What the Stop button stops, by Activity kind, in the refusal's words.
RUNNING = {"chat": "the current answer", "ingest": "reading the conversation in",
           "quality": "the quality check"}


class Activity(QObject):
    """Which answer or ingest runs now.

    ``request`` is its engine request id, or -1 while it waits for its
    session's KV cache to open (the real id is not known yet); ``kind`` is
    "chat" or "ingest"; ``session_id`` the session it reads or answers in.
    All are None when nothing runs.
    """

    busyChanged = Signal(bool)
    refused = Signal(str)  # the message saying what has to wait

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.request: int | None = None
        self.kind: str | None = None
        self.session_id: str | None = None

    @staticmethod
    def is_refusal(text: str) -> bool:
        """Whether ``text`` is a refusal of this kind, which is moot once nothing runs."""
        return any(text.startswith(f"Stop {running} before ") and text.endswith(".")
                   for running in RUNNING.values())

    @property
    def busy(self) -> bool:
        """True while an answer streams or a conversation is ingested."""
        return self.request is not None

    def set(self, request: int | None, kind: str | None, session_id: str | None = None) -> None:
        """Record the running request (None, None: nothing runs) and say whether it is busy."""
        if session_id is not None or request is None:
            self.session_id = session_id
        self.request, self.kind = request, kind
        self.busyChanged.emit(request is not None)

    def clear(self) -> None:
        """Nothing runs any more."""
        self.set(None, None)

    def forget(self) -> None:
        """Drop the running request without a signal: the window is closing."""
        self.request = self.kind = self.session_id = None

    def refuse(self, what: str) -> bool:
        """True, with a message, when ``what`` has to wait for the running request."""
        if self.busy:
            running = RUNNING.get(self.kind or "", RUNNING["chat"])
            self.refused.emit(REFUSAL.format(running=running, what=what))
            return True
        return False
