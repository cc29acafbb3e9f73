"""Sampling settings, the mlx-lm samplers built from them, and the streamed answer loop."""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from engine.cache import adapter
from engine.errors import EngineError, KvBudgetExceeded
from engine.events import Event, TokenChunk, TokenLogprob
from engine.memory.guard import PressureWatch
from engine.session import checkpoints, speculative

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# mlx-lm's default window for the repetition penalty; long enough to stop loops,
# short enough not to punish every common word in a long answer.
REPETITION_CONTEXT = 64
# Ids of the prompt that give a continued answer's first word its context (a few
# cover a character split over tokens).
PRIMER_TOKENS = 4
PRIMER_MARK = "."  # text that is never a space, when those ids' text was all space
# Most alternatives a request may ask for per token (OpenAI's own limit).
MAX_TOP_LOGPROBS = 20
# Below this a temperature samples greedily: mlx-lm scales the logits by its
# inverse, which overflows float32 near 1e-38 and turns the draw uniform.
GREEDY_BELOW = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Attributes:
        temperature: 0 picks the most likely token (greedy).
        top_p: nucleus mass to keep; 1.0 disables it.
        top_k: keep only the k most likely tokens; 0 disables it.
        min_p: drop tokens below this fraction of the top token's probability.
        repetition_penalty: > 1 discourages repeating recent tokens; 1.0 disables it.
        presence_penalty: subtracted from the logit of every token seen in the
            recent tokens (``REPETITION_CONTEXT``, the prompt's included); 0 disables it.
        frequency_penalty: subtracted once per occurrence in those tokens; 0
            disables it.
        logit_bias: (token id, bias) pairs added to those tokens' logits.
        logprobs: None returns no log probabilities; n >= 0 returns each sampled
            token's and its n most likely alternatives (``TokenChunk.logprobs``).
        grammar: an llguidance grammar (``constraint.json_schema_grammar``) the
            answer must follow, or None.
        max_tokens: most tokens to generate.
        seed: random seed for reproducible sampling, or None.
        speculative: "lookup" (the default) proposes tokens found in the chat's
            own text and verifies them in one forward pass (same answer, fewer
            passes; never slower beyond noise, docs/benchmarks.md); "off"
            decodes one token per pass.
    """

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: str | None = None
    max_tokens: int = 512
    seed: int | None = None
    speculative: str = "lookup"

    def __post_init__(self) -> None:
        # NaN passes every range check below, and infinity some: neither is a setting.
        problems = [f"{name} must be a finite number (got {value})"
                    for name, value in self._numbers() if not math.isfinite(value)]
        if problems:
            raise EngineError("Invalid sampling settings: " + "; ".join(problems) + ".")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1) (got {self.min_p})")
        if self.repetition_penalty <= 0:
            problems.append(
                f"repetition_penalty must be > 0 (got {self.repetition_penalty})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"logprobs must be from 0 to {MAX_TOP_LOGPROBS} "
                            f"(got {self.logprobs})")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if self.speculative not in speculative.MODES:
            problems.append(f"speculative must be one of {', '.join(speculative.MODES)} "
                            f"(got {self.speculative!r})")
        if problems:
            raise EngineError("Invalid sampling settings: " + "; ".join(problems) + ".")


    def _numbers(self) -> list[tuple[str, float]]:
        """The settings that are real numbers, by name (the logit biases too)."""
        named = [(name, float(getattr(self, name))) for name in
                 ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")]
        return named + [(f"logit_bias[{token}]", float(bias)) for token, bias in self.logit_bias]


def build_sampler(params: SamplingParams) -> Sampler:
    """Return mlx-lm's sampler for these settings (greedy at temperature 0).

    A ``top_k`` of the whole vocabulary or more keeps every token, as 0 does:
    mlx-lm raises on it instead, inside a compiled function whose raise leaves
    MLX's random state (every answer's) without a value.
    """
    def sampler(top_k: int) -> Sampler:
        temperature = params.temperature if params.temperature >= GREEDY_BELOW else 0.0
        return make_sampler(temp=temperature,
                            top_p=params.top_p if params.top_p < 1.0 else 0.0,
                            min_p=params.min_p, top_k=top_k)

    limited = sampler(params.top_k)
    if not params.top_k:
        return limited
    unlimited = sampler(0)
    return lambda logprobs: (limited if params.top_k < logprobs.shape[-1]
                             else unlimited)(logprobs)


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Return mlx-lm's logits processors for these settings (may be empty)."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        # 1.0 multiplies by one: no processor, so plain answers keep their fast path.
        repetition_penalty=None if params.repetition_penalty == 1.0
        else params.repetition_penalty,
        repetition_context_size=REPETITION_CONTEXT,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=REPETITION_CONTEXT,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=REPETITION_CONTEXT,
    )


def draw_seed(seed: int, draw: int) -> int:
    """The seed of a seeded answer's ``draw``-th sampler call: its own numbers, one
    fresh seed a call, whatever other answers drew between its calls."""
    digest = hashlib.blake2b(f"{seed}/{draw}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def reseed_at_random() -> None:
    """Give MLX's one random state, which every answer draws from, a seed no request
    chose (MLX offers no way to put a state back)."""
    mx.random.seed(secrets.randbits(63))


def seeded_draw(seed: int, draw: Callable[[], mx.array]) -> mx.array:
    """``draw()`` (a sampler call) from MLX's random state seeded with ``seed``; the
    state is then reseeded at random, so answers without a seed (the next, or the
    batch's other rows) stay random rather than follow this request's seed."""
    mx.random.seed(seed)
    try:
        return draw()
    finally:
        reseed_at_random()


class AnswerStream:
    """One streamed answer: mlx-lm's sampling loop over a session's cache.

    Args:
        model: the mlx-lm model.
        cache: its prompt cache, holding every prompt token but the last.
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        end_ids: ids that end the turn.
        held: the ids the cache holds; extended in place with every fed token.
        sampling: the sampling settings.
        request_id: stamped on every ``TokenChunk``.
        cancel: checked after every token.
        emit: receives the ``TokenChunk`` events.
        tick: called after every token (stats).
        index: the session's n-gram index of the ids it holds, for drafts (kept
            between answers); None builds one from ``held`` when speculating.
        after: the ids whose text the answer goes on from (a continued answer, a
            plain-text completion); empty when it starts a turn of its own.
    """

    def __init__(
        self,
        model: Any,
        cache: list[Any],
        tokenizer: Any,
        end_ids: frozenset[int],
        held: list[int],
        sampling: SamplingParams,
        *,
        request_id: int,
        cancel: threading.Event | PressureWatch,
        emit: Callable[[Event], None],
        tick: Callable[[], None],
        index: speculative.ContextIndex | None = None,
        after: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.cache = cache
        self.end_ids = end_ids
        self.held = held
        self.sampler = build_sampler(sampling)
        self.processors = build_logits_processors(sampling)
        self.grammar = None
        if sampling.grammar is not None:
            from engine.session.constraint import GrammarMask

            # Last: the bias and penalties must not bring back a token it rules out.
            self.grammar = GrammarMask(sampling.grammar, tokenizer, end_ids)
            self.processors.append(self.grammar)
        self.request_id = request_id
        self.cancel = cancel
        self.emit = emit
        self.tick = tick
        self.generated: list[int] = []
        self.detokenizer = tokenizer.detokenizer
        self._prime(after, tokenizer)
        self.pending_ids: list[int] = []
        # Log probabilities asked for: the scores of each queued step, read in
        # the order its tokens are.
        self.top_logprobs = sampling.logprobs
        self.scores: deque[mx.array] = deque()
        self.pending_logprobs: list[TokenLogprob] = []
        self.history = mx.array([], dtype=mx.int32)
        self.started = time.perf_counter()
        self.first_token_at = self.started
        self.last_token_at = self.started
        # A verification scores several tokens in one pass; log probabilities are
        # read one decode step at a time, so a request for them decodes plainly.
        self.speculate = sampling.speculative == "lookup" and sampling.logprobs is None
        self.index = index if index is not None else speculative.ContextIndex()
        self.drafter: speculative.Drafter | None = None
        # What speculation did: tokens proposed, proposed tokens accepted, and the
        # forward passes the answer took (the first one, over the prompt's last
        # token, included).
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.steps = 0
        self._saved: checkpoints.Checkpoint | None = None
        self._pause: Callable[[], bool] = lambda: False
        self.paused_at = 0  # the unfed token a paused run goes on from
        self.seed = sampling.seed
        self.draws = 0  # sampler calls so far (a seeded answer's next seed)

    def _step(self, token: mx.array) -> mx.array:
        adapter.ensure_capacity(self.cache, 1)
        logits = self.model(token[None], cache=self.cache)[:, -1, :]
        return self.sample(token, logits)

    def sample(self, token: mx.array, logits: mx.array) -> mx.array:
        """The next token after feeding ``token`` (``[1]``), from its ``logits``
        (``[1, vocab]``): the processors, the log probabilities, the sampler (lazy)."""
        if self.processors:
            # Lazy concat: the previous token may not be computed yet.
            self.history = mx.concat([self.history, token])[-REPETITION_CONTEXT:]
            for processor in self.processors:
                logits = processor(self.history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self.top_logprobs is not None:
            self.scores.append(logprobs)
        return self.draw(logprobs)

    def draw(self, logprobs: mx.array) -> mx.array:
        """The sampler's tokens for ``logprobs`` (lazy).

        MLX's sampler draws from one random state that every answer shares: a
        seeded answer seeds it for each of its draws (:func:`draw_seed`,
        :func:`seeded_draw`), so its numbers are the same alone and in a batch,
        whoever drew before it.
        """
        self.draws += 1
        if self.seed is None:
            return self.sampler(logprobs)
        return seeded_draw(draw_seed(self.seed, self.draws - 1), lambda: self.sampler(logprobs))

    def _prime(self, after: Sequence[int], tokenizer: Any) -> None:
        """Give the detokenizer the text the answer goes on from, then forget it.

        mlx-lm's detokenizers drop the leading space of a stream's first word,
        right for a new turn but gluing a continuation to the word before it
        ("and" + "agility"). A few ids of context make the first word a later
        one; ``finalize`` lets out what they held back, so none of it comes out
        again with the answer's first token.
        """
        if not after:
            return
        for token in after[-PRIMER_TOKENS:]:
            self.detokenizer.add_token(token)
        self.detokenizer.finalize()
        if not self.detokenizer.text:
            # Their text was one space, dropped as a first word's: the answer's
            # first word would lose its own. A visible character is a first word.
            for token in tokenizer.encode(PRIMER_MARK, add_special_tokens=False):
                self.detokenizer.add_token(token)
            self.detokenizer.finalize()
        _ = self.detokenizer.last_segment  # the prompt's own text, not the answer's

    def _score(self, token: int) -> None:
        """Read the log probabilities of the step that sampled ``token`` (steps are
        read in the order they were queued), when the request asked for them."""
        if self.top_logprobs is None or not self.scores:
            return
        row = self.scores.popleft().reshape(-1)
        if token in self.end_ids:
            return  # the end of the turn is no part of the answer's text
        top: tuple[tuple[int, float], ...] = ()
        if self.top_logprobs:
            ids = mx.argsort(-row)[:self.top_logprobs]
            # tolist() of a 1-D array is a flat list (MLX's stubs say any nesting).
            pairs = zip(cast("list[int]", ids.tolist()), cast("list[float]", row[ids].tolist()),
                        strict=True)
            # A token a grammar (or a bias) ruled out is no alternative the answer had,
            # and minus infinity is no JSON number.
            top = tuple((ident, value) for ident, value in pairs if math.isfinite(value))
        self.pending_logprobs.append(TokenLogprob(token, float(row[token]), top))

    def stream(self, token: int) -> None:
        """Detokenize one token; emit text once it holds only whole characters."""
        self.detokenizer.add_token(token)
        self.pending_ids.append(token)
        text = self.detokenizer.last_segment
        if text:
            self._send(text)

    def _send(self, text: str) -> None:
        self.emit(TokenChunk(self.request_id, text, tuple(self.pending_ids),
                             tuple(self.pending_logprobs)))
        self.pending_ids = []
        self.pending_logprobs = []

    def flush(self) -> None:
        """Emit whatever the detokenizer still holds back.

        Held back means the text so far ends inside a character: an answer cut
        at its length limit there ends before that character, never with the
        replacement character the partial bytes decode to.
        """
        self.detokenizer.finalize()
        text = self.detokenizer.last_segment.rstrip("\ufffd")
        if text or self.pending_ids:
            self._send(text)

    def run(self, prompt: list[int], max_tokens: int,
            pause: Callable[[], bool] | None = None) -> str:
        """Generate up to ``max_tokens`` tokens; returns "stop", "length" or "cancelled",
        or "paused" when ``pause`` said so between two steps.

        A paused answer goes on elsewhere (a batch, ``engine.session.batch``) from
        :attr:`paused_at`, the token sampled and not fed yet; what the detokenizer
        holds back stays held for the text that follows.
        """
        self.history = mx.array(prompt[-REPETITION_CONTEXT:-1], dtype=mx.int32)
        self._pause = pause or (lambda: False)
        paused = False  # what ``pause`` said last: asked again, it may differ

        def until() -> bool:
            nonlocal paused
            paused = self._pause()
            return paused

        reason = "cancelled"
        try:
            if self.speculate:
                reason = self._run_speculative(prompt, max_tokens)
            else:
                ended, self.paused_at = self._decode(prompt[-1], max_tokens, max_tokens,
                                                     until=until)
                reason = ended or ("paused" if paused else "length")
            return reason
        finally:
            if reason != "paused":
                self.flush()

    def _hold(self, token: int) -> None:
        self.held.append(token)
        if self.speculate:
            self.index.extend([token])
            if self.drafter is not None:
                self.drafter.watch(token, self.index)

    def _decode(self, token: int, count: int, max_tokens: int,
                until: Callable[[], bool] | None = None) -> tuple[str | None, int]:
        """Plain decoding from the unfed ``token``: up to ``count`` tokens, one a pass.

        ``until`` is asked before each next pass is queued; True ends the run early.
        Returns the finish reason (None: ``count`` tokens made or ``until`` said so,
        the answer goes on) and the last token sampled, which is not fed yet when
        the reason is None.
        """
        y = self._step(mx.array([token]))
        self._hold(token)
        self.steps += 1
        mx.async_eval(y)
        made = 0
        while True:
            made += 1
            # Queue the next step before reading this token (mlx-lm's overlap):
            # the device computes while Python detokenizes.
            room = made < count and len(self.generated) + 1 < max_tokens
            paused = room and until is not None and until()
            room = room and not paused
            queue_next = room and not self.cancel.is_set()
            if queue_next:
                self.steps += 1
                try:
                    next_y = self._step(y)
                    mx.async_eval(next_y)
                except KvBudgetExceeded:
                    # Raised before any layer changed: end this answer at the
                    # budget, as if it had reached its length limit.
                    queue_next = room = False
                    max_tokens = len(self.generated) + 1
            token = int(y)
            self._score(token)
            self.last_token_at = time.perf_counter()
            if not self.generated:
                self.first_token_at = self.last_token_at
            if queue_next:
                self._hold(token)
            if token in self.end_ids:
                return "stop", token
            self.generated.append(token)
            self.stream(token)
            self.tick()
            if self.cancel.is_set():
                return "cancelled", token
            if not queue_next:
                return (None if (made >= count or paused) and len(self.generated) < max_tokens
                        else "length"), token
            y = next_y

    # -- speculative decoding ------------------------------------------------

    def _run_speculative(self, prompt: list[int], max_tokens: int) -> str:
        """Draft from the held ids, verify each draft in one pass (see speculative.py)."""
        self.index.sync(self.held)
        backend = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.drafter = drafter = speculative.Drafter(speculative.ROW_COST[backend])
        pending = prompt[-1]  # sampled (or the prompt's last) but not fed yet
        while True:
            if self._pause():
                self.paused_at = pending
                return "paused"
            room = max_tokens - len(self.generated)
            proposal = self.index.propose([pending], speculative.MAX_DRAFT)
            size = drafter.draft_size(proposal, room - 1)
            if not size:
                proposal = drafter.continuation(pending)
                size = drafter.draft_size(proposal, room - 1)
            draft = proposal.tokens[:size]
            if self.grammar is not None:  # a draft the grammar forbids could never be kept
                draft = draft[:self.grammar.valid_prefix(pending, draft)]
            if not draft:
                reason, pending = self._decode_plainly(drafter, pending, room, max_tokens)
                if reason is not None:
                    return reason
                continue
            try:
                sampled, base = self._verify(pending, draft)
            except KvBudgetExceeded:
                # No room for the draft's rows: one plain token now.
                reason, pending = self._decode_plainly(drafter, pending, 1, max_tokens)
                if reason is not None:
                    return reason
                continue
            accepted = speculative.accepted_prefix(draft, sampled)
            if self.seed is not None:
                self.draws += accepted + 1  # as plain decoding draws these tokens
            if self.grammar is not None:
                self.grammar.rewind(len(draft) - accepted)
            # The token sampled after the draft scores the proposal's next one too,
            # for free: the drafter learns from every token the pass judged.
            judged = proposal.tokens[:len(sampled)]
            drafter.record(proposal.match_length, len(judged),
                           speculative.accepted_prefix(judged, sampled))
            self.draft_tokens += len(draft)
            self.accepted_tokens += accepted
            reason, kept = self._emit(sampled[:accepted + 1], max_tokens)
            # As in plain decoding an end-of-turn token stays fed, so the next
            # turn's template extends the cache.
            fed_end = reason == "stop" and kept < accepted
            self._keep([pending, *draft], base, 1 + min(kept, accepted) + fed_end)
            if reason == "stop" and not fed_end:
                self._feed(sampled[accepted])
            if reason is not None:
                return reason
            pending = sampled[accepted]

    def _decode_plainly(self, drafter: speculative.Drafter, pending: int, count: int,
                        max_tokens: int) -> tuple[str | None, int]:
        """Plain passes, each queued before the last is read, until a draft pays again.

        The drafter scores the proposals it skipped against the tokens these make
        (``_hold``), so drafting resumes as soon as the text starts repeating.
        """
        def until() -> bool:
            return drafter.wants_draft() or self._pause()
        try:
            return self._decode(pending, count, max_tokens, until=until)
        except KvBudgetExceeded:
            return "length", pending  # as plain decoding: the budget ends the answer

    def _verify(self, pending: int, draft: list[int]) -> tuple[list[int], int]:
        """One forward pass over ``pending`` and ``draft``; the token sampled at each.

        Returns the sampled tokens (one per fed token) and how many tokens the
        cache held before. Layers that cannot trim are checkpointed first, so
        ``_keep`` can bring them back.
        """
        fed = [pending, *draft]
        adapter.ensure_capacity(self.cache, len(fed))  # raises before any layer changes
        base = len(self.held)
        self._saved = (checkpoints.take(self.cache, base, boundary=False)
                       if draft and checkpoints.needs_checkpoints(self.cache) else None)
        logits = self.model(mx.array(fed)[None], cache=self.cache)[0]
        self.steps += 1
        history = mx.concat([self.history, mx.array(fed, dtype=mx.int32)])
        start = self.history.size
        rows = []
        for i in range(len(fed)):
            row = logits[i:i + 1]
            # Each position sees the tokens before it, as plain decoding would.
            seen = history[:start + i + 1][-REPETITION_CONTEXT:]
            for processor in self.processors:
                row = processor(seen, row)
            rows.append(row)
        scores = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]
        logprobs = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
        return self._draw_rows(logprobs), base

    def _draw_rows(self, logprobs: mx.array) -> list[int]:
        """The token sampled at each row of a verification.

        A seeded answer draws each row with the seed plain decoding gives that
        token (the caller counts the draws it kept), so the same seed gives the
        same answer whichever drafts were tried, alone or in a batch.
        """
        if self.seed is None:
            tokens = self.draw(logprobs)
        else:
            rows = [seeded_draw(draw_seed(self.seed, self.draws + i),
                                partial(self.sampler, logprobs[i:i + 1]))
                    for i in range(logprobs.shape[0])]
            tokens = mx.concatenate(rows)
        # tolist() of a 1-D array is a flat list (MLX's stubs say any nesting).
        return cast("list[int]", tokens.tolist())

    def _emit(self, tokens: list[int], max_tokens: int) -> tuple[str | None, int]:
        """Stream ``tokens`` in order until one ends the answer.

        Returns the finish reason (None: go on) and how many tokens came before the
        one that ended it (all of them when none did).
        """
        for i, token in enumerate(tokens):
            self.last_token_at = time.perf_counter()
            if not self.generated:
                self.first_token_at = self.last_token_at
            if token in self.end_ids:
                return "stop", i
            self.generated.append(token)
            self.stream(token)
            self.tick()
            if self.cancel.is_set():
                return "cancelled", i
            if len(self.generated) >= max_tokens:
                return "length", i
        return None, len(tokens)

    def receive(self, token: int, max_tokens: int) -> str | None:
        """Take one token sampled by a step another loop ran (a batch's).

        Streams it unless it ends the turn; returns the finish reason ("stop",
        "cancelled", "length") or None when the answer goes on.
        """
        self._score(token)
        return self._emit([token], max_tokens)[0]

    def _feed(self, token: int) -> None:
        """Feed one token without sampling after it (an answer's end-of-turn token)."""
        try:
            adapter.ensure_capacity(self.cache, 1)
        except KvBudgetExceeded:
            return  # as plain decoding: at the budget the end token stays unfed
        self.model(mx.array([token])[None], cache=self.cache)
        mx.eval(adapter.eval_targets(self.cache))
        self.held.append(token)
        self.index.extend([token])

    def _keep(self, fed: list[int], base: int, count: int) -> None:
        """Keep the first ``count`` of the ``fed`` tokens in the cache, drop the rest.

        Paged layers trim (their pages go back to the pool); a layer that cannot
        trim gets its checkpointed state back and the kept tokens fed again.
        """
        saved, self._saved = self._saved, None
        self.history = mx.concat([self.history, mx.array(fed[:count], dtype=mx.int32)])
        self.history = self.history[-REPETITION_CONTEXT:]
        target = base + count
        if count < len(fed):
            store = checkpoints.CheckpointStore()
            if saved is not None:
                store.add(saved)
            held = checkpoints.rewind(self.cache, target, store)
            if held is None:
                raise EngineError("The cache could not go back after a draft; "
                                  "turn speculative decoding off in Settings.")
            if held < target:
                self.model(mx.array(fed[held - base:count])[None], cache=self.cache)
                mx.eval(adapter.eval_targets(self.cache))
        self.held.extend(fed[:count])
        self.index.extend(fed[:count])

