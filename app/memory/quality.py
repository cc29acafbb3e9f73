"""The quality receipt of a chat: its KV mode against fp16 on its own last tokens.

``QualityCheck`` runs the check for the shown chat (one request at a time, like an
answer: Stop cancels it), keeps each receipt with the chat in the history store,
and says what it measured; the memory panel shows the receipts per mode.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, Signal

from app.activity import Activity, Job
from app.engine_bridge import EngineBridge
from app.sessions.actions import SessionActions
from app.sessions.caches import SessionCaches
from app.store import HistoryStore, SessionRecord
from engine import (
    MODES,
    REFERENCE,
    Event,
    Failed,
    Finished,
    QualityChecked,
    QualityProgress,
    QualityReceipt,
)

KIND = "quality"  # the Activity kind while a check runs
WINDOW = 1024  # engine.session.quality_check.WINDOW_TOKENS, named here without importing MLX


# Verdict bands on the mean KL to fp16 (nats), upper bounds; docs/benchmark-runs.md
# ("Quality verdict bands") names the quality-bench rows behind each cut-off.
VERDICTS = ((1e-3, "Indistinguishable from fp16"), (2e-2, "Minor differences from fp16"),
            (0.2, "Noticeable differences from fp16"))
LARGE = "Large differences from fp16"
# Below this many positions a verdict rests on too little to go by for a long chat
# (the 99th percentile is then nearly the largest value), and says so.
FEW_POSITIONS = 256
# Why the check's count of a chat can be above the one the panel and sidebar show.
COUNTED = ("The check read the chat as {tokens:,} tokens: closed as a finished turn, with "
           "the end-of-turn marks that its KV cache reads only with the next message.")


def verdict(kl_mean: float) -> str:
    """The plain verdict for a mean KL to fp16."""
    return next((words for bound, words in VERDICTS if kl_mean < bound), LARGE)


def receipt_line(receipt: QualityReceipt) -> str:
    """The verdict in plain words; the numbers are in ``receipt_details``."""
    badge = f"{receipt.mode} · rotated" if receipt.rotated else receipt.mode
    return f"{verdict(receipt.kl_mean)} ({badge}, this chat)"


def advice(receipt: QualityReceipt) -> str:
    """What to do about the verdict: keep the mode, or which one to reopen the chat
    in; for a verdict from few positions, to check again once the chat is longer."""
    said = _mode_advice(receipt)
    if receipt.positions < FEW_POSITIONS:
        # No count here: the check's is a little above the one the chat shows.
        said += (" This chat is short yet, and a verdict on so few tokens says little "
                 "of a long chat: check again once it is longer.")
    return said


def _mode_advice(receipt: QualityReceipt) -> str:
    mode, kl = receipt.mode, receipt.kl_mean
    if kl < VERDICTS[0][0]:
        smaller = MODES.smaller(mode)
        more = (f" If you need more context in the same memory, try {smaller}: reopen the "
                "chat in it and check again." if smaller else "")
        return f"Keep {mode}: it answers as fp16 would.{more}"
    if kl < VERDICTS[1][0]:
        return (f"Keep {mode} for everyday use; for exact quotes and figures, "
                f"{MODES.larger(mode)} stays closer to fp16.")
    return f"Reopen this chat in {MODES.larger(mode)}: its answers stay closer to fp16."


def outdated_line(receipt: QualityReceipt, why: str) -> str:
    """A receipt that no longer speaks for its chat, and what to do about it."""
    return (f"The last check of {receipt.mode} is out of date: {why}. Check again to see "
            f"what {receipt.mode} costs this chat now.")


def receipt_summary(receipt: QualityReceipt) -> str:
    """The numbers in a line the panel can hold: "98.7% same next token · mean KL 0.004"."""
    return f"{receipt.top1:.1%} same next token as fp16 · mean KL {_kl(receipt.kl_mean)}"


def receipt_numbers(receipt: QualityReceipt) -> str:
    """What was measured: agreement and mean KL over the window the check read.

    No total of the chat's tokens here: the check counts the chat closed as a
    finished turn, a token or two more than its KV cache holds (see
    ``receipt_details``), and the chat's own count is said elsewhere.
    """
    scope = (f"the last {receipt.window_tokens:,} tokens"
             if receipt.window_tokens < receipt.context_tokens else "the whole chat")
    return (f"Same next token as fp16 for {receipt.top1:.1%} of {scope} · mean KL "
            f"{_kl(receipt.kl_mean)}{_perplexity(receipt)} (read as one window)")


def _perplexity(receipt: QualityReceipt) -> str:
    """" · perplexity 12.31 against fp16's 12.29 (+0.2%)", or "" where not measured."""
    mode, reference = receipt.perplexity, receipt.reference_perplexity
    if mode is None or reference is None:
        return ""
    return (f" · perplexity {mode:.2f} against fp16's {reference:.2f} "
            f"({mode / reference - 1:+.1%})")


def receipt_details(receipt: QualityReceipt) -> str:
    """The verdict, the numbers, the tail of the KL, what was read, the model and when."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(receipt.measured_at))
    return (f"{receipt_line(receipt)}\n{receipt_numbers(receipt)}\n99th percentile KL "
            f"{_kl(receipt.kl_p99)} · {receipt.model} · measured {when}\n"
            f"{COUNTED.format(tokens=receipt.context_tokens)}")


def _kl(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3f}" if value >= 1e-3 else f"{value:.1e}"


class QualityCheck(QObject):
    """Starts quality checks and keeps their receipts with their chats.

    A check is its chat's job while it lasts (``activity``), so sending in that
    chat waits for it and Stop cancels it; it waits in line behind other chats'
    jobs, then for its chat's KV cache to open (``caches``), which only names the
    chat's mode and rotation to the engine. The user may read other chats
    meanwhile (``sessions``): the receipt is said only while its own chat is
    shown, and kept with it either way.
    """

    progress = Signal(object)  # engine.QualityProgress of the running check
    checked = Signal(str, object)  # session id, QualityReceipt
    notice = Signal(str)
    errorRaised = Signal(str)

    def __init__(self, bridge: EngineBridge, store: HistoryStore, activity: Activity,
                 caches: SessionCaches, sessions: SessionActions,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.store, self.activity = bridge, store, activity
        self.caches, self.sessions = caches, sessions

    def unavailable(self, session: SessionRecord | None, model_ready: bool,
                    has_text: bool, loading: bool = False) -> str:
        """Why ``session`` (with ``has_text``: any message) cannot be checked now; "" if it can.

        ``loading``: a model is being loaded (not ready yet).
        """
        if not model_ready:
            return ("The model is loading: check once it is ready." if loading
                    else "Load a model first: the check runs it.")
        if session is None:
            return "Open a chat first."
        job = self.activity.job_of(session.id)
        if job is not None:
            return ("A quality check is running; Stop cancels it." if job.kind == KIND
                    else "Wait for this chat's answer or reading to finish.")
        if session.kv_mode == REFERENCE:
            return (f"This chat keeps {REFERENCE}, the reference itself: there is nothing "
                    "to compare.")
        if not has_text:
            return "Nothing to check yet: send a message or attach a document first."
        return ""

    def start(self, session: SessionRecord, messages: list[dict[str, str]]) -> Job:
        """Check ``session``, whose conversation the engine reads as ``messages``."""
        return self.activity.add(session.id, KIND, session.title,
                                 lambda job: self._run(job, session, messages),
                                 lambda _job: None)

    def _run(self, job: Job, session: SessionRecord, messages: list[dict[str, str]]) -> None:
        if self.sessions.shown(session.id):
            self.notice.emit(f"Checking {session.kv_mode} against fp16 on the last "
                             f"≤ {WINDOW:,} tokens of this chat… Stop cancels.")

        # What the receipt measured, to tell later whether it still speaks for the chat.
        system_prompt = messages[0]["content"] if messages and messages[0]["role"] == "system" \
            else ""

        def submit() -> None:
            rid = self.bridge.check_quality(
                session.id, messages, lambda event: self._handle(job, event, system_prompt))
            if self.activity.submitted(job, rid):  # Stop was pressed while the cache opened
                self.bridge.cancel(rid)

        self.caches.ensure_open(session, submit, lambda event: self._failed(job, event))

    def _handle(self, job: Job, event: Event, system_prompt: str) -> None:
        if isinstance(event, QualityProgress):
            self.activity.note(job, progress=event)
            self.progress.emit(event)
        elif isinstance(event, QualityChecked):
            self._checked(event, system_prompt)
        elif isinstance(event, Finished):
            if event.reason == "cancelled":
                self.notice.emit(self.sessions.about(
                    job.session_id, "Quality check cancelled; nothing was stored."))
            self.activity.end(job)
        elif isinstance(event, Failed):
            self._failed(job, event)

    def _checked(self, event: QualityChecked, system_prompt: str) -> None:
        # A receipt: kept with its chat, and said while that chat is shown.
        if self.store.session(event.session_id) is None:
            return  # deleted meanwhile
        self.store.save_receipt(event.session_id, event.receipt, system_prompt)
        self.checked.emit(event.session_id, event.receipt)
        if self.sessions.shown(event.session_id):
            self.notice.emit(f"{receipt_line(event.receipt)}. {advice(event.receipt)}")

    def _failed(self, job: Job, event: Failed) -> None:
        self.errorRaised.emit(self.sessions.about(job.session_id, event.message))
        self.activity.end(job)
