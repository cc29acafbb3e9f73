"""What is typed in the composer, kept per chat across chat switches and restarts.

Each chat's draft lives in the history with the chat (``HistoryStore.set_draft``),
saved a moment after the typing stops, so a crash loses at most that moment;
switching chats saves the one left at once and shows the one opened. Text
typed while no chat is shown goes with the chat the next send or New Chat
makes. Attachments are not part of a draft.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer

SAVE_AFTER_MS = 400


class Drafts(QObject):
    """Keeps ``composer``'s text as the draft of the chat ``controller`` shows."""

    def __init__(self, controller, composer, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.composer = controller.store, composer
        current = controller.current
        self.session_id: str | None = current.id if current else None
        self._loading = False
        self._timer = QTimer(self, singleShot=True, interval=SAVE_AFTER_MS)
        self._timer.timeout.connect(self.save_now)
        composer.edit.textChanged.connect(self._typed)
        controller.currentSessionChanged.connect(self._switched)
        self._show(self.store.draft(self.session_id))

    def save_now(self) -> None:
        """Write the shown chat's draft (the window closes, or the typing paused)."""
        self._timer.stop()
        self.store.set_draft(self.session_id, self.composer.text())

    def _typed(self) -> None:
        if self._loading:
            return
        if not self.composer.text():
            self.save_now()  # a sent message must not come back as a draft after a crash
        else:
            self._timer.start()

    def _switched(self, record) -> None:
        new_id = record.id if record is not None else None
        if new_id == self.session_id:  # renamed, or its count changed: the same chat
            return
        text = self.composer.text()
        draft = self.store.draft(new_id)
        if self.session_id is None and new_id is not None and text and not draft:
            # Typed before any chat existed: the chat just made (a send, New Chat) takes it.
            self.store.set_draft(None, "")
            self.session_id = new_id
            self.save_now()
            return
        self.save_now()
        self.session_id = new_id
        self._show(draft)

    def _show(self, text: str) -> None:
        if text == self.composer.text():
            return
        self._loading = True
        try:
            self.composer.edit.setPlainText(text)
            self.composer.edit.moveCursor(self.composer.edit.textCursor().MoveOperation.End)
        finally:
            self._loading = False
