"""The engine-event side of ``ChatController``: answers and ingests as they run and end.

Tokens stream into the open chat, the answer is saved as it ends (complete,
stopped, failed), failures are shown, and stats samples feed the memory panel.
"""

from __future__ import annotations

from engine import Failed, Finished, StatsSample, TokenChunk

TOO_LONG_TURN = ("Too long for the model's context; kept here but not sent with later "
                 "messages. Edit it to a shorter one, or reopen the chat in a smaller KV mode.")
MEMORY_STOP = ("Stopped to protect your computer: system memory turned critical or free RAM ran "
               "out. Close other apps or chats, or reopen this chat in a smaller KV mode.")


class EngineEventHandlers:
    """What the controller does with each engine event, mixed into ``ChatController``.

    The controller's ``__init__`` owns the state used here (``active_request``,
    ``recorder``, ``model``, ``store``, ...), connects these handlers to the
    bridge, and defines the signals they emit.
    """

    def _on_token(self, event: TokenChunk) -> None:
        if self.closed:
            return
        if event.request_id == self.active_request and self.active_kind == "chat":
            self.model.append_text(event.text)
            self.recorder.mark_dirty()

    def _finish_answer(self, status: str, reason: str | None, stats: dict | None = None) -> None:
        self.recorder.finish(status, reason, stats)
        if self.current is not None:
            self.sessionsChanged.emit()
        self.answerFinished.emit(status)

    def _on_finished(self, event: Finished) -> None:
        if self.closed:
            return
        kind = self._kinds.pop(event.request_id, None)
        if event.request_id != self.active_request:
            return
        if kind == "chat":
            status = "stopped" if event.reason in ("cancelled", "memory") else "complete"
            reason = {"cancelled": "Stopped", "length": "Reached the answer length limit",
                      "memory": MEMORY_STOP}.get(event.reason)
            if event.reason == "memory":
                self.errorRaised.emit(MEMORY_STOP)
            self._finish_answer(status, reason, _stats_dict(event.stats))
        elif kind == "ingest":
            done = "Cancelled re-ingest" if event.reason == "cancelled" else "Conversation ingested"
            self.notice.emit(f"{done} in {self.current.kv_mode if self.current else ''}.")
        self._record_tokens()
        self._set_active(None, None)

    def _on_failed(self, event: Failed) -> None:
        if self.closed:
            return
        kind = self._kinds.pop(event.request_id, None)
        self._load_paths.pop(event.request_id, None)
        if kind == "load" and event.request_id == self._load_request:
            self._on_load_failed(event.message)
            return
        self.errorRaised.emit(event.message)
        if kind == "open":
            self._after_open.pop(event.request_id, None)
            if self.active_request == -1:  # the chat or ingest waiting on this session
                if self.active_kind == "chat":
                    self._finish_answer("failed", event.message)
                self._set_active(None, None)
        elif event.request_id == self.active_request:
            if kind == "chat":
                if event.error_type == "ContextTooLong":
                    self._set_aside_sent_turn()
                self._finish_answer("failed", event.message)
            self._set_active(None, None)

    def _set_aside_sent_turn(self) -> None:
        # A turn the context can't hold would make every later turn fail as well:
        # keep it in the history, marked failed, and leave it out of what the
        # model sees (ChatModel.engine_messages skips it).
        row = self._sent_row
        if row is None or row >= self.model.rowCount():
            return
        message = self.model.message(row)
        if message.role != "user":
            return
        self.store.update_message(message.message_id, status="failed", reason=TOO_LONG_TURN)
        self.model.update_row(row, status="failed", reason=TOO_LONG_TURN)

    def _on_ingest_progress(self, event) -> None:
        if self.closed:
            return
        if event.request_id == self.active_request:
            self.ingestProgress.emit(event)

    def _on_stats(self, sample: StatsSample) -> None:
        if self.closed:
            return
        if sample.timestamp <= self._last_stats_time:
            return
        self._last_stats_time = sample.timestamp
        if sample.session_id:
            self.session_bytes[sample.session_id] = sample.kv_bytes_used
        self.statsUpdated.emit(sample)

    def _poll_stats(self) -> None:
        sample = self.bridge.latest_stats()
        if sample is not None:
            self._on_stats(sample)

    def _record_tokens(self) -> None:
        sample = self.bridge.latest_stats()
        if self.current and sample and sample.session_id == self.current.id:
            self.store.set_tokens(self.current.id, sample.tokens_in_context)
            self.current = self.store.session(self.current.id)
            self.sessionsChanged.emit()


def _stats_dict(stats) -> dict | None:
    if stats is None:
        return None
    return {
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "ttft": stats.time_to_first_token,
        "prefill_tps": stats.prefill_tps,
        "decode_tps": stats.decode_tps,
    }
