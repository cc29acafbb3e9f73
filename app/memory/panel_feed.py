"""Keeps the memory panel on the chat shown in the window.

Every per-session figure on the panel (KV line, pages, history, the "Chat"
column) comes from the shown session's own latest ``StatsSample``, which
``SessionCaches`` keeps per session; a chat whose cache is not held says so
instead of showing another chat's numbers. While several chats answer at once
(the engine sends a sample of each), one line names them all with each one's
KV bytes, from the same per-session samples.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer

from app.controller import ChatController
from app.format import visible_text
from app.memory.fit_check import FitChecker
from app.memory.panel import MemoryPanel
from app.memory.stored_kv import StoredKvFeed
from engine import StatsSample, system_readings

PROJECTION_EVERY = 8  # full-context projection refresh, in samples (free RAM drifts slowly)
RAM_EVERY_MS = 2000  # the system memory gauge between samples


class PanelFeed(QObject):
    """Feeds ``panel`` from ``controller``'s samples of the shown session.

    Args:
        controller: the ``ChatController`` (its current session, caches and signals).
        panel: the memory panel it fills.
        fit: the window's ``FitChecker`` (per-mode projections from the worker).
    """

    def __init__(self, controller: ChatController, panel: MemoryPanel, fit: FitChecker,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.controller, self.panel, self.fit = controller, panel, fit
        self._ticks = 0
        self._queued = False
        controller.statsUpdated.connect(self.on_stats)
        controller.cacheChanged.connect(self.refresh)
        controller.currentSessionChanged.connect(lambda _record: self.refresh())
        controller.answerFinished.connect(lambda _status: self.refresh())
        # The chat's state sentence changes as its job starts, moves on and ends.
        controller.activityChanged.connect(self.refresh_state)
        controller.ingestProgress.connect(lambda _progress: self.refresh_state())
        controller.bridge.storedKv.connect(self._listing_changed)
        # Samples come only while the engine works: the gauge reads the system itself.
        self._ram = QTimer(self, interval=RAM_EVERY_MS)
        self._ram.timeout.connect(lambda: self.show_system_memory(only_visible=True))
        self._ram.start()
        self.stored_kv = StoredKvFeed(controller, panel.stored_kv, self)
        for signal in (controller.busyChanged, controller.modelStateChanged,
                       controller.qualityChecked, controller.sessionsChanged):
            signal.connect(self.refresh_quality)
        panel.quality_action.triggered.connect(lambda: controller.check_quality())
        self.refresh()

    def refresh(self) -> None:
        """Show the current session: its name, its latest sample (or none) and projections."""
        current = self.controller.current
        session_id = current.id if current else None
        self.refresh_state()
        sample = self.controller.caches.sample_for(session_id)
        if sample is not None:
            self.panel.update_sample(sample, self.controller.total_kv())
        else:
            self.panel.show_no_cache()
            self.panel.show_total(self.controller.total_kv())
        self.show_system_memory()
        self._project(force=True)
        self.stored_kv.show()  # chat titles may have changed
        self.refresh_quality()

    def refresh_state(self) -> None:
        """Say the shown chat's state again (its job moved on, or its snapshot changed)."""
        current = self.controller.current
        session_id = current.id if current else None
        rotated = bool(session_id and self.controller.caches.rotations.get(session_id))
        self.panel.set_session(visible_text(current.title) if current else None,
                               current.kv_mode if current else None,
                               self.controller.cache_state(session_id), session_id,
                               rotated=rotated)
        self.panel.show_together(self.controller.answering_together())

    def _listing_changed(self, _listing: object) -> None:
        if not self.controller.closed:  # the app quits: the history is closing
            self.refresh_state()

    def refresh_quality(self, *_args: object) -> None:
        """The shown chat's quality receipts, and whether "Check Quality" can run now."""
        session_id = self.controller.current.id if self.controller.current else None
        receipts = self.controller.receipts(session_id)
        self.panel.show_receipts(receipts, self.controller.quality_unavailable(),
                                 self.controller.outdated_receipts(session_id, receipts))

    def show_system_memory(self, only_visible: bool = False) -> None:
        """Read the computer's memory now (psutil, no MLX): the gauge never waits for a sample."""
        if not only_visible or self.panel.isVisible():
            self.panel.show_system_memory(system_readings())

    def on_stats(self, sample: StatsSample) -> None:
        """A new sample: shown when it is the current session's (RAM from any)."""
        if not self.panel.isVisible():
            return
        shown = self.panel.update_sample(sample, self.controller.total_kv())
        self.panel.show_together(self.controller.answering_together())
        self._ticks += 1
        full = self._ticks % PROJECTION_EVERY == 0
        if (full or (shown and self.panel.kv_tokens != self.panel.now_tokens)) \
                and not self._queued:
            # Its own event-loop turn, and one for all samples that arrived meanwhile:
            # the sample above already took one, and streaming must not stutter.
            self._queued = True
            QTimer.singleShot(0, lambda: self._project(force=full))

    def _project(self, force: bool = False) -> None:
        self._queued = False
        tokens = self.panel.kv_tokens
        if tokens is None:
            current = self.controller.current
            tokens = current.tokens if current else 0
        if not force and tokens == self.panel.now_tokens:
            return
        self.panel.update_projection(self.fit.report_for(tokens), self.fit.full_context_report())
