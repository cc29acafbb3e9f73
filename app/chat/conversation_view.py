"""The centre pane: one widget per message, bound to the ``ChatModel``.

A streaming flush changes the last row only, so only the last widget
re-renders; earlier messages are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import QEvent, QModelIndex, QObject, Qt, QTimer, Signal, SignalInstance
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.markdown_view import MarkdownView
from app.chat.model import (
    AttachmentsRole,
    ChatModel,
    ReasonRole,
    RoleRole,
    StatsRole,
    StatusRole,
)
from app.chat.recorder import (
    CLOSED_WHILE_ANSWERING,
    CONTEXT_END,
    LENGTH_LIMIT,
    STOPPED_READING,
)
from app.format import counted, human_bytes, human_duration, unbroken, visible_text
from app.sessions.chat_state import JOB_WORDS, ChatState, reuse_sentence

STATUS_TEXT = {
    "streaming": "Answering…",
    "stopped": "Stopped",
    "failed": "Failed",
    "interrupted": "Interrupted — the partial answer was kept",
}
READING_LABEL = f"{JOB_WORDS[ChatState.READING]}…"  # an answer whose chat is read first
# Reasons short and common enough to be the row's label instead of its status word.
REASON_LABELS = {CLOSED_WHILE_ANSWERING: "Closed while answering",
                 LENGTH_LIMIT: "Length limit", CONTEXT_END: "Context full"}
COPIED_TEXT = "Copied ✓"
COPIED_MS = 1500
# A user message longer than this shows its start, with "Show all" for the rest.
COLLAPSE_CHARS = 1500
COLLAPSE_LINES = 25
SHOW_ALL = "Show all"
SHOW_LESS = "Show less"
# A chat opens with its last this many rows built; each page above is as long.
PAGE_ROWS = 40


def collapsed(text: str) -> str | None:
    """The start of a long message, cut at a line or word end and marked " …", or None.

    At most ``COLLAPSE_LINES`` lines and ``COLLAPSE_CHARS`` characters are kept.
    """
    lines = text.split("\n")
    if len(text) <= COLLAPSE_CHARS and len(lines) <= COLLAPSE_LINES:
        return None
    start = "\n".join(lines[:COLLAPSE_LINES])
    if len(start) > COLLAPSE_CHARS:
        start = start[:COLLAPSE_CHARS]
        # A whole last line reads best, then a whole word; never half of one.
        line_end = start.rfind("\n")
        end = line_end if line_end > COLLAPSE_CHARS * 0.8 else start.rfind(" ")
        if end > COLLAPSE_CHARS // 2:
            start = start[:end]
    return start.rstrip() + " …"


SPECULATIVE_TIP = ("Speculative decoding: the next words are looked up in the chat's own "
                   "text and the model checks them together, so each of its steps can add "
                   "more than one token.")


def stats_text(stats: dict | None) -> str:
    """An answer's stats line, "128 tokens · first word in 0.2 s · 34.2 tokens/s".

    It begins "Reused 3,930 stored tokens, read 120 new" when the chat's KV
    snapshot on disk was used; a speculative answer adds "2.4 tokens a step"
    (``SPECULATIVE_TIP`` says what that is). An answer with no token (a read
    stopped before it) has no line. Each part keeps to one line: a narrow
    column wraps between parts, never inside one.
    """
    if not stats or not stats.get("generated_tokens"):
        return ""
    parts = [counted(stats["generated_tokens"], "token")]
    if stats.get("ttft") is not None:
        parts.append(f"first word in {_seconds(stats['ttft'])}")
    if stats.get("decode_tps"):
        parts.append(f"{stats['decode_tps']:.1f} tokens/s")
    if stats.get("draft_tokens") and stats.get("decode_steps"):
        # Each pass adds its own token and the drafts it accepted. Not tokens over
        # passes: the pass that sampled the end token and the one queued after it
        # count as steps with no token, so a short answer read "0.8 tokens a step".
        steps = stats["decode_steps"]
        parts.append(f"{1 + stats.get('accepted_tokens', 0) / steps:.1f} tokens a step")
    parts = [unbroken(part) for part in parts]
    reused = reuse_sentence(stats.get("reused_tokens", 0), stats.get("prefill_tokens", 0))
    return " · ".join([reused, *parts] if reused else parts)



def _seconds(seconds: float) -> str:
    """0.213 -> "0.2 s"; 547.2 -> "9m 07s": a wait as a person would say it."""
    return f"{seconds:.1f} s" if seconds < 60 else human_duration(seconds)


class MessageWidget(QFrame):
    """One message: who, the Markdown text, attachments, stats and actions."""

    copyRequested = Signal()
    regenerateRequested = Signal()
    editRequested = Signal()
    continueRequested = Signal()

    def __init__(self, role: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.role = role
        self.setObjectName("userMessage" if role == "user" else "assistantMessage")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(14, 10, 14, 8)
        outer.setSpacing(4)
        self.author = QLabel("You" if role == "user" else "Longleaf")
        self.author.setObjectName("author")
        outer.addWidget(self.author)
        self.files = QLabel()
        self.files.setTextFormat(Qt.TextFormat.PlainText)  # a file's name is never markup
        self.files.setObjectName("attachmentLine")
        self.files.setWordWrap(True)
        self.files.hide()
        outer.addWidget(self.files)
        self.body = MarkdownView(self)
        outer.addWidget(self.body)
        # Long pasted text shows its start; the whole of it is one click away.
        self.text = ""
        self.expanded = False
        self.show_all = QToolButton(self)
        self.show_all.setObjectName("messageAction")
        self.show_all.setAutoRaise(True)
        self.show_all.setCursor(Qt.CursorShape.PointingHandCursor)
        self.show_all.clicked.connect(self._toggle_all)
        self.show_all.hide()
        outer.addWidget(self.show_all, 0, Qt.AlignmentFlag.AlignLeft)
        footer = self.footer = QHBoxLayout()
        footer.setSpacing(6)
        self.status = QLabel()
        self.status.setObjectName("messageStatus")
        self.status.setWordWrap(True)
        self.stats = QLabel()
        self.stats.setObjectName("messageStats")
        # Wraps before the buttons beside it are pushed out of a narrow column.
        self.stats.setWordWrap(True)
        # The stats line takes the room a short (or empty) status leaves.
        footer.addWidget(self.status)
        footer.addWidget(self.stats, 1)
        self.copy_button = self._action("Copy", self.copyRequested)
        self.regenerate_button = self._action("Regenerate", self.regenerateRequested)
        self.edit_button = self._action("Edit", self.editRequested)
        self.continue_button = self._action("Continue", self.continueRequested)
        self.continue_button.setToolTip("The answer stopped at the length limit: go on")
        for button in (self.continue_button, self.copy_button, self.regenerate_button,
                       self.edit_button):
            footer.addWidget(button)
        outer.addLayout(footer)

    def _action(self, text: str, signal: SignalInstance) -> QToolButton:
        button = QToolButton(self)
        button.setText(text)
        button.setAutoRaise(True)
        button.setObjectName("messageAction")
        button.setCursor(Qt.CursorShape.PointingHandCursor)
        button.clicked.connect(signal.emit)
        return button

    def show_message(self, content: str, status: str, reason: str | None, stats: dict | None,
                     attachments: tuple, reading: bool = False) -> None:
        """Render a row of the model; ``reading``: a streaming answer whose chat is
        still being read (no word yet)."""
        shown = content or ("…" if status == "streaming" else "")
        if self.role == "user":
            self.text = shown
            self._show_user_text()
        else:
            self.body.set_markdown(shown)
        self.body.setVisible(bool(content) or status == "streaming")
        if attachments:
            # A line may wrap in a name or between facts, never inside a number's.
            self.files.setText("  ".join(
                f"{visible_text(a.name)} · {unbroken(human_bytes(a.size))} · "
                f"{unbroken(counted(a.tokens, 'token'))}" for a in attachments))
        self.files.setVisible(bool(attachments))
        label = REASON_LABELS.get(reason or "", STATUS_TEXT.get(status, ""))
        if status == "streaming" and reading and not content:
            label = READING_LABEL
        if reason and reason.startswith(STOPPED_READING):
            label = reason.split(";")[0]  # "Stopped while reading: 1,408 of 4,898 tokens kept"
        if reason and status == "complete":
            # Short in the row (a 560 px column wrapped the long one onto 4 lines);
            # the whole reason is on hover.
            label = REASON_LABELS.get(reason, reason)
        # Engine errors are spelled out once, in the window's banner; the row keeps
        # a short label with the full reason on hover.
        self.status.setText(label)
        self.status.setVisible(bool(label))
        self.status.setToolTip(reason or "")
        if self.status.property("state") != status:
            self.status.setProperty("state", status)
            self.status.style().unpolish(self.status)
            self.status.style().polish(self.status)
        line = stats_text(stats) if self.role == "assistant" else ""
        self.stats.setText(line)
        # A wrapping label gets only its minimum width beside a stretching one: the
        # status alone ("Reading the conversation…") would wrap after a word or two.
        self.footer.setStretchFactor(self.status, 0 if line else 1)
        self.stats.setToolTip(SPECULATIVE_TIP if "tokens\u00a0a\u00a0step" in line else "")

    def _show_user_text(self) -> None:
        start = collapsed(self.text)
        # Typed text: Shift+Enter line breaks stay.
        self.body.set_plain(self.text if start is None or self.expanded else start)
        self.show_all.setVisible(start is not None)
        hidden = len(self.text) - len((start or "").removesuffix(" …"))
        self.show_all.setText(SHOW_LESS if self.expanded else f"{SHOW_ALL} ({hidden:,} more "
                                                               "characters)")

    def _toggle_all(self) -> None:
        self.expanded = not self.expanded
        self._show_user_text()

    def full_text(self) -> str:
        """The message's whole text, also while it is shown collapsed."""
        return self.text if self.role == "user" else self.body.markdown()

    def show_copied(self) -> None:
        """Say on the Copy button that the text is on the clipboard, for a moment."""
        self.copy_button.setText(COPIED_TEXT)
        button = self.copy_button  # the context: no call once the row is gone
        QTimer.singleShot(COPIED_MS, button, lambda: button.setText("Copy"))

    def set_actions(self, *, copy: bool, regenerate: bool, edit: bool,
                    go_on: bool = False) -> None:
        """Show only the actions that apply to this row now."""
        self.continue_button.setVisible(go_on)
        self.copy_button.setVisible(copy)
        self.regenerate_button.setVisible(regenerate)
        self.edit_button.setVisible(edit)


class ConversationView(QScrollArea):
    """A scrolling column of ``MessageWidget``s that follows the model.

    A chat opens with only its last ``PAGE_ROWS`` rows built: a widget renders
    its Markdown when it is made, and a long chat's every row at once would
    freeze the window. Reaching the top of the column builds the page before
    it, above, and the rows on screen stay where they were (``widgets[i]`` is
    model row ``first_built + i``; the built rows always run to the model's end).
    """

    regenerateRequested = Signal()
    editRequested = Signal()
    continueRequested = Signal()  # the last answer, cut at the length limit, should go on

    def __init__(self, model: ChatModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.busy = False
        self.reading = False
        # The row that was on top when a page was put above it, and its place
        # on screen then: kept there while the new rows settle their heights.
        self._anchor: MessageWidget | None = None
        self._anchor_offset = 0
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.column = QWidget()
        self.column.setObjectName("conversationColumn")
        self.layout_ = QVBoxLayout(self.column)
        self.layout_.setContentsMargins(24, 16, 24, 16)
        self.layout_.setSpacing(10)
        self.placeholder = QLabel(
            "<h2>Start a conversation</h2><p>Type below, or drop documents anywhere in the "
            "window — text, Markdown, source code, PDF or Word.</p>")
        self.placeholder.setObjectName("placeholder")
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setWordWrap(True)
        self.layout_.addWidget(self.placeholder)
        self.layout_.addStretch(1)
        self.setWidget(self.column)
        self.widgets: list[MessageWidget] = []
        self.first_built = 0  # the model row of ``widgets[0]``
        self._follow = True
        self._placing = False  # the view's own scroll, not the user's
        self._loading = False  # a page is queued
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.verticalScrollBar().rangeChanged.connect(self._on_range)
        model.modelReset.connect(self._rebuild)
        model.rowsInserted.connect(self._on_inserted)
        model.rowsRemoved.connect(self._on_removed)
        model.dataChanged.connect(self._on_changed)
        self._rebuild()

    def widget_for(self, row: int) -> MessageWidget | None:
        """Model row ``row``'s widget, or None while it is not built."""
        index = row - self.first_built
        return self.widgets[index] if 0 <= index < len(self.widgets) else None

    def set_busy(self, busy: bool, reading: bool = False) -> None:
        """Hide regenerate/edit while an answer streams; ``reading``: its chat is still
        being read, so its row says so rather than "Answering…"."""
        changed = reading != self.reading
        self.busy, self.reading = busy, reading
        if changed and self.widgets:
            self._render(self.model.rowCount() - 1)
        self._refresh_actions()

    def _make(self, row: int) -> MessageWidget:
        role = self.model.data(self.model.index(row), RoleRole)
        widget = MessageWidget(role, self.column)
        widget.copyRequested.connect(lambda w=widget: self._copy(w))
        widget.regenerateRequested.connect(self.regenerateRequested.emit)
        widget.editRequested.connect(self.editRequested.emit)
        widget.continueRequested.connect(self.continueRequested.emit)
        return widget

    def _render(self, row: int) -> None:
        widget = self.widget_for(row)
        if widget is None:
            return
        index = self.model.index(row)
        widget.show_message(
            self.model.data(index) or "", self.model.data(index, StatusRole),
            self.model.data(index, ReasonRole), self.model.data(index, StatsRole),
            self.model.data(index, AttachmentsRole) or (),
            reading=self.reading and row == self.model.rowCount() - 1)

    def _drop(self, widgets: list[MessageWidget]) -> None:
        # Out of the layout and hidden now: deleteLater waits for the event loop
        # that called it, and a context menu's nested loop would show the old
        # chat's rows above the new ones until the menu closes.
        for widget in widgets:
            if widget is self._anchor:
                self._hold(None)
            self.layout_.removeWidget(widget)
            widget.hide()
            widget.deleteLater()

    def _rebuild(self) -> None:
        """Show the model's last page of rows, following the bottom."""
        self._drop(self.widgets)
        self.widgets = []
        self.first_built = max(0, self.model.rowCount() - PAGE_ROWS)
        self._build(self.first_built, self.model.rowCount() - 1)
        self._after_change()
        self._follow = True
        # Another chat's last page may be just as tall: no range change would say so.
        self._scroll_to_bottom_later()

    def _build(self, first: int, last: int) -> None:
        """Make and render the widgets of model rows ``first``..``last``, which lie
        within or right beside the built ones."""
        for row in range(first, last + 1):
            widget = self._make(row)
            at = row - self.first_built
            self.widgets.insert(at, widget)
            self.layout_.insertWidget(at + 1, widget)  # after the placeholder
            self._render(row)

    def _on_inserted(self, _parent: QModelIndex, first: int, last: int) -> None:
        if first < self.first_built:
            self.first_built += last - first + 1  # above the built rows: built later if reached
        else:
            self._build(first, last)
        self._after_change()

    def _on_removed(self, _parent: QModelIndex, first: int, last: int) -> None:
        start = max(first, self.first_built) - self.first_built
        end = max(start, last + 1 - self.first_built)
        self._drop(self.widgets[start:end])
        del self.widgets[start:end]
        self.first_built -= max(0, min(last + 1, self.first_built) - first)  # those above
        if not self.widgets and self.first_built > 0:
            self._rebuild()  # every built row went: the rows left show as a chat opened
            return
        self._after_change()

    def _on_changed(self, top: QModelIndex, bottom: QModelIndex,
                    roles: Sequence[int] = ()) -> None:
        for row in range(max(top.row(), self.first_built), bottom.row() + 1):
            self._render(row)
        # Streamed text alone (a flush) changes no row's actions: they follow
        # statuses, the busy state and which rows are last; a long chat's flushes
        # would otherwise walk every row.
        if list(roles) != [Qt.ItemDataRole.DisplayRole]:
            self._refresh_actions()

    def _after_change(self) -> None:
        self.placeholder.setVisible(self.model.rowCount() == 0)
        self._refresh_actions()

    def _last_user_row(self) -> int:
        """The model row of the last user message (-1 for none), built or not."""
        for row in range(self.model.rowCount() - 1, -1, -1):
            if self.model.data(self.model.index(row), RoleRole) == "user":
                return row
        return -1

    def _refresh_actions(self) -> None:
        last_user = self._last_user_row()
        last = self.model.rowCount() - 1
        for row, widget in enumerate(self.widgets, self.first_built):
            index = self.model.index(row)
            streaming = self.model.data(index, StatusRole) == "streaming"
            last_answer = not self.busy and row == last and self.model.can_answer_again(row)
            widget.set_actions(
                copy=not streaming and bool(self.model.data(index)),
                regenerate=last_answer,
                edit=not self.busy and row == last_user,
                go_on=last_answer and self.model.data(index, ReasonRole) == LENGTH_LIMIT,
            )

    def _copy(self, widget: MessageWidget) -> None:
        QGuiApplication.clipboard().setText(widget.full_text())
        widget.show_copied()

    def _load_earlier(self) -> None:
        """Build the page of rows before the built ones, above them, keeping the rows
        on screen where they are."""
        self._loading = False
        bar = self.verticalScrollBar()
        if self.first_built == 0 or bar.value() != bar.minimum():
            return  # the top was only passed through, as the column was laid out
        self._hold(self.widgets[0] if self.widgets else None)
        last = self.first_built - 1
        self.first_built = max(0, self.first_built - PAGE_ROWS)
        self._build(self.first_built, last)
        self._refresh_actions()

    def _hold(self, widget: MessageWidget | None) -> None:
        """Keep ``widget`` where it is on screen (None: keep none) until the user scrolls."""
        if self._anchor is not None:
            self._anchor.removeEventFilter(self)
        self._anchor = widget
        if widget is not None:
            self._anchor_offset = widget.y() - self.verticalScrollBar().value()
            widget.installEventFilter(self)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self._anchor and event.type() == QEvent.Type.Move:
            self._keep_anchor()  # the rows above it grew or settled
        return super().eventFilter(watched, event)

    def _keep_anchor(self) -> None:
        if self._anchor is None:
            return
        self._placing = True
        try:
            self.verticalScrollBar().setValue(self._anchor.y() - self._anchor_offset)
        finally:
            self._placing = False

    def _queue_earlier(self) -> None:
        if self.first_built > 0 and not self._loading:
            self._loading = True
            # Out of the scroll bar's own signal: building rows lays the column out again.
            QTimer.singleShot(0, self, self._load_earlier)

    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        if not self._placing:
            self._hold(None)  # the user scrolled: the rows need not stay put any more
        self._follow = value >= bar.maximum() - 40
        if value == bar.minimum() and not self._placing:
            self._queue_earlier()

    def _on_range(self, _low: int, high: int) -> None:
        if self._anchor is not None:
            self._keep_anchor()
        elif self._follow:
            self._scroll_to_bottom_later()
        if high == 0:
            self._queue_earlier()  # no scroll bar to reach the top with: fill the view

    def _scroll_to_bottom_later(self) -> None:
        # With the view as context: a range change while the window is destroyed
        # queues a scroll that must not run on the deleted view.
        QTimer.singleShot(0, self, self._scroll_to_bottom)

    def _scroll_to_bottom(self) -> None:
        if self._follow:  # unless the user scrolled up meanwhile (to the top: a page loads)
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())
