"""Each chat's one state, and the one sentence that says it.

A chat is new, in memory, on disk, waiting, reading, answering or checking
quality; the sidebar, the memory panel and the composer all say it with the
words made here, from the same facts: the chat's job (``app.activity``), what
the engine holds of it in memory (its latest stats sample), what its KV
snapshot on disk holds, and the history's own count. Pure Python: no Qt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from app.format import compact_count, human_bytes, short_title

if TYPE_CHECKING:  # for annotations only: this module stays free of Qt
    from app.activity import Activity
    from app.sessions.caches import SessionCaches
    from app.store import SessionRecord
    from engine import SnapshotInfo


class ChatState(Enum):
    """What a chat is, or what its job does now; the value is the sidebar's word."""

    NEW = "New"
    IN_MEMORY = "In memory"
    ON_DISK = "On disk"
    WAITING = "Waiting…"
    READING = "Reading…"
    ANSWERING = "Answering…"
    CHECKING = "Checking quality…"


# app.activity's job states -> the chat's state while the job lasts.
JOB_STATES = {"waiting": ChatState.WAITING, "reading": ChatState.READING,
              "answering": ChatState.ANSWERING, "checking": ChatState.CHECKING}


# A running job's words, also the composer's progress row title.
JOB_WORDS = {ChatState.READING: "Reading the conversation",
             ChatState.ANSWERING: "Answering", ChatState.CHECKING: "Checking quality"}


@dataclass(frozen=True)
class ChatFacts:
    """What is known of one chat, in plain values.

    ``job``: its job's state ("waiting", "reading", "answering", "checking"), or "".
    ``held_tokens``: tokens its KV cache in memory holds (the latest sample), None
    when the engine holds none. ``history_tokens``: the history's saved count.
    ``snapshot``: its KV snapshot on disk (an ``SnapshotInfo``: tokens, mode,
    disk_bytes), or None. ``waiting_for``: the title of the chat it waits for.
    ``held``: why the engine holds its answer before it joins those answering
    (the engine's own sentence), or "".
    ``progress``: (done, total) tokens of the read or check under way.
    ``whole_tokens``: the conversation's tokens while memory holds only the part
    of it a stopped read kept (None: memory holds all it has read).
    """

    job: str = ""
    held_tokens: int | None = None
    history_tokens: int = 0
    snapshot: SnapshotInfo | None = None
    waiting_for: str = ""
    held: str = ""
    progress: tuple[int, int] | None = None
    whole_tokens: int | None = None


def chat_state(facts: ChatFacts) -> ChatState:
    """The chat's one state."""
    if facts.job:
        return JOB_STATES.get(facts.job, ChatState.ANSWERING)
    if facts.held_tokens:
        return ChatState.IN_MEMORY
    # A cache opened but empty (a quality check reads the chat on its own) holds
    # nothing: what the chat has is still on disk.
    if facts.snapshot is not None or facts.history_tokens:
        return ChatState.ON_DISK
    return ChatState.NEW


def chat_tokens(facts: ChatFacts) -> int:
    """The chat's token count: what memory holds, else the most its disk copies hold.

    A snapshot stored as the app closed mid-answer holds more than the history's
    count saved before it; an older snapshot holds less than the history.
    """
    if facts.held_tokens:
        return facts.held_tokens
    return max(_stored(facts), facts.history_tokens)


def _stored(facts: ChatFacts) -> int:
    return int(getattr(facts.snapshot, "tokens", 0) or 0) if facts.snapshot is not None else 0


def state_sentence(facts: ChatFacts) -> str:
    """The one sentence for the chat's state, the same wherever it is shown."""
    state = chat_state(facts)
    tokens = chat_tokens(facts)
    if state is ChatState.NEW:
        return "New chat: nothing to read yet."
    if state is ChatState.IN_MEMORY:
        if facts.whole_tokens is not None and facts.whole_tokens > tokens:
            return (f"In memory: {tokens:,} of its {facts.whole_tokens:,} tokens; the next "
                    f"message reads the other {facts.whole_tokens - tokens:,} first.")
        return f"In memory: {tokens:,} tokens, ready to answer at once."
    if state is ChatState.ON_DISK:
        snapshot = facts.snapshot
        if snapshot is not None and _stored(facts) >= tokens:
            return (f"On disk: {tokens:,} tokens stored ({human_bytes(snapshot.disk_bytes)}); "
                    "the next message reopens them instead of reading the chat again.")
        if snapshot is not None:
            return (f"On disk: {_stored(facts):,} of its {tokens:,} tokens stored "
                    f"({human_bytes(snapshot.disk_bytes)}); the next message reopens them "
                    "and reads the rest.")
        return f"On disk as text: the next message reads its {tokens:,} tokens in again."
    if state is ChatState.WAITING:
        if facts.held:
            return facts.held
        return (f"Waiting for ‘{short_title(facts.waiting_for)}’ to finish…" if facts.waiting_for
                else ChatState.WAITING.value)
    what = JOB_WORDS[state]
    if facts.progress is not None and state is not ChatState.ANSWERING:
        done, total = facts.progress
        return f"{what}… {done:,} / {total:,} tokens"
    return f"{what}…"


def sidebar_line(facts: ChatFacts, when: str) -> str:
    """A sidebar row's second line: the state's word, tokens and last activity (idle)."""
    return sidebar_lines(facts, when)[0]


def sidebar_lines(facts: ChatFacts, when: str) -> list[str]:
    """A sidebar row's second line, longest first; a narrow row shows the first that fits.

    Whole facts are left out from the end rather than a number cut ("5,17…").
    """
    state = chat_state(facts)
    if state in (ChatState.READING, ChatState.CHECKING) and facts.progress is not None:
        done, total = facts.progress
        return [f"{state.value} {done * 100 // max(1, total)}%", state.value]
    if state in (ChatState.WAITING, ChatState.READING, ChatState.ANSWERING,
                 ChatState.CHECKING):
        return [state.value]
    if state is ChatState.NEW:
        return [f"{state.value} · {when}", state.value]
    tokens = chat_tokens(facts)
    return [f"{state.value} · {tokens:,} tokens · {when}", f"{state.value} · {tokens:,} tokens",
            f"{state.value} · {compact_count(tokens)} tokens", state.value]


def reuse_sentence(reused: int, read: int) -> str:
    """"Reused 3,930 stored tokens, read 120 new" after a send, or "" when none was reused."""
    if reused <= 0:
        return ""
    return f"Reused {reused:,} stored tokens, read {read:,} new"


def facts_of(record: SessionRecord, activity: Activity, caches: SessionCaches,
             snapshots: dict[str, SnapshotInfo]) -> ChatFacts:
    """The facts of chat ``record`` from the app's sources of them.

    Args:
        record: its ``SessionRecord`` (id, tokens).
        activity: the ``Activity`` (its job, and the job it waits for or why the
            engine holds it).
        caches: the ``SessionCaches`` (whether memory holds it, and how much).
        snapshots: session id -> ``SnapshotInfo`` of the KV snapshots on disk.
    """
    job = activity.job_of(record.id)
    ahead = activity.ahead_of(job) if job is not None else None
    sample = caches.sample_for(record.id)
    progress = job.progress if job is not None else None
    return ChatFacts(
        job=job.state if job is not None else "",
        held_tokens=sample.tokens_in_context if sample is not None else None,
        history_tokens=record.tokens,
        snapshot=snapshots.get(record.id),
        waiting_for=ahead.title if ahead is not None else "",
        held=job.held if job is not None else "",
        progress=(progress.tokens_done, progress.tokens_total) if progress is not None else None,
        whole_tokens=caches.whole_of(record.id),
    )
