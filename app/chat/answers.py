"""Answers and re-ingests, from the request to how they ended.

Tokens stream into the answer's own chat (shown or not: the user may read
other chats meanwhile), the answer is saved as it grows and as it ends
(complete, stopped, failed), and failures are shown. Every ending ends its job,
whatever the history can still save: the recorder keeps what it cannot write.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from app.activity import Activity, Job
from app.chat.model import ChatModel
from app.chat.recorder import CONTEXT_END, LENGTH_LIMIT, AnswerRecorder, stopped_reading
from app.engine_bridge import EngineBridge
from app.sessions.actions import SessionActions
from app.sessions.caches import SessionCaches
from app.settings import Settings
from app.store import EditRecord, HistoryStore, SessionRecord
from engine import (
    DiskFault,
    Event,
    Failed,
    Finished,
    GenerationStats,
    IngestProgress,
    SamplingParams,
    TokenChunk,
)

log = logging.getLogger(__name__)

TOO_LONG_TURN = ("Too long for the model's context; kept here but not sent with later "
                 "messages. Edit it to a shorter one, or reopen the chat in a smaller KV mode.")
EARLIER_KEPT = "The earlier answer is kept."
EDIT_RETURNED = "The conversation is as it was; your edit is back in the box."
MEMORY_STOP = ("Stopped to protect your computer: system memory turned critical or free RAM ran "
               "out. Close other apps or chats, or reopen this chat in a smaller KV mode.")


@dataclasses.dataclass(frozen=True)
class Replaced:
    """The turn an answer made again (Regenerate) or an edit replaces.

    Its messages stay in the history until the new answer's first text comes, so
    an answer that ends before any (refused, failed, stopped while it read) leaves
    the chat as it was: the earlier answer kept, an edit back in the composer.
    """

    message_ids: tuple[int, ...]  # deleted once the new answer has text
    edit: EditRecord | None = None  # an edit's rewritten message (its id: the one edited)


class Answers(QObject):
    """Starts chat and ingest requests and follows each one's events to its end.

    Each is a job of its chat (``activity``): it waits in line while a
    re-ingest or quality check runs, then for its session's KV cache to open
    (``caches``). The bridge hands every event of its request to the handler it
    was submitted with. Several chats answer at once, so each chat's answer
    streams into that chat's own recorder, which fills ``model`` while its chat
    is shown (``sessions``).
    """

    answerFinished = Signal(str)  # final status of the answer
    errorRaised = Signal(str)
    notice = Signal(str)
    ingestProgress = Signal(object)
    editReturned = Signal(str)  # session id: an edit came back (``HistoryStore.edit``)

    def __init__(self, bridge: EngineBridge, settings: Settings, store: HistoryStore,
                 model: ChatModel, activity: Activity, caches: SessionCaches,
                 sessions: SessionActions, parent: QObject | None = None, *,
                 sampling: Callable[[], SamplingParams],
                 max_context: Callable[[], int | None] = lambda: None) -> None:
        super().__init__(parent)
        self.bridge, self.settings, self.store, self.model = bridge, settings, store, model
        self.sampling = sampling  # the settings over the loaded model's own defaults
        self.max_context = max_context  # the loaded model's context (None: none loaded)
        self.activity, self.caches, self.sessions = activity, caches, sessions
        # Session id -> its answers' recorder, kept after the answer ends: writes the
        # history could not take yet wait in it.
        self.recorders: dict[str, AnswerRecorder] = {}
        # Session id -> the turn its answer replaces, until that answer has text.
        self._replacing: dict[str, Replaced] = {}
        sessions.currentSessionChanged.connect(
            lambda record: self._show(record.id if record else None))

    def recorder_of(self, session_id: str) -> AnswerRecorder:
        """The recorder of chat ``session_id``'s answers (made on first use)."""
        recorder = self.recorders.get(session_id)
        if recorder is None:
            recorder = AnswerRecorder(self.store, self.model, self)
            recorder.unsaved.connect(
                lambda reason: self.errorRaised.emit(self.sessions.about(session_id, reason)))
            recorder.saved.connect(self.notice)
            self.recorders[session_id] = recorder
        return recorder

    @property
    def unsaved(self) -> bool:
        """Whether any answer waits for the history to take its writes."""
        return any(recorder.pending for recorder in self.recorders.values())

    def flush(self) -> bool:
        """Write what every recorder keeps unsaved; True when nothing waits any more."""
        return all([recorder.flush() for recorder in self.recorders.values()])

    def _show(self, session_id: str | None) -> None:
        for recorder in self.recorders.values():
            recorder.show(session_id)

    # Starting -------------------------------------------------------------

    def start_chat(self, session: SessionRecord, replaced: Replaced | None = None) -> Job:
        """Answer the conversation in ``model``, which ends with a user turn; the
        answer takes the place of ``replaced`` once it has text."""
        messages = self.model.engine_messages(self.settings.system_prompt)
        # The user turn (sent or regenerated) is the last row.
        sent_id = self.model.message(self.model.rowCount() - 1).message_id
        if replaced is not None:
            self._replacing[session.id] = replaced
        return self.activity.add(session.id, "chat", session.title,
                                 lambda job: self._run(job, session, messages, sent_id),
                                 lambda job: self._dropped(job, sent_id))

    def start_continue(self, session: SessionRecord, message_id: int) -> Job:
        """Let the answer ``message_id``, the conversation's last row, go on in place."""
        messages = self.model.engine_messages(self.settings.system_prompt)
        answer = self.model.message(self.model.rowCount() - 1)
        return self.activity.add(session.id, "chat", session.title,
                                 lambda job: self._run(job, session, messages, 0,
                                                       (message_id, answer.content,
                                                        answer.stats)),
                                 self._dropped)

    def start_ingest(self, session: SessionRecord) -> Job:
        """Read the conversation in ``model`` into ``session``'s new KV cache."""
        messages = self.model.engine_messages(self.settings.system_prompt)
        return self.activity.add(session.id, "ingest", session.title,
                                 lambda job: self._run(job, session, messages, 0),
                                 self._dropped)

    def _run(self, job: Job, session: SessionRecord, messages: list[dict[str, str]],
             sent_id: int, continued: tuple[int, str, dict | None] | None = None) -> None:
        # Its turn has come: the answer's row is made now, in its own chat (or, for
        # Continue, the answer it extends records again).
        recorder = self.recorder_of(session.id)
        if continued is not None:
            message_id, text, stats = continued
            recorder.resume(session.id, message_id, text, self.sessions.shown(session.id), stats)
        elif job.kind == "chat":
            try:
                recorder.start(session.id, self.sessions.shown(session.id))
            except DiskFault as fault:  # no row for the answer: it does not start
                kept = self._put_back(job.session_id, sent_id)
                self.errorRaised.emit(f"The answer was not started. {fault}{kept}")
                self.activity.end(job)
                return
        # A failed Continue keeps the answer it extends: "failed" would leave it unseen.
        failed = "stopped" if continued is not None else "failed"

        def handle(event: Event) -> None:
            self._handle(job, sent_id, event, failed)

        def submit() -> None:
            if job.kind == "chat":
                rid = self.bridge.chat(session.id, messages, self.sampling(), handle)
            else:
                rid = self.bridge.ingest(session.id, messages, handle)
            if self.activity.submitted(job, rid):  # Stop was pressed while the cache opened
                self.bridge.cancel(rid)

        self.caches.ensure_open(session, submit,
                                # The session's KV cache could not be opened: the job ends.
                                lambda event: self._failed(job, sent_id, event, failed))

    # Engine events of one request ----------------------------------------

    def _handle(self, job: Job, sent_id: int, event: Event, failed: str) -> None:
        if isinstance(event, TokenChunk):
            if job.kind == "chat":
                if event.text and job.session_id in self._replacing:
                    self._replace(job.session_id)
                self.recorder_of(job.session_id).append(event.text)
                self.activity.note(job, answering=True)
        elif isinstance(event, IngestProgress):
            if job.kind == "chat":
                # The prompt's last token is read by the step that makes the first
                # word: counted, the total is what the send reads (the fit line's count).
                event = dataclasses.replace(event, tokens_total=event.tokens_total + 1)
            self.activity.note(job, progress=event)
            self.ingestProgress.emit(event)
        elif isinstance(event, Finished):
            self._finished(job, sent_id, event)
        elif isinstance(event, Failed):
            self._failed(job, sent_id, event, failed)

    def finish_answer(self, session_id: str, status: str, reason: str | None,
                      stats: dict | None = None) -> None:
        """Save how chat ``session_id``'s answer ended and say so; a continued answer's
        stats count all of it."""
        recorder = self.recorder_of(session_id)
        recorder.finish(status, reason, merged_stats(recorder.earlier_stats, stats))
        self.sessions.sessionsChanged.emit()
        self.answerFinished.emit(status)

    def _finished(self, job: Job, sent_id: int, event: Finished) -> None:
        try:
            self._record_finished(job, sent_id, event)
        finally:  # the chat never stays busy, whatever recording its end did
            self.activity.end(job)

    def _record_finished(self, job: Job, sent_id: int, event: Finished) -> None:
        # Once the answer streams, a stop cuts the answer, not the read: its last
        # read progress says nothing of the stop.
        kept = _kept(event, None if job.answering else job.progress,
                     counted_last=job.kind == "chat")
        if job.kind == "chat":
            status = "stopped" if event.reason in ("cancelled", "memory") else "complete"
            reason = {"cancelled": "Stopped", "length": LENGTH_LIMIT,
                      "memory": MEMORY_STOP}.get(event.reason)
            if event.reason == "length" and _fills(event.stats, self.max_context()):
                reason = CONTEXT_END
            if event.reason == "cancelled" and kept is not None:
                reason = stopped_reading(*kept)
            put_back = self._put_back(job.session_id, sent_id)
            if event.reason == "memory":
                self.errorRaised.emit(self.sessions.about(job.session_id,
                                                          MEMORY_STOP + put_back))
            if put_back:
                said = "" if event.reason == "memory" else (
                    "Stopped before the answer began." if event.reason == "cancelled"
                    else "The model gave no new answer.") + put_back
                self._ended_without_text(job.session_id, status, said)
            else:
                self.finish_answer(job.session_id, status, reason, _stats_dict(event.stats))
        else:
            self._report_ingest(job.session_id, event, kept)
        whole = kept[1] if kept is not None and event.kept_tokens is not None else None
        self.caches.read_ended(job.session_id, whole)
        # This chat's own latest sample: with chats answering together, the engine's
        # latest one may be another chat's (the engine sends this one before the end).
        sample = self.caches.sample_for(job.session_id) or self.bridge.latest_stats()
        self.sessions.record_tokens(job.session_id, sample, whole)

    def _report_ingest(self, session_id: str, event: Finished,
                       kept: tuple[int, int] | None) -> None:
        # Said only while its chat is on screen: it is about that chat.
        ingested = self.store.session(session_id)
        if ingested is None or not self.sessions.shown(session_id):
            return
        if event.reason != "cancelled":
            self.notice.emit(f"Read the conversation in: it is in memory in {ingested.kv_mode}.")
        elif kept is not None:
            self.notice.emit(f"Stopped reading the conversation in: {kept[0]:,} of "
                             f"{kept[1]:,} tokens kept in {ingested.kv_mode}; the next message "
                             "reads the rest.")
        else:
            self.notice.emit(f"Stopped reading the conversation in ({ingested.kv_mode}).")

    def _failed(self, job: Job, sent_id: int, event: Failed, status: str) -> None:
        try:
            kept = ""
            if job.kind == "chat":
                kept = self._put_back(job.session_id, sent_id)
                if kept:
                    self._ended_without_text(job.session_id, status)
                else:
                    if event.error_type == "ContextTooLong":
                        self._set_aside_sent_turn(sent_id)
                    self.finish_answer(job.session_id, status, event.message)
            self.errorRaised.emit(self.sessions.about(
                job.session_id, self._with_unsaved(job.session_id, event.message + kept)))
        finally:  # the chat never stays busy, whatever recording the failure did
            self.activity.end(job)

    def _with_unsaved(self, session_id: str, message: str) -> str:
        """``message``, and that the answer waits unsaved when it does (one banner)."""
        unsaved = self.recorder_of(session_id).unsaved_reason
        return f"{message} {unsaved}" if unsaved and unsaved not in message else message

    def _dropped(self, job: Job, sent_id: int = 0) -> None:
        # Cancelled while it waited in line: the engine never saw it.
        if job.kind != "chat":
            return
        kept = self._put_back(job.session_id, sent_id)
        if kept:
            self._ended_without_text(job.session_id, "stopped",
                                     "Stopped before the answer began." + kept)
        elif self.sessions.shown(job.session_id):
            self.notice.emit("Not sent: your message is kept. Edit it to send it again.")

    # A turn replaced -------------------------------------------------------

    def _replace(self, session_id: str) -> None:
        """The new answer has text: the turn it replaces leaves the history."""
        replaced = self._replacing.pop(session_id)
        try:
            self.store.delete_messages(replaced.message_ids)
        except DiskFault as fault:  # both stay: the earlier one shows above the new
            log.warning("the replaced turn stays in the history: %s", fault)
            return
        if any(self.model.row_of(i) is not None for i in replaced.message_ids):
            # Shown again since (the chat was left and came back): shown no more.
            self.sessions.reload(session_id)
            self.recorder_of(session_id).show(session_id)

    def _put_back(self, session_id: str, sent_id: int) -> str:
        """Put back the turn the answer of chat ``session_id`` was to replace, as the
        answer ended before any text: its own row goes, an edit's new turn goes back
        to the composer. What to tell the user ("" when there was nothing to put back
        or the history could not take it)."""
        replaced = self._replacing.pop(session_id, None)
        if replaced is None:
            return ""
        recorder = self.recorder_of(session_id)
        gone: tuple[int, ...] = (recorder.message_id,) if recorder.recording else ()
        if replaced.edit is not None and sent_id:
            gone += (sent_id,)
        try:
            if gone or replaced.edit is not None:  # a Regenerate refused at once writes nothing
                with self.store.writing():
                    self.store.delete_messages(gone)
                    if replaced.edit is not None:
                        self.store.set_edit(session_id, replaced.edit)
        except DiskFault as fault:  # the chat shows both turns; nothing is lost
            log.warning("the replaced turn was not put back: %s", fault)
            self.sessions.reload(session_id)
            return ""
        recorder.drop()
        self.sessions.reload(session_id)
        if replaced.edit is not None:
            self.editReturned.emit(session_id)
            return " " + EDIT_RETURNED
        return " " + EARLIER_KEPT

    def _ended_without_text(self, session_id: str, status: str, said: str = "") -> None:
        """An answer put back ended (``status``) before any text: ``said`` (what the
        banner says of it, when its error did not) goes to the chat shown."""
        if said and self.sessions.shown(session_id):
            self.notice.emit(said)
        self.sessions.sessionsChanged.emit()
        self.answerFinished.emit(status)

    def _set_aside_sent_turn(self, sent_id: int) -> None:
        # A turn the context can't hold would make every later turn fail as well:
        # keep it in the history, marked failed, and leave it out of what the
        # model sees (ChatModel.engine_messages skips it).
        if not sent_id:
            return
        try:
            self.store.update_message(sent_id, status="failed", reason=TOO_LONG_TURN)
        except DiskFault as fault:  # set aside for this run all the same
            log.warning("the turn set aside was not saved as such: %s", fault)
        row = self.model.row_of(sent_id)
        if row is not None:
            self.model.update_row(row, status="failed", reason=TOO_LONG_TURN)


def _kept(event: Finished, read: IngestProgress | None,
          counted_last: bool = False) -> tuple[int, int] | None:
    """(kept, total) tokens when reading the conversation in stopped short, else None.

    ``counted_last``: ``read``'s total counts the prompt's last token, which only
    the answer's first step reads (a chat's progress): a read that reached the
    token before it was whole.
    """
    if event.kept_tokens is not None and event.total_tokens is not None:
        kept, total = event.kept_tokens, event.total_tokens
    elif event.reason == "cancelled" and read is not None:
        # An engine that does not say: its last progress.
        kept, total = read.tokens_done, read.tokens_total - (1 if counted_last else 0)
    else:
        return None
    return (kept, total) if kept < total else None


def merged_stats(earlier: dict | None, later: dict | None) -> dict | None:
    """The stats of an answer made in pieces (Continue): its tokens and steps added up,
    its rate over all of them, its first word the first piece's."""
    if not earlier or not later:
        return later or earlier
    merged = dict(later)
    for key in ("generated_tokens", "prefill_tokens", "draft_tokens", "accepted_tokens",
                "decode_steps"):
        merged[key] = (earlier.get(key) or 0) + (later.get(key) or 0)
    merged["ttft"] = earlier.get("ttft") if earlier.get("ttft") is not None else later.get("ttft")
    merged["reused_tokens"] = earlier.get("reused_tokens", 0)
    seconds = sum(part["generated_tokens"] / part["decode_tps"] for part in (earlier, later)
                  if part.get("decode_tps") and part.get("generated_tokens"))
    merged["decode_tps"] = merged["generated_tokens"] / seconds if seconds else 0.0
    return merged


def _fills(stats: GenerationStats | None, max_context: int | None) -> bool:
    """Whether an answer stopped at its length with the context full: the engine ends
    an answer the context can hold no more of as it does one at its length limit."""
    return (stats is not None and max_context is not None
            and stats.prompt_tokens + stats.generated_tokens >= max_context)


def _stats_dict(stats: GenerationStats | None) -> dict | None:
    if stats is None:
        return None
    return {
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "ttft": stats.time_to_first_token,
        "prefill_tps": stats.prefill_tps,
        "decode_tps": stats.decode_tps,
        # Tokens read in, and how many of those held came from the chat's snapshot on disk.
        "prefill_tokens": stats.prefill_tokens,
        "reused_tokens": stats.reused_tokens,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "decode_steps": stats.decode_steps,
    }
