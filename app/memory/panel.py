"""The right-hand memory panel: KV bytes, pages, RAM pressure, per-mode projections.

Fed by ``StatsSample``s (>= 2 Hz while the engine works, polled otherwise);
the projection table comes from the worker's fit check, which is arithmetic
over the model's facts and never touches MLX. A model split across machines
adds a row per machine (its layers, KV, pages and free RAM), and the projection
is then the machines' together: what the tightest of them holds.
"""

from __future__ import annotations

import html
from types import SimpleNamespace
from typing import Protocol

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QBrush, QColor, QFont
from PySide6.QtWidgets import (
    QFrame,
    QHeaderView,
    QLabel,
    QProgressBar,
    QScrollArea,
    QTableWidget,
    QTableWidgetItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.format import counted, human_bytes, percent, short_title, short_tokens, visible_text
from app.memory.api_sessions import ApiSessionsSection
from app.memory.charts import HistoryChart, PagePoolView
from app.memory.labels import section_heading, value_label
from app.memory.quality import (
    advice,
    outdated_line,
    receipt_details,
    receipt_line,
    receipt_summary,
)
from app.memory.stored_kv import StoredKvSection
from app.sessions.caches import KvTotal
from app.sessions.session_list import mode_colour
from engine import DEFAULT_MODE, MODES, REFERENCE, FitReport, KvMode, RankShare, StatsSample

RAM_WARNING_PERCENT = 80.0
RAM_CRITICAL_PERCENT = 92.0
NO_CACHE = "None of it in memory now"
KV_TIP = ("The KV cache: what the model keeps of each token it has read, so it does not "
          "read them again. It grows with the chat, in the chat's KV mode.")
PAGES_TIP = ("Pages are per layer: each attention layer keeps its own pages of the chat's "
             "tokens, so a short chat still holds one page in every layer.")
STORAGE_NOTE = ("Sizes are storage arithmetic for whole pages: the last page of each layer "
                "counts in full.")
QUALITY_COLUMN = 3  # same top-1 as fp16, from the chat's quality receipts
MACHINES_TIP = ("The model is split across these machines: each runs its layers and keeps "
                "this chat's pages for them, so each needs room for every token. Another "
                "machine's figures are as of its last reply (the chat's open, a message's "
                "start and end).")
NOT_MEASURED = "Not measured for this chat yet."
TOTAL_TIP = ("The pages of every chat held in memory, each page two chats share once. "
             "\"Held\": their storage with the room it keeps ahead for the next tokens (it "
             "grows in steps, not a page at a time): what your memory limit counts.")
TOGETHER_TIP = ("The chats the model answers at once: each step makes the next token of "
                "every one of them. Each keeps its own pages, in its own KV mode.")


class SystemMemory(Protocol):
    """The computer's memory readings: a ``StatsSample``'s, or ``system_readings``'."""

    @property
    def system_total_bytes(self) -> int: ...

    @property
    def system_available_bytes(self) -> int: ...

    @property
    def system_used_percent(self) -> float: ...

    @property
    def pressure_level(self) -> str | None: ...


def ram_level(sample: SystemMemory) -> str:
    """"normal", "warning" or "critical" from used % and the OS pressure level."""
    pressure = (sample.pressure_level or "").lower()
    if pressure == "critical" or sample.system_used_percent >= RAM_CRITICAL_PERCENT:
        return "critical"
    if pressure in ("warn", "warning") or sample.system_used_percent >= RAM_WARNING_PERCENT:
        return "warning"
    return "normal"


def shared_note(sample: StatsSample) -> str:
    """" · 4.1 MB shared with 1 other chat" when pages are shared, else ""."""
    others = sample.kv_shared_with
    if not sample.kv_shared_bytes or not others:
        return ""
    return (f" · {human_bytes(sample.kv_shared_bytes)} shared with "
            f"{counted(others, 'other chat')}")


def other_layers_line(sample: StatsSample) -> str:
    """"Other layers: 24.0 MB of ≤ 30.0 MB (sliding windows) · checkpoints 96.0 MB of
    ≤ 120.0 MB" on its own line, or ""."""
    if not sample.other_cache_kinds:
        return ""
    line = (f"<br>Other layers: {human_bytes(sample.other_cache_bytes)} of ≤ "
            f"{human_bytes(sample.other_cache_bound_bytes)} ({sample.other_cache_kinds})")
    if sample.checkpoint_bound_bytes:
        line += (f" · checkpoints {human_bytes(sample.checkpoint_bytes)} of ≤ "
                 f"{human_bytes(sample.checkpoint_bound_bytes)}")
    return line


def together_line(chats: list[tuple[str, int | None]]) -> str:
    """"Answering together: ‘A’ 1.2 MB · ‘B’ 3.4 MB" for two chats or more, else "".

    ``chats``: each chat's title and the KV bytes its latest sample says (None
    before its first).
    """
    if len(chats) < 2:
        return ""
    parts = [f"‘{short_title(visible_text(title), 24)}’ "
             + (human_bytes(kv_bytes) if kv_bytes is not None else "no pages yet")
             for title, kv_bytes in chats]
    return "Answering together: " + " · ".join(parts)


def pages_text(sample: StatsSample) -> str:
    """The page figures, saying that pages are per layer."""
    layers = len(sample.layers)
    per = sample.pages_in_use / layers if layers else 0
    about = "" if per == int(per) else "about "
    where = f" across {layers} layers ({about}{per:,.0f} per layer)" if layers else ""
    # Storage shared with other chats (a document's) holds their own pages too.
    others = sample.pages_allocated - sample.pages_in_use - sample.pages_free
    theirs = f" · {others:,} other chats'" if others > 0 else ""
    return (f"{sample.pages_in_use:,} pages in use{where} · {sample.pages_allocated:,} "
            f"allocated · {sample.pages_free:,} free{theirs} · last page "
            f"{percent(sample.last_page_fill)} full · {sample.page_size} tokens a page")


def fits_sentence(tokens_fit: int, max_context: int, mode: KvMode, machines: int = 1,
                  tight: RankShare | None = None, *, budget_bound: bool = False) -> str:
    """"Fits in free memory: the whole context" or how many tokens of it, in ``mode``;
    on ``machines`` > 1, what they hold together and the ``tight`` one that limits it;
    ``budget_bound``: the memory limit set in Settings, not free memory, limits it."""
    where = fit_place(budget_bound, machines)
    if tokens_fit >= max_context:
        return f"Fits in {where}: the whole context ({max_context:,} tokens) in {mode}."
    text = f"Fits in {where}: {tokens_fit:,} of {max_context:,} tokens in {mode}."
    return text + (f" The tight one: {tight.host}." if tight is not None else "")


def fit_place(limit_binds: bool, machines: int = 1) -> str:
    """What holds the tokens that fit, as the panel and the New Chat dialog say it:
    "your memory limit (Settings)" where it binds, else free memory."""
    if limit_binds:
        return "your memory limit (Settings)"
    return "free memory" if machines <= 1 else f"the free memory of {machines} machines"


def machine_line(share: RankShare) -> str:
    """One machine of a pipeline: "<b>mac2</b> · layers 0–11 · 4.0 MB in 8 pages · 9 GB free"."""
    first, end = share.layers
    return (f"<b>{html.escape(share.host)}</b> · layers {first}–{end - 1} · "
            f"{human_bytes(share.kv_bytes)} in {share.pages_in_use:,} pages · "
            f"{human_bytes(share.free_bytes)} free")


def _fits_text(tokens_fit: int, max_context: int) -> str:
    """Tokens memory holds, capped at the model's context (more is of no use), as the
    context is said everywhere else ("8.1k"): rounded down, so only "all" reads as all."""
    if tokens_fit >= max_context:
        return f"all {short_tokens(max_context)}"
    short = short_tokens(tokens_fit)
    # Just short of the context, the short figure is the context's own: the count says it.
    return f"{tokens_fit:,}" if short == short_tokens(max_context) else short


class MemoryPanel(QScrollArea):
    """Live KV, page-pool and RAM view for the current session."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("memoryPanel")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setMinimumWidth(300)
        body = QWidget()
        body.setObjectName("memoryBody")
        layout = QVBoxLayout(body)
        # Tight margins: at a 700-px window the sections down to Check Quality show
        # without scrolling, and the table of modes fits the panel's minimum width.
        layout.setContentsMargins(8, 8, 8, 8)
        layout.setSpacing(4)
        self.title = QLabel("Memory")
        self.title.setObjectName("panelTitle")
        layout.addWidget(self.title)
        self.session_label = value_label()
        layout.addWidget(self.session_label)

        layout.addWidget(section_heading("Memory this chat uses"))
        self.kv_bar = QProgressBar()
        self.kv_bar.setTextVisible(False)
        self.kv_bar.setMaximumHeight(8)
        # Bars without text: a screen reader has only these names to say what they measure.
        self.kv_bar.setAccessibleName("This chat's KV bytes in use, of those allocated")
        self.kv_label = value_label()
        self.kv_label.setToolTip(KV_TIP)
        self.kv_total_label = value_label()
        self.kv_total_label.setToolTip(TOTAL_TIP)
        layout.addWidget(self.kv_label)
        layout.addWidget(self.kv_total_label)
        self.together_label = value_label("")
        self.together_label.setObjectName("answeringTogether")
        self.together_label.setTextFormat(Qt.TextFormat.PlainText)  # titles are the user's
        self.together_label.setToolTip(TOGETHER_TIP)
        self.together_label.hide()
        layout.addWidget(self.together_label)

        layout.addWidget(section_heading("System memory"))
        self.ram_bar = QProgressBar()
        self.ram_bar.setTextVisible(False)
        self.ram_bar.setMaximumHeight(8)
        self.ram_bar.setObjectName("ramGauge")
        self.ram_bar.setAccessibleName("System memory used")
        self.ram_label = value_label()
        self.ram_label.setToolTip("Memory of the whole computer, used by every app; Longleaf "
                                  "stops an answer before it runs out")
        layout.addWidget(self.ram_label)
        layout.addWidget(self.ram_bar)

        # Only for a model split across machines.
        self.machines_heading = section_heading("Machines")
        self.machines_label = value_label()
        self.machines_label.setObjectName("machines")
        self.machines_label.setToolTip(MACHINES_TIP)
        layout.addWidget(self.machines_heading)
        layout.addWidget(self.machines_label)
        self.show_machines(())

        layout.addWidget(section_heading("Memory by KV mode"))
        self.table = QTableWidget(len(MODES), 4)
        self.table.setObjectName("projectionTable")
        # Short headers: the panel is narrow and Qt clips long ones mid-word.
        self.table.setHorizontalHeaderLabels(["Chat", "Full", "Fits", "vs fp16"])
        for column, tip in enumerate((
            "Memory this chat's tokens take in each mode, in memory now or not",
            "Memory the model's whole context would take, in each mode",
            "Tokens that fit in free memory in each mode (at most the model's context)",
            "Share of next tokens that match fp16, from this chat's quality check of each mode",
        )):
            header = self.table.horizontalHeaderItem(column)
            if header is not None:  # set by setHorizontalHeaderLabels above
                header.setToolTip(tip)
        self.table.setVerticalHeaderLabels(list(MODES))
        # Columns as wide as their widest cell, the bold row included: a stretched
        # column can be narrower than its text and cut it.
        self.table.horizontalHeader().setSectionResizeMode(
            QHeaderView.ResizeMode.ResizeToContents)
        self.table.setWordWrap(False)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        self.table.verticalHeader().setDefaultSectionSize(24)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        self.table.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.table.setFixedHeight(26 + 24 * len(MODES) + 4)
        layout.addWidget(self.table)
        # Empty (and out of the way) until a model's projection fills them: no bare "—".
        self.fits_label = value_label("")
        self.fits_label.hide()
        layout.addWidget(self.fits_label)
        self.projection_note = value_label("")
        self.projection_note.hide()
        layout.addWidget(self.projection_note)
        self.quality_label = value_label()
        self.quality_label.setObjectName("qualityReceipt")
        layout.addWidget(self.quality_label)
        # Shared with the Chat menu; enabled (with the reason when not) by PanelFeed.
        self.quality_action = QAction("Check Quality", self)
        self.quality_button = QToolButton()
        self.quality_button.setDefaultAction(self.quality_action)
        layout.addWidget(self.quality_button)

        # The engineering numbers, folded away until asked for.
        self.details_button = QToolButton()
        self.details_button.setText("Details")
        self.details_button.setCheckable(True)
        self.details_button.setObjectName("detailsToggle")
        self.details_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.details_button.setArrowType(Qt.ArrowType.RightArrow)
        self.details_button.setAutoRaise(True)
        self.details_button.setToolTip("Bytes allocated, pages per layer and the memory "
                                       "allocator's own counters")
        self.details_button.toggled.connect(self._show_details)
        layout.addWidget(self.details_button)
        self.details = QWidget()
        self.details.setObjectName("panelDetails")
        inner = QVBoxLayout(self.details)
        inner.setContentsMargins(0, 0, 0, 0)
        inner.setSpacing(6)
        # How full the pages allocated are: the bar under the line that says it.
        self.kv_detail = value_label()
        inner.addWidget(self.kv_detail)
        self.kv_bar.setToolTip("Bytes of the chat's pages in use, of those allocated")
        inner.addWidget(self.kv_bar)
        self.pages_label = value_label()
        self.pages_label.setToolTip(PAGES_TIP)
        inner.addWidget(self.pages_label)
        self.pool = PagePoolView()
        self.pool.setAccessibleName("This chat's pages")
        inner.addWidget(self.pool)
        self.ram_detail = value_label()
        inner.addWidget(self.ram_detail)
        self.storage_note = value_label()
        self.storage_note.setText(STORAGE_NOTE)
        inner.addWidget(self.storage_note)
        self.details.hide()
        layout.addWidget(self.details)

        layout.addWidget(section_heading("History"))
        self.chart = HistoryChart()
        self.chart.setAccessibleName("KV and Longleaf's memory over time")
        layout.addWidget(self.chart)
        self.api_sessions = ApiSessionsSection()  # hidden while the local server is off
        layout.addWidget(self.api_sessions)
        self.stored_kv = StoredKvSection()
        layout.addWidget(self.stored_kv)
        layout.addStretch(1)
        self.setWidget(body)
        self.mode: KvMode | None = None
        self.session_id: str | None = None
        self.kv_tokens: int | None = None  # tokens of the shown sample; None: no cache
        self.now_tokens: int | None = None  # tokens the "Chat" column was computed for
        self.samples_shown = 0
        self.level = "normal"
        self.show_receipts({})

    def set_session(self, title: str | None, mode: KvMode | None, cache_state: str,
                    session_id: str | None = None, *, rotated: bool = False) -> None:
        """Name the session the numbers belong to; ``cache_state`` is its state sentence.

        Showing another session clears every per-session figure: until a sample
        of that session arrives, the panel says it holds no cache rather than
        keep the previous chat's numbers.
        """
        if session_id != self.session_id or self.mode != mode:
            self.chart.show_session(session_id)
            self.show_no_cache()
        self.mode, self.session_id = mode, session_id
        if mode is None:
            self.session_label.setText("No chat open")
            return
        colour = mode_colour(mode).name()
        badge = f"{mode} · rotated" if rotated else mode  # rows stored after a Hadamard rotation
        self.session_label.setText(
            f"<span style='background:{colour};color:white;border-radius:4px'>&nbsp;{badge}&nbsp;"
            f"</span>&nbsp; {html.escape(short_title(title or '', 60))}<br>"
            f"<span style='opacity:.7'>{html.escape(cache_state)}</span>")

    def show_no_cache(self) -> None:
        """The shown chat has no KV cache in memory: no page, byte or token figure.

        Where the chat is instead (on disk, or new) is the state sentence's to say.
        """
        self.kv_tokens = None
        self.show_machines(())
        self.kv_label.setText(NO_CACHE)
        self.kv_detail.setText("")
        self.kv_bar.setMaximum(1000)
        self.kv_bar.setValue(0)
        self.pages_label.setText("No pages held")
        self.pool.set_pages(0, 0, 0, 0.0, mode_colour(self.mode or DEFAULT_MODE))
        self.pool.setToolTip("")
        self.chart.show_no_cache()

    def clear_projection(self) -> None:
        """No model is ready (loading, or none fits): no projection, rather than the
        figures and tint of the chat and model shown before."""
        self.now_tokens = None
        for row, mode in enumerate(MODES):
            for column in range(QUALITY_COLUMN):
                self.table.setItem(row, column, self._cell("", mode))
        self.projection_note.setText("")
        self.projection_note.hide()
        self.fits_label.setText("")
        self.fits_label.hide()

    def update_sample(self, sample: StatsSample, total: KvTotal) -> bool:
        """Show one stats snapshot; False when its KV figures belong to another session.

        System memory is shown from any sample (it is the same for every chat);
        the KV, page and history figures only from the shown session's own. A
        cache that holds no token (opened for a quality check, say) is no cache.
        """
        self._update_ram(sample)
        self._update_ram_detail(sample)
        self.show_total(total)
        if sample.session_id is None or sample.session_id != self.session_id:
            return False
        self.samples_shown += 1
        if not sample.tokens_in_context:
            self.show_no_cache()
            self.kv_label.setText(f"{NO_CACHE}{other_layers_line(sample)}")
            self.show_machines(sample.ranks)
            return True
        self.show_machines(sample.ranks)
        self.kv_tokens = sample.tokens_in_context
        allocated = max(sample.kv_bytes_allocated, 1)
        self.kv_label.setText(
            f"<b>{human_bytes(sample.kv_bytes_used)}</b> for "
            f"{counted(sample.tokens_in_context, 'token')}{shared_note(sample)}"
            f"{other_layers_line(sample)}")
        self.kv_detail.setText(
            f"KV {human_bytes(sample.kv_bytes_used)} used of "
            f"{human_bytes(sample.kv_bytes_allocated)} allocated")
        self.kv_bar.setMaximum(1000)
        self.kv_bar.setValue(int(1000 * sample.kv_bytes_used / allocated))
        self.pages_label.setText(pages_text(sample))
        self.pool.set_pages(sample.pages_in_use, sample.pages_allocated, sample.pages_free,
                            sample.last_page_fill, mode_colour(self.mode or DEFAULT_MODE))
        per = self.pool.pages_per_cell()
        self.pool.setToolTip(PAGES_TIP if per == 1 else f"Each square is {per} pages. {PAGES_TIP}")
        self.chart.add(sample.kv_bytes_used, sample.process_rss_bytes)
        return True

    def show_machines(self, ranks: tuple[RankShare, ...]) -> None:
        """A row per machine of a pipeline, rank 0 first (hidden on one machine)."""
        shown = len(ranks) > 1
        self.machines_heading.setVisible(shown)
        self.machines_label.setVisible(shown)
        self.machines_label.setText("<br>".join(machine_line(share) for share in ranks))

    def show_total(self, total: KvTotal) -> None:
        """The KV bytes every chat held in memory takes together, and the storage
        held for them when that is more."""
        text = f"All open chats together: {human_bytes(total.used)}"
        if human_bytes(total.held) != human_bytes(total.used):
            text += f" ({human_bytes(total.held)} held)"
        self.kv_total_label.setText(text)

    def show_together(self, chats: list[tuple[str, int | None]]) -> None:
        """The chats answering at once and each one's KV bytes (hidden for fewer than two)."""
        text = together_line(chats)
        self.together_label.setText(text)
        self.together_label.setVisible(bool(text))

    def _show_details(self, shown: bool) -> None:
        self.details.setVisible(shown)
        self.details_button.setArrowType(Qt.ArrowType.DownArrow if shown
                                         else Qt.ArrowType.RightArrow)

    def show_system_memory(self, readings: dict) -> None:
        """The gauge from ``engine.memory.stats.system_readings``: RAM is the computer's,
        shown whether or not the shown chat holds anything."""
        self._update_ram(SimpleNamespace(**readings))

    def _update_ram(self, sample: SystemMemory) -> None:
        level = ram_level(sample)
        self.ram_bar.setMaximum(1000)
        self.ram_bar.setValue(int(10 * sample.system_used_percent))
        if level != self.ram_bar.property("level"):
            # Re-polishing under a stylesheet is costly: only when the colour changes.
            self.ram_bar.setProperty("level", level)
            self.ram_bar.style().unpolish(self.ram_bar)
            self.ram_bar.style().polish(self.ram_bar)
        self.level = level
        warning = {"warning": " — memory is getting tight",
                   "critical": " — critical: stop or close chats"}.get(self.level, "")
        self.ram_label.setText(
            f"<b>{sample.system_used_percent:.0f}%</b> used · "
            f"{human_bytes(sample.system_available_bytes)} free of "
            f"{human_bytes(sample.system_total_bytes)}{warning}")

    def _update_ram_detail(self, sample: StatsSample) -> None:
        lines = [f"Longleaf uses {human_bytes(sample.process_rss_bytes)} · swap "
                 f"{human_bytes(sample.swap_used_bytes)}"]
        if sample.mlx_active_bytes:
            lines.append(f"MLX {human_bytes(sample.mlx_active_bytes)} active · "
                         f"{human_bytes(sample.mlx_peak_bytes)} peak · "
                         f"{human_bytes(sample.mlx_cache_bytes)} cache")
        if sample.pressure_level:  # macOS only: other systems have no such reading
            lines.append(f"Memory pressure (macOS): {sample.pressure_level}")
        self.ram_detail.setText("<br>".join(lines))

    def show_receipts(self, receipts: dict, unavailable: str = "",
                      outdated: dict[str, str] | None = None) -> None:
        """Show the chat's quality receipts by mode, and whether a check can run now.

        ``receipts`` maps a mode to its ``engine.QualityReceipt``; ``unavailable``
        is why "Check Quality" cannot run now ("" when it can); ``outdated`` says
        why, by mode, a receipt no longer speaks for the chat (shown as such).
        """
        outdated = outdated or {}
        for row, mode in enumerate(MODES):
            receipt = receipts.get(mode)
            if mode == REFERENCE:
                item = self._cell("ref", mode)
                item.setToolTip(f"{mode} is the reference the other modes are measured against")
            elif receipt is None:
                item = self._cell("—", mode)
                item.setToolTip(NOT_MEASURED)
            elif mode in outdated:
                item = self._cell("—", mode)
                item.setToolTip(f"{outdated_line(receipt, outdated[mode])}\n\nThen: "
                                f"{receipt_details(receipt)}")
            else:
                item = self._cell(f"{receipt.top1:.1%}", mode)
                item.setToolTip(receipt_details(receipt))
            self.table.setItem(row, QUALITY_COLUMN, item)
        own = receipts.get(self.mode or "")
        if own is not None and own.mode in outdated:
            lines = [html.escape(outdated_line(own, outdated[own.mode])),
                     f"<span style='opacity:.7'>Then: {html.escape(receipt_summary(own))}"
                     "</span>"]
        elif own is not None:
            lines = [html.escape(receipt_line(own)),
                     f"<span style='opacity:.7'>{html.escape(receipt_summary(own))}</span>",
                     html.escape(advice(own))]
        else:
            lines = [NOT_MEASURED]
        if unavailable:
            lines.append(f"<span style='opacity:.7'>{html.escape(unavailable)}</span>")
        self.quality_label.setText("<br>".join(lines))
        self.quality_label.setToolTip(receipt_details(own) if own is not None else "")
        self.quality_action.setEnabled(not unavailable)
        self.quality_action.setToolTip(unavailable or "Compare this chat's KV mode with fp16 "
                                       "on its last ≤ 1,024 tokens")

    def _cell(self, text: str, mode: KvMode) -> QTableWidgetItem:
        """A right-aligned table cell, bold and tinted in the shown chat's mode."""
        item = QTableWidgetItem(text)
        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if mode == self.mode:
            # The table's own font (its stylesheet size), bold: read when the cell is
            # made, so cells made before the panel was first shown are made again then.
            bold = QFont(self.table.font())
            bold.setBold(True)
            item.setFont(bold)
            tint = QColor(mode_colour(mode))
            tint.setAlphaF(0.22)
            item.setBackground(QBrush(tint))
        return item

    def update_projection(self, now_report: FitReport | None,
                          full_report: FitReport | None) -> None:
        """Fill the per-mode table from two ``FitReport``s (now and full context);
        without them (no model ready) it is emptied."""
        if now_report is None or full_report is None:
            self.clear_projection()
            return
        self.now_tokens = now_report.token_count
        machines = len(now_report.ranks)
        for row, mode in enumerate(MODES):
            now = now_report.for_mode(mode)
            full = full_report.for_mode(mode)
            cells = (
                human_bytes(now.bytes_needed) if now.supported else "n/a",
                human_bytes(full.bytes_needed) if full.supported else "n/a",
                _fits_text(fit_tokens(now_report, mode), full_report.max_context)
                if now.supported else "head_dim",
            )
            for column, text in enumerate(cells):
                self.table.setItem(row, column, self._cell(text, mode))
        self.projection_note.setText(
            f"Chat: its {now_report.token_count:,} tokens · full: the model's whole "
            f"context, {full_report.max_context:,} tokens.")
        self.projection_note.show()
        own = MODES.find(self.mode or "")
        text = ""
        if own is not None and now_report.for_mode(own).supported:
            text = fits_sentence(fit_tokens(now_report, own), full_report.max_context, own,
                                 machines, now_report.tight_machine(own),
                                 budget_bound=budget_bound(now_report, own))
        self.fits_label.setText(text)
        self.fits_label.setVisible(bool(self.fits_label.text()))


def fit_tokens(report: FitReport, mode: KvMode) -> int:
    """Tokens memory holds in ``mode``: free RAM or the memory limit, the smaller, on
    this machine, or on a pipeline the machines' together (their tightest)."""
    pool = report.pool_tokens(mode) if report.ranks else None
    if pool is not None:
        return pool
    entry = report.for_mode(mode)
    return min(entry.tokens_fit_ram, entry.tokens_fit_budget
               if entry.tokens_fit_budget is not None else entry.tokens_fit_ram)


def budget_bound(report: FitReport, mode: KvMode) -> bool:
    """Whether the memory limit (Settings), not free RAM, bounds ``mode`` here."""
    entry = report.for_mode(mode)
    return (not report.ranks and entry.tokens_fit_budget is not None
            and entry.tokens_fit_budget < entry.tokens_fit_ram)
