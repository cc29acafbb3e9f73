"""The fit check shown above the composer before a turn is sent.

Tokens after this turn (context + attachments + typed text + the answer's
maximum) against the model's context, the page budget and free RAM, with the
KV bytes each mode would need — from the worker's ``fit_check``, which is pure
arithmetic over ``engine.cache.kvquant.project_kv_bytes`` and never touches MLX.
For a model split across machines it also says what the machines hold together
and which one is the tight one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer

from app.chat.answers import MEMORY_STOP
from app.chat.composer import Composer
from app.chat.model import ChatMessage, engine_content
from app.chat.recorder import CONTEXT_END, LENGTH_LIMIT
from app.controller import ChatController
from app.format import human_bytes, human_duration
from app.store import AttachmentRecord
from engine import MODES, EngineError, FitReport, KvMode, PrefillRate, TurnOverhead

DEBOUNCE_MS = 250
COUNT_INLINE_CHARS = 20_000  # longer pastes are estimated to keep typing smooth
SHOW_ABOVE_TOKENS = 1024
FULL_TTL_S = 3.0
SHOW_WAIT_ABOVE_TOKENS = 2048  # shorter reads take a few seconds at most
TOO_LONG_TO_SEND = ("This message is longer than the model's context in any mode: remove an "
                    "attachment or shorten it, or start a new chat.")
# A file's first and last tokens may tokenize otherwise beside its document
# block's newlines than alone: its room keeps one token for each.
BLOCK_SLACK = 2


def wait_sentence(new: int, reused: int, rate: PrefillRate | None) -> str:
    """"Reading 2,249 new tokens (2,098 reused) takes about 50s here", or "" for a short read.

    ``reused`` tokens are held already (the chat's cache, or its snapshot on disk):
    the read starts after them, where each token costs more than at the start.
    """
    if new < SHOW_WAIT_ABOVE_TOKENS:
        return ""
    what = (f"Reading {new:,} new tokens ({reused:,} reused)" if reused
            else f"Reading {new:,} tokens")
    if rate is None:
        return f"{what} · first read on this machine: no estimate yet"
    return f"{what} takes about {human_duration(rate.seconds(reused, reused + new))} here"


class FitChecker(QObject):
    """Recomputes the fit line when the composer, session or model changes."""

    def __init__(self, controller: ChatController, composer: Composer,
                 attachments: dict[int, AttachmentRecord], parent: QObject | None = None) -> None:
        super().__init__(parent)
        # ``attachments``: the window's dict of the composer's files (changed in place).
        self.controller, self.composer, self.attachments = controller, composer, attachments
        self.last_report: FitReport | None = None
        self.last_total = 0
        self.last_prompt_tokens = 0
        self._full: tuple[tuple[object, ...], float, FitReport | None] | None = None
        self._documents: tuple[tuple, int] | None = None  # (the files, their blocks' tokens)
        self._replaced: tuple[tuple, int] | None = None  # (the edited rows, their tokens)
        self._timer = QTimer(self, singleShot=True, interval=DEBOUNCE_MS)
        self._timer.timeout.connect(self.run)
        composer.edit.textChanged.connect(self.schedule)

    def schedule(self) -> None:
        """Recompute shortly (typing is debounced)."""
        self._timer.start()

    def limits_changed(self) -> None:
        """The engine's memory limit changed: the full-context report kept for a few
        seconds counted the old one, and so does the fit line shown."""
        self._full = None
        self.schedule()

    def report_for(self, tokens: int) -> FitReport | None:
        """The worker's ``FitReport`` for ``tokens``, or None without a model."""
        if not self.controller.model_ready:
            return None
        current = self.controller.current
        session_id = current.id if current and current.id in self.controller.opened else None
        try:
            return self.controller.bridge.fit_check(session_id, max(0, tokens),
                                                    self.controller.settings.page_size)
        except EngineError:  # no model any more, or the session has just closed
            return None

    def max_context(self) -> int | None:
        """The loaded model's maximum context, if a model is loaded."""
        report = self.full_context_report()
        return report.max_context if report is not None else None

    def full_context_report(self) -> FitReport | None:
        """The ``FitReport`` at the model's full context (refreshed every few seconds)."""
        key = (self.controller.model_id, self.controller.model_ready,
               self.controller.current.id if self.controller.current else None)
        now = time.monotonic()
        if self._full is not None and self._full[0] == key and now - self._full[1] < FULL_TTL_S:
            return self._full[2]
        probe = self.report_for(1)
        report = self.report_for(probe.max_context) if probe is not None else None
        self._full = (key, now, report)
        return report

    def answer_reserve(self) -> int:
        """Tokens the fit line and the attachment offers keep for the answer.

        Its maximum, but at most a quarter of the context: an answer limit near
        the context's size would leave no room for any document, and the engine
        ends an answer that fills the context anyway.
        """
        max_tokens = self.controller.settings.sampling.max_tokens
        max_context = self.max_context()
        return min(max_tokens, max_context // 4) if max_context else max_tokens

    def room(self, name: str = "") -> int | None:
        """Tokens a new attachment named ``name`` may have, so the message still fits.

        The context less what the fit line counts besides the file's own text:
        the chat, the chat template's tokens around the message, the other
        attachments' blocks, the typed text, this file's own document block
        and the answer's reserve.
        """
        max_context = self.max_context()
        if not max_context:
            return None
        records = (*self.attachments.values(), _empty_file(name))
        around, _estimated = self.prompt_tokens(records)
        used = self.context_tokens() + around + BLOCK_SLACK + self.answer_reserve()
        return max(1, max_context - used)

    def context_tokens(self) -> int:
        """Tokens of the current session's conversation the next send keeps (held, or
        to read again): while a message is edited, the chat before it."""
        current = self.controller.current
        if current is None:
            return 0
        held = self._held_tokens()
        whole = current.tokens if held is None else max(
            held, self.controller.caches.whole_of(current.id) or 0)
        # The send replaces the edited message and its answer: counting them beside
        # the message in the box counted that turn twice.
        return max(0, whole - self._replaced_tokens())

    def _kept_rows(self) -> int:
        """Rows of the chat the next send keeps: those before the edited message."""
        model, edited = self.controller.model, self.controller.edited_message_id
        if edited is not None:
            for row in range(model.rowCount()):
                if model.message(row).message_id == edited:
                    return row
        return model.rowCount()

    def _replaced_tokens(self) -> int:
        """Tokens of the rows the next send replaces (an edited message and its answer),
        counted once per edit."""
        model, kept = self.controller.model, self._kept_rows()
        if kept == model.rowCount():
            return 0
        key = (model.message(kept).message_id, model.rowCount(), self.controller.model_ready)
        if self._replaced is None or self._replaced[0] != key:
            self._replaced = (key, sum(self._row_tokens(row)
                                       for row in range(kept, model.rowCount())))
        return self._replaced[1]

    def _row_tokens(self, row: int) -> int:
        """Tokens row ``row`` took in the cache: a message's with the chat template
        around it, an answer's as made."""
        message = self.controller.model.message(row)
        bridge = self.controller.bridge
        try:
            overhead = bridge.turn_overhead(self.controller.settings.system_prompt)
            if message.role == "assistant":
                return self._answer_held(row, overhead)
            text = engine_content(message)
            return (overhead.after(self._ending_before(row))
                    + (bridge.count_tokens(text) if text else 0))
        except EngineError:  # no model loaded: estimated
            return len(engine_content(message)) // 4

    def _answer_held(self, row: int, overhead: TurnOverhead) -> int:
        """The tokens answer ``row`` holds in the cache: those made, less the last one
        when it ended at a limit (sampled, never fed), plus its end of turn when the
        cache holds that (``TurnOverhead.after`` counts the same on the next message)."""
        message = self.controller.model.message(row)
        made = (message.stats or {}).get("generated_tokens")
        if not made:
            text = message.content
            return self.controller.bridge.count_tokens(text) if text else 0
        ending = self._ending_before(row + 1)
        return int(made) + {"stop": overhead.end_held, "length": -1, "memory": -1}.get(
            ending or "", 0)

    def _held_tokens(self) -> int | None:
        """Tokens the engine's latest sample says the current session holds, if it is its."""
        current = self.controller.current
        sample = self.controller.bridge.latest_stats() if self.controller.model_ready else None
        if current is not None and sample is not None and sample.session_id == current.id:
            return sample.tokens_in_context
        return None

    def prompt_tokens(self, records: tuple | None = None) -> tuple[int, bool]:
        """Tokens the engine will read for what the composer holds; True when estimated.

        The message as the engine gets it (``engine_content``: the attachments'
        document blocks, then the text) plus what the chat template adds around
        it (``EngineWorker.turn_overhead``: the system prompt on a chat's first
        message, role markers, the generation prompt, the previous answer's end
        of turn), so it is the ``prefill_tokens`` the send then reports for a
        chat whose cache is held. Only the typed text is tokenized per keystroke.
        ``records`` stand in for the composer's attachments.
        """
        if records is None:
            records = tuple(self.attachments.values())
        text = self.composer.text()
        if not text and not records:
            return 0, False
        joined = "\n\n" + text if records and text else text  # as engine_content joins
        bridge = self.controller.bridge
        if len(text) <= COUNT_INLINE_CHARS:
            try:
                overhead = bridge.turn_overhead(self.controller.settings.system_prompt)
                template = overhead.after(self._ending_before(self._kept_rows()))
                return (template + self._documents_tokens(records)
                        + (bridge.count_tokens(joined) if joined else 0)), False
            except EngineError:  # no model loaded: estimated below
                pass
        return sum(r.tokens for r in records) + len(joined) // 4, True

    def _formatting(self, prompt: int) -> int:
        """Of ``prompt``, the tokens that are neither the files' nor the typed text's own:
        the chat template's around the message and the files' document markers."""
        own = sum(r.tokens for r in self.attachments.values())
        text = self.composer.text()
        try:
            own += self.controller.bridge.count_tokens(text) if text else 0
        except EngineError:
            return 0
        return max(0, prompt - own)

    def _ending_before(self, row: int) -> str | None:
        """How the answer before row ``row`` ended, as the engine says it (None: no
        message before it)."""
        model = self.controller.model
        if not row:
            return None
        last = model.message(row - 1)
        if last.role != "assistant":
            return "cancelled"  # no answer to end: the cache holds the chat as it is
        endings = {LENGTH_LIMIT: "length", CONTEXT_END: "length", MEMORY_STOP: "memory"}
        ending = endings.get(last.reason) if last.reason is not None else None
        return ending or ("cancelled" if last.status == "stopped" else "stop")

    def _documents_tokens(self, records: tuple) -> int:
        """Tokens of the attachments' document blocks, counted once per set of files."""
        if not records:
            return 0
        key = tuple((r.name, r.sha256, r.tokens) for r in records)
        if self._documents is None or self._documents[0] != key:
            blocks = engine_content(ChatMessage("user", "", attachments=records))
            self._documents = (key, self.controller.bridge.count_tokens(blocks))
        return self._documents[1]

    def run(self) -> None:
        """Compute and show the fit line."""
        if self.controller.closed:  # a check scheduled just before the window closed
            return
        prompt, estimated = self.prompt_tokens()
        answer = self.answer_reserve()
        total = self.context_tokens() + prompt + answer
        report = self.report_for(total)
        self.last_report, self.last_total, self.last_prompt_tokens = report, total, prompt
        current = self.controller.current
        mode = current.kv_mode if current else self.controller.settings.default_mode
        attached = bool(self.attachments)
        quiet = prompt < SHOW_ABOVE_TOKENS and not attached and report is not None and (
            report.for_mode(mode).fits)
        if report is None or quiet:
            self.composer.show_fit("", True)
            self.composer.block_send("")
            return
        context = self.context_tokens()
        answer_room = report.max_context - context - prompt
        parts = TokenParts(context, prompt, 0 if estimated else self._formatting(prompt), answer)
        html, ok = fit_html(report, mode, total, estimated, answer_room, parts)
        wait = wait_sentence(*self.tokens_to_read(prompt), self.controller.prefill_rate())
        self.composer.show_fit(f"{html}<br>{wait}." if wait else html, ok)
        # An estimate (a long paste) never turns Send off: the engine's own count decides.
        self.composer.block_send(TOO_LONG_TO_SEND if answer_room < 1 and not estimated else "")

    def tokens_to_read(self, prompt: int) -> tuple[int, int]:
        """(new, reused): the tokens the next send reads in, and those it starts from.

        A held cache keeps the whole chat; a chat whose cache left memory starts
        from its KV snapshot on disk (in the chat's mode), and reads the rest again.
        """
        current = self.controller.current
        context = self.context_tokens()
        if current is None:
            return prompt, 0
        if current.id in self.controller.opened:
            # A read stopped short left part of the chat to read first.
            held = self._held_tokens()
            held = context if held is None else min(held, context)
            return context - held + prompt, held
        snapshot = self.controller.bridge.stored_snapshot(current.id)
        reused = (min(snapshot.tokens, context)
                  if snapshot is not None and snapshot.mode == current.kv_mode else 0)
        return context - reused + prompt, reused


def _empty_file(name: str) -> AttachmentRecord:
    """A file of no text: its document block is what a file adds besides its text."""
    return AttachmentRecord(name, 0, "", 0, "")


@dataclass(frozen=True)
class TokenParts:
    """What the fit line's total is made of: the chat held or to read again, this
    message (``formatting`` of it the chat template's and the files' markers) and
    the answer's reserve."""

    chat: int
    message: int
    formatting: int
    answer: int

    def words(self) -> str:
        """"the chat 1,200 + this message 4,716 (54 of them chat formatting) + 512 kept
        for the answer"."""
        parts = [f"the chat {self.chat:,}"] if self.chat else []
        message = f"this message {self.message:,}"
        if self.formatting:
            message += f" ({self.formatting:,} of them chat formatting)"
        parts += [message, f"{self.answer:,} kept for the answer"]
        return " + ".join(parts)


def fit_html(report: FitReport, mode: KvMode, total: int, estimated: bool = False,
             answer_room: int | None = None,
             parts: TokenParts | None = None) -> tuple[str, bool]:
    """The fit line as rich text, and whether the turn fits in ``mode``.

    ``answer_room``: the tokens the context leaves for the answer after the
    message, when known (below 1: the message itself does not fit). ``parts``:
    what the total is made of, said after it.
    """
    entry = report.for_mode(mode)
    approx = "≈" if estimated else ""
    per_mode = " · ".join(
        (f"<b>{m} {human_bytes(report.for_mode(m).bytes_needed)}</b>" if m == mode
         else f"{m} {human_bytes(report.for_mode(m).bytes_needed)}")
        for m in MODES if report.for_mode(m).supported)
    # What the limit leaves this chat (other chats' pages and reserves taken off),
    # not the limit as set: the two would read as one figure.
    budget = (f" · {human_bytes(report.budget_bytes)} left of your memory limit"
              if report.budget_bytes is not None else "")
    made_of = f" ({parts.words()})" if parts is not None else ""
    head = (f"After this message: {approx}{total:,} of {report.max_context:,} tokens"
            f"{made_of} · memory for them: {per_mode} · {human_bytes(report.available_bytes)} free"
            f"{budget}")
    peak = getattr(entry, "prefill_peak_bytes", 0)
    if peak:
        # Reading in needs more than the pages: the weights and one chunk's scratch.
        head += (f"<br>Reading it in needs up to ≈ {human_bytes(peak)} at once (the model, "
                 "this memory and working space)")
    pool = pool_sentence(report, mode)
    if pool:
        head += f"<br>{pool}"
    short = report.machine_short(mode, total) if len(getattr(report, "ranks", ())) > 1 else None
    if entry.fits and short is None:
        return f"✓ {head}", True
    why = (wont_fit_sentence(report, mode, total, answer_room) if short is None
           else short)
    return f"⚠ {head}<br><b>{why}</b>", False


def pool_sentence(report: FitReport, mode: KvMode) -> str:
    """"On 2 machines: 12,288 tokens fit in q8 · mac2 is the tight one", or ""
    on one machine."""
    ranks = getattr(report, "ranks", ())
    tokens = report.pool_tokens(mode) if len(ranks) > 1 else None
    if tokens is None:
        return ""
    tight = report.tight_machine(mode)
    text = f"On {len(ranks)} machines: {min(tokens, report.max_context):,} tokens fit in {mode}"
    if tight is not None:
        text += (f" · {tight.host} is the tight one ({human_bytes(tight.free_bytes)} "
                 "free there)")
    return text


def wont_fit_sentence(report: FitReport, mode: KvMode, total: int,
                      answer_room: int | None = None) -> str:
    """Plain words: why the turn won't fit in ``mode`` and which mode would.

    Past the context, a message that still fits leaves the answer less room
    (the engine ends it at the context): said so, and it can be sent. One that
    does not fit itself cannot be sent (``TOO_LONG_TO_SEND``).
    """
    entry = report.for_mode(mode)
    if not entry.fits_context and answer_room is not None and answer_room >= 1:
        return (f"The answer has room for only {answer_room:,} tokens: the model's context "
                f"ends at {report.max_context:,} tokens in any mode. Remove an attachment "
                "or start a new chat for a longer answer.")
    if not entry.fits_context:
        return (f"This won't fit: {total:,} tokens is more than the model's context of "
                f"{report.max_context:,} tokens in any mode. Remove an attachment or start "
                "a new chat; Send is off until it fits.")
    limit = "your memory limit (Settings)" if not entry.fits_budget else "free memory"
    better = next((m for m in MODES.quantized()
                   if m != mode and report.for_mode(m).fits), None)
    text = (f"This won't fit in {mode}: it needs {human_bytes(entry.bytes_needed)} but "
            f"{limit} holds only {entry.tokens_fit:,} tokens in {mode}.")
    if better:
        return text + f" It would fit in {better} — use Reopen in {better}…"
    return text + " No mode fits; remove an attachment or free memory."
