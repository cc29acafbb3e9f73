"""What is in the composer, kept per chat across chat switches and restarts.

Each chat's draft (the typed text and the attachments not yet sent) lives in
the history with the chat (``HistoryStore.set_draft``), saved a moment after
the typing stops and at once when an attachment comes or goes, so a crash
loses at most that moment; switching chats saves the one left at once and
shows the one opened. What is in the composer while no chat is shown goes
with the chat the next send or New Chat makes. A file still being read when
the chat changes goes to the draft of the chat it was dropped into once read
(the window calls ``add_file``). An earlier message put back to edit sets the
draft aside: the draft saved stays the user's own, and it comes back to the
composer once the edit is sent or cancelled, or its chat is left. The edit
itself is saved beside it (``HistoryStore.set_edit``) as the draft is, and
comes back, in edit mode, whenever its chat is shown again: after a switch, a
quit or a crash. A draft the history cannot take (a full or read-only disk) is
kept in memory for the run and shown again when its chat is.
"""

from __future__ import annotations

import itertools
import logging

from PySide6.QtCore import QObject, QTimer

from app.chat.attachments import MAX_FILES, copy_of, restored_left_out
from app.chat.composer import Composer
from app.controller import ChatController
from app.store import AttachmentRecord, EditRecord, SessionRecord
from engine import DiskFault

log = logging.getLogger(__name__)

SAVE_AFTER_MS = 400
SAVE_FILES_EVERY_MS = 1000


class Drafts(QObject):
    """Keeps ``composer``'s text and ``attachments`` as the draft of the chat shown.

    ``attachments`` is the window's dict of the composer's attachments by chip id
    (changed in place); the window calls ``save_now`` when it changes.
    """

    def __init__(self, controller: ChatController, composer: Composer,
                 attachments: dict[int, AttachmentRecord],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.composer, self.attachments = controller.store, composer, attachments
        self.controller = controller
        current = controller.current
        self.session_id: str | None = current.id if current else None
        self._loading = False
        # What the composer says of the draft shown: the files left out of it, or "".
        self.said = ""
        self._restored_ids = itertools.count(-1, -1)  # the loader's job ids are positive
        self._timer = QTimer(self, singleShot=True, interval=SAVE_AFTER_MS)
        self._timer.timeout.connect(self.save_now)
        self._files_timer = QTimer(self, singleShot=True, interval=SAVE_FILES_EVERY_MS)
        self._files_timer.timeout.connect(self.save_now)
        # Drafts the history could not take, by chat: the newest word on them.
        self._unsaved: dict[str | None, tuple[str, tuple[AttachmentRecord, ...]]] = {}
        # The draft an edit took the composer from: (its chat, its text, its files).
        self._set_aside: tuple[str | None, str, tuple[AttachmentRecord, ...]] | None = None
        self._edited: int | None = None  # the id of the message edited
        # The chat and files the last save wrote (None: none known to be stored), of
        # the draft and of the edit under way.
        self._files_saved: tuple[str | None, tuple[AttachmentRecord, ...]] | None = None
        self._edit_files_saved: tuple[str, tuple[AttachmentRecord, ...]] | None = None
        composer.edit.textChanged.connect(self._typed)
        controller.currentSessionChanged.connect(self._switched)
        self._show(*self._draft(self.session_id))
        self._resume_edit()

    def save_now(self) -> None:
        """Write the shown chat's draft (the window closes, the typing paused, a file came)."""
        self._timer.stop()
        self._files_timer.stop()
        aside = self._set_aside
        if aside is not None and aside[0] == self.session_id:
            self._save(*aside)  # the draft stays the user's own; the edit is kept apart
            self._keep_edit(self._edited_now())
            return
        self._save(self.session_id, self.composer.text(), tuple(self.attachments.values()))

    def begin_edit(self, text: str, files: tuple[AttachmentRecord, ...]) -> None:
        """Show an earlier message to edit, setting the draft in the composer aside
        until the edit is sent (:meth:`end_edit`) or its chat is left."""
        if self._set_aside is None or self._set_aside[0] != self.session_id:
            self.save_now()
            self._set_aside = (self.session_id, self.composer.text(),
                               tuple(self.attachments.values()))
        self._edited = self.controller.edited_message_id
        self.show_attachments(files)
        self._show_text(text)

    def end_edit(self) -> None:
        """The edit was sent or cancelled: the draft it set aside comes back to the
        composer."""
        aside, self._set_aside, self._edited = self._set_aside, None, None
        if aside is not None and aside[0] == self.session_id:
            self._show(aside[1], aside[2])
            self._keep_edit(None)
        self.save_now()

    def _edited_now(self) -> EditRecord | None:
        if self._edited is None:
            return None
        return EditRecord(self._edited, self.composer.text(), tuple(self.attachments.values()))

    def _keep_edit(self, edit: EditRecord | None) -> None:
        """Save ``edit`` as the shown chat's edit under way (None: it has none)."""
        if self.session_id is None:
            return
        if edit is not None and self.store.session(self.session_id) is None:
            edit = None  # the chat was deleted: nothing of it stays
        written = (self.session_id, edit.attachments) if edit is not None else None
        try:
            # Its files as last written are not written again (as a draft's).
            self.store.set_edit(self.session_id, edit,
                                files=written is None or written != self._edit_files_saved)
        except DiskFault as fault:  # the composer still holds it
            log.warning("edit not saved: %s", fault)
            self._edit_files_saved = None
            return
        self._edit_files_saved = written

    def _resume_edit(self) -> None:
        """Put the edit kept for the chat just shown back in the composer, in edit mode."""
        kept = self.store.edit(self.session_id) if self.session_id is not None else None
        if kept is None:
            return
        if self.controller.resume_edit(kept.message_id):
            self.begin_edit(kept.text, kept.attachments)
            return
        # Its message is not the last any more: the rewritten text joins the draft,
        # sending it replaces nothing.
        text = self.composer.text()
        if kept.attachments:
            self.show_attachments((*self.attachments.values(), *kept.attachments))
        self._show_text(f"{text}\n\n{kept.text}" if text and kept.text else text or kept.text)
        self._keep_edit(None)
        self.save_now()

    def add_file(self, session_id: str | None, record: AttachmentRecord) -> None:
        """Add ``record`` to the draft of ``session_id``, a chat not shown now (a file
        read in after its chat was left)."""
        text, files = self._draft(session_id)
        if len(files) < MAX_FILES and copy_of(record, files) is None:
            self._save(session_id, text, (*files, record))

    def save_soon(self) -> None:
        """Write the draft within ``SAVE_FILES_EVERY_MS`` (a file came and more are being
        read: one save for all that come meanwhile)."""
        if not self._files_timer.isActive():
            self._files_timer.start()

    def _save(self, session_id: str | None, text: str,
              files: tuple[AttachmentRecord, ...]) -> None:
        # The files as last written for this chat are not written again: a pause in
        # typing beside large documents would rewrite them all, on the GUI thread.
        unchanged = self._files_saved is not None and self._files_saved == (session_id, files)
        try:
            self.store.set_draft(session_id, text, None if unchanged else files)
        except DiskFault as fault:
            if not self._unsaved:  # said once while any draft waits
                log.warning("draft kept in memory only: %s", fault)
                self.controller.errorRaised.emit(
                    f"Your draft is kept in this window only, until the history takes it "
                    f"again; quitting before then loses it. {fault}")
            self._unsaved[session_id] = (text, files)
            self._files_saved = None
            return
        self._unsaved.pop(session_id, None)
        self._files_saved = (session_id, files)

    def kept_unsaved(self) -> bool:
        """Whether a draft is still kept in memory only once each is tried again."""
        for session_id, (text, files) in list(self._unsaved.items()):
            self._files_saved = None
            self._save(session_id, text, files)
        return bool(self._unsaved)

    def _draft(self, session_id: str | None) -> tuple[str, tuple[AttachmentRecord, ...]]:
        """The draft of ``session_id``: the one kept in memory, else the saved one."""
        if session_id in self._unsaved:
            return self._unsaved[session_id]
        return self.store.draft(session_id), self.store.draft_attachments(session_id)

    def show_attachments(self, records: tuple[AttachmentRecord, ...]) -> None:
        """Put ``records`` in the composer in place of its attachments, as chips (the
        first ``MAX_FILES``; the rest are left out, and that is said)."""
        self.attachments.clear()
        self.composer.clear_chips()
        if len(records) > MAX_FILES:
            log.info("a draft of %d files shown as its first %d", len(records), MAX_FILES)
            self.said = restored_left_out(len(records))
            self.composer.show_notice(self.said)
            records = records[:MAX_FILES]
        for record in records:
            chip_id = next(self._restored_ids)
            self.attachments[chip_id] = record
            self.composer.add_chip(chip_id, record.name).set_record(record)

    def _typed(self) -> None:
        if self._loading:
            return
        if not self.composer.text():
            self.save_now()  # a sent message must not come back as a draft after a crash
        else:
            self._timer.start()

    def _switched(self, record: SessionRecord | None) -> None:
        new_id = record.id if record is not None else None
        if new_id == self.session_id:  # renamed, or its count changed: the same chat
            return
        held = bool(self.composer.text() or self.attachments)
        draft, files = self._draft(new_id)
        if self.session_id is None and new_id is not None and held and not (draft or files):
            # Made before any chat existed: the chat just made (a send, New Chat) takes it.
            self._save(None, "", ())
            self.session_id = new_id
            self.save_now()
            return
        self.save_now()  # with an edit under way, the draft it set aside and the edit
        # The chat left: its edit waits, saved, for its return.
        self._set_aside = self._edited = None
        self.session_id = new_id
        self._show(draft, files)
        self._resume_edit()

    def _show(self, text: str, files: tuple[AttachmentRecord, ...]) -> None:
        self.said = ""
        if files or self.attachments or self.composer.chips:  # files still read too
            self.show_attachments(files)
            if len(files) > MAX_FILES:  # keep what is shown, so the next start is quick
                self._save(self.session_id, text, tuple(self.attachments.values()))
        self._show_text(text)

    def _show_text(self, text: str) -> None:
        if text == self.composer.text():
            return
        self._loading = True
        try:
            self.composer.edit.setPlainText(text)
            self.composer.edit.moveCursor(self.composer.edit.textCursor().MoveOperation.End)
        finally:
            self._loading = False
