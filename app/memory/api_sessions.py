"""The memory panel's "API sessions": what the local server holds on the engine.

Shown only while the local server runs. The sessions come from the server's
own list (name, KV mode, tokens of its last prompt); their bytes from each
one's latest ``StatsSample``, which the worker sends as it reads or answers
(kept here: the chats' ``SessionCaches`` keeps only the chats').
"""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QVBoxLayout, QWidget

from app.controller import ChatController
from app.format import api_chat_title, human_bytes
from app.memory.labels import section_heading, value_label
from engine import API_SESSION_PREFIX, KvMode, StatsSample

NONE_YET = "None yet: the first request opens one."


def session_line(number: int, mode: KvMode, tokens: int, sample: StatsSample | None) -> str:
    """"Another app's chat 1 · q8 · 1,234 tokens · 2.1 MB" (bytes once a sample of it
    arrived)."""
    if sample is not None:
        tokens = sample.tokens_in_context
    size = f" · {human_bytes(sample.kv_bytes_used)}" if sample is not None else ""
    return f"{api_chat_title(number)} · {mode} · {tokens:,} tokens{size}"


class ApiSessionsSection(QWidget):
    """A heading and one line per API session; hidden while the server is off."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(6)
        heading = section_heading("API sessions")
        heading.setToolTip("Conversations the local server keeps in memory for other apps; "
                           "the least recently used goes to disk when another is needed.")
        layout.addWidget(heading)
        self.rows = value_label(NONE_YET)
        layout.addWidget(self.rows)
        self.hide()

    def show_sessions(self, running: bool, lines: list[str]) -> None:
        """Show ``lines`` (one per session) while the server runs; hide otherwise."""
        self.setVisible(running)
        self.rows.setText("<br>".join(lines) if lines else NONE_YET)


class ApiSessionsFeed(QObject):
    """Fills ``section`` from the controller's local server and its stats samples.

    Args:
        controller: the ``ChatController`` (its ``local_server`` and stats samples).
        section: the section it fills.
    """

    def __init__(self, controller: ChatController, section: ApiSessionsSection,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.controller, self.section = controller, section
        controller.local_server.statusChanged.connect(lambda _status: self.refresh())
        controller.statsUpdated.connect(self._on_stats)
        self.refresh()

    def _on_stats(self, sample: StatsSample) -> None:
        if sample.session_id and sample.session_id.startswith(API_SESSION_PREFIX):
            self.refresh()

    def refresh(self) -> None:
        """Show the server's sessions now."""
        host = self.controller.local_server
        lines = [session_line(number, s.mode, s.tokens, sample)
                 for number, s, sample in self.controller.api_sessions()]
        self.section.show_sessions(host.running, lines)
