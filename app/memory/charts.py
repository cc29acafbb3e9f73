"""QPainter pictures for the memory panel: the page pool and a history chart."""

from __future__ import annotations

import math
from collections import deque

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import (
    QColor,
    QPainter,
    QPaintEvent,
    QPalette,
    QPen,
    QPolygonF,
    QResizeEvent,
)
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.format import human_bytes

MAX_CELLS = 320
MAX_ROWS = 4  # the grid's height at most: the panel's top sections fit a 700-px window
MIN_CHART_SPAN = 20
CELL = 9
GAP = 2


class PagePoolView(QWidget):
    """A grid of the storage's page cells: in use (filled), other chats' (faint:
    storage shared with them), and free (outlined). ``allocated`` is the whole
    storage, its free pages included."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.in_use = self.allocated = self.free = 0
        self.last_fill = 0.0
        self.colour = QColor("#2f7d5b")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(CELL * 3)

    def set_pages(self, in_use: int, allocated: int, free: int, last_fill: float,
                  colour: QColor) -> None:
        """Update the picture (repaints only when something changed)."""
        state = (in_use, allocated, free, round(last_fill, 2), colour.name())
        if state == (self.in_use, self.allocated, self.free, round(self.last_fill, 2),
                     self.colour.name()):
            return
        self.in_use, self.allocated, self.free = in_use, allocated, free
        self.last_fill, self.colour = last_fill, colour
        self._fit_height()
        self.update()

    def _fit_height(self) -> None:
        # Sized here, never in paintEvent: resizing while painting loops forever.
        height = self.sizeHint().height()
        if height != self.height():
            self.setFixedHeight(height)

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._fit_height()

    def pages_per_cell(self) -> int:
        """How many pages one cell stands for (the pool may be huge), at most
        ``MAX_ROWS`` rows of cells at the grid's width."""
        return max(1, math.ceil(self.allocated / min(MAX_CELLS, MAX_ROWS * self._columns())))

    def _columns(self) -> int:
        return max(1, (self.width() + GAP) // (CELL + GAP))

    def sizeHint(self) -> QSize:
        cells = math.ceil(self.allocated / self.pages_per_cell()) or 1
        rows = math.ceil(cells / self._columns())
        return QSize(200, max(CELL, rows * (CELL + GAP)))

    def heightForWidth(self, width: int) -> int:
        return self.sizeHint().height()

    def paintEvent(self, _event: QPaintEvent) -> None:
        # A few batched draw calls, not several per cell: this repaints at 4 Hz
        # while the engine thread competes for the GIL.
        painter = QPainter(self)
        per = self.pages_per_cell()
        cells = math.ceil(self.allocated / per)
        taken = self.allocated - self.free  # this chat's pages, then other chats'
        columns = self._columns()
        used: list[QRectF] = []
        reserved: list[QRectF] = []
        free: list[QRectF] = []
        partial: QRectF | None = None
        for cell in range(cells):
            first_page = cell * per
            rect = QRectF((cell % columns) * (CELL + GAP), (cell // columns) * (CELL + GAP),
                          CELL, CELL)
            if first_page < self.in_use:
                last = first_page + per >= self.in_use and per == 1 and 0 < self.last_fill < 1
                (reserved if last else used).append(rect)
                if last:
                    partial = QRectF(rect.x(), rect.y() + CELL * (1 - self.last_fill),
                                     CELL, CELL * self.last_fill)
            elif first_page < taken:
                reserved.append(rect)
            else:
                free.append(rect.adjusted(0.5, 0.5, -0.5, -0.5))
        empty = QColor(self.colour)
        empty.setAlphaF(0.28)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(empty)
        painter.drawRects(reserved)
        painter.setBrush(self.colour)
        painter.drawRects(used)
        if partial is not None:
            painter.drawRect(partial)
        painter.setPen(QPen(self.palette().color(QPalette.ColorRole.Mid), 1))
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawRects(free)


KEPT_HISTORIES = 16  # chats whose history is kept while another is shown


class HistoryChart(QWidget):
    """Two lines over time: KV bytes used and process RSS."""

    def __init__(self, capacity: int = 240, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.kv: deque[int] = deque(maxlen=capacity)
        self.rss: deque[int] = deque(maxlen=capacity)
        # The chat whose history is shown, and the others' kept for a switch back.
        self.session_id: str | None = None
        self._kept: dict[str, tuple[deque[int], deque[int]]] = {}
        self.held = False  # whether the chat shown holds a cache now (its last sample's)
        self.kv_colour = QColor("#2f7d5b")
        self.rss_colour = QColor("#8a6bd1")
        self.setMinimumHeight(90)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def add(self, kv_bytes: int, rss_bytes: int) -> None:
        """Append one sample and repaint."""
        self.held = True
        self.kv.append(kv_bytes)
        self.rss.append(rss_bytes)
        self.update()

    def clear(self) -> None:
        """Forget the history shown."""
        self.kv.clear()
        self.rss.clear()
        self.update()

    def show_no_cache(self) -> None:
        """The chat's cache left memory: its history stays, the legend's figure goes
        (the last sample's bytes are no longer held)."""
        self.held = False
        self.update()

    def legend(self) -> tuple[str, str]:
        """The legend's two figures: the KV held now and the process's memory."""
        kv = human_bytes(self.kv[-1]) if self.held and self.kv else "none in memory"
        return f"● KV {kv}", f"● RSS {human_bytes(self.rss[-1] if self.rss else 0)}"

    def show_session(self, session_id: str | None) -> None:
        """Show ``session_id``'s own history, kept while other chats were shown."""
        if session_id == self.session_id:
            return
        if self.session_id is not None:
            self._kept[self.session_id] = (self.kv, self.rss)
            while len(self._kept) > KEPT_HISTORIES:
                self._kept.pop(next(iter(self._kept)))
        self.session_id = session_id
        capacity = self.kv.maxlen
        fresh: tuple[deque[int], deque[int]] = (deque(maxlen=capacity), deque(maxlen=capacity))
        self.kv, self.rss = self._kept.pop(session_id, fresh) if session_id is not None else fresh
        self.update()

    def _line(self, values: deque[int], top: float, rect: QRectF) -> QPolygonF:
        # Stretch a short history across the chart; scroll once it is full.
        span = max(MIN_CHART_SPAN, len(values)) - 1
        step = rect.width() / span
        start = rect.right() - step * (len(values) - 1)
        return QPolygonF([QPointF(start + i * step, rect.bottom() - rect.height() * v / top)
                          for i, v in enumerate(values)])

    def paintEvent(self, _event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        palette = self.palette()
        rect = QRectF(self.rect()).adjusted(1, 16, -1, -1)
        painter.setPen(QPen(palette.color(QPalette.ColorRole.Mid), 1))
        painter.setBrush(palette.color(QPalette.ColorRole.Base))
        painter.drawRoundedRect(rect, 5, 5)
        muted = QColor(palette.color(QPalette.ColorRole.Text))
        muted.setAlphaF(0.7)
        small = painter.font()
        small.setPointSizeF(max(7.0, small.pointSizeF() * 0.85))
        painter.setFont(small)
        kv_top = max(self.kv, default=0)
        rss_top = max(self.rss, default=0)
        legend = self.legend()
        painter.setPen(self.kv_colour)
        painter.drawText(QRectF(0, 0, rect.width() / 2, 14), Qt.AlignmentFlag.AlignLeft, legend[0])
        painter.setPen(self.rss_colour)
        painter.drawText(QRectF(rect.width() / 2, 0, rect.width() / 2, 14),
                         Qt.AlignmentFlag.AlignRight, legend[1])
        inner = rect.adjusted(4, 6, -4, -4)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        for values, top, colour in ((self.rss, rss_top, self.rss_colour),
                                    (self.kv, kv_top, self.kv_colour)):
            if len(values) >= 2 and top > 0:
                painter.setPen(QPen(colour, 1.6))
                painter.drawPolyline(self._line(values, top * 1.1, inner))
        if not self.kv:
            painter.setPen(muted)
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, "No samples yet")
