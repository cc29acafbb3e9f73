"""Several conversations answering at once: one forward pass a step for all of them.

A decode step reads every weight of the model to make one token; a batch makes
one token for each of its conversations from the same read. Each conversation
keeps its own session: its paged cache in its own KV mode, its sampling
settings, its stop tokens, its length limit and its Stop. The layers see the
batch through :class:`engine.cache.batched.BatchedCache`, so no conversation is
padded to another's length.

Conversations join between steps (their prompt read in first, as :meth:`Session.chat`
reads it) and leave when their answer ends or is cancelled; the others go on
with the next step. Rows decode plainly (no speculative drafts). Every method
runs MLX and must be called from the engine worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from engine.cache import adapter
from engine.cache.batched import BatchedCache, check_batchable
from engine.errors import EngineError, KvBudgetExceeded
from engine.events import GenerationStats
from engine.session.prefill import Emit
from engine.session.prompt_ids import Prompt
from engine.session.sampling import REPETITION_CONTEXT, SamplingParams
from engine.session.session import AnswerStart, Session


@dataclass(frozen=True)
class RowToken:
    """What one step did for one conversation.

    Attributes:
        request_id: the conversation's request.
        token: the token sampled (an end-of-turn token included); None when the
            row left without sampling (cancelled before the step, or out of pages).
        finish: None while the answer goes on; else "stop", "length",
            "cancelled" or "memory", as :meth:`Session.chat` says it.
        stats: the answer's timings once it finished, else None.
    """

    request_id: int
    token: int | None
    finish: str | None = None
    stats: GenerationStats | None = None


@dataclass
class _Row:
    """One answering conversation of the batch."""

    session: Session
    answer: AnswerStart
    pending: int  # sampled (or the prompt's last) and not fed yet
    # Its answer ended with the end-of-turn token, fed by one more step (no sample).
    ending: bool = False

    @property
    def request_id(self) -> int:
        return self.answer.stream.request_id


class BatchDecoder:
    """The answering conversations of one model, decoded together a token a step.

    Args:
        model: the mlx-lm model every joining session holds.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: list[_Row] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def request_ids(self) -> tuple[int, ...]:
        """The requests answering, in batch order."""
        return tuple(row.request_id for row in self.rows)

    def join(
        self,
        session: Session,
        messages: list[dict[str, str]],
        sampling: SamplingParams,
        *,
        request_id: int,
        cancel: threading.Event,
        emit: Emit,
        tick: Callable[[], None],
        prompt: Prompt | None = None,
    ) -> None:
        """Read ``session``'s conversation in and add its answer to the batch.

        Arguments as :meth:`Session.chat`'s; the answer's tokens stream through
        ``emit`` as the steps make them. Speculative drafts are off in a batch.

        Raises:
            EngineError: the session cannot join (another model, a layer the
                batch cannot carry, a pipeline, already answering), or what
                :meth:`Session.start_answer` raises.
        """
        self._check_joins(session, request_id)
        answer = session.start_answer(messages, replace(sampling, speculative="off"),
                                      request_id=request_id, cancel=cancel, emit=emit,
                                      tick=tick, prompt=prompt)
        stream = answer.stream
        stream.history = mx.array(answer.prompt[-REPETITION_CONTEXT:-1], dtype=mx.int32)
        self.rows.append(_Row(session, answer, answer.prompt[-1]))

    def _check_joins(self, session: Session, request_id: int) -> None:
        if session.model is not self.model:
            raise EngineError("Only conversations of the same model can answer together.")
        if session.followers is not None:
            raise EngineError("A model split over several machines answers one chat at a time.")
        if any(row.session is session for row in self.rows):
            raise EngineError(f"{session.session_id} is answering already.")
        if request_id in self.request_ids:
            raise EngineError(f"Request {request_id} is answering already.")
        check_batchable([session.cache])

    def step(self) -> list[RowToken]:
        """One forward pass for every answering conversation; one token each.

        Rows cancelled since the last step, or whose pages cannot hold one more
        token, leave first. Returns what happened to each answering row, in
        batch order; rows that finished have left the batch.
        """
        results: list[RowToken] = []
        rows = []
        for row in list(self.rows):
            reason = self._cannot_step(row)
            if reason is None:
                rows.append(row)
            elif row.ending:
                self.rows.remove(row)  # its answer was reported; the end stays unfed
            else:
                results.append(self._finish(row, None, reason))
        if rows:
            taken = self._forward(rows)
            results.extend(r for r in taken if r is not None)
        return results

    def run(self) -> list[RowToken]:
        """Step until every answer finished; the finished rows, in the order they ended."""
        finished: list[RowToken] = []
        while self.rows:
            finished.extend(r for r in self.step() if r.finish is not None)
        return finished

    def _cannot_step(self, row: _Row) -> str | None:
        """Why ``row`` leaves before the step (None: it steps)."""
        if row.answer.watch.is_set() and not row.ending:
            return "cancelled"
        try:
            adapter.ensure_capacity(row.session.cache, 1)
        except KvBudgetExceeded:
            # As an answer alone: the budget ends it as its length limit would.
            return "length"
        return None

    def _forward(self, rows: list[_Row]) -> list[RowToken | None]:
        tokens = mx.array([[row.pending] for row in rows], dtype=mx.int32)
        cache = BatchedCache([row.session.cache for row in rows])
        try:
            logits = self.model(tokens, cache=cache.layers)[:, -1, :]
            cache.write_back()
            sampled = [row.answer.stream.sample(tokens[index], logits[index:index + 1])
                       for index, row in enumerate(rows)]
            ids: list[int] = mx.concatenate(sampled).tolist()  # type: ignore[assignment]
        except Exception:
            # A failed step may leave layers at different lengths.
            for row in rows:
                row.session.rollback()
            raise
        return [self._take(row, int(token)) for row, token in zip(rows, ids, strict=True)]

    def _take(self, row: _Row, token: int) -> RowToken | None:
        """Hold the fed token, then stream the sampled one (or finish).

        None for a row whose answer ended before this step (it fed its end token).
        """
        stream = row.answer.stream
        row.session.tokens.append(row.pending)
        stream.steps += 1
        if row.ending:
            self.rows.remove(row)
            return None
        room = len(stream.generated) + 1 < row.answer.max_tokens
        reason = stream.receive(token, row.answer.max_tokens)
        if reason is None:
            row.pending = token
            return RowToken(row.request_id, token)
        result = self._finish(row, token, reason)
        if reason == "stop" and room:
            # As an answer alone feeds its end-of-turn token, so the next turn's
            # template extends the cache: one more step, reported now.
            row.pending, row.ending = token, True
            self.rows.append(row)
        return result

    def _finish(self, row: _Row, token: int | None, reason: str) -> RowToken:
        self.rows.remove(row)
        row.answer.stream.flush()
        reason, stats = row.session.finish_answer(row.answer, reason)
        return RowToken(row.request_id, token, reason, stats)
