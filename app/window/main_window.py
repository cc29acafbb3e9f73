"""The main window: sessions | conversation + composer | memory panel."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QEvent, QSize, Qt, Signal
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QDragEnterEvent,
    QDragMoveEvent,
    QDropEvent,
    QShowEvent,
)
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QFileDialog,
    QLabel,
    QMainWindow,
    QMenu,
    QMessageBox,
    QSplitter,
    QStyle,
    QToolBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.activity import Job
from app.chat.attachments import (
    CHARS_PER_TOKEN_BOUND,
    MAX_FILES,
    DocumentLoader,
    already_attached,
    attach_filter,
    awaiting_model,
    copy_of,
    files_left_out,
)
from app.chat.composer import READING, Composer
from app.chat.conversation_view import ConversationView
from app.chat.drafts import Drafts
from app.controller import QUIT_DRAFT_UNSAVED, ChatController
from app.format import human_duration, unbroken, visible_text
from app.local_server import ServerStatus, status_text
from app.memory.api_sessions import ApiSessionsFeed
from app.memory.fit_check import FitChecker
from app.memory.panel import MemoryPanel
from app.memory.panel_feed import PanelFeed
from app.sessions.chat_state import JOB_WORDS, ChatState
from app.sessions.session_list import SessionList
from app.store import AttachmentRecord, SessionRecord
from app.window.dialogs import NewChatDialog, SettingsDialog
from app.window.downloads import Downloads
from app.window.menus import build_menus, build_toolbar, set_toolbar_icons
from app.window.model_picker import DEMO, ModelPicker
from app.window.models_dialog import ModelsDialog
from app.window.parts import Banner, FileOpenFilter, local_files
from app.window.quit_box import QUIT, quit_box
from engine import DownloadProgress, Event, request_id_of

log = logging.getLogger(__name__)

CHECKING = JOB_WORDS[ChatState.CHECKING]  # the progress row's title while a check reads
EXIT_WITHIN_S = 2.0  # from closing the window to the process having exited
# Widths in pixels. The chat column keeps room for a line of text and its status
# lines at the smallest window the app targets (1024 wide, with both side
# columns); the side columns give way first, down to their minimums.
CHAT_MIN_WIDTH = 560
SIDEBAR_WIDTH = (156, 240)  # (minimum, preferred)
PANEL_WIDTH = (306, 330)  # its table of modes needs this much in the stylesheet's font
DEFAULT_SIZE = QSize(1380, 860)
MODEL_STATE_WIDTH = 200  # the toolbar's model state text, in pixels at most
# The three columns' minimums side by side, and the height at which the memory
# panel's top sections show without scrolling (tests/app/window/test_layout.py).
MINIMUM_SIZE = QSize(1024, 700)


SETTINGS_UNSAVED = ("Your settings apply until Longleaf quits but could not be saved: {} "
                    "cannot be written (a full or read-only disk).")

class MainWindow(QMainWindow):
    """Longleaf's window."""

    filesDropped = Signal(list)
    closeAccepted = Signal()  # the window is going: the app is quitting
    # Made by build_toolbar and build_menus, which take the window as a MenuHost.
    models_action: QAction
    new_chat_action: QAction
    reopen_button: QToolButton
    reopen_menu: QMenu
    model_label: QLabel
    model_picker: ModelPicker
    model_state: QLabel
    panel_action: QAction
    settings_action: QAction
    close_action: QAction
    quit_action: QAction
    about_action: QAction
    stop_action: QAction
    find_action: QAction

    def __init__(self, controller: ChatController) -> None:
        super().__init__()
        self.controller = controller
        self.settings = controller.settings
        self.setWindowTitle("Longleaf")
        self.setAcceptDrops(True)
        self.resize(initial_size(self.screen().availableSize()))
        self.loader = DocumentLoader(controller.bridge.token_ends, self)
        self.attachments: dict[int, AttachmentRecord] = {}
        # What the composer says of the files added since the last drop (files left
        # out, each file's notes or refusal), each added to the rest, never over it.
        self._said: list[str] = []
        self._reading_for: dict[int, str | None] = {}  # files being read: the chat each came to
        self._awaiting_model: list[str] = []  # files given before a model was ready
        self.closed_at: float | None = None
        self._shown_once = False
        self._opened_folder: str | None = None
        self.downloads = Downloads(self)
        # Per download: the model loaded when it was asked for. It loads when done
        # only over that same model, with nothing running.
        self._download_over: dict[str, str] = {}
        self.downloads.progressed.connect(self._on_download_progress)
        self.downloads.ended.connect(self._on_download_ended)
        self.models_dialog: ModelsDialog | None = None
        self._shown_states: dict[str, str] = {}
        self._shown_chat: str | None = None
        self._configuring: int | None = None  # the request applying Settings' memory limit
        self._build()
        self.fit = FitChecker(controller, self.composer, self.attachments, self)
        self.drafts = Drafts(controller, self.composer, self.attachments, self)
        self.quit_box: QMessageBox | None = None  # asking whether to quit mid-answer
        self._quit_unasked = False  # the system asked to quit: no one is there to answer
        self.panel_feed = PanelFeed(controller, self.panel, self.fit, self)
        self.api_sessions_feed = ApiSessionsFeed(controller, self.panel.api_sessions, self)
        build_toolbar(self)
        build_menus(self)
        self._fit_minimum()
        self._connect()
        self._refresh_sessions()
        self._on_session_changed(controller.current)
        self.file_open_filter = FileOpenFilter(self, self.add_files)
        app = QApplication.instance()
        if app is not None:  # the QApplication made at start
            app.installEventFilter(self.file_open_filter)
        geometry = self.settings.window_geometry
        if geometry:
            self.restoreGeometry(geometry)

    # Layout ---------------------------------------------------------------

    def _build(self) -> None:
        self.sessions = SessionList()
        self.banner = Banner()
        self.conversation = ConversationView(self.controller.model)
        self.composer = Composer()
        centre = QWidget()
        centre.setObjectName("centre")
        column = QVBoxLayout(centre)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(self.banner)
        column.addWidget(self.conversation, 1)
        column.addWidget(self.composer)
        self.panel = MemoryPanel()
        # The panel scrolls once its sections outgrow the window (a long title, the
        # quality receipts): its scroll bar's width is kept beside the table of
        # modes, and taken from the chat column, whose message footers wrap.
        scroll_bar = self.style().pixelMetric(QStyle.PixelMetric.PM_ScrollBarExtent)
        centre.setMinimumWidth(CHAT_MIN_WIDTH - scroll_bar)
        self.sessions.setMinimumWidth(SIDEBAR_WIDTH[0])
        self.panel.setMinimumWidth(PANEL_WIDTH[0] + scroll_bar)
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        # A hairline between columns, as the stylesheet draws it: the columns' minimums
        # add up to MINIMUM_SIZE's width with no room for wider handles.
        self.splitter.setHandleWidth(1)
        self.splitter.addWidget(self.sessions)
        self.splitter.addWidget(centre)
        self.splitter.addWidget(self.panel)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([SIDEBAR_WIDTH[1], 800, PANEL_WIDTH[1]])
        self.splitter.setChildrenCollapsible(False)
        # Dragging the panel's edge to the right folds it away, like Memory in the toolbar.
        self.splitter.setCollapsible(2, True)
        self.splitter.splitterMoved.connect(self._on_splitter_moved)
        self.setCentralWidget(self.splitter)
        self.panel.setVisible(self.settings.memory_panel_visible)
        # The local server's one line, in a status bar shown only while it is on.
        self.server_status = QLabel()
        self.server_status.setObjectName("serverStatus")
        self.statusBar().addWidget(self.server_status, 1)
        self.statusBar().setSizeGripEnabled(False)
        self.statusBar().hide()
        self.composer.edit.filesDropped.connect(self.add_files)
        self.composer.offer_parts_from(self.loader)
        self.composer.edit.pasteRefused.connect(self._on_paste_refused)

    def _connect(self) -> None:
        c = self.controller
        self.sessions.sessionSelected.connect(c.select_session)
        self.sessions.typedAway.connect(self._type_in_composer)
        self.sessions.renameRequested.connect(c.rename_session)
        self.sessions.deleteRequested.connect(
            lambda session_id: c.delete_session(
                session_id, [record.id for record in self.sessions.records()]))
        self.sessions.searchChanged.connect(lambda _t: self._refresh_sessions())
        c.sessionsChanged.connect(self._refresh_sessions)
        # A row says whether its chat is in memory or on disk: those change too.
        c.cacheChanged.connect(self._refresh_sessions)
        c.bridge.storedKv.connect(self._on_stored_kv)
        c.bridge.ended.connect(self._on_request_ended)
        c.currentSessionChanged.connect(self._on_session_changed)
        c.modelStateChanged.connect(self._on_model_state)
        c.errorRaised.connect(lambda text: self.banner.show_message(text, "error"))
        c.notice.connect(lambda text: self.banner.show_message(text, "info"))
        c.busyChanged.connect(self._on_busy)
        c.activityChanged.connect(self._show_activity)
        c.ingestProgress.connect(self._on_progress)
        c.editRequested.connect(self._on_edit_requested)
        c.local_server.statusChanged.connect(self._show_server_status)
        c.busyChanged.connect(lambda _busy: self._show_server_status())
        self.conversation.regenerateRequested.connect(c.regenerate)
        self.conversation.editRequested.connect(c.begin_edit)
        self.conversation.continueRequested.connect(c.continue_answer)
        self.composer.sendRequested.connect(self.send)
        self.composer.stopRequested.connect(c.stop)
        self.composer.editCancelled.connect(self.cancel_edit)
        self.composer.attachRequested.connect(self.ask_attach)
        self.composer.removeAttachment.connect(self._remove_attachment)
        self.loader.loaded.connect(self._on_loaded)
        self.loader.failed.connect(self._on_load_failed)

    # Models ---------------------------------------------------------------

    def open_model_folder(self) -> None:
        """Pick a model folder and load it."""
        folder = QFileDialog.getExistingDirectory(self, "Open a model folder",
                                                  self.settings.last_folder)
        if folder:
            self.settings.last_folder = str(Path(folder).parent)
            # Remembered once it has loaded: a broken folder is not added to the picker.
            self._opened_folder = folder
            self.controller.load_model(folder)

    def choose_model(self, path: str) -> None:
        """Load the model picked in the picker; snap the picker back if refused."""
        self.controller.load_model(path)
        if self.controller.model_id != path:  # refused (an answer is running)
            self.model_picker.set_current(self.model_picker.current_path)

    def open_models(self) -> None:
        """The Models dialog: facts of every model, Load, and one-click downloads."""
        if self.models_dialog is not None:
            self.models_dialog.raise_()
            return
        picker = self.model_picker
        loaded: str | None = self.controller.model_id
        if loaded == DEMO:
            loaded = str(picker.demo.path) if picker.demo is not None else None
        dialog = ModelsDialog(picker.installed(), picker.recommended, self.downloads.running,
                              self, loaded=loaded)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.loadRequested.connect(self._load_from_library)
        dialog.downloadRequested.connect(self._download)
        dialog.cancelRequested.connect(self.downloads.cancel)
        dialog.destroyed.connect(lambda: setattr(self, "models_dialog", None))
        self.models_dialog = dialog
        dialog.show()

    def _load_from_library(self, path: str) -> None:
        demo = self.model_picker.demo
        self.choose_model("demo" if demo is not None and str(demo.path) == path else path)

    def _on_download_progress(self, progress: DownloadProgress) -> None:
        if self.models_dialog is not None:
            self.models_dialog.show_progress(progress)

    def _on_download_ended(self, repo_id: str, folder: str | None, message: str,
                           cancelled: bool) -> None:
        entry = next((e for e in self.model_picker.recommended if e.repo_id == repo_id), None)
        shown = False
        if self.models_dialog is not None and entry is not None:
            # Said in the dialog, beside its Retry, not in the banner behind it.
            self.models_dialog.download_ended(entry, folder, message, cancelled)
            shown = True
        if folder is None:
            if not shown:
                self.banner.show_message(message, "info" if cancelled else "error")
            return
        self.model_picker.refresh(self.settings.model_folders)
        asked_over = self._download_over.pop(repo_id, None)
        if asked_over != self.controller.model_id or self.controller.busy:
            # Another model was chosen since, or chats run: loading this one would
            # switch models (and drop every chat's cache) unasked.
            self.banner.show_message(f"Downloaded {repo_id}. Choose it in the toolbar's "
                                     "model list when you want it.", "info")
            return
        self.banner.show_message(f"Downloaded {repo_id}; loading it.", "info")
        self.choose_model(folder)

    def _download(self, repo_id: str) -> None:
        """Start downloading ``repo_id``, noting the model it was asked for over."""
        self._download_over.setdefault(repo_id, self.controller.model_id)
        self.downloads.start(repo_id)

    def _on_model_state(self, text: str, ready: bool) -> None:
        # A long model name is shortened in the middle: the toolbar keeps one row at 1024 px.
        shown = ("● " if ready else "○ ") + text
        self.model_state.setText(self.model_state.fontMetrics().elidedText(
            shown, Qt.TextElideMode.ElideMiddle, MODEL_STATE_WIDTH))
        self.model_state.setToolTip(shown if self.model_state.text() != shown else "")
        self._fit_minimum()  # the toolbar's row is as wide as this text
        self.model_state.setProperty("ready", ready)
        self.model_state.style().unpolish(self.model_state)
        self.model_state.style().polish(self.model_state)
        max_context = self.fit.max_context() if ready else None
        self.composer.edit.max_paste_chars = (
            max_context * CHARS_PER_TOKEN_BOUND if max_context else None)
        if ready:
            folder, self._opened_folder = self._opened_folder, None
            if folder == self.controller.model_id and folder not in self.settings.model_folders:
                self.settings.model_folders = [*self.settings.model_folders, folder]
                self.model_picker.refresh(self.settings.model_folders)
            elif self.controller.model_id == DEMO and self.model_picker.demo is None:
                # The first start converts the demo after the picker's scan: scan again
                # so the Demo item gets its size, context and costs.
                self.model_picker.refresh(self.settings.model_folders)
            self.model_picker.set_current(self.controller.model_id, text)
            self.fit.schedule()
            self.panel_feed.refresh()
            if self._awaiting_model:
                paths, self._awaiting_model = self._awaiting_model, []
                self._said = []
                self.add_files(paths)

    # Sessions -------------------------------------------------------------

    def _refresh_sessions(self) -> None:
        if self.controller.closed:  # the app quits: the history is closing (a search
            return                  # typed just before still has its pause to run)
        current = self.controller.current.id if self.controller.current else None
        records = self.controller.store.sessions(self.sessions.search.text())
        self.sessions.set_sessions(records, current, self.controller.all_chat_facts(records))

    def _on_stored_kv(self, _listing: object) -> None:
        self._refresh_sessions()

    def _on_session_changed(self, record: SessionRecord | None) -> None:
        self._refresh_sessions()
        title = f"{visible_text(record.title)} — {record.kv_mode}" if record else "Longleaf"
        self.setWindowTitle(f"{title} · Longleaf" if record else title)
        self.reopen_button.setEnabled(record is not None)
        if self.banner.property("kind") == "info":
            self.banner.hide()  # a notice is about the chat it was said in
        shown = record.id if record is not None else None
        if shown != self._shown_chat:
            # What the composer said of a file, and a file's offer, are about the
            # draft of the chat they were said in.
            self._shown_chat = shown
            self._say_only(self.drafts.said)  # of the draft just shown, if any
            self.composer.withdraw_offer()
        self.composer.show_editing(self.controller.editing)  # an edit is its chat's
        self._show_activity()
        self.fit.schedule()

    def _type_in_composer(self, text: str) -> None:
        """Move the keyboard to the message box, with ``text`` typed there."""
        self.composer.edit.setFocus(Qt.FocusReason.OtherFocusReason)
        if text:
            self.composer.edit.insertPlainText(text)

    def ask_new_chat(self) -> None:
        """Ask for the mode, then start a new chat."""
        full = self.fit.full_context_report()
        dialog = NewChatDialog(self.settings.default_mode, full, self)
        if dialog.exec():
            # A chat with nothing in it, not even a draft, is the new chat already.
            blank = not self.composer.text().strip() and not self.attachments
            # A search would leave the new chat out of the list, nothing selected.
            self.sessions.search.clear()
            self.controller.new_session(dialog.mode(), keep_blank=blank)
            # The dialog hands the focus back to whatever had it (often the toolbar's
            # model picker): the question typed next belongs in the new chat's box.
            self.composer.edit.setFocus(Qt.FocusReason.OtherFocusReason)

    # Sending --------------------------------------------------------------

    def send(self) -> None:
        """Send the composer's text and attachments; keep them if it can't be sent.

        It starts at once beside other chats' answers; while a re-ingest or quality
        check runs, it waits in line and starts by itself.
        """
        if self.loader.pending:
            self.banner.show_message("Still reading an attached file; send again in a moment.",
                                     "info")
            return
        text = self.composer.text()
        self.fit.run()  # the typing's debounced check may not have run yet
        too_long = self._too_long_to_send(text) or self.composer.send_blocked
        if too_long:
            self.banner.show_message(too_long, "error")
            return
        records = tuple(self.attachments.values())
        if self.controller.send(text, records):
            self.composer.set_text("")
            self.attachments.clear()
            self.composer.clear_chips()
            # The attachments sent are no draft any more; a draft an edit set aside is.
            self.drafts.end_edit()
            self.composer.show_editing(False)
            self._say_only("")
            self.banner.hide()
            self.fit.schedule()

    def _too_long_to_send(self, text: str) -> str:
        """Why ``text`` can't be sent at all, or "".

        Refused here, before it is saved or shown: no tokenizer packs more than
        ``CHARS_PER_TOKEN_BOUND`` characters per token, so past that many per
        token of context it can never fit, and a saved turn that can't fit would
        make every later turn of the chat fail too.
        """
        max_context = self.fit.max_context()
        if not max_context or len(text) <= max_context * CHARS_PER_TOKEN_BOUND:
            return ""
        return (f"This message is {len(text):,} characters, {_more_than(max_context)}. "
                "It was not sent and is still in the box: shorten it, or use a model with "
                "a longer context.")

    def _on_paste_refused(self, chars: int) -> None:
        max_context = self.fit.max_context() or 0
        self.banner.show_message(
            f"That paste is {chars:,} characters, {_more_than(max_context)}, so it was not "
            "pasted. Paste a part of it, or use a model with a longer context.", "error")

    def _on_busy(self, busy: bool) -> None:
        if not busy and self.controller.activity.is_refusal(self.banner.label.text()):
            self.banner.hide()  # "Stop the current answer before…" is moot once it ended
        self.fit.schedule()

    def _show_activity(self) -> None:
        """The composer and the rows show the shown chat's own job only; the sidebar all."""
        activity = self.controller.activity
        states = activity.states()
        if states != self._shown_states:
            self._shown_states = states
            self._refresh_sessions()  # each chat with a job says so in the sidebar
            self.panel_feed.refresh_quality()  # whether this chat can be checked now
        current = self.controller.current
        job = activity.job_of(current.id if current else None)
        ahead = activity.ahead_of(job) if job is not None else None
        stopping = job is not None and job.stopping
        # Chat ▸ Stop (Esc) stops the shown chat's job only: greyed out with none.
        self.stop_action.setEnabled(job is not None)
        self.composer.set_generating(job is not None and job.started, stopping)
        self.composer.show_waiting(ahead.title if ahead is not None else None,
                                   self._how_far(ahead) if ahead is not None else "",
                                   held=job.held if job is not None else "")
        reading = (job if job is not None and job.started
                   and job.state in ("reading", "checking") else None)
        progress = reading.progress if reading is not None else None
        title = CHECKING if job is not None and job.kind == "quality" else READING
        if reading is None:
            self.composer.progress_box.hide()
        elif progress is None:  # the first part is still being read
            self.composer.show_starting(title, stopping)
        elif reading.kind == "quality":  # no rate: see Composer.show_progress
            self.composer.show_progress(progress.tokens_done, progress.tokens_total, None, None,
                                        CHECKING, stopping)
        else:
            self.composer.show_progress(
                progress.tokens_done, progress.tokens_total, progress.tokens_per_second,
                self.controller.read_eta(progress), READING, stopping)
        self.conversation.set_busy(job is not None,
                                   reading=reading is not None and reading.kind == "chat")

    def _how_far(self, job: Job) -> str:
        """How far the job a message waits for is: "reading: 512 / 3,552 tokens, about
        39s left", "answering", or "" before it says."""
        progress = job.progress
        if job.state == "answering":
            return "answering"
        if progress is None or job.state not in ("reading", "checking"):
            return ""
        what = "reading" if job.state == "reading" else "checking quality"
        figures = [f"{progress.tokens_done:,} / {progress.tokens_total:,} tokens"]
        eta = self.controller.read_eta(progress) if job.state == "reading" else None
        if eta is not None:
            figures.append(f"about {human_duration(eta)} left")
        return f"{what}: " + ", ".join(unbroken(part) for part in figures)

    def _on_progress(self, _event: object) -> None:
        self._show_activity()
        self._refresh_sessions()  # a reading chat's row says how far it is

    def _show_server_status(self, status: ServerStatus | None = None) -> None:
        status = status or self.controller.local_server.status
        text = status_text(status)
        self.server_status.setText(text)
        self.server_status.setProperty("state", status.state)
        self.statusBar().setVisible(bool(text))

    def _on_edit_requested(self, text: str, attachments: Sequence[AttachmentRecord]) -> None:
        self.drafts.begin_edit(text, tuple(attachments))
        self.composer.show_editing(True)

    def cancel_edit(self) -> None:
        """Give up the edit shown: the last message stays, the draft it set aside is back."""
        self.controller.cancel_edit()
        self.drafts.end_edit()
        self.composer.show_editing(False)

    # Documents ------------------------------------------------------------

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if local_files(event.mimeData()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event: QDragMoveEvent) -> None:
        if local_files(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        paths = local_files(event.mimeData())
        if paths:
            event.acceptProposedAction()
            self.add_files(paths)

    def ask_attach(self) -> None:
        """The attach dialog."""
        paths, _ = QFileDialog.getOpenFileNames(
            self, "Attach documents", self.settings.last_folder, attach_filter())
        if paths:
            self.settings.last_folder = str(Path(paths[0]).parent)
        self.add_files(paths)

    def add_files(self, paths: list[str]) -> None:
        """Read files off the GUI thread and show them as chips, up to ``MAX_FILES`` in
        the composer; the others are left out, and that is said. Files given before a
        model is ready (opened with Longleaf as it starts) wait for it."""
        if not self.controller.model_ready:
            # Counting a file's tokens takes the model's tokenizer: refused now, a
            # file opened with Longleaf as it starts would be lost.
            self._awaiting_model.extend(paths)
            self._tell(awaiting_model(paths))
            return
        self.filesDropped.emit(list(paths))
        taken = list(paths[:max(0, MAX_FILES - len(self.composer.chips))])
        left_out = files_left_out(len(paths), len(taken)) if len(taken) < len(paths) else ""
        if left_out:
            log.info("%d of %d files given were attached", len(taken), len(paths))
        self._said = []
        self._tell(left_out)
        for path in taken:
            job_id = self.loader.load(path, self.fit.room(Path(path).name) or 131_072)
            self.composer.add_chip(job_id, Path(path).name)
            self._reading_for[job_id] = self.drafts.session_id

    def _tell(self, said: str) -> None:
        """Add what a file's read says to what was said of the files added since the
        last drop: one file's news never hides another's."""
        if said:
            self._said.append(said)
        self.composer.show_notice(" ".join(self._said))

    def _say_only(self, said: str) -> None:
        """Show ``said`` alone (a chat shown, a message sent): the files' news is over."""
        self._said = [said] if said else []
        self.composer.show_notice(said)

    def _on_loaded(self, job_id: int, record: AttachmentRecord, notes: tuple) -> None:
        if job_id not in self._reading_for:  # removed while it was being read
            return
        dropped_in = self._reading_for.pop(job_id)
        if dropped_in not in (None, self.drafts.session_id):  # its chat was left since
            self.drafts.add_file(dropped_in, record)
            return
        same = copy_of(record, self.attachments.values())
        if same is not None:
            # Dropped again: a second copy would only double its tokens in the prompt.
            self.composer.remove_chip(job_id)
            self._tell(already_attached(record.name, same.name))
            return
        chip = self.composer.chips.get(job_id)
        if chip is None:  # its chat was left and shown again: the switch took its chip
            chip = self.composer.add_chip(job_id, record.name)
        chip.set_record(record)
        self.attachments[job_id] = record
        if self.loader.pending:
            self.drafts.save_soon()  # more files are coming: one save for many
        else:
            self.drafts.save_now()
        self._tell(" ".join(notes))
        self.fit.schedule()

    def _on_load_failed(self, job_id: int, message: str) -> None:
        self._reading_for.pop(job_id, None)
        self.composer.remove_chip(job_id)
        self._tell(message)

    def _remove_attachment(self, job_id: int) -> None:
        self.loader.cancel(job_id)  # still being read: the files after it go ahead
        self.composer.drop_offer(job_id)
        self._reading_for.pop(job_id, None)
        self.attachments.pop(job_id, None)
        self.composer.remove_chip(job_id)
        self.drafts.save_now()
        self.fit.schedule()

    # Panel ----------------------------------------------------------------

    def _on_splitter_moved(self, _pos: int, _index: int) -> None:
        if self.panel.isVisible() and self.splitter.sizes()[2] == 0:
            self.panel_action.setChecked(False)  # hides it through set_panel_visible

    def as_widget(self) -> QWidget:
        """The window itself (``MenuHost``: the parent of the toolbar's actions)."""
        return self

    def set_panel_visible(self, visible: bool) -> None:
        """Show or hide the memory panel, and remember the choice."""
        self.panel.setVisible(visible)
        self.settings.memory_panel_visible = visible
        self._fit_minimum()  # a narrow window widens to take the panel back
        sizes = self.splitter.sizes()
        if visible and sizes[2] == 0:  # folded by a drag: open it at its usual width
            self.splitter.setSizes([sizes[0], sizes[1] - PANEL_WIDTH[1], PANEL_WIDTH[1]])
        if visible:
            self.panel_feed.refresh()

    def _fit_minimum(self) -> None:
        """The window's minimum: its visible columns' minimums side by side, and the
        toolbar's whole row, so with the memory panel hidden it can be narrower
        (MINIMUM_SIZE with all three)."""
        columns = (self.splitter.widget(i) for i in range(self.splitter.count()))
        shown = [column for column in columns if column is not None and not column.isHidden()]
        width = (sum(column.minimumWidth() for column in shown)
                 + self.splitter.handleWidth() * (len(shown) - 1))
        toolbar = self.findChild(QToolBar, "mainToolbar")
        if toolbar is not None:  # narrower, it folds controls into its overflow menu
            width = max(width, toolbar.sizeHint().width())
        self.setMinimumSize(min(width, MINIMUM_SIZE.width()), MINIMUM_SIZE.height())

    # Window ---------------------------------------------------------------

    def open_settings(self) -> None:
        """The Settings dialog."""
        if SettingsDialog(self.settings, self, self.controller.sampling(),
                          model_folder=self.controller.model_id).exec():
            if not self.settings.sync():
                self.banner.show_message(SETTINGS_UNSAVED.format(self.settings.path),
                                         "error")
            self.model_picker.refresh(self.settings.model_folders)
            self._configuring = self.controller.bridge.configure(
                self.settings.memory_budget_bytes, self.settings.ingest_chunk,
                self.settings.read_share)
            self.controller.bridge.set_snapshot_budget(self.settings.stored_kv_budget_bytes)
            self.controller.local_server.apply()
            self.controller.machines_changed()

    def _on_request_ended(self, event: Event) -> None:
        """Once the engine holds a new memory limit, show the fit against it: no stats
        sample follows a configure, so the panel and the fit line would keep the old one."""
        if self._configuring is None or request_id_of(event) != self._configuring:
            return
        self._configuring = None
        self.fit.limits_changed()
        self.panel_feed.refresh()

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        if not self._shown_once:
            # Otherwise the first field in the window, the sidebar's search, takes the
            # keys: a question typed at launch would search the chats.
            self._shown_once = True
            self.composer.edit.setFocus(Qt.FocusReason.OtherFocusReason)

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and hasattr(self, "settings_action"):
            set_toolbar_icons(self)  # the icons are drawn in the palette's text colour

    def closeEvent(self, event: QCloseEvent) -> None:
        # Nothing here waits: the history is saved and the engine told to stop,
        # and the window goes away at once. ``finish_closing`` then joins the
        # threads, after the window is gone.
        self.drafts.save_now()
        question = self.controller.quit_question() or (
            QUIT_DRAFT_UNSAVED if self.drafts.kept_unsaved() else "")
        if question and not self._quit_confirmed():
            event.ignore()
            self._ask_quit(question)
            return
        if self.closed_at is None:
            self.closed_at = time.monotonic()
        self.drafts.save_now()
        self.settings.window_geometry = bytes(self.saveGeometry().data())
        self.settings.sync()
        app = QApplication.instance()
        if app is not None:
            app.removeEventFilter(self.file_open_filter)
        self.controller.close()
        event.accept()
        self.closeAccepted.emit()

    def quit_now(self) -> None:
        """Close as a confirmed quit, asking nothing: the system asked (logout,
        shutdown, ``kill``) or Ctrl-C in the terminal did, and no one may be there to
        answer. An open dialog is cancelled first, since its loop would keep the app."""
        self._quit_unasked = True
        for dialog in self.findChildren(QDialog):
            if dialog.isVisible():
                dialog.reject()
        if self.isVisible():  # the quit question's Quit, taken by the reject, closed it
            self.close()

    def _quit_confirmed(self) -> bool:
        box = self.quit_box
        return self._quit_unasked or (
            box is not None and box.clickedButton() is box.button(QUIT))

    def _ask_quit(self, question: str) -> None:
        """Ask without blocking (a sheet on macOS); Quit closes the window again."""
        if self.quit_box is not None and self.quit_box.isVisible():
            return
        self.quit_box = quit_box(question, self)
        self.quit_box.finished.connect(lambda _r: self._quit_confirmed() and self.close())
        self.quit_box.open()

    def finish_closing(self, within: float = EXIT_WITHIN_S) -> bool:
        """Join the file readers and the engine thread after the window closed.

        Waits at most until ``within`` seconds after the close; True when every
        thread has ended. A prefill chunk or model load inside MLX cannot be
        interrupted, so this may be False; the history is saved either way.
        """
        closed_at = self.closed_at if self.closed_at is not None else time.monotonic()

        def left() -> float:
            return max(0.05, within - (time.monotonic() - closed_at))

        readers_done = self.loader.wait(int(left() * 1000))
        readers_done = self.model_picker.wait(int(left() * 1000)) and readers_done
        # A download stopped here resumes from its partial files next time.
        readers_done = self.downloads.wait_all(left()) and readers_done
        return self.controller.shutdown(left()) and readers_done


def initial_size(available: QSize) -> QSize:
    """The first window's size: 1380×860, or the whole screen when that is smaller."""
    return QSize(min(DEFAULT_SIZE.width(), available.width()),
                 min(DEFAULT_SIZE.height(), available.height()))


def _more_than(max_context: int) -> str:
    return (f"more than this model's {max_context:,}-token context can hold (at most about "
            f"{max_context * CHARS_PER_TOKEN_BOUND:,} characters)")
