"""The work chats give the engine: answers run together, reads and checks alone.

A job (an answer, a re-ingest, a quality check) belongs to its chat; a chat has
at most one. The engine answers several chats at once, so a chat's answer
starts at once beside the others. A re-ingest or a quality check runs alone
(the engine holds it until the answers end), and so does the line here: the
jobs wait in the order they were sent, and one starts when every job ahead of
it has started and it can run beside those running — an answer beside
answers, a re-ingest or check only when nothing runs. So an answer sent after
a re-ingest waits behind it, never overtakes it. A waiting job starts by
itself when the jobs it waits for end; cancelling it then costs nothing.

An answer can also wait inside the engine, started but held until memory can
hold it beside the others, or, answering, for its next page (``held``: the
engine's reason, until it reads or its next text arrives). What is about one
chat (sending again, editing, deleting it, Stop) waits only for that chat's own
job; switching models waits for all of them.
``refuse`` says so in the banner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal

from app.format import short_title
from engine import IngestProgress

REFUSAL = "Stop {running} before {what}."
# What the Stop button stops, by job kind, in the refusal's words.
RUNNING = {"chat": "the current answer", "ingest": "reading the conversation in",
           "quality": "the quality check"}
# The same, for a job that may be in another chat than the one shown.
RUNNING_IN = {"chat": "the answer in ‘{title}’", "ingest": "reading ‘{title}’ in",
              "quality": "the quality check of ‘{title}’"}
ALONE = ("ingest", "quality")  # the kinds the engine runs with nothing beside them
WAITING = "waiting"  # app.sessions.chat_state says each state in words


@dataclass(eq=False)
class Job:
    """One chat's request, from the send to its end.

    ``request`` is its engine request id once submitted (None while it waits in
    line or for its chat's KV cache to open); ``progress`` the last reading
    progress, ``answering`` whether its answer's first text has arrived;
    ``held`` why the engine holds it before it joins the answers running or
    before its answer goes on (the engine's words, "" once it reads or its next
    text arrives).
    """

    session_id: str
    kind: str  # "chat", "ingest" or "quality"
    title: str
    start: Callable[[Job], None]
    dropped: Callable[[Job], None]  # called when it is cancelled before it started
    request: int | None = None
    progress: IngestProgress | None = None
    answering: bool = False
    started: bool = False
    stopping: bool = False  # Stop was pressed: cancelled as soon as it has a request
    held: str = ""

    @property
    def alone(self) -> bool:
        """Whether it runs with no other job beside it."""
        return self.kind in ALONE

    @property
    def state(self) -> str:
        """"waiting", "reading", "answering" or "checking"."""
        if not self.started or self.held:
            return WAITING
        if self.kind == "quality":
            return "checking"
        return "answering" if self.answering else "reading"


class Activity(QObject):
    """The jobs of every chat, in the order they were sent: those started run, the
    rest wait (see the module's docstring for which starts when)."""

    changed = Signal()  # a job was added, started, moved on or ended
    busyChanged = Signal(bool)  # whether any job runs or waits
    refused = Signal(str)  # the message saying what has to wait

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.jobs: list[Job] = []
        self._refusals: set[str] = set()  # said, and moot once nothing runs

    def is_refusal(self, text: str) -> bool:
        """Whether ``text`` is a refusal said here, which is moot once nothing runs."""
        return text in self._refusals

    @property
    def busy(self) -> bool:
        """True while any chat's job runs or waits."""
        return bool(self.jobs)

    @property
    def running(self) -> list[Job]:
        """The jobs the engine works on (or whose caches open), oldest first."""
        return [job for job in self.jobs if job.started]

    def job_of(self, session_id: str | None) -> Job | None:
        """The job of chat ``session_id``, running or waiting."""
        return next((job for job in self.jobs if job.session_id == session_id), None)

    def job_with(self, request_id: int) -> Job | None:
        """The job whose engine request is ``request_id``."""
        return next((job for job in self.jobs if job.request == request_id), None)

    def ahead_of(self, job: Job) -> Job | None:
        """The job ``job`` waits for in line, or None when it has started.

        A re-ingest or check waits for the first job ahead of it; an answer for
        the first re-ingest or check ahead of it, running or waiting itself.
        """
        if job.started or job not in self.jobs:
            return None
        ahead = self.jobs[:self.jobs.index(job)]
        if job.alone:
            return ahead[0] if ahead else None
        return next((other for other in ahead if other.alone), None)

    def retitle(self, session_id: str, title: str) -> None:
        """Chat ``session_id`` was renamed ``title``: its job says so from now on."""
        for job in self.jobs:
            if job.session_id == session_id and job.title != title:
                job.title = title
                self.changed.emit()

    def states(self) -> dict[str, str]:
        """Each chat with a job -> its state ("answering", "waiting", …)."""
        return {job.session_id: job.state for job in self.jobs}

    def add(self, session_id: str, kind: str, title: str, start: Callable[[Job], None],
            dropped: Callable[[Job], None]) -> Job:
        """Queue a job for ``session_id``; it starts now when the line lets it.

        The caller has checked the chat has no job yet (``refuse_in``).
        """
        job = Job(session_id, kind, title, start, dropped)
        self.jobs.append(job)
        if len(self.jobs) == 1:
            self.busyChanged.emit(True)
        self._start_waiting()
        self.changed.emit()
        return job

    def submitted(self, job: Job, request_id: int) -> bool:
        """The engine took ``job`` as ``request_id``; True when Stop came first (cancel it)."""
        job.request = request_id
        self.changed.emit()
        return job.stopping

    def stop(self, job: Job, cancel: Callable[[int], None]) -> None:
        """Stop ``job`` alone: out of the line if it waits, else its request is cancelled."""
        if self.drop(job):
            return
        if job.stopping:
            return
        job.stopping = True
        if job.request is not None:
            cancel(job.request)
        # Said at once: the engine sees the cancel only between two parts of a read.
        self.changed.emit()

    def note(self, job: Job, progress: IngestProgress | None = None,
             answering: bool = False) -> None:
        """What ``job`` does now: its reading progress, or that its answer streams."""
        before = job.state
        if progress is not None:
            job.progress = progress
        job.answering = job.answering or answering
        if progress is not None or answering:
            job.held = ""  # it joined the answers running, or went on
        if job.state != before:
            self.changed.emit()

    def hold(self, job: Job, reason: str) -> None:
        """The engine holds ``job`` before it joins the answers running, for ``reason``."""
        if job.held != reason:
            job.held = reason
            self.changed.emit()

    def go_on(self, job: Job) -> None:
        """The engine holds ``job`` no more: it reads, or its answer goes on."""
        self.hold(job, "")

    def end(self, job: Job) -> None:
        """``job`` ended (finished, failed, stopped); those waiting for it may start."""
        if job not in self.jobs:
            return
        self.jobs.remove(job)
        self._start_waiting()
        self.changed.emit()
        if not self.jobs:
            self.busyChanged.emit(False)

    def drop(self, job: Job) -> bool:
        """Cancel ``job`` while it waits in line; False when it has started already."""
        if job.started or job not in self.jobs:
            return False
        self.jobs.remove(job)
        job.dropped(job)
        # An answer behind a dropped re-ingest may start now.
        self._start_waiting()
        self.changed.emit()
        if not self.jobs:
            self.busyChanged.emit(False)
        return True

    def forget(self) -> None:
        """Drop every job without a signal: the window is closing."""
        self.jobs.clear()

    def _start_waiting(self) -> None:
        """Start, in order, each waiting job that can run now; stop at the first that
        cannot, so none overtakes a job sent before it."""
        for job in list(self.jobs):
            if job.started:
                continue
            if job not in self.jobs or not self._can_start(job):
                return
            job.started = True
            job.start(job)

    def _can_start(self, job: Job) -> bool:
        running = self.running
        if job.alone:
            return not running
        return not any(other.alone for other in running)

    def refuse(self, what: str) -> bool:
        """True, with a message naming the chats, when ``what`` has to wait for every
        job to end (they may be in chats other than the one shown)."""
        jobs = [*self.running, *(job for job in self.jobs if not job.started)]
        if not jobs:
            return False
        first = jobs[0]
        running = RUNNING_IN.get(first.kind, RUNNING_IN["chat"]).format(
            title=short_title(first.title))
        if len(jobs) > 1:
            running += f" and {len(jobs) - 1:,} more"
        self._refuse_with(REFUSAL.format(running=running, what=what))
        return True

    def refuse_in(self, session_id: str | None, what: str, named: bool = False) -> bool:
        """True, with a message, when ``what`` has to wait for chat ``session_id``'s job.

        ``named``: the chat is not the one shown, so the message names it (Stop and
        Esc act on the chat shown, which has nothing to stop).
        """
        return self._refuse(self.job_of(session_id), what, named)

    def _refuse_with(self, text: str) -> None:
        self._refusals.add(text)
        self.refused.emit(text)

    def _refuse(self, job: Job | None, what: str, named: bool = False) -> bool:
        if job is None:
            return False
        running = (RUNNING_IN.get(job.kind, RUNNING_IN["chat"]).format(
            title=short_title(job.title)) if named else RUNNING.get(job.kind, RUNNING["chat"]))
        self._refuse_with(REFUSAL.format(running=running, what=what))
        return True
