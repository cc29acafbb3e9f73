"""The bottom pane: attachments, the fit check, ingest progress and the text box."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QEvent, QMimeData, QSize, Qt, QTimer, Signal, SignalInstance
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)
from superqt import QFlowLayout

from app.chat.attachments import DocumentLoader
from app.format import counted, human_bytes, human_duration, unbroken, visible_text
from app.sessions.chat_state import JOB_WORDS, ChatFacts, ChatState, state_sentence
from app.store import AttachmentRecord

READING = JOB_WORDS[ChatState.READING]
# Said the moment Stop or Cancel is pressed: the engine stops between two parts
# of a read (or two words of an answer), and a part may take a while to end.
STOPPING_READ = "Stopping after this part…"
STOPPING = "Stopping…"
FIRST_PART = "Reading the first part…"
EDITING = "Editing your last message: sending replaces it and its answer."


def _local_files(mime: QMimeData) -> list[str]:
    return [url.toLocalFile() for url in mime.urls() if url.isLocalFile()]


class MessageEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter adds a line; grows with its text up to a limit.

    Esc is the window's Stop, except while ``takes_escape`` says this box has a
    use for it (an edit to cancel): then it is ``escaped`` here.
    """

    submitted = Signal()
    escaped = Signal()
    filesDropped = Signal(list)
    pasteRefused = Signal(int)  # characters of a paste too long to ever send

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        # Pastes longer than this are refused before Qt lays them out (laying out a
        # paste no context holds would stall the window); None: no limit (no model loaded).
        self.max_paste_chars: int | None = None
        self.takes_escape: Callable[[], bool] = lambda: False
        self.setPlaceholderText("Message Longleaf…  (Enter to send, Shift+Enter for a new line)")
        self.setAccessibleName("Message")  # the placeholder goes once something is typed
        self.setTabChangesFocus(True)
        self.document().documentLayout().documentSizeChanged.connect(self._grow)
        self._grow()

    def event(self, event: QEvent) -> bool:
        # Asked before the window's shortcuts: taking Esc here keeps it from Stop.
        if event.type() == QEvent.Type.ShortcutOverride and self._is_escape_taken(event):
            event.accept()
            return True
        return super().event(event)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        if self._is_escape_taken(event):
            self.escaped.emit()
            return
        super().keyPressEvent(event)

    def _is_escape_taken(self, event: QEvent) -> bool:
        return (isinstance(event, QKeyEvent) and event.key() == Qt.Key.Key_Escape
                and not event.modifiers() and self.takes_escape())

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return bool(_local_files(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        # Files dropped or pasted here are attachments, not their paths as text.
        files = _local_files(source)
        if files:
            self.filesDropped.emit(files)
        elif self.max_paste_chars is not None and len(source.text()) > self.max_paste_chars:
            self.pasteRefused.emit(len(source.text()))
        else:
            super().insertFromMimeData(source)

    def _grow(self, *_args: object) -> None:
        line = self.fontMetrics().lineSpacing()
        lines = min(10, max(2, int(self.document().size().height())))
        self.setFixedHeight(lines * line + 18)


class AttachmentChip(QFrame):
    """One attached file: name, size, tokens, and a remove button."""

    removeRequested = Signal(int)

    def __init__(self, job_id: int, name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.job_id, self.name = job_id, name
        self.setObjectName("chip")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 3, 4, 3)
        layout.setSpacing(4)
        self.label = QLabel(f"{visible_text(name)} · reading…")
        self.label.setTextFormat(Qt.TextFormat.PlainText)  # a file's name is never markup
        layout.addWidget(self.label)
        self.remove_button = QToolButton(self)
        self.remove_button.setText("✕")
        self.remove_button.setAutoRaise(True)
        self.remove_button.setToolTip("Remove this attachment")
        # A screen reader would say "multiplication x" for the glyph, and not which file.
        self.remove_button.setAccessibleName(f"Remove {visible_text(name)}")
        self.remove_button.clicked.connect(lambda: self.removeRequested.emit(self.job_id))
        layout.addWidget(self.remove_button)

    def set_waiting(self) -> None:
        """The file was read and is too long: it waits for the user's choice."""
        self.label.setText(f"{visible_text(self.name)} · too long: choose below")

    def set_record(self, record: AttachmentRecord) -> None:
        """Show the parsed file's size and token count."""
        self.label.setText(
            f"{visible_text(record.name)} · {human_bytes(record.size)} · "
            f"{counted(record.tokens, 'token')}")


class Composer(QWidget):
    """Attachment chips, inline notices, fit check, ingest progress and input."""

    sendRequested = Signal()
    stopRequested = Signal()
    editCancelled = Signal()  # the edit's Cancel, or Esc with nothing running here
    attachRequested = Signal()
    removeAttachment = Signal(int)
    partAccepted = Signal(int)  # job id of a too-long file whose fitting part is taken
    partDeclined = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(16, 6, 16, 12)
        outer.setSpacing(6)
        # Chips wrap onto rows: twenty files' chips in one row would squeeze each to
        # a few letters, and the composer's minimum width would grow with them.
        self.chips_box = QWidget(self)
        self.chips_row = QFlowLayout(self.chips_box)
        self.chips_row.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.chips_box)
        self.notice = QLabel()
        self.notice.setTextFormat(Qt.TextFormat.PlainText)  # it may quote a file's name
        self.notice.setObjectName("inlineNotice")
        self.notice.setWordWrap(True)
        self.notice.hide()
        outer.addWidget(self.notice)
        outer.addWidget(self._offer_row())
        self.fit = QLabel()
        self.fit.setObjectName("fitCheck")
        self.fit.setWordWrap(True)
        self.fit.setTextFormat(Qt.TextFormat.RichText)
        self.fit.hide()
        outer.addWidget(self.fit)
        outer.addWidget(self._progress_row())
        outer.addWidget(self._waiting_row())
        outer.addWidget(self._editing_row())
        box = QFrame()
        box.setObjectName("inputBox")
        row = QHBoxLayout(box)
        row.setContentsMargins(6, 4, 6, 4)
        self.attach_button = QToolButton()
        self.attach_button.setText("+")  # in every font; the stylesheet sets its size
        self.attach_button.setObjectName("attachButton")
        self.attach_button.setToolTip("Attach documents (or drop them anywhere)")
        self.attach_button.setAccessibleName("Attach documents")  # not "+"
        self.attach_button.setIconSize(QSize(18, 18))
        self.attach_button.clicked.connect(self.attachRequested.emit)
        self.edit = MessageEdit()
        self.edit.setFrameShape(QFrame.Shape.NoFrame)
        self.edit.submitted.connect(self.sendRequested.emit)
        self.edit.takes_escape = self._escape_cancels_edit
        self.edit.escaped.connect(self.editCancelled.emit)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.setDefault(True)
        self.send_button.pressed.connect(self._note_press)
        self.send_button.clicked.connect(self._send_or_stop)
        self._pressed_stop: bool | None = None  # what the button said when pressed
        row.addWidget(self.attach_button, 0, Qt.AlignmentFlag.AlignBottom)
        row.addWidget(self.edit, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        outer.addWidget(box)
        self.chips: dict[int, AttachmentChip] = {}
        self.generating = False
        self.stopping = False
        self.send_blocked = ""  # why the message can't be sent as it is, or ""

    def _offer_row(self) -> QWidget:
        self.offer_box = QFrame()
        self.offer_box.setObjectName("inlineNotice")
        row = QHBoxLayout(self.offer_box)
        row.setContentsMargins(0, 0, 0, 0)
        self.offer_label = QLabel()
        self.offer_label.setTextFormat(Qt.TextFormat.PlainText)  # it names the file
        self.offer_label.setWordWrap(True)
        self.offer_accept = QPushButton()
        self.offer_decline = QPushButton("Don't attach")
        self.offer_accept.clicked.connect(lambda: self._answer_offer(self.partAccepted))
        self.offer_decline.clicked.connect(lambda: self._answer_offer(self.partDeclined))
        row.addWidget(self.offer_label, 1)
        row.addWidget(self.offer_accept)
        row.addWidget(self.offer_decline)
        self.offer_box.hide()
        # Too-long files waiting for the choice, the one shown first: (job id, what
        # is said, the tokens offered).
        self._offers: list[tuple[int, str, int]] = []
        return self.offer_box

    def offer_part(self, job_id: int, message: str, tokens: int) -> None:
        """Say a file is too long and offer to attach its first ``tokens`` tokens;
        a second file's offer waits until the one shown is answered."""
        self._offers.append((job_id, message, tokens))
        chip = self.chips.get(job_id)
        if chip is not None:  # read already: it waits for the choice below, not reading
            chip.set_waiting()
        if len(self._offers) == 1:
            self._show_offer()

    def _show_offer(self) -> None:
        _job_id, message, tokens = self._offers[0]
        self.offer_label.setText(message)
        self.offer_accept.setText(f"Attach the first {tokens:,} tokens")
        self.offer_box.show()

    def withdraw_offer(self) -> None:
        """Decline every offer (their chat is no longer on screen)."""
        while self._offers:
            self._answer_offer(self.partDeclined)

    def drop_offer(self, job_id: int) -> None:
        """Decline the offer of ``job_id``, if one is shown or waits (its chip went)."""
        if self._offers and self._offers[0][0] == job_id:
            self._answer_offer(self.partDeclined)
        elif any(offer[0] == job_id for offer in self._offers):
            self._offers = [offer for offer in self._offers if offer[0] != job_id]
            self.partDeclined.emit(job_id)

    def _answer_offer(self, signal: SignalInstance) -> None:
        job_id, _message, _tokens = self._offers.pop(0)
        self.offer_box.hide()
        signal.emit(job_id)
        if self._offers:
            self._show_offer()

    def offer_parts_from(self, loader: DocumentLoader) -> None:
        """Offer the fitting part of each too-long file ``loader`` (a DocumentLoader) reads."""
        loader.tooLong.connect(lambda job, text, part: self.offer_part(job, text, part.tokens))
        self.partAccepted.connect(loader.accept_part)
        self.partDeclined.connect(lambda job: loader.decline_part(job, ""))

    def _progress_row(self) -> QWidget:
        # The title, the bar under it and the figures under that, Cancel beside
        # them: the figures get the column's whole width, and wrap between facts.
        self.progress_box = QFrame()
        self.progress_box.setObjectName("ingestBox")
        row = QHBoxLayout(self.progress_box)
        row.setContentsMargins(10, 6, 6, 6)
        column = QVBoxLayout()
        column.setSpacing(4)
        self.progress_title = QLabel(READING)
        self.progress = QProgressBar()
        self.progress.setTextVisible(False)
        self.progress.setFixedHeight(8)
        self.progress_label = QLabel()
        self.progress_label.setObjectName("ingestLabel")
        self.progress_label.setWordWrap(True)
        column.addWidget(self.progress_title)
        column.addWidget(self.progress)
        column.addWidget(self.progress_label)
        self.progress_cancel = QPushButton("Cancel")
        self.progress_cancel.clicked.connect(self.stopRequested.emit)
        row.addLayout(column, 1)
        row.addWidget(self.progress_cancel, 0, Qt.AlignmentFlag.AlignVCenter)
        self.progress_box.hide()
        # The time left counts down between the engine's reports (each part of a
        # read takes a while): the last estimate less the time since it came.
        self._eta_at: float | None = None
        self._figures = ""
        self._stopping = False
        self.clock = time.monotonic
        self._countdown = QTimer(self, interval=1000)
        self._countdown.timeout.connect(self._show_figures)
        return self.progress_box

    def _waiting_row(self) -> QWidget:
        self.waiting_box = QFrame()
        self.waiting_box.setObjectName("ingestBox")
        row = QHBoxLayout(self.waiting_box)
        row.setContentsMargins(10, 4, 4, 4)
        self.waiting_label = QLabel()
        self.waiting_label.setObjectName("ingestLabel")
        self.waiting_label.setTextFormat(Qt.TextFormat.PlainText)  # a title is the user's text
        self.waiting_label.setWordWrap(True)
        cancel = QPushButton("Cancel")
        cancel.setToolTip("Take this message out of the line (or stop it waiting); it "
                          "stays in the chat")
        cancel.clicked.connect(self.stopRequested.emit)
        row.addWidget(self.waiting_label, 1)
        row.addWidget(cancel)
        self.waiting_box.hide()
        return self.waiting_box

    def show_waiting(self, title: str | None, ahead: str = "", held: str = "") -> None:
        """Say this chat's message waits for chat ``title`` to finish (None: it doesn't);
        ``ahead`` says how far that chat is ("reading: 512 / 3,552 tokens, …").

        ``held``: the engine's reason for holding this chat's answer until memory
        lets it join those answering (said instead; "" when it does not hold it).
        """
        if held:
            self.waiting_label.setText(state_sentence(ChatFacts(job="waiting", held=held)))
            self.waiting_box.show()
            return
        if title is None:
            self.waiting_box.hide()
            return
        sentence = state_sentence(ChatFacts(job="waiting", waiting_for=title))
        self.waiting_label.setText(f"{sentence} It is {ahead}." if ahead else sentence)
        self.waiting_box.show()

    def _editing_row(self) -> QWidget:
        # Beside the box it is about, for as long as the edit lasts: a notice said
        # meanwhile (in the window's banner) cannot hide that sending replaces.
        self.editing_box = QFrame()
        self.editing_box.setObjectName("ingestBox")
        row = QHBoxLayout(self.editing_box)
        row.setContentsMargins(10, 4, 4, 4)
        label = QLabel(EDITING)
        label.setObjectName("ingestLabel")
        label.setWordWrap(True)
        cancel = QPushButton("Cancel")
        cancel.setToolTip("Keep your last message and its answer as they are (Esc)")
        cancel.clicked.connect(self.editCancelled.emit)
        row.addWidget(label, 1)
        row.addWidget(cancel)
        self.editing_box.hide()
        return self.editing_box

    def show_editing(self, editing: bool) -> None:
        """Say the box holds an earlier message to edit (False: it holds none)."""
        self.editing_box.setVisible(editing)

    def _escape_cancels_edit(self) -> bool:
        # Esc stops what runs in this chat first; only then is it the edit's Cancel.
        return (not self.editing_box.isHidden() and not self.generating
                and self.waiting_box.isHidden())

    def _note_press(self) -> None:
        self._pressed_stop = self.generating

    def _send_or_stop(self) -> None:
        # The click does what the button said when it was pressed: an answer that
        # ended between press and release turns that Stop into nothing, never into
        # a Send of a message still being written.
        stop = self.generating if self._pressed_stop is None else self._pressed_stop
        self._pressed_stop = None
        if not stop:
            self.sendRequested.emit()
        elif self.generating:
            self.stopRequested.emit()

    def text(self) -> str:
        """The typed message."""
        return self.edit.toPlainText()

    def set_text(self, text: str) -> None:
        """Replace the typed message (edit-and-resend)."""
        self.edit.setPlainText(text)
        self.edit.setFocus()

    def set_generating(self, generating: bool, stopping: bool = False) -> None:
        """Turn Send into Stop while an answer streams, and into a pressed "Stopping…"
        from the Stop until the engine says the job ended."""
        self.generating, self.stopping = generating, stopping
        self.send_button.setText((STOPPING if stopping else "Stop") if generating else "Send")
        self._enable_send()
        self.send_button.setProperty("stop", generating)
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)
        self.progress_cancel.setEnabled(not stopping)
        if not generating:
            self.progress_box.hide()
            self._countdown.stop()

    def block_send(self, reason: str) -> None:
        """Turn Send off while the message can't be sent as it is (``reason``; "": on)."""
        self.send_blocked = reason
        self._enable_send()

    def _enable_send(self) -> None:
        blocked = bool(self.send_blocked) and not self.generating
        self.send_button.setEnabled(not (self.generating and self.stopping) and not blocked)
        self.send_button.setToolTip(self.send_blocked if blocked else "")

    def show_progress(self, done: int, total: int, tps: float | None, eta: float | None,
                      title: str = READING, stopping: bool = False) -> None:
        """Reading progress: tokens done / total, with the rate and time left when
        ``tps`` is given.

        A quality check passes None: its first chunk is mostly set-up, so a rate
        from it would promise minutes that are not there. ``stopping``: Cancel
        was pressed and the engine ends the part it reads first.
        """
        self.progress_title.setText(title)
        self.progress_box.show()
        self.progress.setMaximum(max(1, total))
        self.progress.setValue(min(done, total))
        self._figures = " · ".join(unbroken(part) for part in (
            [f"{done:,} / {total:,} tokens"]
            + ([] if tps is None else [f"{tps:,.0f} tokens/s"])))
        self._eta_at = None if tps is None or eta is None else self.clock() + eta
        self._stopping = stopping
        self._show_figures()
        self.progress_cancel.setEnabled(not stopping)
        if done >= total:
            self.progress_box.hide()

    def show_starting(self, title: str = READING, stopping: bool = False) -> None:
        """A read under way whose first part has not ended yet: no count to show yet.

        The first part of a first read takes longest (the model's first run
        prepares its kernels): a moving bar says it is working.
        """
        self.progress_title.setText(title)
        self.progress.setMaximum(0)  # a busy bar: no part has ended yet
        self._figures, self._eta_at, self._stopping = FIRST_PART, None, stopping
        self._show_figures()
        self.progress_cancel.setEnabled(not stopping)
        self.progress_box.show()

    def _show_figures(self) -> None:
        if self._stopping:
            self.progress_label.setText(STOPPING_READ)
            self._countdown.stop()
            return
        text = self._figures
        if self._eta_at is not None:
            left = self._eta_at - self.clock()
            text += " · " + unbroken(f"about {human_duration(left)} left" if left >= 1
                                      else "almost done")
            self._countdown.start()
        else:
            self._countdown.stop()
        self.progress_label.setText(text)

    def add_chip(self, job_id: int, name: str) -> AttachmentChip:
        """Show a chip for a file being read."""
        chip = AttachmentChip(job_id, name, self)
        chip.removeRequested.connect(self.removeAttachment.emit)
        self.chips[job_id] = chip
        self.chips_row.addWidget(chip)
        return chip

    def remove_chip(self, job_id: int) -> None:
        """Drop one chip."""
        chip = self.chips.pop(job_id, None)
        if chip is not None:
            chip.deleteLater()

    def clear_chips(self) -> None:
        """Drop every chip (after sending)."""
        for job_id in list(self.chips):
            self.remove_chip(job_id)

    def show_notice(self, text: str) -> None:
        """An inline message under the chips (e.g. a file that can't be read)."""
        self.notice.setText(text)
        self.notice.setVisible(bool(text))

    def show_fit(self, html: str, ok: bool) -> None:
        """The fit check, highlighted when the turn won't fit."""
        self.fit.setText(html)
        self.fit.setProperty("ok", ok)
        self.fit.style().unpolish(self.fit)
        self.fit.style().polish(self.fit)
        self.fit.setVisible(bool(html))
